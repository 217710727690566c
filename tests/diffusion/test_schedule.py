"""Slot occupancy of a request order (diffusion.schedule): hand-checked cases and the issue-13
workload's bound for first-come-first-served and longest-first."""

import dataclasses

import numpy as np
import pytest

from dice_jax.diffusion.schedule import longest_first, occupancy


def test_equal_requests_fill_every_slot():
  assert occupancy([5] * 8, slots=4, refill_blocks=0) == 1.0


def test_one_long_request_last_leaves_the_other_slots_idle():
  # slots 2: [1, 1] then 8 on one slot -> makespan 9, useful 10 of 18
  assert occupancy([1, 1, 8], slots=2, refill_blocks=0) == pytest.approx(10 / 18)
  # longest first: 8 on slot A, 1 and 1 on slot B -> makespan 8, useful 10 of 16
  assert occupancy([8, 1, 1], slots=2, refill_blocks=0) == pytest.approx(10 / 16)


def test_refill_gap_counts_only_for_requests_that_reuse_a_slot():
  # two slots, three requests of 4: the third starts after 4 + 1 idle block
  assert occupancy([4, 4, 4], slots=2, refill_blocks=1) == pytest.approx(12 / (2 * 9))


def test_issue_13_mixed_workload_bound():
  budgets = np.random.RandomState(0).randint(64, 4097, 512)
  blocks = [-(-int(n) // 4) for n in budgets]
  fifo = occupancy(blocks, slots=128)
  lpt = occupancy(sorted(blocks, reverse=True), slots=128)
  assert 0.72 < fifo < 0.82 and lpt > 0.97


@dataclasses.dataclass
class _Req:
  id: int
  max_new_tokens: int


def test_longest_first_is_stable():
  reqs = [_Req(0, 5), _Req(1, 9), _Req(2, 5), _Req(3, 1)]
  assert [r.id for r in longest_first(reqs)] == [1, 0, 2, 3]


def test_bad_slot_count_is_refused():
  with pytest.raises(ValueError, match="slots"):
    occupancy([1], slots=0)
