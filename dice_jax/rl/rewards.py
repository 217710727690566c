"""Rewards from verifier outcomes: a small registry of pure functions `outcome -> float`.

* `binary` (DICE `training/RL/`): 1 iff the candidate compiled, is correct and is not
  deceptive; speed plays no part.
* `speed` (beyond DICE): every failure scores 0 and every correct kernel scores in [1, 2], rising
  with its speedup: 1 + log2(1 + s) / log2(1 + cap), capped at 2 from s = cap (default 8x). A correct
  kernel at 0.1x still scores 1.04, above any failure, unlike the service's shaped reward (0 below
  0.5x); an untimed correct kernel (speedup 0) scores 1. Asks the verifier to time candidates.

`make_reward(name, **options)` returns the function; `REWARDS` lists the names.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Protocol


class Outcome(Protocol):
  compiled: bool
  correct: bool
  deceptive: bool
  speedup: float


RewardFn = Callable[[Outcome], float]


def passed(outcome: Outcome) -> bool:
  """DICE's condition for a valid reward: compiled, correct and not deceptive."""
  return bool(outcome.compiled and outcome.correct and not outcome.deceptive)


def binary_reward(outcome: Outcome) -> float:
  return 1.0 if passed(outcome) else 0.0


def speed_reward(outcome: Outcome, *, cap: float = 8.0) -> float:
  if not passed(outcome):
    return 0.0
  s = min(max(float(outcome.speedup), 0.0), cap)
  return 1.0 + math.log2(1.0 + s) / math.log2(1.0 + cap)


REWARDS: dict[str, Callable[..., float]] = {"binary": binary_reward, "speed": speed_reward}
NEEDS_TIMING = frozenset({"speed"})


def make_reward(name: str, **options) -> RewardFn:
  """The reward function `name` with its options bound; raises naming the bad name or option."""
  if name not in REWARDS:
    raise ValueError(f"unknown reward {name!r}; known: {sorted(REWARDS)}")
  if name == "binary" and options:
    raise ValueError(f"reward 'binary' takes no options, got {sorted(options)}")
  if name == "speed":
    unknown = set(options) - {"cap"}
    if unknown:
      raise ValueError(f"reward 'speed' takes only 'cap', got {sorted(unknown)}")
    if not options.get("cap", 8.0) > 0:
      raise ValueError(f"reward 'speed': cap must be > 0, got {options['cap']}")
  return functools.partial(REWARDS[name], **options)
