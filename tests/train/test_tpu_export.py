"""The SFT train step, the TraceRL update and the sampler's prefill and decode step of a small
model (head width 128, the TPU lane width) export for TPU from this CPU host, on a mesh of 8 fake
devices with fsdp and tensor axes and abstract shapes, with the Pallas TPU kernels inside."""

from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dice_jax import sharding, tpu_lowering
from dice_jax.diffusion.sampler import SamplerConfig
from dice_jax.model.config import get_config


def _mesh_and_config():
  mesh = sharding.make_mesh(data=1, fsdp=4, tensor=2)
  return mesh, get_config("tiny", head_dim=128, attention_impl="flash", remat=True)


def test_sft_and_rl_steps_export_for_tpu_with_the_mosaic_kernels():
  mesh, mcfg = _mesh_and_config()
  sft = tpu_lowering.export_sft_step(mcfg, mesh, batch=4, seq_len=256)
  rl = tpu_lowering.export_rl_step(mcfg, mesh, batch=4, row_len=512)
  for exported in (sft, rl):
    s = tpu_lowering.summary(exported)
    assert s["platforms"] == ("tpu",) and s["devices"] == 8
    # forward, its rematerialised copy, and the two backward kernels; no GPU kernel anywhere
    assert s["custom_calls"] == {"tpu_custom_call": 4}
    assert s["mosaic_kernels"] == {
      "bd_flash_tpu_dkv": 1,
      "bd_flash_tpu_dq": 1,
      "bd_flash_tpu_fwd": 2,
    }
    text = exported.mlir_module()
    assert "fsdp" in text and "tensor" in text  # partitioned over the pod mesh
  assert [a.shape for a in sft.in_avals[-5:-1]] == [(4, 256)] * 4  # the batch, abstract


def test_sampler_prefill_and_decode_export_for_tpu_with_the_cache_kernel_and_a_split_cache():
  mesh, mcfg = _mesh_and_config()
  scfg = SamplerConfig(max_new_tokens=64)
  out = tpu_lowering.export_sampler_steps(
    mcfg, mesh, scfg, slots=8, prompt_width=128, prefill_rows=4
  )
  prefill, decode = (tpu_lowering.summary(out[k]) for k in ("prefill", "decode"))
  assert set(prefill["custom_calls"]) == {"tpu_custom_call"}
  assert set(prefill["mosaic_kernels"]) == {"bd_flash_tpu_fwd"}
  # each decode forward reads each layer's cache through the kernel (2 layers x 2 forwards)
  assert decode["mosaic_kernels"] == {"bd_flash_tpu_fwd": 4}
  # the K/V cache comes in and goes out split over the rows (fsdp) and K/V heads (tensor), donated
  # (stored [L, B, S, K*H], the cache kernel's layout: whole K/V heads per tensor shard)
  split = NamedSharding(mesh, P(None, ("data", "fsdp"), None, "tensor"))
  kv_shape = (
    lambda a: (  # noqa: E731
      a.ndim == 4
      and a.shape[:2] == (mcfg.num_layers, 8)
      and a.shape[3] == mcfg.num_kv_heads * mcfg.head_dim
    )
  )
  for name, exported in out.items():
    for avals, shardings in (
      (exported.in_avals, exported.in_shardings_jax(mesh)),
      (exported.out_avals, exported.out_shardings_jax(mesh)),
    ):
      kv = [s for a, s in zip(avals, shardings) if kv_shape(a)]
      assert len(kv) == 2 and all(s.is_equivalent_to(split, 4) for s in kv), (name, kv)
    assert "tf.aliasing_output" in exported.mlir_module(), name
