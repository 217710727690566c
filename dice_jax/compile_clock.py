"""Seconds JAX spends compiling, from its own monitoring events.

JAX reports tracing, lowering and backend compilation (a persistent-cache hit included) through
`jax.monitoring`; `CompileClock` sums those durations. A listener cannot be removed again, so a
process shares one clock (`shared()`, installed on first use, not at import) and each caller reads
the difference between two `mark()`s: `clock.since(mark)`. A program compiled again where it should
have been reused (a shape or static argument that changes between calls) shows up as compile
seconds where none were expected; `JAX_EXPLAIN_CACHE_MISSES=1` then logs why.
"""

from __future__ import annotations

import dataclasses
import threading

import jax

from dice_jax.compile_cache import HIT as CACHE_HIT

# jax/_src/dispatch.py's events: tracing, lowering, backend compile (a cache hit included)
COMPILE_EVENTS = (
  "/jax/core/compile/jaxpr_trace_duration",
  "/jax/core/compile/jaxpr_to_mlir_module_duration",
  "/jax/core/compile/backend_compile_duration",
)


@dataclasses.dataclass(frozen=True)
class Mark:
  """The clock's sums at one moment."""

  compile_s: float
  cache_hits: int


class CompileClock:
  """Compile seconds and persistent-cache hits summed since `install`. `split()` gives the sums
  since the last split (one owner); `mark()` / `since(mark)` for clocks shared by several."""

  def __init__(self):
    self.total_s, self.hits, self._at = 0.0, 0, (0.0, 0)
    self._lock = threading.Lock()

  def install(self) -> "CompileClock":
    def on_duration(event, duration, **_):
      if event in COMPILE_EVENTS:
        with self._lock:
          self.total_s += duration

    def on_event(event, **_):
      if event == CACHE_HIT:
        with self._lock:
          self.hits += 1

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    return self

  def mark(self) -> Mark:
    with self._lock:
      return Mark(self.total_s, self.hits)

  def since(self, mark: Mark) -> float:
    """Compile seconds since `mark`."""
    return self.mark().compile_s - mark.compile_s

  def since_split(self) -> float:
    """Compile seconds since the last `split`."""
    with self._lock:
      return self.total_s - self._at[0]

  def split(self) -> dict:
    with self._lock:
      s, h = self.total_s - self._at[0], self.hits - self._at[1]
      self._at = (self.total_s, self.hits)
    return dict(compile_s=round(s, 1), cache_hits=h)


_SHARED: CompileClock | None = None
_SHARED_LOCK = threading.Lock()


def shared() -> CompileClock:
  """This process's clock, installed the first time it is asked for (compiles before that are not
  counted)."""
  global _SHARED
  with _SHARED_LOCK:
    if _SHARED is None:
      _SHARED = CompileClock().install()
    return _SHARED
