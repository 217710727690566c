"""What the timing costs per candidate on this host (CPU): three timed runs of an honest candidate through
one service, then the phases' means. ``PYTHONPATH=. python tests/verifier/timing_cost.py``"""

import json
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import test_verifier_evidence as t  # noqa: E402

PHASES = ("baseline", "calibration", "timing", "recheck", "exchange_call_ms", "trials")


class _TmpDirs:
  def mktemp(self, name):
    return pathlib.Path(tempfile.mkdtemp(prefix=name))


def main() -> None:
  fixture = t.service.__wrapped__(_TmpDirs())
  svc = next(fixture)
  for i in range(3):
    r = t._verify(svc, f"cost-{i}", t.holes.GOOD + f"\n# {i}\n", num_perf_trials=100, num_warmup=3)
    print(i, r.failure_kind.value, f"run_s {r.run_s:.2f} speedup {r.speedup:.3f}", r.candidate)
  phases = svc[1].metrics.snapshot()["run_phase_mean_s"]
  print(json.dumps({k: round(v, 4) for k, v in phases.items() if k in PHASES}))
  next(fixture, None)


if __name__ == "__main__":
  main()
