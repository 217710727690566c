"""The metric functions equal KernelBench's own code (tests/eval/kernelbench_score.py, a verbatim copy
of KernelBench @ 423217d) on hand-made result sets and on random ones."""

import math
import random

import pytest

from dice_jax.eval import metrics as m

from . import kernelbench_score as kb

P = m.FAST_P_THRESHOLDS


def _both(problems):
  """Hand-made level -> (our results, KernelBench's analysis of the same level).

  `problems`: per problem None (no result) or (compiled, correct, baseline_ms, candidate_ms)."""
  ours, eval_results, baseline = [], {}, {}
  for pid, p in enumerate(problems, 1):
    baseline[pid] = 1.0 if p is None else p[2]
    if p is None:
      ours.append(None)
      continue
    compiled, correct, base_ms, cand_ms = p
    speedup = base_ms / cand_ms if correct else 0.0
    ours.append(m.Outcome(compiled, correct, speedup, failure_kind="OK" if correct else "X"))
    eval_results[str(pid)] = {
      "compiled": compiled,
      "correctness": correct,
      "runtime": cand_ms if correct else -1.0,
    }
  return ours, kb.analyze(eval_results, baseline, list(range(1, len(problems) + 1)))


def _assert_equal(ours, theirs):
  lm = m.level_metrics(ours)
  assert lm.compile_rate == theirs["compilation_rate"]
  assert lm.exec_accuracy == theirs["correctness_rate"]
  assert dict(lm.fast_p) == theirs["fast_p"]
  assert math.isclose(lm.geomean_speedup, theirs["geo_mean_speedup"], rel_tol=1e-12, abs_tol=0)


def test_kernelbench_unit_test_vectors():
  # KernelBench's unit_tests/test_score.py: is_correct, baseline, actual and the expected numbers.
  ours, theirs = _both(
    [
      (True, True, 0.1, 0.2),
      (True, False, 0.15, 0.15),
      (True, True, 0.2, 0.3),
      (True, True, 0.05, 0.01),
      (True, False, 0.3, 0.2),
    ]
  )
  _assert_equal(ours, theirs)
  assert math.isclose(m.geomean_speedup(ours), 1.185631101, abs_tol=1e-7)
  assert m.fast_p(ours, 1.0) == 0.2 and m.fast_p(ours, 0.5) == 0.4


def test_no_correct_kernels():
  ours, theirs = _both([(True, False, 1.0, 1.0), (False, False, 2.0, 1.0), None])
  _assert_equal(ours, theirs)
  lm = m.level_metrics(ours)
  assert lm.geomean_speedup == 0.0 and set(lm.fast_p.values()) == {0.0}
  assert lm.compile_rate == pytest.approx(1 / 3) and lm.exec_accuracy == 0.0


def test_speedup_exactly_p_is_not_faster_than_p():
  # speedups exactly 0.5, 0.8 (0.8/1.0), 1, 1.5 and 2: strict '>' leaves each out of its own fast_p
  rows = [(True, True, b, 1.0) for b in (0.5, 0.8, 1.0, 1.5, 2.0)]
  ours, theirs = _both(rows)
  _assert_equal(ours, theirs)
  assert m.fast_p_table(ours) == {0.0: 1.0, 0.5: 0.8, 0.8: 0.6, 1.0: 0.4, 1.5: 0.2, 2.0: 0.0}


def test_failed_compiles_and_missing_results_count_in_the_denominator():
  rows = [
    (True, True, 3.0, 1.0),  # 3x
    (False, False, 1.0, 1.0),  # failed compile
    (False, False, 1.0, 1.0),
    None,  # no result at all (patched in as not compiled, not correct)
  ]
  ours, theirs = _both(rows)
  _assert_equal(ours, theirs)
  lm = m.level_metrics(ours)
  assert (lm.problems, lm.with_results) == (4, 3)
  assert lm.compile_rate == 0.25 and lm.exec_accuracy == 0.25
  assert lm.fast_p[2.0] == 0.25 and lm.geomean_speedup == pytest.approx(3.0)
  assert lm.failure_kinds == {"X": 2, "MISSING": 1, "OK": 1}


