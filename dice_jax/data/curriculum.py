"""Data scheduling for BiC-RL: which tasks each RL step uses (DICE, github.com/deadlykitten4/DICE `training/RL/`).

DICE moves from single operations to fused operations to whole-model structures. Its code does this with
``sequential_select``: step s (1-based "epoch") takes items ``[(s-1)·k, s·k)`` modulo N in *file order*, and the
end-to-end file is sorted by level. Two schedules, both pure functions of the step (so resuming needs only the
step number):

* ``SequentialSchedule`` -- DICE's file-order schedule (optionally stable-sorted by curriculum stage first).
* ``StageSchedule`` -- per-step stage weights given at milestone steps (piecewise-constant or linearly
  interpolated); each step's task count per stage is the largest-remainder apportionment of the weights, and
  within a stage tasks are drawn without replacement from seeded per-pass permutations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from absl import logging

from dice_jax.data.tasks import STAGE_NAMES, KernelTask

NUM_STAGES = len(STAGE_NAMES)


def apportion(weights: Sequence[float], n: int) -> list[int]:
  """Integer counts summing to n, proportional to weights (largest remainder; ties to the earlier stage)."""
  w = np.asarray(weights, float)
  if (w < 0).any() or w.sum() <= 0:
    raise ValueError(f"weights must be non-negative with a positive sum, got {list(weights)}")
  exact = w / w.sum() * n
  counts = np.floor(exact).astype(int)
  rem = exact - counts
  for i in sorted(range(len(w)), key=lambda i: (-rem[i], i))[: n - counts.sum()]:
    counts[i] += 1
  return counts.tolist()


@dataclasses.dataclass(frozen=True)
class SequentialSchedule:
  """DICE's ``sequential_select``: step s (0-based) takes positions ``[s·k, (s+1)·k) mod N`` in file order."""

  sort_by_stage: bool = False

  def order(self, tasks: Sequence[KernelTask]) -> list[int]:
    idx = list(range(len(tasks)))
    if self.sort_by_stage:
      idx.sort(key=lambda i: tasks[i].stage)  # stable: file order within a stage
    return idx

  def select(self, tasks: Sequence[KernelTask], step: int, k: int, seed: int = 0) -> list[int]:
    order = self.order(tasks)
    return [order[(step * k + i) % len(order)] for i in range(k)]


@dataclasses.dataclass(frozen=True)
class StageSchedule:
  """Stage weights over steps. ``milestones`` = ((step, (w_single, w_fused, w_model)), ...), steps increasing;
  before the first milestone its weights hold, after the last the last weights hold."""

  milestones: tuple[tuple[int, tuple[float, ...]], ...]
  interpolate: bool = True
  shuffle_within_stage: bool = True

  def __post_init__(self):
    if not self.milestones:
      raise ValueError("StageSchedule needs at least one milestone")
    steps = [m[0] for m in self.milestones]
    if steps != sorted(steps) or len(set(steps)) != len(steps):
      raise ValueError(f"milestone steps must be strictly increasing, got {steps}")
    for s, w in self.milestones:
      if len(w) != NUM_STAGES or min(w) < 0 or sum(w) <= 0:
        raise ValueError(f"milestone at step {s}: need {NUM_STAGES} non-negative weights, got {w}")

  def weights(self, step: int) -> np.ndarray:
    steps = [m[0] for m in self.milestones]
    ws = [np.asarray(m[1], float) / sum(m[1]) for m in self.milestones]
    if step <= steps[0]:
      return ws[0]
    if step >= steps[-1]:
      return ws[-1]
    j = int(np.searchsorted(steps, step, side="right"))  # steps[j-1] <= step < steps[j]
    if not self.interpolate:
      return ws[j - 1]
    t = (step - steps[j - 1]) / (steps[j] - steps[j - 1])
    return (1 - t) * ws[j - 1] + t * ws[j]

  def stage_counts(
    self, step: int, k: int, available: Sequence[bool] = (True,) * NUM_STAGES
  ) -> list[int]:
    w = self.weights(step) * np.asarray(available, float)
    if w.sum() <= 0:  # the scheduled stages have no tasks: fall back to whatever exists
      w = np.asarray(available, float)
    return apportion(w, k)


class TaskScheduler:
  """Maps an RL step to its tasks under a schedule; a pure function of (tasks, schedule, seed, step)."""

  def __init__(
    self,
    tasks: Sequence[KernelTask],
    schedule: SequentialSchedule | StageSchedule,
    tasks_per_step: int,
    seed: int = 0,
  ):
    if not tasks:
      raise ValueError("no tasks to schedule")
    if tasks_per_step < 1:
      raise ValueError(f"tasks_per_step must be >= 1, got {tasks_per_step}")
    self.tasks = list(tasks)
    self.schedule = schedule
    self.k = tasks_per_step
    self.seed = seed
    self.by_stage = [
      [i for i, t in enumerate(self.tasks) if t.stage == s] for s in range(NUM_STAGES)
    ]
    self._available = [bool(b) for b in self.by_stage]
    self._consumed = [np.zeros(NUM_STAGES, int)]  # consumed[s] = per-stage draws before step s
    if isinstance(schedule, StageSchedule):
      for s, w in schedule.milestones:
        for st in range(NUM_STAGES):
          if w[st] > 0 and not self._available[st]:
            logging.warning(
              "schedule gives stage %s weight at step %d but there are no such tasks",
              STAGE_NAMES[st],
              s,
            )

  def _counts(self, step: int) -> list[int]:
    return self.schedule.stage_counts(step, self.k, self._available)

  def _consumed_before(self, step: int) -> np.ndarray:
    while len(self._consumed) <= step:
      s = len(self._consumed) - 1
      self._consumed.append(self._consumed[-1] + np.asarray(self._counts(s)))
    return self._consumed[step]

  def _stage_item(self, stage: int, j: int) -> int:
    pool = self.by_stage[stage]
    n = len(pool)
    p, r = divmod(j, n)
    if self.schedule.shuffle_within_stage:
      perm = np.random.default_rng([self.seed, stage, p]).permutation(n)
      return pool[int(perm[r])]
    return pool[r]

  def indices_for_step(self, step: int) -> list[int]:
    if step < 0:
      raise ValueError(f"step must be >= 0, got {step}")
    if isinstance(self.schedule, SequentialSchedule):
      return self.schedule.select(self.tasks, step, self.k, self.seed)
    start = self._consumed_before(step)
    out = []
    for stage, c in enumerate(self._counts(step)):
      out += [self._stage_item(stage, int(start[stage]) + j) for j in range(c)]
    return out

  def tasks_for_step(self, step: int) -> list[KernelTask]:
    return [self.tasks[i] for i in self.indices_for_step(step)]
