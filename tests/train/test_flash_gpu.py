"""The flash kernel compiled by Triton on a GPU host (`pytest -m gpu tests/train`)."""

import jax
import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
def test_compiled_flash_kernel_matches_dense_on_gpu():
  from experiments.bench_train import check_attention

  errs = check_attention("flash")  # bf16, 2 rows x 2*256 tokens, packed, response-aligned blocks
  assert errs["out"] < 0.05
  assert max(errs["dq"], errs["dk"], errs["dv"]) < 0.02
