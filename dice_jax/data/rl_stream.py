"""Grain RL task stream: each scheduled task repeated G times consecutively as one group (GRPO/TraceRL).

Element contract (consumed by the rollout / BiC-RL code), one dict per rollout:
  ``task_id`` str, ``group_index`` int (global group number: the G consecutive members share it),
  ``member_index`` int (0..G-1), ``step`` int (RL step), ``level`` int, ``stage`` int (0 single op, 1 fused,
  2 model), ``kind`` "e2e" | "infill", ``prompt`` str, ``prompt_ids`` int32 array, ``reference_code`` str (the
  PyTorch code), and for infilling ``prefix``, ``suffix``, ``middle`` (ground truth); else those are "".

Step s holds ``tasks_per_step`` groups (DICE: 64 tasks x 16 rollouts, DICE `training/RL/` configs). With several
processes, process p takes the p-th contiguous slice of each step's tasks (as DICE's per-node
``sequential_select``). The element at flat index i is a pure function of i, so the grain iterator's state
(``get_state``/``set_state``) restores the stream exactly.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Literal

import grain
import numpy as np

from dice_jax.data import prompts
from dice_jax.data.curriculum import SequentialSchedule, StageSchedule, TaskScheduler
from dice_jax.data.tasks import KernelTask


@dataclasses.dataclass(frozen=True)
class RLStreamConfig:
  group_size: int = 16
  tasks_per_step: int = 64  # global, over all processes
  num_steps: int = 100
  prompt_style: Literal["chat", "dice"] = "dice"
  seed: int = 0
  process_index: int = 0
  process_count: int = 1

  def __post_init__(self):
    if self.group_size < 1 or self.tasks_per_step < 1 or self.num_steps < 1:
      raise ValueError("group_size, tasks_per_step and num_steps must be >= 1")
    if self.tasks_per_step % self.process_count:
      raise ValueError(
        f"tasks_per_step {self.tasks_per_step} must divide by process_count {self.process_count}"
      )
    if not 0 <= self.process_index < self.process_count:
      raise ValueError(f"process_index {self.process_index} not in [0, {self.process_count})")

  @property
  def local_tasks_per_step(self) -> int:
    return self.tasks_per_step // self.process_count

  @property
  def elements_per_step(self) -> int:
    return self.local_tasks_per_step * self.group_size


def task_prompt(task: KernelTask, tokenizer=None, style: str = "dice") -> str:
  if task.kind == "infill":
    return prompts.infilling_prompt(task.reference_code, task.prefix, task.suffix, tokenizer, style)
  return prompts.e2e_prompt(task.reference_code, tokenizer, style)


class _RolloutAt:
  """Flat index -> rollout element (pure)."""

  def __init__(self, scheduler: TaskScheduler, tokenizer, cfg: RLStreamConfig):
    self.sched, self.tok, self.cfg = scheduler, tokenizer, cfg

  @functools.lru_cache(maxsize=4096)
  def _prompt(self, task_index: int) -> tuple[str, np.ndarray]:
    text = task_prompt(self.sched.tasks[task_index], self.tok, self.cfg.prompt_style)
    return text, np.asarray(self.tok.encode(text), np.int32)

  @functools.lru_cache(maxsize=64)
  def _local_step(self, step: int) -> list[int]:
    idx = self.sched.indices_for_step(step)
    n = self.cfg.local_tasks_per_step
    return idx[self.cfg.process_index * n : (self.cfg.process_index + 1) * n]

  def __call__(self, i: int) -> dict:
    cfg = self.cfg
    step, r = divmod(int(i), cfg.elements_per_step)
    local, member = divmod(r, cfg.group_size)
    ti = self._local_step(step)[local]
    task = self.sched.tasks[ti]
    text, ids = self._prompt(ti)
    return {
      "task_id": task.task_id,
      "group_index": step * cfg.tasks_per_step
      + cfg.process_index * cfg.local_tasks_per_step
      + local,
      "member_index": member,
      "step": step,
      "level": task.level,
      "stage": task.stage,
      "kind": task.kind,
      "prompt": text,
      "prompt_ids": ids,
      "reference_code": task.reference_code,
      "prefix": task.prefix or "",
      "suffix": task.suffix or "",
      "middle": task.middle or "",
    }


def make_rl_stream(
  tasks: Sequence[KernelTask],
  tokenizer,
  cfg: RLStreamConfig,
  schedule: SequentialSchedule | StageSchedule | None = None,
  start_step: int = 0,
) -> grain.IterDataset:
  """The RL rollout stream for ``cfg.num_steps`` steps (default schedule: DICE's sequential file order)."""
  sched = TaskScheduler(tasks, schedule or SequentialSchedule(), cfg.tasks_per_step, cfg.seed)
  n = cfg.num_steps * cfg.elements_per_step
  ds = grain.MapDataset.range(start_step * cfg.elements_per_step, n).map(
    _RolloutAt(sched, tokenizer, cfg)
  )
  return ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))


def next_step(iterator, cfg: RLStreamConfig) -> list[dict]:
  """The next RL step's rollout requests (``local_tasks_per_step`` groups of ``group_size``)."""
  return [next(iterator) for _ in range(cfg.elements_per_step)]
