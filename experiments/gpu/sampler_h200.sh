#!/bin/bash
# Issue 13 on one H200 in one pass (<= 8 minutes): every sampler measurement, most important first.
# Each measurement is appended to $OUT/results.jsonl and $OUT/results.md is rewritten after it, so
# a run cut at its limit returns what it had. Run from the repository root:
#   OUT=/some/dir bash experiments/gpu/sampler_h200.sh
# RUNS (bench_sampler --runs), SAMPLER_FLAGS (more bench_sampler flags) and SAMPLER_S (time limit)
# override the defaults below.
# Order (experiments/bench_sampler.py): static 1024+1024 (default tiles) -> forward breakdown
# (scan, dynamic-slice fusion, unrolled, prefill chunk) -> profile (device time by kernel) -> tile sweep -> static with the
# picked settings -> dynamic decoding on a sharpened LM head -> engine 1024+4096 x 128 (no stop)
# -> mixed-length continuous batching (512 prompts, 128 slots) -> the same workload static.
set -u
OUT=${OUT:-/tmp/sampler_h200}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.96  # the 1024+4096 cache alone is 92 GiB
export TF_CPP_MIN_LOG_LEVEL=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__, jax.devices())'
} >"$OUT/env.txt" 2>&1
RUNS=${RUNS:-static,static_fp8,breakdown,profile,sweep,best,dynamic,long,mixed,mixed_longest_first,mixed_static}
# shellcheck disable=SC2086  # SAMPLER_FLAGS: extra bench_sampler flags, split on spaces
timeout "${SAMPLER_S:-465}" python3 -m experiments.bench_sampler --out="$OUT" --runs="$RUNS" \
  ${SAMPLER_FLAGS:-} 2>&1 |
  grep -v "^W.*pxla\|^I[0-9]" >"$OUT/log.txt"
echo "exit ${PIPESTATUS[0]}" >>"$OUT/log.txt"
tail -c 4000 "$OUT/results.md" 2>/dev/null
