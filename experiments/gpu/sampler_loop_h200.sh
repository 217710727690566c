#!/usr/bin/env bash
# Issue 39's open questions on one H200 in <= BUDGET s (default 560), one process per part, rows in
# results.jsonl (bench_sampler) and rollout/bench_rl.json as they come, packed with every log into
# $OUT/results.tgz after each part (budget.sh), a status line per part in $OUT/status.txt. sdar_4b,
# random bf16 weights, 128 rows, 1,024 + 1,024 unless noted.
#
#   tests    the cache kernel's visible_half and share_prompts tests on the GPU (Triton), before
#            anything uses them, and the sampler's first call settled (tests/diffusion/test_decode_gpu.py)
#   loop     bench_sampler --runs=profile_loop: one iteration of the static, capped dynamic (R = 72)
#            and capped dynamic float8-cache loops by kind and kernel (experiments/decode_loop_profile.py;
#            $OUT/profile_loop.md), tiles split=4096 + fp8_widen=f16: where a batch forward's
#            ~23 ms go beside the forward's 15.1, and what the float8 cache adds in the loop
#   ab       options_forward of the TILES variants (deeper pipelines and 128-key tiles, for the
#            float8 cache's kernel at 3.1 TB/s as well: is it short of loads in flight?), then
#            options_rates, dynamic_capped (R = 72): the default tiles against split=4096 (one
#            program a row) in ONE process, then static the same: is one program a row the default?
#   lhs      options_forward under XLA's latency-hiding scheduler: base, split=64 (the rounding
#            control), weights=fp8 (float8 weights' one-forward argmax beside split=64's), halves=1
#            (each row half's attention on a second stream: does it overlap the other half's
#            matmuls once the scheduler may move the stream call's start and done apart?), then
#            the capped dynamic rate with and without halves (each half packs R / 2 rows)
#   fp8      one 8-token forward in the capped loop's layout (rows past R = 72 mid-block: first b
#            tokens invisible; 32 query rows a cache-kernel program, where session 24's float8 kernel
#            took 8.27 ms in the loop against 5.9 in a 4-token forward) of split=4096 in bf16 and on
#            the float8 cache (f16 widening, 3 stages), each with and without visible_half (a
#            mid-block row's program runs its 16 visible rows only), and with 8 warps; then the
#            capped dynamic rates of those four in one process (rates and token agreement), then
#            static bf16 against the float8 cache (process fp8static)
#   rlloop   bench_sampler --runs=profile_loop at the RL rollout's shape and sampling (sdar_1p7b,
#            896 + 4,096, R = 48, split=8192; temperature 1 with log-probs, unsharpened: loops
#            rollout, rollout_fp8), iterations at fill ~2,900: where session 24's 22.8 ms a batch
#            forward went (5,610 tok/s; ~9 ms of K/V reads and ~3 ms of matmuls at that fill)
#   rlf16    rlloop's float8 loop alone with the float8 tiles bench_rl was run with (3 stages, f16)
#   fp8w     item 4, float8 weights as a labelled mode: the capped dynamic rate (R = 72, split=4096) on
#            float8 projection weights against bf16 in one process, and the fraction of the bf16
#            run's tokens it matches on 64 prompts of the sharpened model, beside the rounding
#            control (the capped loop against the uncapped `dynamic`: the same decoding, other GEMM
#            shapes)
#   conc     options_forward of split=4096 with and without halves=1, serialised, then under XLA's
#            CONCURRENT command buffers (a DAG of the forward's kernels): one half's attention beside
#            the other half's matmuls, where one stream and the latency-hiding scheduler gave none
#   share    the rollout part's shape in one job for each of SHARE_MODES (default "share cascade"; also
#            "base", "cascade128", "cascade_rowprefill"), SHARE_ROLLOUTS (1) timed rollouts each: DecodeTiles.share_prompts (a
#            group's rows read its prompt's K/V from one row), DecodeTiles.cascade (a group's prompt
#            attended once with all its members' queries; the RL default), cascade128 (its group launch
#            in 128-row query tiles on 8 warps), cascade_rowprefill (the RL default with every row
#            prefilling its own prompt, 16 rows a chunk: the baseline of the grouped prefill,
#            SamplerConfig.prefill_once_per_group); on a card under 100 GB on the float8 cache
#            (3 stages, f16), as bf16 does not fit; stack samples and cache-miss reasons in each log
#            (SHARE_FLAGS: more bench_rl flags, e.g. a CPU smoke run's tiny shapes)
#   rollout  bench_rl's rollout alone (--update_steps=0) at the RL shape: sdar_1p7b, 8 groups x 16 =
#            128 rows, 896 + 4,096, temperature 1 (the RL loop's sampling), R = 48, split=8192
#            (issue 39 item 3: 8,000 tok/s; 4,962 uncapped in session 21's bench_rl), share_prompts (the RL default)
# Run from the repository root (grain wheels installed in PYTHONPATH, as rl_step_h200.sh says):
#   OUT=/some/dir bash experiments/gpu/sampler_loop_h200.sh
# BUDGET, PARTS (tests,loop,ab,lhs,conc,fp8,rlloop,rlf16,fp8w,share,rollout), CONFIG, TILES (ab's forward variants) and FLAGS (more bench_sampler flags, e.g. a CPU smoke
# run's tiny shapes) override; an existing PYTHONPATH is kept.
source "$(dirname "$0")/budget.sh"  # the start; left, status, has, rows, part
BUDGET=${BUDGET:-560}
PARTS=${PARTS:-tests,loop,ab,lhs,fp8,rlloop,rollout}
CONFIG=${CONFIG:-sdar_4b}
F8=cache=fp8+fp8_widen=f16
TILES=${TILES:-base,split=4096,block_k=128,num_stages=3,$F8,$F8+block_k=128,$F8+num_stages=3}
bench() {  # bench NAME MIN_S FLAGS...: bench_sampler at the issue's shape
  local name=$1 min=$2
  shift 2
  # shellcheck disable=SC2086  # FLAGS: extra flags, split on spaces
  part "$name" "$min" python3 -m experiments.bench_sampler --out="$OUT" --config="$CONFIG" \
    --batch=128 --prompt_len=1024 --new_tokens=1024 --commit_rows=72 "$@" ${FLAGS:-}
}
{
  git rev-parse HEAD 2>/dev/null
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
} >"$OUT/env.txt"
status "start: $(tr '\n' ' ' <"$OUT/env.txt")"

