"""The evaluation report of a run directory: ``report.md``, ``metrics.json`` and two PNGs.

  * a per-level table of the KernelBench metrics beside DICE's published row of the same model size
    (``published.py``), against eager PyTorch and, when measured, against ``torch.compile``;
  * speedups flagged for review (above the run's threshold), and how they are counted (``metrics.py``);
  * pass@k when a problem has several samples; failure kinds by level; the time split
    (generation, compile, run); the hardware and software versions of the learner and the verifier.

Everything is read back from ``run.json``, ``records.jsonl`` and the optional ``reviews.json``, so the
report of a finished or interrupted run can be rebuilt at any time (``python -m experiments.eval
--report_only --out=DIR``).
"""

from __future__ import annotations

import collections
import json
import math
import os
from collections.abc import Mapping, Sequence

from dice_jax.eval import metrics, published
from dice_jax.eval.records import (
  EvalRecord,
  Problem,
  RecordLog,
  level_outcomes,
  read_manifest,
  read_reviews,
)

REPORT = "report.md"
METRICS = "metrics.json"
SPEEDUP_PNG = "speedups.png"
FAILURES_PNG = "failure_kinds.png"
BASELINES = {"eager": "eager PyTorch", "compile": "torch.compile (inductor, default mode)"}


def compute_metrics(
  problems: Sequence[Problem],
  records: Sequence[EvalRecord],
  samples: int,
  baseline: str,
  reviews: Mapping[str, str],
  ks: Sequence[int] = (),
) -> dict[int, metrics.LevelMetrics]:
  """Per-level metrics of a run (levels in increasing order)."""
  by_level = level_outcomes(problems, records, samples, baseline, reviews)
  ks = [k for k in ks if k <= samples] if samples > 1 else []
  return {
    lv: metrics.level_metrics(first, every, ks) for lv, (first, every) in sorted(by_level.items())
  }


def _pct(x: float) -> str:
  return f"{100 * x:.1f}"


def _metrics_table(per_level: Mapping[int, metrics.LevelMetrics], rows) -> list[str]:
  ps = metrics.FAST_P_THRESHOLDS
  head = (
    ["level", "problems", "results", "compiled %", "exec %"]
    + [f"fast_{p:g} %" for p in ps]
    + ["geomean speedup", "deceptive %", "flagged"]
  )
  head += [f"{r.model} {r.size}: exec / fast_1 / fast_2 %" for r in rows]
  lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
  for lv, lm in per_level.items():
    cells = [
      f"L{lv}",
      str(lm.problems),
      str(lm.with_results),
      _pct(lm.compile_rate),
      _pct(lm.exec_accuracy),
    ]
    cells += [_pct(lm.fast_p[p]) for p in ps]
    cells += [f"{lm.geomean_speedup:.3f}", _pct(lm.deceptive_rate), str(lm.flagged)]
    for r in rows:
      pub = r.levels.get(lv)
      cells.append("-" if pub is None else " / ".join(f"{v:.1f}" for v in pub))
    lines.append("| " + " | ".join(cells) + " |")
  return lines


def _flagged_section(
  records: Sequence[EvalRecord], reviews: Mapping[str, str], threshold: float
) -> list[str]:
  flagged = [r for r in records if r.speedup_flagged and r.correct]
  lines = [
    f"## Speedups flagged for review (> {threshold:g}x)",
    "",
    "A flagged result counts as compiled and correct (exec accuracy, fast_0) but its speedup is "
    "left out of fast_p for p > 0 and of the geometric mean until `reviews.json` in this directory "
    'accepts it (`{"TASK#SAMPLE": "accept" | "reject"}`; reject = incorrect and deceptive). '
    "KernelBench, which only warns, counts them: its numbers are listed under the metrics table "
    "whenever a speedup is flagged.",
    "",
  ]
  if not flagged:
    return lines + ["None."]
  lines += ["| task | sample | speedup (eager) | speedup (compile) | review |", "|" + " --- |" * 5]
  for r in flagged:
    comp = f"{r.compiled_baseline.speedup:.2f}" if r.compiled_baseline else "-"
    review = reviews.get(r.key, "pending")
    lines.append(f"| {r.task_id} | {r.sample} | {r.eager.speedup:.2f} | {comp} | {review} |")
  return lines


def _failure_table(per_level: Mapping[int, metrics.LevelMetrics]) -> list[str]:
  kinds = sorted({k for lm in per_level.values() for k in lm.failure_kinds})
  head = ["failure kind"] + [f"L{lv}" for lv in per_level]
  lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
  for k in kinds:
    lines.append(
      "| " + " | ".join([k] + [str(lm.failure_kinds.get(k, 0)) for lm in per_level.values()]) + " |"
    )
  return lines


