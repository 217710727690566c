#!/usr/bin/env bash
# Every GPU measurement the open issues still need, on one H200 host, in one call (<= 10 min), most
# important first; each part's results are packed into $OUT/results.tgz as it ends, so a cut run
# returns what it had.
#
#   tests, rates, identity (issue 14): the verifier GPU tests, then `verifier bench` rates with the
#      compile-worker build flow, then the identity candidates of all 250 level 1-3 problems.
#   eval (issue 11, eval_h200.sh): known candidates, then a random sdar_1p7b end to end on 10 level-1
#      problems.
#   sampler (issue 13): sampler_h200.sh (RUNS, SAMPLER_FLAGS pick runs and sizes) with the time left.
#
# Data (no ../shared on the GPU host), in the git-ignored .gpu_data/ (carry it):
#   mkdir -p .gpu_data/verifier .gpu_data/eval
#   cp ../shared/data/dice_rl/kernel_infilling_evaluation.json ../shared/data/kernelbench/level{1,2,3}.jsonl \
#     .gpu_data/verifier/ && cp ../shared/data/kernelbench/level1.jsonl .gpu_data/eval/ \
#     && cp -r ../shared/data/sdar_chat .gpu_data/eval/sdar_chat
#   (the bench's `single` phase also reads KernelBench's one-shot example pair, copied there as
#   one_shot_model_ex_add.py.txt and one_shot_model_new_ex_add.py.txt)
# grain is not needed by any part. Run from the repository root:
#   OUT=/some/dir PARTS=tests,rates bash experiments/gpu/remaining_h200.sh
# (TESTS_S, RATES_S and IDENTITY_S set the time limits of those parts; RATE_PHASES the bench phases of rates.)
# PARTS picks what runs, of tests,rates,identity,eval,sampler (default tests,rates,sampler: what is still
# open after session 5); the sampler takes what is left of the call's CALL_S seconds (default 590).
# The device tool returns at most 8 files from $OUT, so the parts write under a work folder and
# $OUT gets results.tgz (rewritten after every part) and status.txt.
set -u
: "${OUT:?set OUT}"
OUT=$(realpath -m "$OUT")
PARTS=${PARTS:-tests,rates,sampler}
W=${WORK:-/tmp/remaining_h200}
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
rm -rf "$W" && mkdir -p "$W/verifier" "$W/eval" "$W/sampler" "$OUT"
T0=$(date +%s)
pack() { tar czf "$OUT/results.tgz.part" -C "$W" . && mv "$OUT/results.tgz.part" "$OUT/results.tgz"; }
stamp() { echo "$(($(date +%s) - T0)) s: $*" | tee -a "$W/status.txt"; cp "$W/status.txt" "$OUT/"; pack; }
has() { [[ ",$PARTS," == *",$1,"* ]]; }
git rev-parse HEAD > "$W/commit.txt"

# Parts run one after another: a timing test or a rate shares the GPU with nothing (session 5 ran eval
# beside the GPU tests, and the side-stream timing test failed that once while it passed alone).
# tests: the verifier GPU tests (socket filter on, the default); SIGINT at the limit so pytest still
#   prints its failures. rates: `verifier bench` DICE's 99 end to end (>= 60/min), level-1 reward
#   (>= 100/min), timed cached (>= 60/min). identity: all 250 level 1-3 references as candidates.
if has tests; then
  timeout -s INT -k 20 "${TESTS_S:-330}" python3 -m pytest -m gpu -v -rA -p no:cacheprovider \
    --durations=0 tests/verifier/test_verifier_gpu.py > "$W/verifier/gpu_tests.log" 2>&1
  stamp "verifier GPU tests: exit $? ($(tail -1 "$W/verifier/gpu_tests.log"))"
fi
if has rates; then
  RATES_S=${RATES_S:-440}  # all three rates: ~200 s of phases + the service start and the single build's PCH; the
  # kernelbench re-run of DICE's non-OK candidates (~80 s) comes last, only if budget is left (session 8)
  timeout "$RATES_S" python3 -m verifier bench --device cuda --phases "${RATE_PHASES:-single,dice_e2e,gpu_level1}" \
    --candidates 99 --level1 24 --level1-samples 4 --timed "${TIMED:-10}" --budget-s $((RATES_S - 20)) \
    --out "$W/verifier/rates.json" \
    > "$W/verifier/rates.log" 2>&1
  stamp "verifier rates: exit $?"
fi
if has identity; then
  IDENTITY_S=${IDENTITY_S:-240}
  timeout "$IDENTITY_S" python3 -m verifier bench --device cuda --phases identity --budget-s $((IDENTITY_S - 30)) \
    --out "$W/verifier/identity.json" > "$W/verifier/identity.log" 2>&1
  stamp "verifier identity: exit $?"
fi
if has eval; then
  OUT="$W/eval" timeout 230 bash experiments/gpu/eval_h200.sh > "$W/eval/script.log" 2>&1
  stamp "eval: exit $? ($(tr '\n' ';' < "$W/eval/times.txt"))"
fi

# 3. sampler, with what is left of the call's CALL_S (default 590 s)
if has sampler; then
  LEFT=$((${CALL_S:-590} - ($(date +%s) - T0)))
  OUT="$W/sampler" SAMPLER_S=$((LEFT - 10)) timeout "$LEFT" bash experiments/gpu/sampler_h200.sh > "$W/sampler/script.log" 2>&1
  stamp "sampler: exit $?"
fi
