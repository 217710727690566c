"""experiments.trace_summary: a profiler trace becomes a per-kernel table of device time."""

import jax
import jax.numpy as jnp
import pytest

from experiments import trace_summary


def test_a_traced_call_gives_device_time_by_kernel(tmp_path):
  f = jax.jit(lambda a: jnp.tanh(a @ a).sum())
  a = jnp.ones((256, 256))
  f(a).block_until_ready()
  with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
    for _ in range(2):
      f(a).block_until_ready()
  s = trace_summary.summarize(str(tmp_path), calls=2)
  assert s["device_ms_per_call"] > 0
  assert s["top"] and all(ms >= 0 and n > 0 for _, _, ms, n in s["top"])
  assert abs(sum(s["by_kind"].values()) - s["device_ms_per_call"]) < 1e-2
  assert "| kind | ms per call |" in trace_summary.markdown(s)


@pytest.mark.parametrize(
  "name, op, kind",
  [
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", "", "matmul"),
    ("loop_fusion_12", "%dot.3 = bf16[512,9728] dot(...)", "matmul"),
    ("cache_part", "", "attention"),
    ("dynamic_slice_fusion_3", "", "slice/copy"),
    ("input_reduce_fusion", "%reduce.1 = f32[8] reduce(...)", "fusion"),
    ("memcpy32_post", "", "slice/copy"),
    ("_kernel", "", "attention"),
    ("xyz", "", "other"),
  ],
)
def test_kernels_are_sorted_into_kinds(name, op, kind):
  assert trace_summary.kind_of(name, op) == kind


def test_a_folder_without_a_trace_is_named(tmp_path):
  with pytest.raises(FileNotFoundError, match="no perfetto_trace"):
    trace_summary.summarize(str(tmp_path))


@pytest.mark.parametrize(
  "argv, line",
  [
    (["/no/such/dir"], "no perfetto_trace.json.gz under /no/such/dir (profiler trace failed?)"),
    (["d", "--calls=x"], "--calls must be a number >= 1, got 'x'"),
    ([], "usage: python -m experiments.trace_summary TRACE_DIR [--calls=N]"),
  ],
)
def test_bad_arguments_are_one_line_and_exit_2(capsys, argv, line):
  with pytest.raises(SystemExit) as e:  # was a FileNotFoundError traceback, or exit status 1
    trace_summary.main(argv)
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.count("\n") == 1 and err.endswith(f"error: {line}\n"), err
