"""The `*_attn` remat policies on TPU, from the compiled program (libtpu's compile-only devices,
`tpu_topology`): the Mosaic kernel's custom-VJP forward tags its output and log-sum-exp
(`flash_bd.OUT_NAME`, `LSE_NAME`), the policy saves them, and the backward pass runs no attention
forward kernel again. The tiny model's SFT step (head width 128, its two layers under
`lax.scan`, so each kernel of a layer is one call in the forward or backward loop body) on a
v5e-8: about 10 s of CPU a compile. The values: tests/model/test_flash_tpu.py."""

import pytest

from dice_jax import tpu_topology

_MISSING = tpu_topology.libtpu_missing()
if _MISSING:
  pytest.skip(_MISSING, allow_module_level=True)

from dice_jax import tpu_lowering  # noqa: E402
from dice_jax.model import flash_tpu  # noqa: E402
from dice_jax.model.config import get_config  # noqa: E402


def _kernels(remat):
  """{kernel name: calls} in the compiled SFT step of the tiny model under `remat`."""
  mcfg = get_config("tiny", head_dim=128, attention_impl="flash", remat=remat)
  assert mcfg.scan_layers
  mesh = tpu_topology.mesh(tpu_topology.get_slice("v5e-8"))
  compiled = tpu_lowering.sft_step(mcfg, mesh, batch=8, seq_len=256).lower().compile()
  return tpu_topology.attention_kernels(compiled.as_text())


def test_attn_policies_run_the_tpu_forward_kernel_once_per_layer(monkeypatch):
  once = {"bd_flash_tpu_fwd": 1, "bd_flash_tpu_dq": 1, "bd_flash_tpu_dkv": 1}
  assert _kernels("dots_attn") == once
  assert _kernels("full_attn") == once
  # without the tags (the kernel before issue 38) the backward re-runs the forward kernel
  monkeypatch.setattr(flash_tpu, "checkpoint_name", lambda x, name: x)
  assert _kernels("dots_attn") == {**once, "bd_flash_tpu_fwd": 2}
