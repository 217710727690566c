#!/usr/bin/env bash
# Issue 36 on one H200: the whole BiC-RL step at DICE's shape (item 2) and the update's MFU beside
# SFT's (item 1). Every part runs under its own `timeout`, writes its JSON as it goes and a line to
# $OUT/status.txt when it ends; $OUT/summary.txt collects the numbers at the end. Random weights,
# synthetic prompts, no data files. Run from the repository root:
#
#   OUT=/some/dir bash experiments/gpu/rl_step_h200.sh                   # PARTS="step": ~8 min
#   PARTS="attn u1p7b sft1p7b u4b sft4b" OUT=/some/dir bash experiments/gpu/rl_step_h200.sh
#
# The GPU host has no grain: carry its wheels (grain, array_record, portpicker for Python 3.12, in
# an ignored .whl/) and install them first to a --target put on PYTHONPATH (the script keeps it).
#
# All parts together get BUDGET seconds (585): each part's limit is cut to what is left, and a
# part with less than 30 s left is skipped (status.txt says so).
#
# Parts:
#   step     experiments/rl_step.py: sdar_1p7b, 8 tasks x 16, 896 + 4,096, recipe=dice, a local
#            CUDA verifier on the same GPU; phases setup, rollout, update (every optimizer step),
#            profile (3 micro-steps traced, summarised by trace_summary), probe (the trainer's old
#            log-prob forward: time and bf16 gap); one record, $OUT/step/rl_step.json, with DICE's
#            64 x 16 step extrapolated. JAX gets 80 % of the GPU (the verifier's workers need the
#            rest). The persistent compilation cache is $CACHE (default .jax_cache/ in the
#            repository: ignored by git, kept between calls on a warm machine; the record says
#            whether it was warm).
#   attn     experiments/bench_attention.py: the flash kernel on one micro-batch of TraceRL rows
#            (2 x 21,376 tokens), live-tile loops vs the earlier skipping loops (their numbers
#            compared), and the live-tile loops at three other tile sizes
#   u1p7b    bench_rl, the update alone: sdar_1p7b 896 + 4,096, 8 rows per optimizer step (2
#            steps, the first compiles), plan by the memory estimate, profile of 3 micro-steps
#   sft1p7b  bench_train sdar_1p7b seq 4,096, 2 rows: the SFT MFU the update is compared with
#            (--check: the kernel against the dense path first, bf16)
#   u4b      bench_rl, the update alone: sdar_4b 1,500 + 4,096, 4 rows per optimizer step
#   sft4b    bench_train sdar_4b seq 4,096, 1 row (with --remat if that does not fit)
#   gputests the flash kernel's GPU tests against the dense path (tests/train/test_flash_gpu.py,
#            tests/rl/test_tracerl_gpu.py), ~100 s; not in the default PARTS
set -u
START=$(date +%s)
OUT=${OUT:-/tmp/rl_step_h200}
PARTS=${PARTS:-step}
BUDGET=${BUDGET:-585}  # seconds for all parts: a part's limit is cut to what is left
CACHE=${CACHE:-$PWD/.jax_cache}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true" TF_CPP_MIN_LOG_LEVEL=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; git log --oneline -1
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
  echo "cache $CACHE: $(ls "$CACHE" 2>/dev/null | wc -l) entries"; } > "$OUT/env.txt" 2>&1

part() {  # part NAME TIMEOUT MEM_FRACTION COMMAND...
  local name=$1 limit=$2 frac=$3; shift 3
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if [ "$left" -lt 30 ]; then echo "$name skipped: ${left} s of the budget left" >> "$OUT/status.txt"; return 1; fi
  [ "$limit" -gt "$left" ] && limit=$left
  mkdir -p "$OUT/$name"
  local t0; t0=$(date +%s)
  XLA_PYTHON_CLIENT_MEM_FRACTION=$frac timeout "$limit" "$@" > "$OUT/$name/log.txt" 2>&1
  local rc=$?
  echo "$name exit $rc in $(( $(date +%s) - t0 )) s" >> "$OUT/status.txt"
  return $rc
}

