"""Advantage rules against hand computations."""

import math

import numpy as np
import pytest

from dice_jax.rl import advantages


def test_group_zscore_uses_the_population_std_and_drops_equal_groups():
  rewards = [1, 0, 0, 0, 1, 1, 1, 1, 0.5, 0.5]
  groups = [7, 7, 7, 7, 3, 3, 3, 3, 9, 9]
  got = advantages.group_zscore(rewards, groups)
  # group 7: mean 1/4, population std sqrt(3/16) = sqrt(3)/4
  hi, lo = (1 - 0.25) / (math.sqrt(3) / 4), (0 - 0.25) / (math.sqrt(3) / 4)
  np.testing.assert_allclose(got.values[:4], [hi, lo, lo, lo], rtol=1e-6)
  assert hi == pytest.approx(math.sqrt(3)) and lo == pytest.approx(-1 / math.sqrt(3))
  np.testing.assert_array_equal(got.values[4:], 0.0)  # groups 3 and 9: all equal -> dropped
  np.testing.assert_array_equal(got.keep, [True] * 4 + [False] * 6)
  assert got.dropped_groups == 2 and got.groups == 3


def test_equal_rewards_that_are_not_exact_in_binary_are_still_dropped():
  got = advantages.group_zscore([0.1] * 16 + [0.0, 1.0], [0] * 16 + [1, 1])
  assert got.dropped_groups == 1 and not got.keep[:16].any()
  np.testing.assert_allclose(got.values[16:], [-1.0, 1.0])


def test_leave_one_out_and_mean_only_by_hand():
  rewards, groups = [3.0, 1.0, 2.0, 5.0, 5.0, 4.0], [0, 0, 0, 1, 1, 2]
  loo = advantages.leave_one_out(rewards, groups)
  np.testing.assert_allclose(loo.values, [3 - 1.5, 1 - 2.5, 2 - 2.0, 0, 0, 0])
  np.testing.assert_array_equal(loo.keep, [True, True, True, False, False, False])
  assert loo.dropped_groups == 2  # the equal pair and the singleton
  mean = advantages.compute("mean_only", rewards, groups)
  np.testing.assert_allclose(mean.values, [1.0, -1.0, 0.0, 0, 0, 0])
  assert mean.dropped_groups == 2 and mean.groups == 3


def test_bad_inputs_are_refused_with_the_reason():
  with pytest.raises(ValueError, match="must be one of"):
    advantages.compute("ppo", [1.0], [0])
  with pytest.raises(ValueError, match="same length"):
    advantages.group_zscore([1.0, 0.0], [0])
  with pytest.raises(ValueError, match="finite"):
    advantages.mean_only([1.0, float("nan")], [0, 0])
  empty = advantages.group_zscore([], [])
  assert empty.values.shape == (0,) and empty.dropped_groups == 0
