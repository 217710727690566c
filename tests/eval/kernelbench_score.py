"""KernelBench's own metric code, copied verbatim as the oracle for tests/eval/test_metrics.py.

Source: ScalingIntelligence/KernelBench @ 423217d9fda91e0c2d67e4a43bf62f96f6d104f1 (2026-03-05),
MIT License, Copyright (c) 2023 Anne Ouyang, Simon Guo, Azalia Mirhoseini.
``fastp`` and ``geometric_mean_speed_ratio_correct_only`` are src/kernelbench/score.py;
``calc_pass_at_k`` is scripts/eval_from_generations.py; ``patch`` and the rate lines are
scripts/benchmark_eval_analysis.py (reduced to what the metrics use). Only formatting differs.
"""

import numpy as np


def geometric_mean_speed_ratio_correct_only(is_correct, baseline_speed, actual_speed, n):
  filtered_baseline_speed = np.array([x for i, x in enumerate(baseline_speed) if is_correct[i]])
  filtered_actual_speed = np.array([x for i, x in enumerate(actual_speed) if is_correct[i]])
  speed_up = filtered_baseline_speed / filtered_actual_speed
  prod = np.prod(speed_up)
  n_correct = np.sum(is_correct)  # Count number of correct samples

  return prod ** (1 / n_correct) if n_correct > 0 else 0


def fastp(is_correct, baseline_speed, actual_speed, n, p):
  filtered_baseline_speed = np.array([x for i, x in enumerate(baseline_speed) if is_correct[i]])
  filtered_actual_speed = np.array([x for i, x in enumerate(actual_speed) if is_correct[i]])
  speed_up = filtered_baseline_speed / filtered_actual_speed
  fast_p_score = np.sum(speed_up > p)
  return fast_p_score / n if n > 0 else 0


def calc_pass_at_k(n, c, k):
  if n - c < k:
    return 1.0
  return 1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1))


def patch(eval_results, problem_ids):
  for pid in problem_ids:
    if str(pid) not in eval_results:
      eval_results[str(pid)] = {
        "sample_id": 0,
        "compiled": False,
        "correctness": False,
        "metadata": {},
        "runtime": -1.0,
        "runtime_stats": {},
      }
  return eval_results


def analyze(eval_results, baseline_means, problem_ids):
  """benchmark_eval_analysis.analyze_greedy_eval's numbers, from dicts instead of files:
  eval_results {pid: {compiled, correctness, runtime}}, baseline_means {pid: mean}."""
  eval_results = patch(dict(eval_results), problem_ids)
  total_count = len(problem_ids)
  compiled_count = sum(e["compiled"] is True for e in eval_results.values())
  correct_count = sum(e["correctness"] is True for e in eval_results.values())
  is_correct, baseline, actual = [], [], []
  for pid in sorted(problem_ids):
    e = eval_results[str(pid)]
    is_correct.append(e["correctness"])
    actual.append(e["runtime"])
    baseline.append(baseline_means[pid])
  is_correct, baseline, actual = np.array(is_correct), np.array(baseline), np.array(actual)
  n = len(is_correct)
  return {
    "compilation_rate": compiled_count / total_count,
    "correctness_rate": correct_count / total_count,
    "geo_mean_speedup": float(
      geometric_mean_speed_ratio_correct_only(is_correct, baseline, actual, n)
    ),
    "fast_p": {
      p: float(fastp(is_correct, baseline, actual, n, p)) for p in [0.0, 0.5, 0.8, 1.0, 1.5, 2.0]
    },
  }
