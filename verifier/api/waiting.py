"""How long the verifier's client waits, defined once (no torch): every launcher, ``verifier check`` and
the client read these numbers from here.

* At start, a run waits up to ``VERIFIER_WAIT_S`` for every verifier to answer its health check
  (``--verifier_wait_s`` in ``experiments.rl``, ``experiments.eval``, ``experiments.build_cuke`` and
  ``python -m verifier check``; ``--verifier=local`` also waits this long for its child to listen),
  with a progress line naming the addresses and the time waited every ``WAIT_PROGRESS_EVERY_S``.
* Per request, ``RetryPolicy``: the timeout of one RPC and how long a request is retried against
  unreachable or busy endpoints before it gives up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Awaitable, Callable, Sequence

VERIFIER_WAIT_S = (
  120.0  # start-up: every endpoint answers its health check within this (flag below)
)
WAIT_FLAG = "--verifier_wait_s"  # the one flag for it, same name in every launcher and `check`
WAIT_PROGRESS_EVERY_S = 10.0  # a progress line at least this often while waiting at start
HEALTH_POLL_S = 0.5  # between health checks while waiting
HEALTH_CALL_S = 5.0  # one health-check RPC
METRICS_CALL_S = 10.0  # one Metrics RPC

CALL_TIMEOUT_S = 3600.0  # one Verify/Build RPC (the service bounds the build and the run itself)
REQUEST_GIVE_UP_S = 1800.0  # a request retried this long without an answer fails
INITIAL_BACKOFF_S = 0.5  # backoff after an endpoint fails, doubling up to MAX_BACKOFF_S
MAX_BACKOFF_S = 30.0


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
  """Waiting on unreachable or busy endpoints: backoff doubles from ``initial_backoff_s`` to at most
  ``max_backoff_s`` (+-25% jitter); a request gives up after ``max_wait_s`` without an answer or after
  ``max_attempts`` calls (0: no limit on calls); one RPC times out after ``call_timeout_s``."""

  initial_backoff_s: float = INITIAL_BACKOFF_S
  max_backoff_s: float = MAX_BACKOFF_S
  max_wait_s: float = REQUEST_GIVE_UP_S
  call_timeout_s: float = CALL_TIMEOUT_S
  max_attempts: int = 0

  def __post_init__(self):
    for name in ("initial_backoff_s", "max_backoff_s", "max_wait_s", "call_timeout_s"):
      if not getattr(self, name) > 0:
        raise ValueError(f"RetryPolicy.{name} must be > 0, got {getattr(self, name)}")
    if self.max_backoff_s < self.initial_backoff_s:
      raise ValueError("RetryPolicy.max_backoff_s must be >= initial_backoff_s")
    if self.max_attempts < 0:
      raise ValueError(f"RetryPolicy.max_attempts must be >= 0, got {self.max_attempts}")

  def backoff_s(self, failures: int) -> float:
    base = min(self.max_backoff_s, self.initial_backoff_s * 2 ** max(0, failures - 1))
    return base * random.uniform(0.75, 1.25)


def check_wait_s(value: float) -> float:
  """``value`` when it is a usable wait; a ValueError naming the flag otherwise."""
  if not value > 0:
    raise ValueError(f"{WAIT_FLAG} must be > 0 seconds, got {value:g}")
  return value


def waiting_line(addresses: Sequence[str], waited_s: float, limit_s: float, errors: str) -> str:
  """The progress line while waiting: who, for how long, and why not yet."""
  return (
    f"waiting for the verifier at {', '.join(addresses)}: {waited_s:.0f} s of {limit_s:g} s "
    f"({WAIT_FLAG}); not answering: {errors}"
  )


async def wait_for(
  probe: Callable[[float], Awaitable[list[str]]],
  addresses: Sequence[str],
  timeout_s: float,
  report: Callable[[str], None] | None = None,
  *,
  every_s: float = WAIT_PROGRESS_EVERY_S,
  poll_s: float = HEALTH_POLL_S,
  clock: Callable[[], float] = time.monotonic,
  sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> list[str]:
  """Calls ``probe(call_timeout_s)`` (-> the endpoints not ready yet, each as 'ADDRESS (why)') every
  ``poll_s`` until it returns none (-> []) or ``timeout_s`` has passed (-> the last list). ``report``
  gets a ``waiting_line`` when the first probe fails and then every ``every_s``: no probe or pause
  runs past the next line's time."""
  start = clock()
  due = None  # when the next progress line is due (None: at the first failure)
  while True:
    now = clock()
    limit = HEALTH_CALL_S if due is None else min(HEALTH_CALL_S, max(due - now, 0.01))
    bad = await probe(min(limit, max(start + timeout_s - now, 0.01)))
    now = clock()
    if not bad:
      return []
    if due is None or now >= due:
      if report is not None:
        report(waiting_line(addresses, now - start, timeout_s, "; ".join(bad)))
      due = now + every_s
    if now - start >= timeout_s:
      return bad
    await sleep(max(0.0, min(poll_s, due - now, start + timeout_s - now)))
