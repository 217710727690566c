"""KernelBench metrics as pure functions over verified results.

Definitions follow ScalingIntelligence/KernelBench at commit 423217d (2026-03-05):
``src/kernelbench/score.py`` (``fastp``, ``geometric_mean_speed_ratio_correct_only``),
``scripts/benchmark_eval_analysis.py`` (rates over every problem of the level: a problem without a
result is patched in as not compiled and not correct) and ``scripts/eval_from_generations.py``
(``calc_pass_at_k``, the unbiased estimator 1 - C(n-c, k) / C(n, k)). DICE vendors the same
functions (ScalingIntelligence/KernelBench @ 423217d; docs/learner-spec.md "Evaluation").

One deliberate addition: a speedup above the review threshold (default 10x, KernelBench main's
``excessive_speedup_threshold``) is *flagged*. KernelBench only warns about it; here an unreviewed
flagged result counts as compiled and correct (it passed every check), hence in exec accuracy and
fast_0, but its speedup is not trusted: it is left out of fast_p for p > 0 and of the geometric mean
until a review accepts it. ``count_flagged=True`` gives KernelBench's own numbers.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping, Sequence

FAST_P_THRESHOLDS = (0.0, 0.5, 0.8, 1.0, 1.5, 2.0)  # benchmark_eval_analysis.py's p_values
REVIEW_SPEEDUP = 10.0  # KernelBench main: excessive_speedup_threshold
MISSING = "MISSING"  # failure kind of a problem without a result


@dataclasses.dataclass(frozen=True)
class Outcome:
  """What the metrics need of one verified sample.

  ``speedup`` is baseline mean / candidate mean (0 when untimed); ``flagged``: the speedup is above
  the review threshold and no review has accepted it yet."""

  compiled: bool
  correct: bool
  speedup: float = 0.0
  deceptive: bool = False
  failure_kind: str = "OK"
  flagged: bool = False


Results = Sequence[Outcome | None]  # one entry per problem of the level; None = no result


def _n(results: Results) -> int:
  if not results:
    raise ValueError("metrics need at least one problem (an empty level has no rates)")
  return len(results)


def compile_rate(results: Results) -> float:
  """Compiled problems / all problems (``compiled_count / total_count``)."""
  return sum(bool(r and r.compiled) for r in results) / _n(results)


def exec_accuracy(results: Results) -> float:
  """Correct problems / all problems (``correct_count / total_count``; DICE's "Exec")."""
  return sum(bool(r and r.correct) for r in results) / _n(results)


def _trusted(r: Outcome | None, count_flagged: bool) -> bool:
  return bool(r and r.correct and (count_flagged or not r.flagged))


def fast_p(results: Results, p: float, count_flagged: bool = False) -> float:
  """Problems that are correct and have speedup strictly above ``p`` / all problems (``fastp``).

  An unreviewed flagged speedup counts only for p = 0 (where fast_0 = exec accuracy), unless
  ``count_flagged``."""
  n = _n(results)
  if p == 0:
    return sum(bool(r and r.correct and r.speedup > 0) for r in results) / n
  return sum(_trusted(r, count_flagged) and r.speedup > p for r in results) / n


def fast_p_table(
  results: Results, thresholds: Sequence[float] = FAST_P_THRESHOLDS, count_flagged: bool = False
) -> dict[float, float]:
  return {p: fast_p(results, p, count_flagged) for p in thresholds}


def geomean_speedup(results: Results, count_flagged: bool = False) -> float:
  """Geometric mean of the speedups of correct problems, 0 when none is correct
  (``geometric_mean_speed_ratio_correct_only``). Unreviewed flagged speedups are left out, and so
  are correct results the verifier could not time (speedup 0: "no speedup reported", e.g. a CPU
  time under what the clock resolves): they count for correctness, never for speed."""
  s = [r.speedup for r in results if _trusted(r, count_flagged) and r.speedup > 0]
  if not s:
    return 0.0
  return math.exp(math.fsum(math.log(x) for x in s) / len(s))


def deceptive_rate(results: Results) -> float:
  """Problems whose candidate was refused as deceptive (cheating) / all problems."""
  return sum(bool(r and r.deceptive) for r in results) / _n(results)


def failure_kinds(results: Results) -> dict[str, int]:
  """Count of each failure kind (``OK`` for passing results, ``MISSING`` for absent ones)."""
  c = collections.Counter(MISSING if r is None else r.failure_kind for r in results)
  return dict(sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))


