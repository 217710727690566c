#!/usr/bin/env bash
# KernelBench evaluation on one H200 host (issue 11), at most ~5 minutes, results under $OUT as they come.
#
# Data (no ../shared on the GPU host), copied on the dev machine into the git-ignored .gpu_data/:
#   mkdir -p .gpu_data/eval && cp ../shared/data/kernelbench/level1.jsonl .gpu_data/eval/ \
#     && cp -r ../shared/data/sdar_chat .gpu_data/eval/sdar_chat
# Run from the repository root:  OUT=/some/dir bash experiments/gpu/eval_h200.sh
#
# A. Known candidates on level-1 problems 19-32 (references renamed ModelNew under the `off` preset,
#    plus hand-written CUDA kernels: correct, wrong, slow, compile error, missing); their metrics are
#    checked exactly (experiments/eval_known.py) -> $OUT/known/check.txt.
# B. A random sdar_1p7b (export_hf --init=random, SDAR tokenizer) evaluated end to end on level-1
#    problems 1-10 through the real generation + service path, new tokens capped at 1,024 (DICE: 4,096)
#    to fit the time; a random model writes no code block, so its raw responses are sent to the
#    verifier (--extract=first_block_or_raw) -> $OUT/e2e/report.md (time split: generation, compile, run).
set -u
: "${OUT:?set OUT}"
OUT=$(realpath -m "$OUT")
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 VERIFIER_TOKEN=
D=.gpu_data/eval
PORT=50071
mkdir -p "$OUT/known" "$OUT/e2e"
T0=$(date +%s)
stamp() { echo "$(($(date +%s) - T0)) s: $*" | tee -a "$OUT/times.txt"; }
left() { local l=$((285 - ($(date +%s) - T0))); echo $((l < 30 ? 30 : l)); }

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, jax, flax; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'jax', jax.__version__, 'flax', flax.__version__)"
  git rev-parse HEAD; } > "$OUT/versions.txt" 2>&1

# One verifier service for both runs (its build cache in /tmp).
python3 -m verifier serve --device cuda --host 127.0.0.1 --port $PORT --cache-dir /tmp/dj_vcache \
  --compile-workers 8 --run-prewarm 6 > "$OUT/verifier.log" 2>&1 &
VPID=$!
# The random model is exported meanwhile, on the CPU (4 GB of weights go to /tmp): JAX on the GPU would
# take memory from the verifier's runs of level-1's 6.4 GB inputs.
JAX_PLATFORMS=cpu python3 -m experiments.export_hf --init=random --config=sdar_1p7b \
  --tokenizer_dir=$D/sdar_chat --out=/tmp/dj_sdar_1p7b_random --overwrite > "$OUT/export.log" 2>&1 &
EPID=$!
for _ in $(seq 90); do grep -q "listening on" "$OUT/verifier.log" && break; sleep 1; done
stamp "verifier up"

# A. known candidates
python3 -m experiments.eval_known --kernelbench=$D/level1.jsonl --problems=19-32 \
  --out="$OUT/known/known.jsonl" > "$OUT/known/write.log" 2>&1
JAX_PLATFORMS=cpu timeout 150 python3 -m experiments.eval --candidates="$OUT/known/known.jsonl" \
  --kernelbench=$D/level1.jsonl --levels=1 --problems=19-32 --strictness=off \
  --verifier=127.0.0.1:$PORT --out="$OUT/known/run" --noprogress > "$OUT/known/eval.log" 2>&1
stamp "A known candidates: exit $?"
# (re)build the report from the records, also after a timeout
JAX_PLATFORMS=cpu python3 -m experiments.eval --report_only --out="$OUT/known/run" >> "$OUT/known/eval.log" 2>&1
python3 -m experiments.eval_known --check="$OUT/known/run" \
  --expected="$OUT/known/known.expected.json" > "$OUT/known/check.txt" 2>&1
stamp "A check: exit $? ($(tail -1 "$OUT/known/check.txt"))"

# B. random sdar_1p7b end to end
wait $EPID
stamp "export: exit $? ($(tail -1 "$OUT/export.log"))"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 timeout "$(left)" python3 -m experiments.eval \
  --hf_dir=/tmp/dj_sdar_1p7b_random --kernelbench=$D/level1.jsonl --levels=1 --problems=1-10 \
  --verifier=127.0.0.1:$PORT --out="$OUT/e2e" --max_new_tokens=1024 --batch_size=10 \
  --extract=first_block_or_raw --noprogress > "$OUT/e2e/eval.log" 2>&1
stamp "B e2e: exit $?"
JAX_PLATFORMS=cpu python3 -m experiments.eval --report_only --out="$OUT/e2e" >> "$OUT/e2e/eval.log" 2>&1

kill $VPID 2>/dev/null
wait $VPID 2>/dev/null
stamp "done"