def _prompts_cut(records: Sequence[EvalRecord], decoding: Mapping) -> list[str]:
  """A line naming the samples whose prompt lost its end to ``max_prompt_tokens`` (DICE's rule)."""
  cut = [r for r in records if r.prompt_cut > 0]
  if not cut:
    return []
  by_level = collections.Counter(r.level for r in cut)
  levels = ", ".join(f"L{lv} {n}" for lv, n in sorted(by_level.items()))
  return [
    f"Prompts cut to their first {decoding.get('max_prompt_tokens', '?')} tokens (`max_prompt_tokens`; "
    f"DICE's evaluation tokenizes with `truncation=True, max_length=4096`): {len(cut)} sample(s) ({levels}), "
    f"up to {max(r.prompt_cut for r in cut):,} tokens lost from the end (the assistant header "
    "among them)."
  ]


def _time_split(records: Sequence[EvalRecord]) -> list[str]:
  gen = math.fsum(r.generation_s for r in records)
  comp = math.fsum(r.compile_s for r in records)
  longest = max((r.compile_s for r in records), default=0.0)
  run = math.fsum(r.run_s for r in records)
  return [
    "| generation (wall, all batches) s | compile, sum over candidates s | compile, longest s "
    "| run on the device, sum s |",
    "| --- | --- | --- | --- |",
    f"| {gen:.1f} | {comp:.1f} | {longest:.1f} | {run:.1f} |",
    "",
    "Builds run in parallel and candidates that share a build wait for it, so the compile sum "
    "overstates the wall time spent compiling; the longest single one bounds it from below.",
  ]


def plot_speedups(records: Sequence[EvalRecord], threshold: float, path: str) -> None:
  """Histogram of log2(eager speedup) of correct samples, one colour per level; speedups flagged
  for review are drawn as their own hatched series."""
  from matplotlib.figure import Figure
  from matplotlib.patches import Rectangle
  from matplotlib.ticker import MaxNLocator

  series = collections.defaultdict(list)
  for r in records:
    if r.correct and r.eager.speedup > 0:
      label = "flagged for review" if r.speedup_flagged else f"level {r.level}"
      series[label].append(math.log2(r.eager.speedup))
  labels = sorted(series, key=lambda k: (k.startswith("flagged"), k))
  fig = Figure(figsize=(7, 4), dpi=110)
  ax = fig.add_subplot()
  if series:
    lo = min(min(v) for v in series.values())
    hi = max(max(v) for v in series.values())
    lo, hi = min(lo, -1.0) - 0.25, max(hi, math.log2(threshold)) + 0.25
    bins = [lo + i * (hi - lo) / 30 for i in range(31)]
    levels = [k for k in labels if not k.startswith("flagged")]
    if levels:
      ax.hist([series[k] for k in levels], bins=bins, stacked=True, label=levels)
    if "flagged for review" in series:
      style = dict(hatch="//", fill=False, edgecolor="crimson")
      _, _, bars = ax.hist(series["flagged for review"], bins=bins, **style)
      for bar in bars:
        bar.set_visible(bar.get_height() > 0)  # no edge lines along the axis
      ax.add_patch(Rectangle((0, 0), 0, 0, label="flagged for review", **style))
    ax.legend()
  else:
    ax.text(0.5, 0.5, "no correct kernels", ha="center", va="center", transform=ax.transAxes)
  marks = ((0.0, "--", " 1x"), (1.0, ":", " 2x"), (math.log2(threshold), "-.", f" {threshold:g}x"))
  for x, style, name in marks:
    ax.axvline(x, color="k", linestyle=style, linewidth=0.8)
    ax.text(x, 1.0, name, transform=ax.get_xaxis_transform(), va="top", fontsize=8)
  ax.yaxis.set_major_locator(MaxNLocator(integer=True))
  ax.set_xlabel("log2 speedup over eager PyTorch (correct samples)")
  ax.set_ylabel("samples")
  ax.set_title("Speedup distribution")
  fig.tight_layout()
  fig.savefig(path)


def plot_failure_kinds(per_level: Mapping[int, metrics.LevelMetrics], path: str) -> None:
  """Stacked bars: share of each failure kind per level."""
  from matplotlib.figure import Figure

  kinds = sorted({k for lm in per_level.values() for k in lm.failure_kinds})
  fig = Figure(figsize=(7, 4), dpi=110)
  ax = fig.add_subplot()
  levels = list(per_level)
  bottom = [0.0] * len(levels)
  for k in kinds:
    share = [100 * per_level[lv].failure_kinds.get(k, 0) / per_level[lv].problems for lv in levels]
    ax.bar([f"L{lv}" for lv in levels], share, bottom=bottom, label=k)
    bottom = [b + s for b, s in zip(bottom, share)]
  ax.set_ylabel("% of problems (sample 0)")
  ax.set_title("Failure kinds by level")
  ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
  fig.tight_layout()
  fig.savefig(path)


