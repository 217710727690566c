"""Evaluation inside the BiC-RL loop (DICE's `evaluation:` block, `eval_every: 10`).

Every `eval_every` RL steps (after that step's update), the current policy decodes one greedy
sample (`low_confidence_static`, DICE's evaluation decoding) of every task of `eval_tasks` (the
infilling evaluation set in the infill phase, KernelBench level 1 in the end-to-end phase), each
judged by the run's judge and reward. Metrics go to the step's record as `eval/*`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dice_jax.data import rl_stream
from dice_jax.data import tasks as tasks_lib
from dice_jax.rl import rewards as rewards_lib
from dice_jax.rl import rollout as rollout_lib

GROUP_OFFSET = 1 << 24
# DICE's `evaluation:` block (configs/rl_sdar_kernel_*.yaml): temperature 1.0 with top_k 1 (the
# argmax: greedy), top_p 1, low_confidence_static; block, steps and max tokens as the rollout's
# (4 / 4 / 4096). With top_k 1 the filtered confidence of every candidate is 1, as in JetEngine.
EVAL_DECODING = dict(strategy="low_confidence_static", temperature=1.0, top_k=1, top_p=1.0)


def due(rl_step: int, eval_every: int) -> bool:
  """Whether the evaluation runs after RL step `rl_step` (1-based)."""
  return eval_every > 0 and rl_step % eval_every == 0


def eval_sampler(sampler):
  """The rollout's sampler with DICE's evaluation decoding (greedy, static remasking)."""
  return dataclasses.replace(sampler, **EVAL_DECODING)


def load_eval_tasks(cfg) -> list[tasks_lib.KernelTask]:
  """`cfg.eval_tasks`, read as the phase's task kind (infilling rows or end-to-end rows)."""
  if cfg.phase == "infill":
    tasks, _ = tasks_lib.load_infilling_tasks(cfg.eval_tasks, default_level=cfg.task_default_level)
  else:
    tasks, _ = tasks_lib.load_e2e_tasks(cfg.eval_tasks, default_level=cfg.task_default_level)
  if not tasks:
    raise ValueError(f"{cfg.eval_tasks}: no evaluation tasks")
  return tasks


def eval_groups(tasks, tokenizer, cfg) -> list[rollout_lib.GroupTask]:
  """One group of one sample per task, prompted as the RL stream prompts (group numbers from
  `GROUP_OFFSET`, apart from the rollout's)."""
  elements = []
  for i, task in enumerate(tasks):
    text = rl_stream.task_prompt(task, tokenizer, cfg.stream.prompt_style)
    elements.append(
      {
        "task_id": task.task_id,
        "group_index": GROUP_OFFSET + i,
        "member_index": 0,
        "kind": task.kind,
        "prompt_ids": np.asarray(tokenizer.encode(text), np.int32),
        "reference_code": task.reference_code,
        "prefix": task.prefix or "",
        "suffix": task.suffix or "",
      }
    )
  return rollout_lib.groups_from_stream(
    elements, tokenizer=tokenizer, prompt_tail_chars=cfg.prompt_tail_chars
  )


def metrics(ro: rollout_lib.Rollout) -> dict:
  n = max(len(ro.outcomes), 1)
  return {
    "eval/samples": float(len(ro.outcomes)),
    "eval/reward_mean": float(ro.rewards.mean()) if ro.rewards.size else 0.0,
    "eval/correct_rate": sum(rewards_lib.passed(o) for o in ro.outcomes) / n,
    "eval/compiled_rate": sum(o.compiled for o in ro.outcomes) / n,
    "eval/groups_skipped": float(ro.groups_skipped),
    "eval/time_s": ro.sample_s + ro.verify_wait_s,
  }
