#!/usr/bin/env bash
# Issue 37 item 9: the float4 ReLU's verifier speedup against KernelBench-style events, with the worker's
# head start (verifier/ipc/head_start.py, HEAD_START_US) at each of US_LIST in turn, ROUNDS times, on one
# machine (the build cache shared). Each round runs the GPU test
# `test_a_kernel_under_a_tenth_of_a_millisecond_is_timed_like_cuda_events` (three verifier runs and the
# in-process timing); its `relu4:` line carries the speedups and the spans' idle edges
# (timing_device_lead_us: pre marker to the first launch, summed over the three runs). The constant is
# edited in this copy of the tree for the round and put back after. Results: $OUT/head_start_ab.txt.
#   OUT=/some/dir US_LIST="100 250" ROUNDS=2 bash experiments/gpu/head_start_ab.sh
set -u
: "${OUT:?set OUT}"
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export VERIFIER_CACHE_DIR=${VERIFIER_CACHE_DIR:-${TMPDIR:-/tmp}/evidence_h200_builds}
F=verifier/ipc/head_start.py
cp "$F" "$OUT/.head_start.py.orig"
trap 'cp "$OUT/.head_start.py.orig" "$F"' EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/head_start_ab.txt"
for r in $(seq "${ROUNDS:-2}"); do
  for us in ${US_LIST:-100 250}; do
    sed -i "s/^HEAD_START_US = .*/HEAD_START_US = $us.0/" "$F"
    timeout -s INT -k 15 "${EACH_S:-110}" python3 -m pytest -m gpu -v -rA -p no:cacheprovider \
      tests/verifier/test_verifier_gpu.py -k tenth_of_a_millisecond > "$OUT/relu_${us}_$r.log" 2>&1
    echo "round $r head start $us us (exit $?): $(grep -E '^relu4:' "$OUT/relu_${us}_$r.log" | cut -c1-600)" \
      | tee -a "$OUT/head_start_ab.txt"
  done
done
