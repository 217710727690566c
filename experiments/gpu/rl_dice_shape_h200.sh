#!/usr/bin/env bash
# BiC-RL at DICE's shape on one H200 (issue 30, items 2-4): the TraceRL update's plan (layout,
# micro_rows, remat policy chosen by dice_jax/rl/memory.py before anything is sampled), its
# estimate beside the measured peak, the update's speed, and one RL step with sampling. Random
# weights, synthetic prompts, no data files. Every part runs under its own `timeout` so the whole
# script fits in ~560 s; each writes $OUT/<part>/bench_rl.json as it goes (the plan and estimate
# first), and a line to $OUT/status.txt when it ends.
#
#   OUT=/some/dir bash experiments/gpu/rl_dice_shape_h200.sh            # all parts, ~550 s
#   PARTS="u4096 step" OUT=/some/dir bash experiments/gpu/rl_dice_shape_h200.sh
#
# Parts (default order: the most informative first):
#   u4096  the update alone (--rollout=synthetic: random responses decoded one token per forward,
#          the worst-case row of 896 + 5 x 4,096 -> 24,576 tokens), sdar_1p7b, plan chosen
#          automatically under the 90% memory fraction: estimate vs measured peak, update tok/s
#   step   one RL step, sdar_1p7b, 896 + 4,096, low_confidence_dynamic rollouts, --verifier=local:
#          4 tasks x 16 samples in sampler calls of 4 groups (bench_rl first compiles the sampler
#          with one such call, untimed, then samples: 2 calls of 64 rows). 64 x 16 at 4,096 tokens
#          samples for ~11 minutes at issue 30's 6,283 tok/s, more than one 600 s device call: run
#          it alone with TASKS=64 GPB=8 STEP_TIMEOUT=590 PARTS=step); time split, peak after the
#          rollout and after the update
#   u2048  the update alone at 896 + 2,048 (issue 30: 21,220 input tok/s at micro_rows=1)
#   u4b    the update alone, sdar_4b, 1,500 + 4,096 (DICE's e2e prompt limit)
# GATHER=1 adds --gather_trained to every part (the LM head on the trained positions only).
# The optimizer steps use ROWS rows each (DICE: 256; the per-step time scales with rows, the
# memory does not: one micro-batch at a time), 2 steps, the first compiling.
set -u
OUT=${OUT:-/tmp/rl_dice_shape_h200}
PARTS=${PARTS:-"u4096 step u2048 u4b"}
TASKS=${TASKS:-4}
GPB=${GPB:-4}
ROWS=${ROWS:-8}
STEP_TIMEOUT=${STEP_TIMEOUT:-230}
EXTRA=""; [ "${GATHER:-0}" = 1 ] && EXTRA="--gather_trained"
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; git log --oneline -1
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } > "$OUT/env.txt" 2>&1

bench() {  # bench PART TIMEOUT MEM_FRACTION ARGS...
  local part=$1 limit=$2 frac=$3; shift 3
  mkdir -p "$OUT/$part"
  local t0=$(date +%s)
  XLA_PYTHON_CLIENT_MEM_FRACTION=$frac timeout "$limit" python3 -m experiments.bench_rl \
    --out="$OUT/$part" $EXTRA "$@" > "$OUT/$part/bench_rl.log" 2>&1
  echo "$part exit $? in $(( $(date +%s) - t0 )) s: bench_rl $*" >> "$OUT/status.txt"
}

for part in $PARTS; do
  case $part in
    u4096) bench u4096 120 0.90 --config=sdar_1p7b --rollout=synthetic --tasks=1 --group_size=16 \
             --prompt_len=896 --new_tokens=4096 --rows_per_update=$ROWS --update_steps=2 ;;
    step)  bench step "$STEP_TIMEOUT" 0.80 --config=sdar_1p7b --tasks=$TASKS --group_size=16 \
             --prompt_len=896 --new_tokens=4096 --groups_per_batch=$GPB --verifier=local \
             --rows_per_update=$ROWS --update_steps=2 ;;
    u2048) bench u2048 90 0.90 --config=sdar_1p7b --rollout=synthetic --tasks=1 --group_size=16 \
             --prompt_len=896 --new_tokens=2048 --rows_per_update=$ROWS --update_steps=2 ;;
    u4b)   bench u4b 120 0.90 --config=sdar_4b --rollout=synthetic --tasks=1 --group_size=8 \
             --prompt_len=1500 --new_tokens=4096 --rows_per_update=4 --update_steps=2 ;;
    *) echo "unknown part $part" >> "$OUT/status.txt" ;;
  esac
done

# Estimate vs measured peak and the chosen plan, per part.
python3 - "$OUT" $PARTS > "$OUT/summary.txt" 2>&1 <<'PY'
import json, os, sys
out = sys.argv[1]
for part in sys.argv[2:]:
    p = os.path.join(out, part, "bench_rl.json")
    if not os.path.exists(p):
        print(f"{part}: no result"); continue
    r = json.load(open(p))
    est = (r.get("update_estimate_gib") or {}).get("total")
    peak = r.get("peak_mem_gib")
    line = [f"{part}: {r.get('config')} {r.get('prompt_len')}+{r.get('new_tokens')}",
            f"plan {r.get('update_plan', r.get('refused', '?'))}",
            f"limit {r.get('device_limit_gib')} GiB",
            f"estimate {est} GiB, measured peak {peak} GiB (after rollout {r.get('peak_mem_gib_after_rollout')})"]
    if est and peak:
        line.append(f"estimate/peak {est / peak:.2f}")
    if "update_input_tok_per_s" in r:
        line.append(f"update {r['update_input_tok_per_s']} input tok/s, matmul MFU "
                    f"{r.get('update_mfu_matmuls')}, step {r.get('optimizer_step_s')} s")
    if "time_split" in r:
        line.append(f"sample {r.get('sample_s')} s ({r.get('generated_tok_per_s')} tok/s), verify-wait "
                    f"{r.get('verify_wait_s')} s, split {r['time_split']}")
    print(" | ".join(line))
PY
cat "$OUT/status.txt" "$OUT/summary.txt"
