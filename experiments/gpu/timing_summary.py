"""One line per gpu_level1 phase of a `verifier bench` result: rate, verdicts, the checker's clock over
the previous method per problem, and where a timed candidate's time goes (``timing_h200.sh``).

  python3 experiments/gpu/timing_summary.py BENCH.json
"""

import json
import sys

KEYS = (
  "exchange_call_before_ms",
  "exchange_call_during_ms",
  "exchange_excess_ms",
  "exchange_overhead_ms",
  "reference_exchange_ms",
  "reference_in_process_ms",
  "calibration",
  "timing",
  "baseline",
  "trials",
  "candidate_load",
  "exchange_stage",
  "exchange_round_trip",
  "candidate_forward",
  "exchange_rt_publish",
  "exchange_rt_wake_in",
  "exchange_rt_wake_out",
)


def main(path: str) -> None:
  phases = json.load(open(path))["gpu_level1"]
  for tag, v in phases.items():
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