def render_markdown(
  manifest: Mapping,
  per_baseline: Mapping[str, Mapping[int, metrics.LevelMetrics]],
  records: Sequence[EvalRecord],
  reviews: Mapping[str, str],
) -> str:
  model = manifest.get("model", {})
  rows = published.rows_for(int(model.get("num_params", 0)))
  size = published.size_class(int(model.get("num_params", 0)))
  threshold = float(manifest.get("review_speedup", metrics.REVIEW_SPEEDUP))
  devices = sorted({r.device_name for r in records if r.device_name})
  env = manifest.get("environment", {})
  if manifest.get("decoding") is None:
    what = f"Known candidates from `{model.get('source', '?')}` (no model, no published row)."
  else:
    what = (
      f"Model: `{model.get('source', '?')}` ({int(model.get('num_params', 0)):,} parameters; "
      + (f"compared with the published {size} rows" if rows else "no published row of this size")
      + ")."
    )
  lines = [
    "# KernelBench evaluation",
    "",
    what,
    f"Problems: {manifest.get('problems_source', '?')}; {manifest.get('samples', 1)} sample(s) per "
    "problem; headline metrics use sample 0 of every problem, missing results count as failures "
    "(KernelBench's `benchmark_eval_analysis.py`).",
    f"Decoding: `{json.dumps(manifest.get('decoding', {}), sort_keys=True)}`.",
    f"Verification: `{json.dumps(manifest.get('verify', {}), sort_keys=True)}`.",
  ]
  lines += _prompts_cut(records, manifest.get("decoding") or {}) + [""]
  for base, per_level in per_baseline.items():
    lines += [f"## Metrics against {BASELINES[base]}", ""]
    lines += _metrics_table(per_level, rows if base == "eager" else [])
    lines += [""]
    if any(lm.flagged for lm in per_level.values()):
      lines += ["fast_p counting flagged speedups (KernelBench's numbers):", ""]
      for lv, lm in per_level.items():
        vals = ", ".join(f"fast_{p:g} {_pct(v)}%" for p, v in lm.fast_p_counting_flagged.items())
        lines.append(f"- L{lv}: {vals}")
      lines.append("")
    if any(lm.pass_at_k for lm in per_level.values()):
      lines += ["pass@k (unbiased estimator, all samples):", ""]
      for lv, lm in per_level.items():
        lines.append(
          f"- L{lv}: " + ", ".join(f"pass@{k} {_pct(v)}%" for k, v in lm.pass_at_k.items())
        )
      lines.append("")
  if rows:
    lines += [
      "Published rows: DICE project page tables v1 (DICE, arXiv 2602.11715), KernelBench as "
      "vendored by DICE (v0-era problem sizes, hardware not stated, probably A100-class), eager "
      "baseline, fp32 atol = rtol = 1e-2.",
      "",
    ]
  lines += _flagged_section(records, reviews, threshold) + [""]
  eager = per_baseline.get("eager", {})
  lines += ["## Failure kinds by level (sample 0)", ""] + _failure_table(eager) + [""]
  lines += [f"![failure kinds]({FAILURES_PNG})", "", "## Speedup distribution", ""]
  lines += [f"![speedups]({SPEEDUP_PNG})", ""]
  lines += ["## Where the time went", ""] + _time_split(records) + [""]
  lines += [
    "## Hardware and versions",
    "",
    f"- verifier device(s): {', '.join(devices) or 'none reported'}",
    f"- learner: {env.get('learner_devices', '?')}",
  ]
  lines += [f"- {k}: {v}" for k, v in sorted(env.items()) if k != "learner_devices"]
  return "\n".join(lines) + "\n"


def write_report(run_dir: str) -> str:
  """Rebuilds ``report.md``, ``metrics.json`` and the PNGs of ``run_dir``; returns the report path."""
  manifest = read_manifest(run_dir)
  records = list(RecordLog(run_dir).records.values())
  reviews = read_reviews(run_dir)
  problems = [Problem(**p) for p in manifest["problems"]]
  samples = int(manifest.get("samples", 1))
  ks = [int(k) for k in manifest.get("pass_at_k", [])]
  per_baseline = {
    b: compute_metrics(problems, records, samples, b, reviews, ks)
    for b in manifest.get("baselines", ["eager"])
  }
  threshold = float(manifest.get("review_speedup", metrics.REVIEW_SPEEDUP))
  plot_speedups(records, threshold, os.path.join(run_dir, SPEEDUP_PNG))
  plot_failure_kinds(per_baseline["eager"], os.path.join(run_dir, FAILURES_PNG))
  with open(os.path.join(run_dir, METRICS), "w", encoding="utf-8") as f:
    json.dump(
      {b: {str(lv): lm.to_json() for lv, lm in pl.items()} for b, pl in per_baseline.items()},
      f,
      indent=2,
    )
  path = os.path.join(run_dir, REPORT)
  with open(path, "w", encoding="utf-8") as f:
    f.write(render_markdown(manifest, per_baseline, records, reviews))
  return path
