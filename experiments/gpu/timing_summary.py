"""One line per gpu_level1 phase of a `verifier bench` result: rate, verdicts, the checker's clock over
the previous method per problem, and where a timed candidate's time goes (``timing_h200.sh``).

  python3 -m experiments.gpu.timing_summary BENCH.json
"""

import json
import sys

from verifier.bench import TIMING_PHASES

# the per-problem timing phases, then the rest of a timed candidate's time
KEYS = TIMING_PHASES + (
  "baseline",
  "trials",
  "candidate_load",
  "exchange_stage",
)


def main(path: str) -> None:
  phases = json.load(open(path))["gpu_level1"]
  for tag, v in phases.items():
    if tag == "timing_median":
      ratios = " ".join(f"{r:.3f}" for r in v["new_over_old_median"].values())
      rate = v["cached_per_min_mean"]
      print(
        f"median over {v['passes']} timed passes: new/old [{ratios}] within 10%: "
        f"{v['within_10pct']}/{v['compared']}; cached rate mean "
        + (f"{rate:.1f}/min" if rate is not None else "-")
      )
      continue
    if not isinstance(v, dict):
      print(tag, v)
      continue
    line = f"{tag}: {v['candidates_per_min']:.1f}/min {v['kinds']}"
    tm = v.get("timing_methods")
    if tm:
      ratios = " ".join(f"{r:.3f}" for r in tm["new_over_old"].values())
      line += f" new/old [{ratios}] within 10%: {tm['within_10pct']}/{tm['compared']}"
    print(line)
    mean = v["run_phase_mean_s"]
    print("  " + " ".join(f"{k}={mean[k]:.4g}" for k in KEYS if k in mean))
    for task, ph in v.get("per_problem_phases", {}).items():
      ratio = (tm or {}).get("new_over_old", {}).get(task, float("nan"))
      print(f"    {task[:28]:28s} {ratio:.3f} " + " ".join(f"{k}={x:.4g}" for k, x in ph.items()))


if __name__ == "__main__":
  main(sys.argv[1])
