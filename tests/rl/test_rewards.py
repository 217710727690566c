"""Reward registry: DICE's binary reward and the speed-aware one (every correct kernel above every
failure, faster correct kernels higher)."""

import pytest

from dice_jax.rl import rewards
from verifier.api.contract import FailureKind, VerifyResult


def _outcome(compiled=True, correct=True, deceptive=False, speedup=0.0, kind="OK"):
  return VerifyResult(
    request_id="r",
    task_id="t",
    compiled=compiled,
    correct=correct,
    deceptive=deceptive,
    reward=0.0,
    failure_kind=FailureKind(kind),
    speedup=speedup,
  )


FAILURES = [
  _outcome(compiled=False, correct=False, kind="COMPILE_ERROR"),
  _outcome(correct=False, kind="WRONG_OUTPUT", speedup=0.0),
  _outcome(correct=True, deceptive=True, kind="TORCH_COMPUTE", speedup=50.0),
  _outcome(compiled=False, correct=False, kind="NO_CODE"),
]


def test_binary_is_one_only_for_compiled_correct_honest_kernels():
  binary = rewards.make_reward("binary")
  assert binary(_outcome()) == 1.0
  assert binary(_outcome(speedup=0.1)) == 1.0  # speed plays no part
  assert [binary(o) for o in FAILURES] == [0.0] * 4


def test_speed_reward_orders_every_correct_kernel_above_every_failure_and_by_speed():
  speed = rewards.make_reward("speed")
  speedups = [0.0, 0.1, 0.5, 1.0, 2.0, 4.0, 8.0]
  scores = [speed(_outcome(speedup=s)) for s in speedups]
  assert max(speed(o) for o in FAILURES) == 0.0
  assert min(scores) == 1.0 and scores == sorted(scores) and len(set(scores)) == len(scores)
  assert scores[1] == pytest.approx(1 + 0.13750352 / 3.169925)  # 0.1x: above 1, well below 1.0x
  assert scores[3] == pytest.approx(1 + 1 / 3.169925) and scores[-1] == 2.0
  assert speed(_outcome(speedup=100.0)) == 2.0  # capped
  assert rewards.make_reward("speed", cap=2.0)(_outcome(speedup=2.0)) == 2.0


def test_bad_names_and_options_are_named():
  with pytest.raises(ValueError, match="unknown reward 'shaped'"):
    rewards.make_reward("shaped")
  with pytest.raises(ValueError, match="'binary' takes no options"):
    rewards.make_reward("binary", cap=2)
  with pytest.raises(ValueError, match="only 'cap'"):
    rewards.make_reward("speed", floor=1)
  with pytest.raises(ValueError, match="cap must be > 0"):
    rewards.make_reward("speed", cap=0)
