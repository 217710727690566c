"""The flash kernels compiled by Triton on a GPU host (`python3 -m pytest -m gpu`).

The `gpu` fixture fails, not skips, when JAX finds no GPU: these tests exist to run there.
"""

import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def test_compiled_flash_kernel_matches_dense_on_gpu(gpu):
  from experiments.bench_train import check_attention

  errs = check_attention("flash")  # bf16, 2 rows x 2*256 tokens, packed, response-aligned blocks
  assert errs["out"] < 0.05
  assert max(errs["dq"], errs["dk"], errs["dv"]) < 0.02


@pytest.mark.parametrize("kind", ["block_causal", "causal"])
def test_compiled_decode_kernel_matches_dense_cached_attention_on_gpu(gpu, kind):
  """bf16 queries over a 1024-slot cache (left padding, unfilled tail) vs the dense f32 path."""
  from dice_jax.model import flash_decode, masks, transformer
  from dice_jax.model.kv_cache import KVCache

  b, t, s, n, k, h = 2, 8, 1024, 8, 2, 128
  r = np.random.RandomState(0)
  f = lambda *shape: jnp.asarray(r.randn(*shape), jnp.bfloat16)  # noqa: E731
  q, kn, vn = f(b, t, n, h), f(b, t, k, h), f(b, t, k, h)
  ck, cv = f(2, b, s, k * h), f(2, b, s, k * h)  # the stored layout: heads fused
  cseg = np.ones((b, s), np.int32)
  cseg[1, :300] = 0  # left padding
  cpos = np.tile(np.arange(s) - 300, (b, 1)).astype(np.int32)
  cache = KVCache(
    k=ck,
    v=cv,
    positions=jnp.asarray(cpos),
    segment_ids=jnp.asarray(cseg),
    block_ids=jnp.asarray(cpos // 4),
    length=jnp.full((b,), 700, jnp.int32),  # slots >= 700 are unfilled
    head_dim=h,
  )
  pos = jnp.asarray(np.tile(np.arange(400, 400 + t), (b, 1)), jnp.int32)
  seg = jnp.ones((b, t), jnp.int32)
  blk = pos // 4
  spec = masks.AttentionSpec(kind, 4, seg, blk)
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  cache32 = KVCache(
    f32(ck), f32(cv), cache.positions, cache.segment_ids, cache.block_ids, cache.length, h
  )
  want = transformer.cached_attention(
    f32(q), f32(kn), f32(vn), f32(ck[1]), f32(cv[1]), spec, pos, seg, blk, cache32
  )
  got = flash_decode.cached_attention(q, kn, vn, 1, spec, pos, seg, blk, cache, interpret=False)
  assert float(jnp.abs(f32(got) - want).max()) < 0.02  # |out| ~0.5; CPU interpreter: 1.5e-3