def flagged_count(results: Results) -> int:
  """Correct results whose speedup awaits review."""
  return sum(bool(r and r.correct and r.flagged) for r in results)


def is_excessive(speedup: float, threshold: float = REVIEW_SPEEDUP) -> bool:
  """KernelBench main's excessive-speedup rule: ``ref / kernel > threshold``."""
  return speedup > threshold


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k of one problem with ``c`` correct of ``n`` samples (``calc_pass_at_k``):
  1 - C(n-c, k) / C(n, k). As KernelBench does, k larger than n is lowered to n."""
  if not 0 <= c <= n:
    raise ValueError(f"pass@k needs 0 <= correct <= samples, got correct={c}, samples={n}")
  if k < 1:
    raise ValueError(f"pass@k needs k >= 1, got {k}")
  k = min(k, n)
  if n - c < k:
    return 1.0
  return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_pass_at_k(samples: Sequence[Sequence[Outcome]], k: int) -> float:
  """pass@k averaged over problems; ``samples[i]`` are problem i's results. A problem with no samples
  counts as 0 (KernelBench averages over the problems present; both agree when none is missing).
  A sample counts as passing when compiled and correct (``calculate_pass_at_k``)."""
  if not samples:
    raise ValueError("pass@k needs at least one problem")
  total = 0.0
  for rs in samples:
    if rs:
      total += pass_at_k(len(rs), sum(r.compiled and r.correct for r in rs), k)
  return total / len(samples)


@dataclasses.dataclass(frozen=True)
class LevelMetrics:
  """Every metric of one level (rates in [0, 1])."""

  problems: int
  with_results: int
  compile_rate: float
  exec_accuracy: float
  fast_p: Mapping[float, float]
  geomean_speedup: float
  deceptive_rate: float
  failure_kinds: Mapping[str, int]
  flagged: int
  fast_p_counting_flagged: Mapping[float, float]
  pass_at_k: Mapping[int, float] = dataclasses.field(default_factory=dict)

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    for key in ("fast_p", "fast_p_counting_flagged"):
      d[key] = {f"{p:g}": v for p, v in d[key].items()}
    d["pass_at_k"] = {str(k): v for k, v in d["pass_at_k"].items()}
    return d


def level_metrics(
  first_samples: Results,
  all_samples: Sequence[Sequence[Outcome]] | None = None,
  ks: Sequence[int] = (),
) -> LevelMetrics:
  """Metrics of one level from each problem's sample 0 (as KernelBench's analysis, which keeps
  ``sample_id == 0``) and, for pass@k with k > 1, every problem's samples."""
  pass_k = {}
  if all_samples is not None:
    if len(all_samples) != len(first_samples):
      raise ValueError(
        f"{len(first_samples)} problems have a first sample but {len(all_samples)} sample lists"
      )
    pass_k = {k: mean_pass_at_k(all_samples, k) for k in ks}
  return LevelMetrics(
    problems=_n(first_samples),
    with_results=sum(r is not None for r in first_samples),
    compile_rate=compile_rate(first_samples),
    exec_accuracy=exec_accuracy(first_samples),
    fast_p=fast_p_table(first_samples),
    geomean_speedup=geomean_speedup(first_samples),
    deceptive_rate=deceptive_rate(first_samples),
    failure_kinds=failure_kinds(first_samples),
    flagged=flagged_count(first_samples),
    fast_p_counting_flagged=fast_p_table(first_samples, count_flagged=True),
    pass_at_k=pass_k,
  )
