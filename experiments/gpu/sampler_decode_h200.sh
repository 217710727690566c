#!/usr/bin/env bash
# Issue 39 on one H200 in <= BUDGET s (default 270): the decode forward's options against the
# default in ONE process (one model, one weights split), the base forward's per-kernel account first.
#
#   options  bench_sampler --runs=options_forward,options_exact,options_rates; sdar_4b, random bf16
#            weights, 128 rows, 1,024 + 1,024 (experiments/decode_options.py):
#            forward  one 4-token decode forward at fill 1,536 per variant (base, splits=3,
#                     fold_new=1, halves=1, the three together, cache=fp8, cache=fp8+fp8_widen=asm),
#                     compiled together: wall ms, device ms by kind; per kernel ms, GB, GFLOP, GB/s,
#                     TFLOP/s in options_forward.md (`base` = the profile-backed account); logits vs
#                     base (fp8_widen=asm vs cache=fp8): max |diff|, bitwise `exact`, argmax agreement
#            exact    tokens and step map of each variant vs its reference, static and dynamic, on a
#                     2-layer model of sdar_4b's shapes, LM head x40, 16 prompts of 64 + 64 tokens
#            rates    dynamic then static at full size for base and `best` (fastest exact bf16
#                     forward): tok/s, tokens per row-forward, vs base, token agreement; only the
#                     programs that fit before the deadline are lowered and compiled
#   tests    the kernel's value and exactness tests on the GPU, only if >= 90 s are left
# If the bench dies of a signal (a compiler crash), it runs once more without the `halves` variants.
# A status line per part in $OUT/status.txt; rows land in $OUT/results.jsonl as they come (a row per
# variant, `skipped` when the deadline cut it). Run from the repository root:
#   OUT=/some/dir bash experiments/gpu/sampler_decode_h200.sh
# BUDGET, PARTS (options,tests), OPTIONS (the variants) and FLAGS (more bench_sampler flags, e.g.
# a CPU smoke run's tiny config) override. An existing PYTHONPATH (e.g. /tmp/site) is kept.
set -u
START=$(date +%s)
: "${OUT:?set OUT}"
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
BUDGET=${BUDGET:-270}
PARTS=${PARTS:-options,tests}
OPTIONS=${OPTIONS:-base,splits=3,fold_new=1,halves=1,splits=3+fold_new=1+halves=1,cache=fp8,cache=fp8+fp8_widen=asm}
left() { echo $((BUDGET - ($(date +%s) - START))); }
status() { echo "$(($(date +%s) - START)) s: $*" | tee -a "$OUT/status.txt"; }
has() { [[ ",$PARTS," == *",$1,"* ]]; }
rows() { if [ -f "$OUT/results.jsonl" ]; then grep -c '"run"' "$OUT/results.jsonl"; else echo 0; fi; }
# part NAME MIN_S COMMAND...: COMMAND under the time left (less 5 s), skipped with less than MIN_S;
# returns COMMAND's status.
part() {
  local name=$1 min=$2 lim rc
  shift 2
  lim=$(($(left) - 5))
  if [ "$lim" -lt "$min" ]; then
    status "$name: skipped ($(left) s left, needs $min)"
    return
  fi
  timeout -k 5 "$lim" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  status "$name: exit $rc (limit $lim s; $(rows) rows in results.jsonl;" \
    "last: $(grep -v '^[WIE][0-9]' "$OUT/$name.log" | tail -1 | cut -c1-160))"
  return $rc
}
{
  git rev-parse HEAD 2>/dev/null
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
} >"$OUT/env.txt"
status "start: $(tr '\n' ' ' <"$OUT/env.txt")"

options() {  # options NAME VARIANTS
  # The bench starts nothing past its deadline: the budget left less start-up and final writes.
  # shellcheck disable=SC2086  # FLAGS: extra flags, split on spaces
  part "$1" 60 python3 -m experiments.bench_sampler --out="$OUT" --config=sdar_4b --batch=128 \
    --prompt_len=1024 --new_tokens=1024 --runs=options_forward,options_exact,options_rates \
    --decode_options="$2" --rate_options=base,best --rate_strategies=dynamic,static \
    --deadline_s=$(($(left) - 20)) ${FLAGS:-}
}
if has options; then
  options options "$OPTIONS"
  rc=$?
  # A compiler crash (a signal, not the timeout's) takes the process: once more without `halves`
  # (none of the options has run on a GPU before this script; the second-stream schedule is the
  # likeliest to crash XLA).
  if [ "$rc" -gt 128 ] && [ "$rc" -ne 137 ] && [[ "$OPTIONS" == *halves* ]]; then
    options options_no_halves "$(tr , '\n' <<<"$OPTIONS" | grep -v halves | paste -sd,)"
  fi
fi
if has tests; then
  part tests 90 python3 -m pytest -q -p no:cacheprovider tests/diffusion/test_flash_decode.py \
    -k "options_equal or without_cvt or every_decode_option"
fi
status "done ($(left) s of $BUDGET left)"
