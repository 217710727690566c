#!/usr/bin/env bash
# One BiC-RL step at sdar_1p7b scale on one H200 with a local verifier, and the sampler/train
# benchmarks at the same token counts (docs/performance.md, "BiC-RL"). At most ~6 minutes; results land
# in $OUT as each part finishes. Needs no data files, no grain and no tokenizers (synthetic
# prompts, random weights). Run from the repository root: OUT=/some/dir bash experiments/gpu/h200_rl_step.sh
set -u
OUT=${OUT:-/tmp/h200_rl_step}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true"
NEW=${NEW:-512}       # new tokens per sample: 4096 OOMs at batch 128 today (sampler branch fixes it)
PROMPT=${PROMPT:-896} # DICE e2e prompts: median 883 tokens
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; git log --oneline -1; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } > "$OUT/env.txt" 2>&1

# 1. The RL step: 64 tasks x 16 samples (8 sampler calls of 128 rows), every response to the local
#    CUDA verifier over gRPC, then the TraceRL update (256 packed rows per optimizer step, synthetic
#    advantages: random weights earn reward 0 and every group would be dropped). 2 of the 4
#    optimizer steps run (the first compiles); the 4-step time is extrapolated from the second.
#    JAX gets 80% of the GPU so the verifier's workers can create their CUDA contexts.
XLA_PYTHON_CLIENT_MEM_FRACTION=0.80 timeout 225 python3 -m experiments.bench_rl --config=sdar_1p7b \
  --tasks=64 --group_size=16 --prompt_len=$PROMPT --new_tokens=$NEW --groups_per_batch=8 \
  --verifier=local --rows_per_update=256 --micro_rows=2 --update_steps=2 --out="$OUT" \
  > "$OUT/bench_rl.log" 2>&1; echo "bench_rl exit $?" >> "$OUT/status.txt"

# 2. The sampler alone on one call's shape (128 rows, same prompt and new tokens; its static run is
#    greedy low_confidence_static: with random weights no confidence passes 0.9, so the rollout's
#    low_confidence_dynamic also unmasks one token per forward, the same forwards).
XLA_PYTHON_CLIENT_MEM_FRACTION=0.90 timeout 55 python3 -m experiments.bench_sampler --config=sdar_1p7b \
  --runs=static --batch=128 --prompt_len=$PROMPT --new_tokens=$NEW --prefill_chunk=16 \
  --out="$OUT/bench_sampler" > "$OUT/bench_sampler.log" 2>&1; echo "bench_sampler exit $?" >> "$OUT/status.txt"

# 3. The train step alone on one micro-batch's token count: TraceRL rows here are 896 + 512 +
#    4 x 512 = 3456 tokens (random weights decode 1 token per step), bucketed to 4096; bench_train's
#    model input is 2 x seq_len per row, so seq_len = row_len / 2 and 2 rows as in a micro-batch.
SEQ=$(python3 -c "import json; print(json.load(open('$OUT/bench_rl.json'))['row_len'] // 2)" 2>/dev/null || echo 2048)
XLA_PYTHON_CLIENT_MEM_FRACTION=0.90 timeout 65 python3 -m experiments.bench_train --config=sdar_1p7b \
  --seq_len=$SEQ --batch_per_device=2 --steps=3 \
  --out="$OUT/bench_train.jsonl" > "$OUT/bench_train.log" 2>&1; echo "bench_train exit $?" >> "$OUT/status.txt"

# 4. Learner's own part vs the benchmarks at the same token counts (target: within 1.3x).
python3 - "$OUT" > "$OUT/summary.txt" 2>&1 <<'PY'
import json, sys, os
out = sys.argv[1]
rl = json.load(open(os.path.join(out, "bench_rl.json")))
print(json.dumps(rl, indent=1))
def last(name):
    p = os.path.join(out, name)
    return json.loads(open(p).read().splitlines()[-1]) if os.path.exists(p) else None
s, t = last("bench_sampler/results.jsonl"), last("bench_train.jsonl")
if s and "sample_s" in rl:
    expect = rl["sampler_calls"] * s["run_s"]
    print(f"rollout: {rl['sample_s']:.1f} s for {rl['sampler_calls']} calls vs bench_sampler "
          f"{s['run_s']:.2f} s/call x {rl['sampler_calls']} = {expect:.1f} s -> ratio {rl['sample_s'] / expect:.2f}")
if t and "optimizer_step_steady_s" in rl:
    micro_s = t["step_s"] * (t["input_len"] * t["rows"]) / (rl["row_len"] * rl["micro_rows"])
    expect = micro_s * rl["accum_steps"]
    print(f"optimizer step ({rl['rows_per_update']} rows): {rl['optimizer_step_steady_s']:.1f} s vs bench_train "
          f"{t['step_s']:.3f} s per {t['rows']} x {t['input_len']} tokens x {rl['accum_steps']} = "
          f"{expect:.1f} s -> ratio {rl['optimizer_step_steady_s'] / expect:.2f}")
    print(f"old log-probs (forward only, {rl['rows_per_update']} rows): {rl['old_logp_steady_s']:.1f} s "
          f"({rl['old_logp_steady_s'] / expect:.2f} of the bench_train step time; a forward is ~1/3)")
PY
cat "$OUT/status.txt" "$OUT/summary.txt"
