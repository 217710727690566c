#!/usr/bin/env bash
# Issue 39 on one H200 in one call (<= TOTAL_S, default 470 s): where one decode forward's time goes
# and what the cache-attention variants change, then the sampler's rates with the fastest exact one.
#
#   profile  experiments.decode_profile (sdar_4b, 128 rows, fill 1536, 4 new tokens):
#            kernel: the cached attention of all 36 layers per variant (ms, TB/s, output vs base);
#            forward: one decode forward per variant (wall ms; device ms by kind and by kernel with
#            each kernel's GB/s and TFLOP/s); writes best_tiles.json (fastest exact forward).
#   rates    bench_sampler --runs=static,dynamic on sdar_4b, 128 rows, 1024 + 1024, with those tiles
#            (tokens per row-forward in each row).
#   long     bench_sampler --runs=long: the engine, 128 x (1024 + 4096), no stop.
#   rl       bench_sampler --runs=dynamic on sdar_1p7b, 128 rows, 896 + 4096 (the RL rollout's shape).
#   tests    the kernel's value and exactness tests on the GPU (the inline-asm fp8 widening for real).
# Each part has its own limit (and none starts past TOTAL_S); results land as they come in $OUT:
# status.txt (a line per part), decode.md (per-kernel tables), results.jsonl (every row of every
# part), results.tgz (all logs). Run from the repository root:
#   OUT=/some/dir bash experiments/gpu/sampler_decode_h200.sh
# PARTS (default profile,rates,long,rl,tests), TOTAL_S, KERNEL_VARIANTS, FORWARD_VARIANTS override;
# PROFILE_FLAGS and BENCH_FLAGS add flags (a CPU smoke run: tiny config and sizes).
set -u
: "${OUT:?set OUT}"
OUT=$(realpath -m "$OUT")
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.96 # the 1024 + 4096 cache alone is 92 GiB
PARTS=${PARTS:-profile,rates,long,rl,tests}
TOTAL_S=${TOTAL_S:-470}
W=${WORK:-/tmp/sampler_decode_h200}
rm -rf "$W" && mkdir -p "$W" "$OUT"
T0=$(date +%s)
left() { echo $((TOTAL_S - ($(date +%s) - T0))); }
pack() { tar czf "$OUT/results.tgz.part" -C "$W" . && mv "$OUT/results.tgz.part" "$OUT/results.tgz"; }
stamp() {
  echo "$(($(date +%s) - T0)) s: $*" | tee -a "$W/status.txt"
  cp "$W/status.txt" "$OUT/"
  for f in decode.md decode.jsonl results.jsonl best_tiles.json; do [ -f "$W/$f" ] && cp "$W/$f" "$OUT/"; done
  pack
}
has() { [[ ",$PARTS," == *",$1,"* ]]; }
# run NAME MIN_S MAX_S CMD...: CMD under min(MAX_S, time left), skipped when less than MIN_S is left.
run() {
  local name=$1 min=$2 max=$3 lim
  shift 3
  lim=$(left)
  [ "$lim" -gt "$max" ] && lim=$max
  if [ "$lim" -lt "$min" ]; then
    stamp "$name: skipped ($(left) s left, needs $min)"
    return
  fi
  timeout -k 10 "$lim" "$@" >>"$W/$name.log" 2>&1
  stamp "$name: exit $? (limit $lim s; last line: $(grep -v '^[WI][0-9]' "$W/$name.log" | tail -1 | cut -c1-200))"
}
{
  git rev-parse HEAD 2>/dev/null
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__, jax.devices())'
} >"$W/env.txt" 2>&1
stamp "start: $(tail -1 "$W/env.txt" | cut -c1-160)"

KV=${KERNEL_VARIANTS:-base,fold_new=1,splits=2,splits=3,fold_new=1+splits=3,block_k=32,cache=fp8,cache=fp8+fp8_widen=asm,cache=fp8+fp8_widen=asm+fold_new=1+splits=3}
FV=${FORWARD_VARIANTS:-base,fold_new=1+splits=3,fold_new=1+splits=3+halves=1,cache=fp8+fp8_widen=asm+fold_new=1+splits=3}
# shellcheck disable=SC2206  # *_FLAGS: extra flags, split on spaces
BENCH=(python3 -m experiments.bench_sampler --out="$W" ${BENCH_FLAGS:-})
# shellcheck disable=SC2206
PROFILE=(python3 -m experiments.decode_profile --out="$W" ${PROFILE_FLAGS:-})
if has profile; then
  # the forward variants stop starting at 190 s; each takes ~30-45 s (compile, timing, trace)
  run profile 60 230 "${PROFILE[@]}" --parts=kernel,forward --kernel_variants="$KV" \
    --forward_variants="$FV" --deadline_s=190
fi
TILES=()
[ -f "$W/best_tiles.json" ] && TILES=(--decode_tiles="$W/best_tiles.json")
stamp "tiles for the rates: $(cat "$W/best_tiles.json" 2>/dev/null || echo default)"
if has rates; then
  run rates 120 200 "${BENCH[@]}" "${TILES[@]}" --runs=static,dynamic
fi
if has long; then
  run long 150 260 "${BENCH[@]}" "${TILES[@]}" --runs=long --long_tokens=4096
fi
if has rl; then
  run rl 100 170 "${BENCH[@]}" "${TILES[@]}" --config=sdar_1p7b --prompt_len=896 \
    --new_tokens=4096 --runs=dynamic
fi
if has tests; then
  run tests 40 120 python3 -m pytest -q -p no:cacheprovider tests/diffusion/test_flash_decode.py \
    -k "options_equal or without_cvt or every_decode_option"
fi
stamp "done"
