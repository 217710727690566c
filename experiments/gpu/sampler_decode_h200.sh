#!/usr/bin/env bash
# Issue 39 on one H200 in <= BUDGET s (default 480): what the cache kernel's dots compile to, the
# kernel tests on the GPU, then the decode forward's options against the default in ONE process
# (one model, one weights split), the base forward's per-kernel account first.
#
#   kernel_code  experiments/kernel_code.py: the cache kernel's Triton dots (bf16 x bf16 -> f32
#            expected) and its PTX's counts of mma.sync / wgmma (tensor cores) against fma.rn.f32,
#            cvt and ex2, for bf16, fold_new, fp8 and fp8+asm (kernel_code.json)
#   tests    the kernel's value, bf16 rounding (splits/fold_new against the base at block_k 64,
#            head 128), dot-type and exactness tests on the GPU (at most TESTS_S, default 150 s).
#            The float32 tests (`attention_matches_dense`: the base; `options_equal`: the options)
#            compare at 1e-5, and at default precision Pallas-Triton and XLA run float32 dots as
#            TF32: the tests run with JAX_DEFAULT_MATMUL_PRECISION=highest (float32 dots in IEEE;
#            bf16 dots stay bf16 x bf16 -> f32)
#   gpu_tests the learner's `gpu` tests (flash attention for training, TraceRL's rows), at most
#            GPU_TESTS_S (default 150 s)
#   options  bench_sampler --runs=options_forward,options_exact,options_rates; sdar_4b, random bf16
#            weights, 128 rows, 1,024 + 1,024 (experiments/decode_options.py):
#            forward  one 4-token decode forward at fill 1,536 per variant (OPTIONS; by default:
#                     base; split=64, the base kernel on other programs: the control of rounding
#                     order; split=4096, one program a row; weights=fp8, float8 projections, alone
#                     and with split=4096; cache=fp8 and its float16 widening, alone and with the
#                     rest), compiled together: wall ms, device ms by kind; per kernel ms, GB,
#                     GFLOP, GB/s, TFLOP/s in options_forward.md (`base` = the profile-backed
#                     account); logits vs the first variant of the same cache type: max |diff|,
#                     bitwise `exact`, argmax agreement (float8 weights' beside split=64's)
#            exact    tokens and step map of each variant vs base, static and dynamic, on a 2-layer
#                     model of sdar_4b's shapes, LM head x40, 16 prompts of 64 + 64 tokens; also
#                     against each earlier variant (`agreement_with_others`; splits=3 runs
#                     split=64's programs there). A variant that only reorders float32 sums
#                     agrees with the base about as well as split=64 does
#            rates    dynamic then static at full size for each RATE_OPTIONS variant (`best`: the
#                     fastest bf16 forward whose tokens equal the base's): tok/s, tokens per
#                     row-forward, vs base, token agreement; only the programs that fit before the
#                     deadline are compiled
# If the bench dies of a signal (a compiler crash), it runs once more without the `halves` variants.
# A status line per part in $OUT/status.txt; rows land in results.jsonl as they come (a row per
# variant, `skipped` when the deadline cut it), packed with the logs into $OUT/results.tgz after each
# part (budget.sh). Run from the repository root:
#   OUT=/some/dir bash experiments/gpu/sampler_decode_h200.sh
# BUDGET, PARTS (kernel_code,tests,options), TESTS_S, OPTIONS (the variants), RATE_OPTIONS (the
# variants measured at full size; `best` = the fastest exact bf16 forward), CONFIG (the model
# preset) and FLAGS (more bench_sampler flags, e.g. a CPU smoke run's tiny shapes) override. An
# existing PYTHONPATH (e.g. /tmp/site) is kept.
source "$(dirname "$0")/budget.sh"  # the start; left, status, has, rows, part
BUDGET=${BUDGET:-480}
PARTS=${PARTS:-kernel_code,tests,gpu_tests,options}
CONFIG=${CONFIG:-sdar_4b}
# Session 22's open questions first: the rounding control (split=64) beside float8 weights (is their
# token disagreement rounding or a wrong GEMM?), one program a row, the float16-widened float8 cache.
OPTIONS=${OPTIONS:-base,split=64,split=4096,weights=fp8,split=4096+weights=fp8,cache=fp8,cache=fp8+fp8_widen=f16,cache=fp8+fp8_widen=f16+split=4096+weights=fp8}
RATE_OPTIONS=${RATE_OPTIONS:-base,split=4096,split=4096+weights=fp8,cache=fp8+fp8_widen=f16+split=4096+weights=fp8}
{
  git rev-parse HEAD 2>/dev/null
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
} >"$OUT/env.txt"
status "start: $(tr '\n' ' ' <"$OUT/env.txt")"

options() {  # options NAME VARIANTS
  # The bench starts nothing past its deadline: the budget left less start-up and final writes.
  # shellcheck disable=SC2086  # FLAGS: extra flags, split on spaces
  part "$1" 60 python3 -m experiments.bench_sampler --out="$OUT" --config="$CONFIG" --batch=128 \
    --prompt_len=1024 --new_tokens=1024 --runs=options_forward,options_exact,options_rates \
    --decode_options="$2" --rate_options="$RATE_OPTIONS" --rate_strategies=dynamic,static \
    --deadline_s=$(($(left) - 20)) ${FLAGS:-}
}
if has kernel_code; then
  part kernel_code 20 python3 -m experiments.kernel_code --out="$OUT" --config="$CONFIG"
fi
if has tests; then  # before the options: they decide whether splits/fold_new are right
  # JAX_PLATFORMS=cuda: these tests carry no `gpu` mark, and the conftest otherwise pins JAX to the CPU
  part tests 60 env JAX_PLATFORMS=cuda JAX_DEFAULT_MATMUL_PRECISION=highest \
    timeout -k 5 "${TESTS_S:-150}" \
    python3 -m pytest -q -p no:cacheprovider \
    tests/diffusion/test_flash_decode.py tests/launchers/test_decode_options.py \
    -k "attention_matches_dense or options_equal or round_like or without_cvt or \
    every_decode_option or bf16_with"
fi
if has gpu_tests; then  # the learner's GPU tests: flash attention (training) and TraceRL's rows
  part gpu_tests 60 timeout -k 5 "${GPU_TESTS_S:-150}" python3 -m pytest -m gpu -q -p no:cacheprovider \
    tests/train/test_flash_gpu.py tests/rl/test_tracerl_gpu.py
fi
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
status "done ($(left) s of $BUDGET left)"