if has tests; then
  # JAX_PLATFORMS=cuda: these tests carry no `gpu` mark, and the conftest otherwise pins JAX to the CPU
  part tests 40 env JAX_PLATFORMS=cuda JAX_DEFAULT_MATMUL_PRECISION=highest python3 -m pytest -q \
    -p no:cacheprovider tests/diffusion/test_flash_decode.py \
    -k "(second_half or half_path or visible_half or shar or group) and not 8_devices"
  part tests_gpu 40 python3 -m pytest -q -p no:cacheprovider -m gpu tests/diffusion/test_decode_gpu.py
fi
if has loop; then
  bench loop 150 --runs=profile_loop --profile_loops=static,dynamic_capped,dynamic_capped_fp8 \
    --decode_tiles='{"split":4096,"fp8_widen":"f16"}'
fi
if has ab; then
  bench ab 150 --runs=options_forward,options_rates --rate_options=base,split=4096 \
    --decode_options="$TILES" --rate_strategies=dynamic_capped,static --deadline_s=$(($(left) - 20))
fi
if has lhs; then
  XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true ${XLA_FLAGS:-}" \
    bench lhs 90 --runs=options_forward,options_rates \
    --decode_options=base,split=64,weights=fp8,halves=1 --rate_options=base,halves=1 \
    --rate_strategies=dynamic_capped --deadline_s=$(($(left) - 20))
fi
if has conc; then
  # XLA's command buffers built as a DAG (CONCURRENT: commands with no buffer conflict run at once):
  # does one row half's attention overlap the other half's matmuls there (halves=1), where one stream
  # and the latency-hiding scheduler gave none (session 24)? The same forwards serialised first.
  bench serial 60 --runs=options_forward --decode_options=split=4096,split=4096+halves=1 --rate_options=split=4096 \
    --deadline_s=$(($(left) / 2 - 20))
  XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN \
--xla_gpu_command_buffer_scheduling_mode=CONCURRENT --xla_gpu_graph_min_graph_size=1 ${XLA_FLAGS:-}" \
    bench conc 60 --runs=options_forward --decode_options=split=4096,split=4096+halves=1 --rate_options=split=4096 \
    --deadline_s=$(($(left) - 20))
