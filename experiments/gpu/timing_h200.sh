#!/usr/bin/env bash
# Issue 25's H200 measurements of the checker's clock, in one device call, most telling first; each part
# writes under $OUT as it ends (a call cut by its limit returns what it had).
#   clock:  the two timing tests (good kernels' speedups; the checker's clock against in-process events)
#   level1: `verifier bench` gpu_level1: reward 10 x 1, then 10 timed pass-through candidates cold and
#           with cached baselines (new/old per problem, rates, where a timed candidate's time goes)
#   tests:  every verifier GPU test
#   dice:   `verifier bench` dice_e2e: DICE's 99 known-good solutions end to end (verdicts, rate)
# Data: .gpu_data/verifier (see remaining_h200.sh), carried. Run from the repository root:
#   OUT=/some/dir PARTS=clock,level1 bash experiments/gpu/timing_h200.sh
set -u
: "${OUT:?set OUT}"
PARTS=${PARTS:-clock,level1}
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
has() { [[ ",$PARTS," == *",$1,"* ]]; }
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null
if has clock; then
  timeout -s INT -k 20 "${CLOCK_S:-200}" python3 -m pytest -m gpu -v -rA -p no:cacheprovider \
    tests/verifier/test_verifier_gpu.py -k "good_kernels or checkers_clock" > "$OUT/clock.log" 2>&1
  echo "clock tests: exit $? ($(tail -1 "$OUT/clock.log"))"
  grep -E "^E .*(assert|Error)" "$OUT/clock.log" | head -6
fi
if has level1; then
  timeout "${LEVEL1_S:-300}" python3 -m verifier bench --device cuda --phases gpu_level1 --level1 10 \
    --level1-samples 1 --timed "${TIMED:-10}" --budget-s $((${LEVEL1_S:-300} - 20)) \
    --out "$OUT/level1.json" > "$OUT/level1.log" 2>&1
  echo "level1 bench: exit $?"
  python3 -m experiments.gpu.timing_summary "$OUT/level1.json"
fi
if has tests; then
  timeout -s INT -k 20 "${TESTS_S:-330}" python3 -m pytest -m gpu -v -rA -p no:cacheprovider \
    --durations=0 tests/verifier/test_verifier_gpu.py > "$OUT/gpu_tests.log" 2>&1
  echo "verifier GPU tests: exit $? ($(tail -1 "$OUT/gpu_tests.log"))"
  grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head
fi
if has dice; then
  timeout "${DICE_S:-200}" python3 -m verifier bench --device cuda --phases dice_e2e --candidates 99 \
    --budget-s $((${DICE_S:-200} - 20)) --out "$OUT/dice.json" > "$OUT/dice.log" 2>&1
  echo "dice bench: exit $?"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1]))['dice_e2e']; print(round(d['candidates_per_min'],1), d['strict'])" "$OUT/dice.json"
fi