for p in $PARTS; do
  case $p in
    step) part step 530 0.80 python3 -m experiments.rl_step --config=sdar_1p7b --recipe=dice \
            --tasks=8 --group_size=16 --prompt_len=896 --new_tokens=4096 --groups_per_batch=8 \
            --verifier=local --compilation_cache="$CACHE" --profile_dir="$OUT/step/trace" \
            --deadline_s=515 --out="$OUT/step/rl_step.json" ;;
    attn) part attn 110 0.90 python3 -m experiments.bench_attention --config=sdar_1p7b \
            --prompt_len=896 --new_tokens=4096 --rows=2 --tiles=128:128:64,64:64:64,128:64:128 \
            --out="$OUT/attn/bench_attention.json" ;;
    u1p7b) part u1p7b 150 0.90 python3 -m experiments.bench_rl --config=sdar_1p7b \
             --rollout=synthetic --tasks=1 --group_size=16 --prompt_len=896 --new_tokens=4096 \
             --rows_per_update=8 --update_steps=2 --compilation_cache="$CACHE" \
             --profile_dir="$OUT/u1p7b/trace" --out="$OUT/u1p7b" ;;
    sft1p7b) part sft1p7b 80 0.95 python3 -m experiments.bench_train --config=sdar_1p7b \
               --seq_len=4096 --batch_per_device=2 --steps=3 --check \
               --out="$OUT/sft1p7b/bench_train.jsonl" ;;
    u4b) part u4b 170 0.90 python3 -m experiments.bench_rl --config=sdar_4b --rollout=synthetic \
           --tasks=1 --group_size=8 --prompt_len=1500 --new_tokens=4096 --rows_per_update=4 \
           --update_steps=2 --compilation_cache="$CACHE" --profile_dir="$OUT/u4b/trace" \
           --out="$OUT/u4b" ;;
    sft4b) part sft4b 80 0.95 python3 -m experiments.bench_train --config=sdar_4b \
             --seq_len=4096 --batch_per_device=1 --steps=3 --out="$OUT/sft4b/bench_train.jsonl" ||
           part sft4b 80 0.95 python3 -m experiments.bench_train --config=sdar_4b \
             --seq_len=4096 --batch_per_device=1 --steps=3 --remat \
             --out="$OUT/sft4b/bench_train.jsonl" ;;
    gputests) part gputests 200 0.90 python3 -m pytest -q -m gpu -p no:cacheprovider \
                tests/train/test_flash_gpu.py tests/rl/test_tracerl_gpu.py ;;
    *) echo "unknown part $p" >> "$OUT/status.txt" ;;
  esac
done

python3 - "$OUT" > "$OUT/summary.txt" 2>&1 <<'PY'
import json, os, sys
out = sys.argv[1]
def load(*p):
    path = os.path.join(out, *p)
    if not os.path.exists(path):
        return None
    text = open(path).read()
    return json.loads(text.splitlines()[-1]) if path.endswith(".jsonl") else json.loads(text)
s = load("step", "rl_step.json")
if s:
    print("STEP", s.get("config"), "recipe", s.get("recipe"), "plan:", s.get("update_plan"))
    print("  cache:", s.get("compilation_cache"))
    for name, ph in (s.get("phases") or {}).items():
        print(f"  {name}: " + json.dumps({k: v for k, v in ph.items() if k not in ("top",)}))
    d = s.get("dice_step") or {}
    for k in ("at_measured_rate", "at_target_rate"):
        if k in d:
            print(f"  DICE 64x16 {k}: {d[k]}")
    if d:
        print("  formula:", d.get("formula"))
    for k in [k for k in s if k.endswith("_skipped") or k.endswith("_error")]:
        print(f"  {k}: {s[k]}")
a = load("attn", "bench_attention.json")
if a:
    print("ATTN", {k: v for k, v in a.items() if k.endswith(("_ms", "_speedup", "_mfu", "_diff_out", "_diff_grads"))})
    for tiles, r in (a.get("tile_sweep_live_only") or {}).items():
        print(f"  tiles {tiles}: {r}")
for u, sft in (("u1p7b", "sft1p7b"), ("u4b", "sft4b")):
    r = load(u, "bench_rl.json")
    t = load(sft, "bench_train.jsonl")
    if r:
        print(f"UPDATE {u}: plan {r.get('update_plan')}; step {r.get('optimizer_step_s')} s; "
              f"MFU {r.get('update_mfu')} (useful {r.get('update_useful_tflops_per_s')} TFLOP/s, "
              f"split {r.get('update_useful_split')}); peak {r.get('peak_mem_gib')} GiB vs estimate "
              f"{(r.get('update_estimate_gib') or {}).get('total')}")
        if r.get("profile"):
            print(f"  profile per micro-step: {r['profile'].get('by_kind_ms_per_micro_step')}")
    if t:
        print(f"  SFT {sft}: mfu {t.get('mfu')} (mask-aware), mfu_2l {t.get('mfu_2l')}, step {t.get('step_s')} s, remat {t.get('remat')}")
PY
cat "$OUT/status.txt" "$OUT/summary.txt"