fi
if has fp8; then
  P=split=4096+$F8+num_stages=3
  V=visible_half=1
  bench fp8 150 --runs=options_forward,options_rates --forward_tokens=8 \
    --decode_options=split=4096,split=4096+$V,$P,$P+$V,$P+num_warps=8 \
    --rate_options=split=4096,split=4096+$V,$P,$P+$V --rate_strategies=dynamic_capped \
    --deadline_s=$(($(left) - 120))
  bench fp8static 100 --runs=options_rates --decode_options=split=4096,$P --rate_options=split=4096,$P \
    --rate_strategies=static --deadline_s=$(($(left) - 20))
fi
if has rlloop; then
  bench rlloop 150 --runs=profile_loop --profile_loops=rollout,rollout_fp8 --config=sdar_1p7b \
    --prompt_len=896 --new_tokens=4096 --commit_rows=48 --decode_tiles='{"split":8192}'
fi
if has rlf16; then
  # the float8 loop with bench_rl's float8 tiles (3 stages, f16 widening), beside rlloop's (2, cast):
  # is the 3.3 ms a forward between bench_rl (21.3) and rlloop (18.0) on an H100 the tiles or prefill?
  bench rlf16 120 --runs=profile_loop --profile_loops=rollout_fp8 --config=sdar_1p7b \
    --prompt_len=896 --new_tokens=4096 --commit_rows=48 \
    --decode_tiles='{"split":8192,"num_stages":3,"fp8_widen":"f16"}'
fi
if has fp8w; then
  bench fp8w 200 --runs=dynamic,dynamic_capped,dynamic_capped_fp8w --agree_prompts=64 \
    --decode_tiles='{"split":4096}'
fi
if has share; then
  tiles='"split":8192' f8=''
  mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  if [ "${mem:-999999}" -lt 100000 ]; then
    tiles='"split":8192,"num_stages":3,"fp8_widen":"f16"' f8=--kv_cache_dtype=float8_e4m3fn
  fi
  modes=${SHARE_MODES:-share cascade}
  n=$(echo $modes | wc -w)
  each=$(($(left) / n))
  for mode in $modes; do
    extra=''
    case $mode in
      base) t=$tiles ;;
      share) t="$tiles,\"share_prompts\":true" ;;
      cascade) t="$tiles,\"share_prompts\":true,\"cascade\":true" ;;  # the RL default
      cascade128) t="$tiles,\"share_prompts\":true,\"cascade\":true,\"group_block_q\":128,\"group_warps\":8" ;;
      # the RL default before the grouped prefill: every row prefills its prompt, 16 rows a chunk
      cascade_rowprefill) t="$tiles,\"share_prompts\":true,\"cascade\":true" \
        extra='--prefill_once_per_group=false --prefill_chunk=16' ;;
      *) status "unknown share mode $mode (base share cascade cascade128 cascade_rowprefill)" && continue ;;
    esac
    mkdir -p "$OUT/share_$mode"
    # shellcheck disable=SC2086
    part "share_$mode" 150 timeout $((each - 10)) python3 -m experiments.bench_rl \
      --out="$OUT/share_$mode" --config=sdar_1p7b --tasks=8 --group_size=16 --groups_per_batch=8 \
      --prompt_len=896 --new_tokens=4096 --verifier=none --update_steps=0 --commit_rows=48 \
      --rollouts=${SHARE_ROLLOUTS:-1} --stack_every_s=2 $f8 --decode_tiles="{$t}" $extra ${SHARE_FLAGS:-}
  done
fi
if has rollout; then
  mkdir -p "$OUT/rollout"
  # shellcheck disable=SC2086
  part rollout 150 python3 -m experiments.bench_rl --out="$OUT/rollout" --config=sdar_1p7b \
    --tasks=8 --group_size=16 --groups_per_batch=8 --prompt_len=896 --new_tokens=4096 \
    --verifier=none --update_steps=0 --commit_rows=48 \
    --decode_tiles='{"split":8192,"share_prompts":true}' \
    ${ROLLOUT_FLAGS:-}
fi
status "done ($(left) s of $BUDGET left)"
