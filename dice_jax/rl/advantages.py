"""Advantages from rewards within groups (the G responses of one task); pure numpy functions.

DICE (`z_score_normalize` in Gen-Verse/dLLM-RL, kept by DICE `training/RL/`): within each group
A_j = (r_j - mean) / std with the POPULATION std; a group whose rewards are all equal (std 0) gets
A = 0 everywhere and is dropped from training. The same scalar is broadcast to every token of the
response (done by `tracerl.build_batches`). Options beyond DICE:

  leave_one_out  A_j = r_j - mean of the other members (RLOO);
  mean_only      A_j = r_j - mean (Dr. GRPO-style, no std scaling).

A group with all rewards equal has zero advantage under every rule, so it is dropped under every
rule (training on it would only spend compute). "Equal" is exact (max == min), not a float std
test: with rewards like 0.1 the population std of equal values can round to 1e-17 instead of 0.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Advantages:
  values: np.ndarray  # [N] float32, 0 for dropped responses
  keep: np.ndarray  # [N] bool, False for the members of dropped groups
  dropped_groups: int  # groups whose rewards were all equal
  groups: int  # groups seen


def _group_index(rewards, groups):
  rewards = np.asarray(rewards, np.float64)
  groups = np.asarray(groups)
  if rewards.ndim != 1 or groups.shape != rewards.shape:
    raise ValueError(
      f"advantages: rewards and groups must be 1-D of the same length, got shapes "
      f"{rewards.shape} and {groups.shape}"
    )
  if not np.all(np.isfinite(rewards)):
    raise ValueError(f"advantages: rewards must be finite, got {rewards.tolist()}")
  _, inverse = np.unique(groups, return_inverse=True)
  return rewards, inverse.reshape(-1)


def _finish(adv, rewards, inverse) -> Advantages:
  n_groups = int(inverse.max()) + 1 if inverse.size else 0
  hi = np.full(n_groups, -np.inf)
  lo = np.full(n_groups, np.inf)
  np.maximum.at(hi, inverse, rewards)
  np.minimum.at(lo, inverse, rewards)
  flat = hi == lo  # every member got the same reward (also: groups of one)
  keep = ~flat[inverse]
  values = np.where(keep, adv, 0.0).astype(np.float32)
  return Advantages(values, keep, int(flat.sum()), n_groups)


def _group_stats(rewards, inverse):
  n_groups = int(inverse.max()) + 1 if inverse.size else 0
  count = np.bincount(inverse, minlength=n_groups).astype(np.float64)
  total = np.bincount(inverse, weights=rewards, minlength=n_groups)
  return count, total


def group_zscore(rewards, groups) -> Advantages:
  """DICE: (r - mean) / std per group, population std; equal-reward groups dropped."""
  rewards, inverse = _group_index(rewards, groups)
  if not rewards.size:
    return _finish(rewards, rewards, inverse)
  count, total = _group_stats(rewards, inverse)
  mean = (total / count)[inverse]
  var = np.bincount(inverse, weights=(rewards - mean) ** 2) / count
  std = np.sqrt(var)[inverse]
  return _finish((rewards - mean) / np.where(std > 0, std, 1.0), rewards, inverse)


def leave_one_out(rewards, groups) -> Advantages:
  """r_j - mean of the other members of j's group; equal-reward groups (and singletons) dropped."""
  rewards, inverse = _group_index(rewards, groups)
  if not rewards.size:
    return _finish(rewards, rewards, inverse)
  count, total = _group_stats(rewards, inverse)
  others = np.maximum(count[inverse] - 1, 1)
  return _finish(rewards - (total[inverse] - rewards) / others, rewards, inverse)


def mean_only(rewards, groups) -> Advantages:
  """r_j - group mean; equal-reward groups dropped."""
  rewards, inverse = _group_index(rewards, groups)
  if not rewards.size:
    return _finish(rewards, rewards, inverse)
  count, total = _group_stats(rewards, inverse)
  return _finish(rewards - (total / count)[inverse], rewards, inverse)


ADVANTAGES: dict[str, Callable[..., Advantages]] = {
  "group_zscore": group_zscore,
  "leave_one_out": leave_one_out,
  "mean_only": mean_only,
}


def compute(name: str, rewards, groups) -> Advantages:
  """The advantage rule `name` (one of `ADVANTAGES`) applied to `rewards` [N] grouped by `groups`."""
  if name not in ADVANTAGES:
    raise ValueError(f"advantage rule must be one of {sorted(ADVANTAGES)}, got {name!r}")
  return ADVANTAGES[name](rewards, groups)
