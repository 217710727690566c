"""experiments.decode_loop_profile: one decode-loop iteration from two profiled calls' difference."""

import pytest

from experiments import decode_loop_profile as lp


def _summary(kernels):
  return {"top": [[n, k, ms, c] for n, k, ms, c in kernels]}


def test_per_forward_is_the_difference_over_the_extra_forwards():
  # prefill (once per call) cancels; the loop's kernels scale with the forwards (10 vs 50)
  short = _summary(
    [("prefill_gemm", "matmul", 40.0, 2), ("cache_part", "attention", 70.0, 10),
     ("nvjet_a", "matmul", 61.0, 20), ("scatter_fusion", "fusion", 1.0, 10)]
  )  # fmt: skip
  long = _summary(
    [("prefill_gemm", "matmul", 40.0, 2), ("cache_part", "attention", 350.0, 50),
     ("nvjet_a", "matmul", 305.0, 100), ("scatter_fusion", "fusion", 5.0, 50),
     ("only_long", "other", 0.8, 1)]
  )  # fmt: skip
  it = lp.per_forward(long, short, forwards=40)
  assert it["by_kind"] == {"attention": 7.0, "matmul": 6.1, "fusion": 0.1, "other": 0.02}
  assert it["device_ms"] == pytest.approx(13.22)
  names = [k[0] for k in it["kernels"]]
  assert names[:2] == ["cache_part", "nvjet_a"]
  gemm = dict((k[0], k) for k in it["kernels"])["prefill_gemm"]
  assert gemm[2] == 0.0 and gemm[3] == 0.0
  assert dict((k[0], k[3]) for k in it["kernels"])["nvjet_a"] == 2.0  # launches per forward
  md = lp.markdown([dict(loop="static", forwards=40, wall_ms=14.0, **it)])
  assert "| static | 40 | 14.0 | 13.22 | 7.0 | 6.1 | 0.1 | 0.02 |" in md
  assert "`cache_part` | attention | 7.0 | 1.0 |" in md


def test_a_kernel_of_the_short_call_only_counts_against_the_loop():
  it = lp.per_forward(_summary([]), _summary([("warm", "other", 2.0, 1)]), forwards=4)
  assert it["by_kind"] == {"other": -0.5}


def test_no_extra_forwards_is_an_error():
  with pytest.raises(ValueError, match="more batch forwards"):
    lp.per_forward(_summary([]), _summary([]), forwards=0)


def test_loops_take_the_cap_and_name_what_is_unknown():
  kw, sharp = lp.loop_settings("dynamic_capped_fp8", 72)
  assert kw == dict(
    strategy="low_confidence_dynamic", commit_rows=72, kv_cache_dtype="float8_e4m3fn"
  )
  assert sharp
  assert lp.loop_settings("static", 0) == (dict(strategy="low_confidence_static"), False)
  with pytest.raises(ValueError, match="needs commit_rows >= 1"):
    lp.loop_settings("dynamic_capped", 0)
  with pytest.raises(ValueError, match="unknown loop 'dynamic_fast'; known: static"):
    lp.loop_settings("dynamic_fast", 72)


def test_the_rollout_loop_samples_like_the_rl_rollout():
  # bench_rl's rollout: capped dynamic at temperature 1 with log-probs, on the unsharpened model;
  # at its shape (896 + 4,096, 128 measured) the iterations sit at fill ~2,900, its mean
  kw, sharp = lp.loop_settings("rollout", 48)
  assert kw == dict(
    strategy="low_confidence_dynamic", commit_rows=48, temperature=1.0, return_logprobs=True
  )
  assert not sharp
  assert lp.loop_settings("rollout_fp8", 48)[0]["kv_cache_dtype"] == "float8_e4m3fn"
  assert lp.loop_prompt_len(896, 4096, 128, 4) == 2880


def test_the_measured_iterations_centre_on_the_forward_accounts_fill():
  # 1,024 + 1,024 new, 128 measured: prompts of 1,472, iterations at fill 1,480-1,600 around 1,536
  assert lp.loop_prompt_len(1024, 1024, 128, 4) == 1472
  assert lp.loop_prompt_len(16, 8, 64, 4) == 16  # never shorter than the prompt
  assert lp.loop_prompt_len(10, 11, 4, 4) == 16  # whole blocks
