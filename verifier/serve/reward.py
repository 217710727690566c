"""Rewards from a verdict.

Binary reward as in DICE's RL (compiled and correct; the DICE paper's RL recipe), plus this project's
anti-cheating and optional ``min_speedup``. The shaped reward (clipped log speedup) is for experiments.
"""

from __future__ import annotations

import math

from verifier.api.contract import FailureKind

SHAPED_LOG2_MIN = -1.0
SHAPED_LOG2_MAX = 3.0


def binary_reward(kind: FailureKind) -> float:
  return 1.0 if kind is FailureKind.OK else 0.0


def shaped_reward(kind: FailureKind, speedup: float, unmeasured: float | None = None) -> float:
  """0 on failure; 1 when correct but untimed; 1 + clip(log2 speedup, -1, 3) when timed. A timed result
  the clock did not resolve (speedup 0) scores what its mean time gives (``unmeasured``: the baseline's
  mean over the candidate's), capped at 1: no bonus, and no more than a measured time would score (red
  team 43c: a slow candidate that jittered its own timed calls past the resolution got 1.0, 0.0 measured)."""
  if kind is not FailureKind.OK:
    return 0.0
  if speedup <= 0:
    return 1.0 if unmeasured is None else min(1.0, shaped_reward(kind, unmeasured))
  return 1.0 + min(max(math.log2(speedup), SHAPED_LOG2_MIN), SHAPED_LOG2_MAX)


def apply_min_speedup(
  kind: FailureKind, speedup: float, min_speedup: float, timed: bool
) -> tuple[FailureKind, str]:
  """A correct candidate below ``min_speedup`` fails with BELOW_MIN_SPEEDUP (only when timed)."""
  if kind is FailureKind.OK and min_speedup > 0 and timed and speedup < min_speedup:
    return FailureKind.BELOW_MIN_SPEEDUP, f"speedup {speedup:.3f} < min_speedup {min_speedup}"
  return kind, ""
