"""JAX's persistent compilation cache for a run: compile once, read back on every later start.

`enable(directory)` points JAX at a cache directory before the first compile: every program that
takes at least `jax_persistent_cache_min_compile_time_secs` to compile (JAX's default 1 s; the
environment variable `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` sets it) is written there by
process 0 and read back by any process that compiles the same program again (same HLO, devices,
flags and JAX version), e.g. a resumed run. The returned `CacheLog` counts what JAX reports
through `jax.monitoring` (cache hits, misses, compile seconds saved) and logs each hit.
"""

from __future__ import annotations

import dataclasses
import os

import jax
from absl import logging

HIT = "/jax/compilation_cache/cache_hits"
MISS = "/jax/compilation_cache/cache_misses"
SAVED = "/jax/compilation_cache/compile_time_saved_sec"


@dataclasses.dataclass
class CacheLog:
  """What the cache in `directory` did in this process."""

  directory: str
  entries_at_start: int
  hits: int = 0
  misses: int = 0
  saved_s: float = 0.0

  def on_event(self, event: str, **kwargs) -> None:
    if event == HIT:
      self.hits += 1
    elif event == MISS:
      self.misses += 1

  def on_duration(self, event: str, duration: float, **kwargs) -> None:
    if event == SAVED:
      self.saved_s += duration
      logging.info(
        "compilation cache hit %d: a compiled program read back, ~%.1f s of compiling saved",
        self.hits,
        duration,
      )

  def summary(self) -> str:
    return (
      f"compilation cache {self.directory}: {self.hits} programs read back (~{self.saved_s:.1f} s "
      f"of compiling saved), {self.misses} compiled"
    )


def entries(directory: str) -> int:
  """Programs stored in a cache directory (JAX writes one `*-cache` file per program)."""
  if not os.path.isdir(directory):
    return 0
  return sum(1 for name in os.listdir(directory) if name.endswith("-cache"))


def enable(directory: str) -> CacheLog:
  """Uses `directory` as JAX's persistent compilation cache from now on (JAX makes it at the first
  compile); call before anything is compiled. Returns the log its hits and misses are counted
  in."""
  directory = os.path.abspath(directory)
  jax.config.update("jax_compilation_cache_dir", directory)
  log = CacheLog(directory, entries(directory))
  jax.monitoring.register_event_listener(log.on_event)
  jax.monitoring.register_event_duration_secs_listener(log.on_duration)
  logging.info("compilation cache %s: %d programs stored", directory, log.entries_at_start)
  return log
