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

  from dice_jax import sharding

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
  rows = jax.NamedSharding(mesh, jax.P(("data", "fsdp")))
  layout = jax.tree.map(lambda x: jax.device_put(x, rows), layout)
  with jax.set_mesh(mesh):
    got = sampler.decode(flash, layout, cfg)
  assert len(got.tokens.sharding.device_set) == 8
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_array_equal(np.asarray(got.step_map), np.asarray(want.step_map))


def test_float8_cache_is_read_as_the_values_it_holds_and_saturates_instead_of_nan():
  """A float8_e4m3fn cache gives the kernel's result on a compute-dtype cache holding the same
  (widened) values, and writes beyond +-448 are clipped rather than turned into NaN."""
  b, t, s, n, k, h = 2, 4, 64, 4, 2, 16
  tiles = flash_decode.DecodeTiles(split=32, block_k=16)
  r = np.random.RandomState(1)
  f = lambda *shape: jnp.asarray(r.randn(*shape), jnp.float32)
  q, kn, vn = f(b, t, n, h), f(b, t, k, h), f(b, t, k, h)
  ck, cv = f(2, b, s, k, h) * 3, f(2, b, s, k, h)
  ck8, cv8 = ck.astype(jnp.float8_e4m3fn), cv.astype(jnp.float8_e4m3fn)
  meta = dict(
    positions=jnp.tile(jnp.arange(s, dtype=jnp.int32), (b, 1)),
    segment_ids=jnp.ones((b, s), jnp.int32),
    block_ids=jnp.tile(jnp.arange(s, dtype=jnp.int32) // 4, (b, 1)),
    length=jnp.asarray([40, 64], jnp.int32),
    tiles=tiles,
  )
  pos = jnp.tile(jnp.arange(64, 64 + t, dtype=jnp.int32), (b, 1))
  seg = jnp.ones((b, t), jnp.int32)
  spec = masks.AttentionSpec("block_causal", 4, seg, pos // 4)
  run = lambda c: flash_decode.cached_attention(q, kn, vn, 1, spec, pos, seg, pos // 4, c)
  got = run(KVCache(k=ck8, v=cv8, **meta))
  want = run(KVCache(k=ck8.astype(jnp.float32), v=cv8.astype(jnp.float32), **meta))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
  # Against the unrounded cache the error is fp8's rounding (3 mantissa bits), averaged by attention.
  full = np.asarray(run(KVCache(k=ck, v=cv, **meta)))
  rel = np.abs(np.asarray(got) - full).mean() / np.abs(full).mean()
  assert 0.0 < rel < 0.05, rel
  # Writes: within range they round to fp8; beyond it they saturate (a plain cast gives NaN).
  cache = KVCache(k=ck8, v=cv8, **meta)
  big = jnp.full((2, b, 1, k, h), 1000.0).at[:, :, :, 0, 0].set(-5000.0).at[:, :, :, 1, 0].set(0.3)
  one = jnp.ones((b, 1), jnp.int32)
  out = cache.append(big, big, one, one, one, at=jnp.zeros((b,), jnp.int32))
  wrote = np.asarray(out.k[:, :, 0].astype(jnp.float32))
  assert np.isnan(np.asarray(big.astype(jnp.float8_e4m3fn).astype(jnp.float32))).any()
  assert np.isfinite(wrote).all() and wrote.max() == 448.0 and wrote.min() == -448.0
  np.testing.assert_allclose(wrote[:, :, 1, 0], 0.3, rtol=0.07)


def test_sampler_and_engine_decode_on_a_float8_cache_of_half_the_bytes():
  """`kv_cache_dtype="float8_e4m3fn"`: the sampler and the engine decode every token (never the mask)
  on a cache of half the bytes; the XLA path and unknown dtypes are refused. Tokens are not compared
  with the exact cache's: a random model's near-ties flip under fp8 rounding (the kernel test above
  bounds the rounding itself)."""
  from dice_jax.diffusion import engine

  mcfg = get_config("tiny", dtype="bfloat16", attention_impl="flash")
  model = transformer.Transformer(mcfg, rngs=nnx.Rngs(0))
  model.lm_head.set_value(model.lm_head[...] * 60.0)
  prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [20, 21] * 5, [30, 31, 32, 33]]
  exact = sampler.SamplerConfig(strategy="low_confidence_static", max_new_tokens=16)
  fp8 = sampler.SamplerConfig(
    strategy="low_confidence_static", max_new_tokens=16, kv_cache_dtype="float8_e4m3fn"
  )
  got = sampler.generate(model, prompts, fp8)
  layout = sampler.layout_prompts(prompts, exact, mcfg.mask_token_id)
  e_exact = sampler.memory_estimate(model, layout, exact)["kv_cache"]
  e_fp8 = sampler.memory_estimate(model, layout, fp8)["kv_cache"]
  assert 0.5 < e_fp8 / e_exact < 0.55  # K/V halve; the int32 metadata stays
  toks = np.asarray(got.tokens)[np.asarray(layout.is_generation)]
  assert toks.size == 4 * 16 and not (toks == mcfg.mask_token_id).any()
  assert (toks >= 0).all() and (toks < mcfg.vocab_size).all()
  eng = engine.ContinuousSampler(model, fp8, slots=2, max_prompt_len=16)
  done = {c.id: c for c in eng.run([engine.Request(i, p) for i, p in enumerate(prompts)])}
  assert sorted(done) == [0, 1, 2, 3]
  assert all(len(c.response_ids) == 16 for c in done.values())
  assert not any((c.response_ids == mcfg.mask_token_id).any() for c in done.values())
  with pytest.raises(ValueError, match="needs attention_impl='flash'"):
    sampler.generate(transformer.Transformer(get_config("tiny"), rngs=nnx.Rngs(0)), prompts, fp8)
  with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
    sampler.SamplerConfig(kv_cache_dtype="int4")
