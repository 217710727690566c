"""Compile slots shared by the builds in flight, least attained service first.

A build holds a slot while its module imports (its compiles included). Held first come, first served up
to its deadline, two hostile builds (a compile bomb, a static initialiser that sleeps) kept an honest
build of 60 s waiting 120 s for the one slot, and it was answered after 185 s (issue 37). Here a build
that has held a slot for ``quantum_s`` while another build waits is suspended (SIGSTOP of every process
of its build and compile workers) and queued again; a free slot goes to the waiting build that has run
the least (first come first among equals), so a new build runs within about a quantum per build that
arrived with it, whatever ran before it; builds shorter than a quantum (every honest build of a
pybind11, a cached extension, or a cold CUDA build under load: 14-30 s) are never suspended. A quantum
shorter than a burst's honest builds time-shares the burst, so none finishes early (10 s did:
experiments/bench_build_burst.py). A build's deadline counts only the time it ran
(``Turn.ran_s``): suspension costs it nothing but latency. A build that needs an extension another build
is compiling waits for that compile without a slot (``pause``): builds of one extension take turns in
the cache, not on the cores (three of one extension, one slot: 54 s, 150 s when they shared it).
"""

from __future__ import annotations

import asyncio
import itertools
import time

TICK_S = 0.25  # how often a full house with builds waiting is re-examined
# Seconds a build may hold a slot while another waits. 30, not 10: honest cold builds run 14-30 s under
# load, and a 10 s quantum time-shared a burst of them so that none finished early (docs/performance.md,
# "Build pipeline": bench_build_burst).
QUANTUM_S = 30.0


class Turn:
  """One build's claim on the slots. ``suspend`` and ``resume`` stop and continue its processes."""

  _order = itertools.count()

  def __init__(self, suspend=lambda: None, resume=lambda: None):
    self.suspend_cb, self.resume_cb = suspend, resume
    self.seq = next(self._order)
    self.attained = 0.0  # seconds it ran, up to ``since``
    self.since = 0.0  # when it last started running
    self.state = "new"  # new | waiting | running | suspended | released | done
    self.granted = asyncio.Event()
    self.suspensions = 0

  def ran_s(self) -> float:
    """Seconds it has run (holding a slot, or after it released one), never counting its waits."""
    live = time.monotonic() - self.since if self.state in ("running", "released") else 0.0
    return self.attained + live

  def _stop_clock(self) -> None:
    self.attained += time.monotonic() - self.since

  def _start_clock(self) -> None:
    self.since = time.monotonic()


class Budget:
  """A deadline in seconds of running (``Turn.ran_s``), or of wall time where there is no turn."""

  def __init__(self, limit_s: float, turn: Turn | None = None):
    self.limit_s, self.turn = limit_s, turn
    self.t0 = time.monotonic()

  def left(self) -> float:
    used = self.turn.ran_s() if self.turn is not None else time.monotonic() - self.t0
    return max(0.0, self.limit_s - used)


class FairSlots:
  def __init__(self, n: int, quantum_s: float = QUANTUM_S):
    self.total, self.quantum_s = n, quantum_s
    self.running: list[Turn] = []
    self.waiting: list[Turn] = []
    self.ticker: asyncio.Task | None = None
    self.preemptions = 0

  @property
  def free(self) -> int:
    return self.total - len(self.running)

  async def acquire(self, turn: Turn) -> None:
    """Until ``turn`` holds a slot (for the first time, or again after ``pause``)."""
    if turn.state != "suspended":
      turn.state = "waiting"
    turn.granted.clear()
    self.waiting.append(turn)
    self._grant()
    self._tick_while_waiting()
    try:
      await turn.granted.wait()
    except BaseException:
      self.release(turn)
      raise

  def pause(self, turn: Turn) -> None:
    """``turn`` waits for something other than a slot (another build's compile of the same extension):
    suspended, its slot given to the next, its clock stopped, not queued until it ``acquire``s again."""
    if turn not in self.running:
      return
    self.running.remove(turn)
    turn._stop_clock()
    turn.state = "suspended"
    turn.suspend_cb()
    self._grant()

  def release(self, turn: Turn) -> None:
    """``turn`` gives its slot back (its module imported, or it ended): it keeps running, unsuspended,
    without one."""
    if turn in self.running:
      self.running.remove(turn)
      turn._stop_clock()
    if turn in self.waiting:
      self.waiting.remove(turn)
    if turn.state == "suspended":
      turn.resume_cb()
    if turn.state in ("running", "suspended"):
      turn.state = "released"
      turn._start_clock()
    elif turn.state != "released":
      turn.state = "done"
    self._grant()

  def finish(self, turn: Turn) -> None:
    """``turn`` is over: no slot, no clock."""
    self.release(turn)
    if turn.state == "released":
      turn._stop_clock()
    turn.state = "done"

  def _next(self) -> Turn | None:
    return min(self.waiting, key=lambda t: (t.attained, t.seq), default=None)

  def _grant(self) -> None:
    while self.free > 0 and self.waiting:
      turn = self._next()
      self.waiting.remove(turn)
      resumed = turn.state == "suspended"
      turn.state = "running"
      turn._start_clock()
      self.running.append(turn)
      if resumed:
        turn.resume_cb()
      turn.granted.set()

  def preempt(self) -> None:
    """Suspend running builds past their quantum while builds that ran less wait (one per waiter)."""
    now = time.monotonic()
    for turn in sorted(self.running, key=lambda t: t.since):
      nxt = self._next()
      if nxt is None:
        return
      if now - turn.since < self.quantum_s or nxt.attained >= turn.ran_s():
        continue
      self.running.remove(turn)
      turn._stop_clock()
      turn.state = "suspended"
      turn.suspensions += 1
      self.preemptions += 1
      turn.suspend_cb()
      self.waiting.append(turn)
      self._grant()

  def _tick_while_waiting(self) -> None:
    if self.ticker is not None and not self.ticker.done():
      return

    async def tick():
      while self.waiting:
        await asyncio.sleep(TICK_S)
        self.preempt()

    self.ticker = asyncio.ensure_future(tick())