def test_random_levels_equal_kernelbench():
  rng = random.Random(0)
  for _ in range(300):
    rows = []
    for _ in range(rng.randint(1, 12)):
      u = rng.random()
      if u < 0.15:
        rows.append(None)
        continue
      compiled = u > 0.3
      correct = compiled and rng.random() < 0.7
      base = rng.choice([0.5, 1.0, 2.0, rng.uniform(0.01, 5.0)])
      cand = rng.choice([0.25, 0.5, 1.0, rng.uniform(0.01, 5.0)])
      rows.append((compiled, correct, base, cand))
    ours, theirs = _both(rows)
    _assert_equal(ours, theirs)


def test_flagged_speedups_stay_out_of_fast_p_until_reviewed():
  ok = m.Outcome(True, True, 1.2)
  flagged = m.Outcome(True, True, 40.0, flagged=True)
  fail = m.Outcome(True, False, failure_kind="WRONG_OUTPUT")
  level = [ok, flagged, fail, None]
  lm = m.level_metrics(level)
  assert lm.exec_accuracy == 0.5 and lm.fast_p[0.0] == 0.5  # fast_0 is still exec accuracy
  assert lm.fast_p[1.0] == 0.25 and lm.fast_p[2.0] == 0.0
  assert lm.geomean_speedup == pytest.approx(1.2) and lm.flagged == 1
  # counting it gives KernelBench's numbers, which only warn about excessive speedups
  assert lm.fast_p_counting_flagged[1.0] == 0.5 and lm.fast_p_counting_flagged[2.0] == 0.25
  assert m.geomean_speedup(level, count_flagged=True) == pytest.approx(math.sqrt(1.2 * 40))
  assert m.is_excessive(10.01) and not m.is_excessive(10.0)  # KernelBench: ref / kernel > 10


def test_deceptive_rate_and_failure_kinds():
  level = [
    m.Outcome(False, False, deceptive=True, failure_kind="TORCH_COMPUTE"),
    m.Outcome(False, False, deceptive=True, failure_kind="TORCH_COMPUTE"),
    m.Outcome(False, False, failure_kind="COMPILE_ERROR"),
    m.Outcome(True, True, 2.5),
    None,
  ]
  assert m.deceptive_rate(level) == 0.4
  assert m.failure_kinds(level) == {"TORCH_COMPUTE": 2, "COMPILE_ERROR": 1, "MISSING": 1, "OK": 1}


def test_pass_at_k_is_the_unbiased_estimator_and_equals_kernelbench():
  for n in range(1, 12):
    for c in range(n + 1):
      for k in range(1, n + 1):
        exact = 1.0 - math.comb(n - c, k) / math.comb(n, k)
        assert m.pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)
        assert m.pass_at_k(n, c, k) == pytest.approx(float(kb.calc_pass_at_k(n, c, k)), abs=1e-12)
  assert m.pass_at_k(3, 1, 10) == 1.0  # k > n is lowered to n, as KernelBench does
  assert m.pass_at_k(3, 0, 10) == 0.0
  with pytest.raises(ValueError, match="correct <= samples"):
    m.pass_at_k(2, 3, 1)


def test_mean_pass_at_k_over_problems():
  ok, bad = m.Outcome(True, True, 1.0), m.Outcome(True, False)
  not_built_but_marked_correct = m.Outcome(False, True, 1.0)  # KernelBench needs both flags
  samples = [[ok, bad, bad, bad], [bad] * 4, [ok] * 4, [not_built_but_marked_correct] * 4, []]
  assert m.mean_pass_at_k(samples, 1) == pytest.approx((0.25 + 0 + 1 + 0 + 0) / 5)
  assert m.mean_pass_at_k(samples, 2) == pytest.approx((0.5 + 0 + 1 + 0 + 0) / 5)
  lm = m.level_metrics([s[0] if s else None for s in samples], samples, ks=(1, 2))
  assert lm.pass_at_k == {1: pytest.approx(0.25), 2: pytest.approx(0.3)}


def test_empty_level_is_an_error():
  with pytest.raises(ValueError, match="at least one problem"):
    m.exec_accuracy([])


def test_a_correct_result_the_verifier_could_not_time_counts_for_correctness_not_speed():
  timed = m.Outcome(True, True, 2.0, failure_kind="OK")
  untimed = m.Outcome(True, True, 0.0, failure_kind="OK")  # "no speedup reported" (was: ValueError)
  assert m.geomean_speedup([timed, untimed]) == 2.0 and m.geomean_speedup([untimed]) == 0.0
