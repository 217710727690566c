"""The Pallas cached-attention kernel (interpreted on CPU) equals the dense cached attention."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dice_jax.diffusion import sampler
from dice_jax.model import flash_decode, masks, transformer
from dice_jax.model.config import get_config
from dice_jax.model.kv_cache import KVCache


@pytest.mark.parametrize("kind,dynamic_loop", [("block_causal", True), ("causal", False)])
def test_flash_cached_attention_matches_dense(kind, dynamic_loop):
  b, t, s, n, k, h = 3, 8, 64, 4, 2, 16
  # 2 splits of 2 tiles; rows fill 37/20/64 slots
  tiles = flash_decode.DecodeTiles(split=32, block_k=16, dynamic_loop=dynamic_loop)
  r = np.random.RandomState(0)
  f = lambda *shape: jnp.asarray(r.randn(*shape), jnp.float32)
  q, kn, vn = f(b, t, n, h), f(b, t, k, h), f(b, t, k, h)
  ck, cv = f(2, b, s, k, h), f(2, b, s, k, h)  # two layers; layer 1 is attended
  cseg = np.ones((b, s), np.int32)
  cseg[0, :5] = 0  # left padding
  cseg[1, :20] = 0
  cpos = np.tile(np.arange(s) - 20, (b, 1)).astype(np.int32)
  cache = KVCache(
    k=ck,
    v=cv,
    positions=jnp.asarray(cpos),
    segment_ids=jnp.asarray(cseg),
    block_ids=jnp.asarray(cpos // 4),
    length=jnp.asarray([37, 20, 64], jnp.int32),
    tiles=tiles,
  )  # slots at or above a row's length hold garbage and must be ignored
  pos = jnp.asarray(np.tile(np.arange(17, 17 + t), (b, 1)), jnp.int32)
  seg = jnp.ones((b, t), jnp.int32)
  blk = pos // 4
  spec = masks.AttentionSpec(kind, 4, seg, blk)
  want = transformer.cached_attention(q, kn, vn, ck[1], cv[1], spec, pos, seg, blk, cache)
  got = flash_decode.cached_attention(q, kn, vn, 1, spec, pos, seg, blk, cache)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_sampler_with_flash_attention_on_8_devices_matches_dense():
  """Flash decode attention, sharded (rows over data x fsdp, K/V heads over tensor, via shard_map
  under `jax.set_mesh`), reproduces the single-device dense sampler."""
  import jax

  from dice_jax.train import sharding

  prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [20, 21] * 5, [30, 31, 32, 33]] * 2
  cfg = sampler.SamplerConfig(strategy="low_confidence_static", max_new_tokens=8)
  sharpen = lambda m: m.lm_head.set_value(m.lm_head[...] * 60.0)
  dense = transformer.Transformer(get_config("tiny", dtype="float32"), rngs=nnx.Rngs(0))
  sharpen(dense)
  want = sampler.generate(dense, prompts, cfg)
  mcfg = get_config("tiny", dtype="float32", attention_impl="flash")
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  flash = sharding.create_sharded(lambda: transformer.Transformer(mcfg, rngs=nnx.Rngs(0)), mesh)
  sharpen(flash)
  layout = sampler.layout_prompts(prompts, cfg, mcfg.mask_token_id)
  layout = jax.tree.map(lambda x: jax.device_put(x, sharding.batch_sharding(mesh, x.ndim)), layout)
  with jax.set_mesh(mesh):
    got = sampler.decode(flash, layout, cfg)
  assert len(got.tokens.sharding.device_set) == 8
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_array_equal(np.asarray(got.step_map), np.asarray(want.step_map))
