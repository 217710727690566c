#!/usr/bin/env bash
# Every GPU measurement the open issues still need, on one H200 host, in one call (<= 10 min), most
# important first; each part writes under $OUT/<part>/ as it goes, so a cut run returns what it had.
#
#   1. verifier (issue 14): the GPU tests, then `verifier bench` with the compile-worker build flow
#      (session 4): DICE's 99 end to end (>= 60/min), level-1 reward (>= 100/min), timed cached (>= 60/min),
#      then the identity candidates of all 250 level 1-3 problems (250/250 OK).
#   2. eval part B (issue 11): a random sdar_1p7b end to end on 10 level-1 problems (eval_h200.sh).
#   3. sampler (issue 13): sampler_h200.sh (static, breakdown, tile sweep, long, mixed), if time is left.
#
# Data (no ../shared on the GPU host), in the git-ignored .gpu_data/ (carry it):
#   mkdir -p .gpu_data/verifier .gpu_data/eval
#   cp ../shared/data/dice_rl/kernel_infilling_evaluation.json ../shared/data/kernelbench/level{1,2,3}.jsonl \
#     .gpu_data/verifier/ && cp ../shared/data/kernelbench/level1.jsonl .gpu_data/eval/ \
#     && cp -r ../shared/data/sdar_chat .gpu_data/eval/sdar_chat
#   (the bench's `single` phase also reads KernelBench's one-shot example pair, copied there as
#   one_shot_model_ex_add.py.txt and one_shot_model_new_ex_add.py.txt)
# grain is not needed by any part. Run from the repository root: OUT=/some/dir bash experiments/gpu/remaining_h200.sh
set -u
: "${OUT:?set OUT}"
OUT=$(realpath -m "$OUT")
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT/verifier" "$OUT/eval" "$OUT/sampler"
T0=$(date +%s)
stamp() { echo "$(($(date +%s) - T0)) s: $*" | tee -a "$OUT/status.txt"; }
git rev-parse HEAD > "$OUT/commit.txt"

# 1. verifier: GPU tests (~110 s) with the socket filter on CUDA candidates too (if they pass, make
#    ServiceConfig.block_sockets_cuda the default), then the rates and the identity candidates
VERIFIER_BLOCK_SOCKETS_CUDA=1 timeout 150 python3 -m pytest -m gpu -q -rs -p no:cacheprovider \
  tests/verifier/test_verifier_gpu.py > "$OUT/verifier/gpu_tests.log" 2>&1
stamp "verifier GPU tests: exit $? ($(tail -1 "$OUT/verifier/gpu_tests.log"))"
timeout 200 python3 -m verifier bench --device cuda --phases single,dice_e2e,gpu_level1 --candidates 99 \
  --level1 24 --level1-samples 4 --timed 8 --budget-s 180 --out "$OUT/verifier/rates.json" \
  > "$OUT/verifier/rates.log" 2>&1
stamp "verifier rates: exit $?"
timeout 170 python3 -m verifier bench --device cuda --phases identity --budget-s 160 \
  --out "$OUT/verifier/identity.json" > "$OUT/verifier/identity.log" 2>&1
stamp "verifier identity: exit $?"

# 2. eval part B (the script's part A is quick and runs first; it has its own 285 s budget)
OUT="$OUT/eval" timeout 300 bash experiments/gpu/eval_h200.sh > "$OUT/eval/script.log" 2>&1
stamp "eval: exit $?"

# 3. sampler, with what is left of the call's 600 s
LEFT=$((590 - ($(date +%s) - T0)))
if [ "$LEFT" -gt 60 ]; then
  OUT="$OUT/sampler" timeout "$LEFT" bash experiments/gpu/sampler_h200.sh > "$OUT/sampler/script.log" 2>&1
  stamp "sampler: exit $?"
else
  stamp "sampler: skipped ($LEFT s left); run experiments/gpu/sampler_h200.sh in its own call"
fi
