#!/usr/bin/env bash
# Issue 37 (items 3-9) on an H200, in one device call (<= 9 min with the default parts), most telling
# first; each part writes under $OUT as it ends and a status line goes to $OUT/status.txt, so a call cut by
# its limit returns what it had.
#   probe:  which kernel limit caps a worker's tasks here (cgroup v1/v2, RLIMIT_NPROC, pid_max), 10 s
#   tests:  every verifier GPU test (DICE's 99 known-good solutions among them: verdicts unchanged is
#           82 OK, 13 FOREIGN_KERNELS, 2 NO_KERNEL, 1 INPUT_MUTATION, 1 NONFINITE_OUTPUT; the 0.07 ms
#           float4 ReLU timed three times; nothing of a candidate on the GPU after its verdict)
#   level1: `verifier bench` gpu_level1: reward rate (target >= 80/min), then 10 timed pass-through
#           candidates cold and cached (target >= 45 timed/min cached; new/old within 10 % for >= 9/10),
#           each run's task counts (tasks_peak - tasks_baseline: the GPU runtime's transient threads,
#           task_limits.RUNTIME_TRANSIENT_TASKS["cuda"] assumes <= 2)
#   dice:   `verifier bench` dice_e2e: DICE's 99 end to end (target >= 100/min; not in the default parts)
# Data: .gpu_data/verifier (kernel_infilling_evaluation.json, level{1,2,3}.jsonl, the one-shot pair; see
# remaining_h200.sh), carried. Run from the repository root:
#   OUT=/some/dir bash experiments/gpu/evidence_v2_h200.sh                  # probe,tests,level1
#   OUT=/some/dir PARTS=level1,dice LEVEL1_RUNS=3 bash experiments/gpu/evidence_v2_h200.sh
set -u
: "${OUT:?set OUT}"
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
PARTS=${PARTS:-probe,tests,level1}
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
T0=$(date +%s)
has() { [[ ",$PARTS," == *",$1,"* ]]; }
stamp() { echo "$(($(date +%s) - T0)) s: $*" | tee -a "$OUT/status.txt"; }
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null

if has probe; then
  timeout 60 python3 - > "$OUT/probe.txt" 2>&1 <<'PY'
import os
from verifier.sandbox import confine
from verifier.sandbox.task_limits import CgroupTree
tree = CgroupTree.create(f"dice-verifier-probe-{os.getpid()}")
print("uid", os.geteuid(), "kernel", os.uname().release)
print("cgroup", f"v{tree.version} at {tree.pids}" if tree else f"none ({CgroupTree.why})")
if tree:
  tree.close()
print("pid_max per namespace", confine._kernel_at_least(6, 14))
PY
  stamp "probe: exit $? ($(tr '\n' ';' < "$OUT/probe.txt"))"
fi

if has tests; then
  timeout -s INT -k 20 "${TESTS_S:-360}" python3 -m pytest -m gpu -v -rA -p no:cacheprovider \
    --durations=0 tests/verifier/test_verifier_gpu.py > "$OUT/gpu_tests.log" 2>&1
  stamp "verifier GPU tests: exit $? ($(tail -1 "$OUT/gpu_tests.log"))"
  grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head | tee -a "$OUT/status.txt"
  grep -E "^strict:" "$OUT/gpu_tests.log" | tee -a "$OUT/status.txt"
fi

if has level1; then
  for run in $(seq "${LEVEL1_RUNS:-1}"); do
    timeout "${LEVEL1_S:-160}" python3 -m verifier bench --device cuda --phases gpu_level1 --level1 10 \
      --level1-samples 1 --timed "${TIMED:-10}" --budget-s $((${LEVEL1_S:-160} - 20)) \
      --out "$OUT/level1_$run.json" > "$OUT/level1_$run.log" 2>&1
    stamp "level1 bench run $run: exit $?"
    python3 -m experiments.gpu.timing_summary "$OUT/level1_$run.json" | tee "$OUT/level1_$run.txt"
    python3 - "$OUT/level1_$run.json" <<'PY' | tee -a "$OUT/status.txt"
import json, sys
d = json.load(open(sys.argv[1]))["gpu_level1"]
for tag, v in d.items():
  if isinstance(v, dict):
    m = v["run_phase_mean_s"]
    print(tag, f"{v['candidates_per_min']:.1f}/min", "tasks baseline", m.get("tasks_baseline"),
          "peak", m.get("tasks_peak"), "end", m.get("tasks_end"),
          "unmeasurable", m.get("timing_unmeasurable", 0), "resolution_ms", m.get("timing_resolution_ms"))
PY
  done
fi

if has dice; then
  timeout "${DICE_S:-200}" python3 -m verifier bench --device cuda --phases dice_e2e --candidates 99 \
    --budget-s $((${DICE_S:-200} - 20)) --out "$OUT/dice.json" > "$OUT/dice.log" 2>&1
  stamp "dice bench: exit $?"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1]))['dice_e2e']; print(round(d['candidates_per_min'],1), d['strict'])" "$OUT/dice.json" | tee -a "$OUT/status.txt"
fi
