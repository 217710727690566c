#!/usr/bin/env bash
# Issue 37 (evidence on every judged call, host compute) on the H200, in one device call, most telling
# first; each part writes under $OUT as it ends (a call cut by its limit returns what it had).
#   probe: the CUPTI collector and the host sampler in a plain process (experiments/gpu/device_records_probe.py)
#   tests: every verifier GPU test: DICE's 99 known-good solutions first (verdicts to
#          $OUT/dice_known_good.json, then the strict counts against the expected 82 OK, 13 FOREIGN_KERNELS,
#          2 NO_KERNEL, 1 INPUT_MUTATION, 1 NONFINITE_OUTPUT and every other verdict listed), then the rest
#          (issue 37's hostile candidates, the good kernels, the adversarial ones, transport, streams)
# Budget: probe <= 45 s, DICE <= 230 s, the rest <= 260 s: under 9 minutes.
# Data: .gpu_data/verifier (kernel_infilling_evaluation.json), carried. Run from the repository root:
#   OUT=/some/dir bash experiments/gpu/evidence_h200.sh
set -u
: "${OUT:?set OUT}"
PARTS=${PARTS:-probe,tests}
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
has() { [[ ",$PARTS," == *",$1,"* ]]; }
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null
if has probe; then
  timeout -k 10 "${PROBE_S:-45}" python3 -m experiments.gpu.device_records_probe > "$OUT/probe.json" 2> "$OUT/probe.log"
  echo "probe: exit $?"
  python3 - "$OUT/probe.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("probe: no report", e); sys.exit()
h, g = d.get("host", {}), d.get("device", {})
print("host sampler:", h.get("error") or f"{h.get('samples')} samples, top {h.get('top')}", "paranoid", h.get("perf_event_paranoid"))
print("device records:", g.get("error") or g.get("self_test"), "cupti", g.get("cupti_version"), "take_ms", g.get("take_ms"))
for k in g.get("kernels", [])[:6]: print("  kernel", k)
for c in g.get("copies", [])[:6]: print("  copy", c)
PY
fi
if has tests; then
  # DICE's 99 first (their verdicts matter most), then every other GPU test; one build cache for both
  export VERIFIER_CACHE_DIR=${VERIFIER_CACHE_DIR:-${TMPDIR:-/tmp}/evidence_h200_builds}
  VERIFIER_REPORT_DIR="$OUT" timeout -s INT -k 20 "${DICE_S:-230}" python3 -m pytest -m gpu -v -rA \
    -p no:cacheprovider tests/verifier/test_verifier_gpu.py -k dice_known_good > "$OUT/dice_test.log" 2>&1
  echo "DICE known-good test: exit $? ($(tail -1 "$OUT/dice_test.log"))"
  timeout -s INT -k 20 "${TESTS_S:-260}" python3 -m pytest -m gpu -v -rA -p no:cacheprovider \
    --durations=0 tests/verifier/test_verifier_gpu.py -k "not dice_known_good" > "$OUT/gpu_tests.log" 2>&1
  echo "verifier GPU tests: exit $? ($(tail -1 "$OUT/gpu_tests.log"))"
  grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
  python3 - "$OUT/dice_known_good.json" <<'PY'
import collections, json, sys
expected = {"OK": 82, "FOREIGN_KERNELS": 13, "NO_KERNEL": 2, "INPUT_MUTATION": 1, "NONFINITE_OUTPUT": 1}
try:
    report = json.load(open(sys.argv[1]))
except Exception as e:
    print("dice: no report", e); sys.exit()
got = collections.Counter(x["kind"] for x in report)
print("dice strict verdicts:", dict(got), "expected:", expected, "same" if dict(got) == expected else "DIFFERENT")
for x in report:
    if x["kind"] != "OK":
        print("  ", x["id"], x["kind"], x["reason"][:200])
for what in ("device records unavailable", "host evidence unavailable", "host evidence incomplete"):
    n = sum(any(what in w for w in x.get("warnings", [])) for x in report)
    print(f"dice: {n} of {len(report)} carry '{what}'")
PY
fi
