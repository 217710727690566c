"""The Pallas cached-attention kernel (interpreted on CPU) equals the dense cached attention."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dice_jax.diffusion import sampler
from dice_jax.model import flash_decode, masks, platform, transformer
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
  ck, cv = f(2, b, s, k * h), f(2, b, s, k * h)  # two layers (heads fused); layer 1 is attended
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
    head_dim=h,
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
  ck, cv = f(2, b, s, k * h) * 3, f(2, b, s, k * h)
  ck8, cv8 = ck.astype(jnp.float8_e4m3fn), cv.astype(jnp.float8_e4m3fn)
  meta = dict(
    positions=jnp.tile(jnp.arange(s, dtype=jnp.int32), (b, 1)),
    segment_ids=jnp.ones((b, s), jnp.int32),
    block_ids=jnp.tile(jnp.arange(s, dtype=jnp.int32) // 4, (b, 1)),
    length=jnp.asarray([40, 64], jnp.int32),
    head_dim=h,
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
  wrote = np.asarray(out.heads(out.k[:, :, 0]).astype(jnp.float32))
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


def _attention_case(seed, b=4, t=8, s=64, n=4, k=2, h=16, dtype=jnp.float32, fp8=False):
  """Queries and new keys over a two-layer cache whose rows fill 37/20/64/3 slots (left padding
  in rows 0 and 1; row 3 sees only its new tokens' block); layer 1 is attended."""
  r = np.random.RandomState(seed)
  f = lambda *shape: jnp.asarray(r.randn(*shape), jnp.float32)
  q, kn, vn = (
    f(b, t, n, h).astype(dtype),
    f(b, t, k, h).astype(dtype),
    f(b, t, k, h).astype(dtype),
  )
  cdt = jnp.float8_e4m3fn if fp8 else dtype
  ck, cv = (f(2, b, s, k * h) * 3).astype(cdt), f(2, b, s, k * h).astype(cdt)
  cseg = np.ones((b, s), np.int32)
  cseg[0, :5] = 0
  cseg[1, :20] = 0
  cpos = np.tile(np.arange(s) - 20, (b, 1)).astype(np.int32)
  cache = KVCache(
    k=ck,
    v=cv,
    positions=jnp.asarray(cpos),
    segment_ids=jnp.asarray(cseg),
    block_ids=jnp.asarray(cpos // 4),
    length=jnp.asarray([37, 20, 64, 3][:b], jnp.int32),
    head_dim=h,
  )
  pos = jnp.asarray(np.tile(np.arange(17, 17 + t), (b, 1)), jnp.int32)
  seg = jnp.ones((b, t), jnp.int32).at[2, :4].set(0)  # row 2's first block is invisible
  spec = masks.AttentionSpec("block_causal", 4, seg, pos // 4)
  return q, kn, vn, cache, spec, pos, seg


def test_kernel_options_equal_the_dense_attention():
  """Balanced programs (`splits`), the new keys folded into the kernel (`fold_new`), the masked
  loop, one program a row (`split` over the whole cache: no merge), and a part of the rows read at
  a row offset (`halves`) give the dense cached attention."""
  q, kn, vn, cache, spec, pos, seg = _attention_case(2)
  ck, cv = cache.k, cache.v
  live = np.asarray(seg > 0)[:, :, None, None]  # the dense result of an invisible query is noise
  want = np.asarray(
    transformer.cached_attention(q, kn, vn, ck[1], cv[1], spec, pos, seg, pos // 4, cache)
  )
  want = np.where(live, want, 0.0)  # the kernel returns 0 there
  base = flash_decode.DecodeTiles(split=32, block_k=16)
  one = dict(split=1024)  # S = 64: one program a row
  for opts in (
    dict(splits=3),
    dict(splits=2, fold_new=True, dynamic_loop=False),
    one,
    dict(one, fold_new=True),
  ):
    c = dataclasses.replace(cache, tiles=dataclasses.replace(base, **opts))
    got = flash_decode.cached_attention(q, kn, vn, 1, spec, pos, seg, pos // 4, c)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5, err_msg=str(opts))
  c = dataclasses.replace(cache, tiles=dataclasses.replace(base, splits=2, fold_new=True))
  half = slice(2, 4)
  got = flash_decode.cached_attention(
    q[half], kn[half], vn[half], 1, spec, pos[half], seg[half], pos[half] // 4, c, row_offset=2
  )
  np.testing.assert_allclose(np.asarray(got), want[half], rtol=1e-5, atol=1e-5)
  # Balanced programs: equal shares of each row's live tiles, none above the fill.
  lo, n, most = flash_decode.tile_plan(
    jnp.asarray([37, 20, 64, 3]),
    jnp.asarray([True, True, True, False]),
    64,
    base.__class__(split=32, block_k=16, splits=3),
  )
  np.testing.assert_array_equal(np.asarray(n), [[1, 1, 1], [1, 1, 0], [2, 2, 0], [0, 0, 0]])
  np.testing.assert_array_equal(np.asarray(lo)[:3], [[0, 1, 2], [0, 1, 2], [0, 2, 4]])
  assert most == 2


# the half path against the whole tile: the same sums on the interpreter; Triton may tile 16 and 32
# rows' dots otherwise on a GPU
_TIGHT = 1e-6 if jax.default_backend() == "cpu" else 1e-5


def test_a_program_whose_first_half_sees_nothing_attends_with_its_second_half_only():
  """`visible_half`: 8 new tokens x 4 heads a K/V head (32 query rows, token-major). Row 2's first
  block is invisible (as a mid-block row's in the capped loop's 2b-token forward), so its program
  runs the dots on its last 16 rows; the other rows run whole. Every output equals the dense
  attention and the full-tile kernel's, with the new keys folded in or not, and the masked loop."""
  q, kn, vn, cache, spec, pos, seg = _attention_case(5, t=8, k=1)
  live = np.asarray(seg > 0)[:, :, None, None]
  want = transformer.cached_attention(
    q, kn, vn, cache.k[1], cache.v[1], spec, pos, seg, pos // 4, cache
  )
  want = np.where(live, np.asarray(want), 0.0)
  base = flash_decode.DecodeTiles(split=32, block_k=16)
  for opts in ({}, dict(fold_new=True), dict(dynamic_loop=False, splits=2)):
    outs = []
    for half in (False, True):
      tiles = dataclasses.replace(base, visible_half=half, **opts)
      c = dataclasses.replace(cache, tiles=tiles)
      outs.append(
        np.asarray(flash_decode.cached_attention(q, kn, vn, 1, spec, pos, seg, pos // 4, c))
      )
    full, halved = outs
    np.testing.assert_allclose(halved, want, rtol=1e-5, atol=1e-5, err_msg=str(opts))
    np.testing.assert_allclose(halved, full, rtol=_TIGHT, atol=_TIGHT, err_msg=str(opts))
    assert not halved[2, :4].any()  # the invisible block: 0, as the full tile gives it


def test_the_kernel_takes_the_half_path_only_where_the_first_half_is_dead():
  """The kernel's own output, per query row: the log-sum-exp of a row that sees nothing is
  EMPTY_LSE on either path; a live first half keeps the whole tile (rows 0-15 of rows 0, 1, 3)."""
  q, kn, vn, cache, spec, pos, seg = _attention_case(6, t=8, k=1)
  b, t, n, h = q.shape
  q_rows = q.reshape(b, t, 1, n, h).transpose(0, 2, 1, 3, 4).reshape(b, 1, t * n, h)
  q_seg = jnp.repeat(seg, n, axis=1)
  q_rank = jnp.repeat(pos // 4, n, axis=1)
  outs = {}
  for half in (False, True):
    tiles = flash_decode.DecodeTiles(split=32, block_k=16, visible_half=half)
    outs[half] = flash_decode.cache_part(
      q_rows, cache.k, cache.v, 1, q_seg, q_rank, cache.segment_ids, cache.block_ids,
      cache.length, tiles=tiles,
    )  # fmt: skip
  (o_full, lse_full), (o_half, lse_half) = outs[False], outs[True]
  np.testing.assert_allclose(np.asarray(o_half), np.asarray(o_full), rtol=_TIGHT, atol=_TIGHT)
  np.testing.assert_allclose(np.asarray(lse_half), np.asarray(lse_full), rtol=_TIGHT, atol=_TIGHT)
  assert np.all(np.asarray(lse_half)[2, 0, :16] == flash_decode.EMPTY_LSE)
  assert np.all(np.asarray(lse_half)[2, 0, 16:] > flash_decode.EMPTY_LSE)


def test_kernel_options_on_bf16_inputs_round_like_the_base_and_splits_is_a_repartition():
  """On bf16 queries and cache (the GPU's decode dtype), `splits` and `fold_new` are as close to
  the float32 dense attention as the base kernel (a kernel bug would be far off), with 4 and 8
  new tokens x 4 heads per K/V head (query rows 16 and 32). They are not bitwise the base:
  another summation order rounds some bf16 outputs the other way, as another `split` of the base
  does, and a random model's near-ties then decode other tokens (docs/performance.md, issue 39).
  `splits` is the base kernel on another partition: bitwise equal to the base with the split
  that gives each row the same programs. On a GPU at the H200 run's tiles (block_k 64, head 128)."""
  x = 4 if jax.default_backend() == "gpu" else 1  # slots per tile / 16
  base = flash_decode.DecodeTiles(split=32 * x, block_k=16 * x)
  f32 = lambda a: a.astype(jnp.float32)
  for t, variants in [(4, ("splits", "fold_new")), (8, ("fold_new",))]:
    q, kn, vn, cache, spec, pos, seg = _attention_case(
      4, t=t, s=64 * x, k=1, h=32 * x, dtype=jnp.bfloat16
    )
    # Live tiles per row: 4, 4, 3 (split 2 + 2, 2 + 1) and 1 (1 + 0): split=32's programs.
    cache = dataclasses.replace(cache, length=jnp.asarray([64, 50, 45, 3], jnp.int32) * x)
    want = transformer.cached_attention(
      *map(f32, (q, kn, vn, cache.k[1], cache.v[1])), spec, pos, seg, pos // 4, cache
    )
    want = np.where(np.asarray(seg > 0)[:, :, None, None], np.asarray(want), 0.0)
    opts = dict(base={}, splits=dict(splits=2), fold_new=dict(fold_new=True))
    got = {}
    for name in ("base",) + variants:
      c = dataclasses.replace(cache, tiles=dataclasses.replace(base, **opts[name]))
      got[name] = np.asarray(
        f32(flash_decode.cached_attention(q, kn, vn, 1, spec, pos, seg, pos // 4, c))
      )
    # The base's error is bf16 rounding (of the probabilities before p.v, of the output): about
    # 2^-8 of the values' size; a wrong tile or merge would be off by far more.
    err = {name: float(np.abs(o - want).max()) for name, o in got.items()}
    assert 0 < err["base"] < 0.03, err
    assert all(e <= 2 * err["base"] for e in err.values()), err
    if t == 4:
      np.testing.assert_array_equal(got["splits"], got["base"])


def test_float8_widening_without_cvt_gives_the_cast_values():
  """`fp8_widen='bits'` (and 'asm', which the interpreter runs as 'bits') reads a float8 cache as
  exactly the bf16 values of a cast: every finite e4m3fn byte, and the kernel's output bit for bit."""
  u = np.arange(256, dtype=np.uint8)
  u = u[(u & 0x7F) != 0x7F]  # e4m3fn's two NaNs (never in the cache: writes saturate)
  want = jnp.asarray(u).view(jnp.float8_e4m3fn).astype(jnp.bfloat16)
  got = flash_decode.e4m3_bits_to_bf16(jnp.asarray(u))
  np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
  # The PTX of fp8_widen='asm', step by step on 32-bit words of four bytes (numpy's bf16 multiply
  # keeps subnormals, as mul.rn.bf16x2 does).
  words = np.concatenate([u, np.zeros((-len(u)) % 4, np.uint8)]).view(np.uint32)
  prmt = lambda w, b0, b1: ((w >> (8 * b0)) & 0xFF) << 8 | ((w >> (8 * b1)) & 0xFF) << 24
  lanes = []
  for a in (prmt(words, 0, 1), prmt(words, 2, 3)):
    b = ((a & 0x7FFF7FFF) >> 4) | (a & 0x80008000)
    pair = b.astype(np.uint32).view(np.uint16).reshape(-1, 2).view(want.dtype)
    lanes.append(pair * np.asarray(2.0**120, want.dtype))
  asm = np.stack(lanes, axis=1).reshape(-1)[: len(u)]
  np.testing.assert_array_equal(asm.view(np.uint16), np.asarray(want).view(np.uint16))
  q, kn, vn, cache, spec, pos, seg = _attention_case(3, b=2, t=4, dtype=jnp.bfloat16, fp8=True)
  outs = {}
  for how in flash_decode.FP8_WIDENS:
    tiles = flash_decode.DecodeTiles(split=32, block_k=16, fp8_widen=how)
    c = dataclasses.replace(cache, tiles=tiles)
    outs[how] = np.asarray(
      flash_decode.cached_attention(q, kn, vn, 1, spec, pos, seg, pos // 4, c).astype(jnp.float32)
    )
  np.testing.assert_array_equal(outs["bits"], outs["cast"])
  np.testing.assert_array_equal(outs["asm"], outs["cast"])
  with pytest.raises(ValueError, match="fp8_widen must be one of"):
    flash_decode.DecodeTiles(fp8_widen="cvt")


def test_float16_widening_is_as_close_to_float32_attention_as_the_bf16_widening():
  """`fp8_widen='f16'` (float16 dots over the float8 cache) against the float32 attention over the
  same float8 values: within the bf16 widening's error (its queries and keys are exact in float16,
  its probabilities rounded to float16 rather than bf16), with and without `fold_new`; a wrong
  tile, a dropped query cast or unscaled keys would be far off."""
  f32 = lambda a: a.astype(jnp.float32)
  q, kn, vn, cache, spec, pos, seg = _attention_case(5, b=4, t=4, dtype=jnp.bfloat16, fp8=True)
  want = transformer.cached_attention(
    *map(f32, (q, kn, vn, cache.k[1], cache.v[1])), spec, pos, seg, pos // 4, cache
  )
  want = np.where(np.asarray(seg > 0)[:, :, None, None], np.asarray(want), 0.0)
  err = {}
  for how in ("cast", "f16"):
    for fold in (False, True):
      tiles = flash_decode.DecodeTiles(split=32, block_k=16, fp8_widen=how, fold_new=fold)
      c = dataclasses.replace(cache, tiles=tiles)
      got = flash_decode.cached_attention(q, kn, vn, 1, spec, pos, seg, pos // 4, c)
      assert got.dtype == jnp.bfloat16
      err[how, fold] = float(np.abs(np.asarray(f32(got)) - want).max())
  assert 0 < err["cast", False] < 0.05, err
  assert all(e <= 1.5 * err["cast", False] for e in err.values()), err


_PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [20, 21] * 5, [30, 31, 32, 33]]


def _sharpened_dense_and_flash():
  """The tiny float32 model (same weights) on dense and on flash attention, its LM head x60 so
  that confidences are far apart (no near-ties between the two attention paths)."""
  models = []
  for impl in ("dense", "flash"):
    m = transformer.Transformer(
      get_config("tiny", dtype="float32", attention_impl=impl), rngs=nnx.Rngs(0)
    )
    m.lm_head.set_value(m.lm_head[...] * 60.0)
    models.append(m)
  return models


def test_sampler_with_every_decode_option_decodes_what_the_dense_sampler_decodes():
  """Exactness: the forward in two row halves (attention on a second stream), balanced programs
  and the new keys folded into the kernel decode the dense sampler's tokens and step map (the
  fused 8-token first forward of each block and its 4-token forwards)."""
  cfg = sampler.SamplerConfig(strategy="low_confidence_static", max_new_tokens=8)
  dense, flash = _sharpened_dense_and_flash()
  want = sampler.generate(dense, _PROMPTS, cfg)
  tiles = flash_decode.DecodeTiles(split=32, block_k=16, splits=2, fold_new=True, halves=True)
  got = sampler.generate(flash, _PROMPTS, dataclasses.replace(cfg, decode_tiles=tiles))
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_array_equal(np.asarray(got.step_map), np.asarray(want.step_map))


def test_row_halves_with_the_commit_cap_decode_what_the_dense_sampler_decodes():
  """`halves` with `commit_rows` (each row half packs its own committing rows: R / 2 of them) in
  ragged dynamic decoding: the dense sampler's tokens, step map and log-probs, with rows deferred
  (more forwards than uncapped). An odd R cannot be split over the halves: an error naming both."""
  cfg = sampler.SamplerConfig(
    strategy="low_confidence_dynamic", threshold=0.5, max_new_tokens=12, return_logprobs=True
  )
  dense, flash = _sharpened_dense_and_flash()
  want = sampler.generate(dense, _PROMPTS, cfg)
  tiles = flash_decode.DecodeTiles(split=32, block_k=16, halves=True)
  run = lambda r: sampler.generate(
    flash, _PROMPTS, dataclasses.replace(cfg, decode_tiles=tiles, commit_rows=r)
  )
  got, uncapped = run(2), run(0)
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_array_equal(np.asarray(got.step_map), np.asarray(want.step_map))
  np.testing.assert_allclose(
    np.asarray(got.logprobs), np.asarray(want.logprobs), rtol=1e-5, atol=1e-5
  )
  assert int(got.forwards) > int(uncapped.forwards)  # one row a half a forward: rows waited
  with pytest.raises(ValueError, match=r"multiple of the 1 row shards x 2 row halves"):
    run(3)


def test_the_capped_loop_with_visible_half_decodes_what_the_dense_sampler_decodes():
  """`visible_half` where it runs: the capped ragged loop's 2b-token forward with 4 query heads a
  K/V head (32 rows a program; a mid-block row's first 16 invisible): the dense sampler's tokens,
  step map and log-probs."""
  cfg = sampler.SamplerConfig(
    strategy="low_confidence_dynamic", threshold=0.5, max_new_tokens=12, return_logprobs=True
  )
  models = []
  for impl in ("dense", "flash"):
    mcfg = get_config("tiny", dtype="float32", attention_impl=impl, num_kv_heads=1)
    m = transformer.Transformer(mcfg, rngs=nnx.Rngs(0))
    m.lm_head.set_value(m.lm_head[...] * 60.0)
    models.append(m)
  dense, flash = models
  want = sampler.generate(dense, _PROMPTS, cfg)
  tiles = flash_decode.DecodeTiles(split=32, block_k=16, visible_half=True)
  got = sampler.generate(
    flash, _PROMPTS, dataclasses.replace(cfg, decode_tiles=tiles, commit_rows=2)
  )
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_array_equal(np.asarray(got.step_map), np.asarray(want.step_map))
  np.testing.assert_allclose(
    np.asarray(got.logprobs), np.asarray(want.logprobs), rtol=1e-5, atol=1e-5
  )


def test_a_call_on_a_gpu_stream_carries_the_stream_and_keeps_its_values():
  """`halves`' stream call through the installed jax's `compute_on` (0.10: `compute_on2`; 0.11:
  `compute_on` with `compute_type` and `out_memory_spaces`): the lowered call is annotated for
  stream 1 and not inlined, and gives the function's values (the annotation is ignored on CPU)."""
  f = lambda x, y: x * y + x
  x, y = jnp.arange(8.0), jnp.full(8, 2.0)
  on_stream = jax.jit(platform.on_gpu_stream(f, 1))
  text = on_stream.lower(x, y).as_text()
  assert '_xla_stream_annotation = "1"' in text and 'inlineable = "false"' in text
  np.testing.assert_array_equal(on_stream(x, y), f(x, y))


def test_a_gpu_stream_call_holds_no_nested_call():
  """Every `jit` inside a stream call is inlined (`platform.inline_jits`): XLA gives a nested call
  the stream annotation too and then cannot schedule it ("No ExecutionStreamId found for
  %call-start", jax 0.11.2 on the H200 for `jnp.clip`, `jnp.pad` and `jnp.where` in `halves`)."""
  f = lambda x, y: jnp.where(x > 1, jnp.clip(x, 0, 3), jnp.pad(y[:6], (1, 1))) * 2
  x, y = jnp.arange(8.0), jnp.full(8, 2.0)
  assert "call @" in jax.jit(f).lower(x, y).as_text()  # the jitted helpers are nested calls
  on_stream = jax.jit(platform.on_gpu_stream(f, 1))
  text = on_stream.lower(x, y).as_text()
  stream_fn = text[text.index("func.func private") :]
  assert "call @" not in stream_fn and "stablehlo.pad" in stream_fn
  np.testing.assert_array_equal(on_stream(x, y), f(x, y))


def _rows_copied(cache, source, length):
  """`cache` whose row b holds row `source[b]`'s slots (K/V and metadata), filled to `length`."""
  same = lambda x, axis: jnp.take(x, jnp.asarray(source), axis=axis)  # noqa: E731
  return dataclasses.replace(
    cache,
    k=same(cache.k, 1),
    v=same(cache.v, 1),
    positions=same(cache.positions, 0),
    segment_ids=same(cache.segment_ids, 0),
    block_ids=same(cache.block_ids, 0),
    length=jnp.asarray(length, jnp.int32),
  )


def test_rows_sharing_a_prompt_read_its_slots_from_the_source_row():
  """`share_prompts`: rows 1 and 3 have row 0's prompt in their first 37 slots
  (`with_prompt_sources`). Their own copies of the slots in whole tiles below 37 are overwritten
  with noise: the kernel still gives the dense attention of the clean cache, so those tiles were
  read from row 0; the tile that straddles slot 37 ([32, 48)) is read from the row itself (its noise
  there shows). Without the option the noise shows everywhere."""
  q, kn, vn, cache, spec, pos, seg = _attention_case(4)
  seg = jnp.ones_like(seg)
  clean = _rows_copied(cache, [0, 0, 2, 0], [40, 40, 64, 40])
  want = np.asarray(
    transformer.cached_attention(q, kn, vn, clean.k[1], clean.v[1], spec, pos, seg, pos // 4, clean)
  )
  noise = jnp.asarray(np.random.RandomState(9).randn(*clean.k.shape), clean.k.dtype) * 5
  members = (jnp.arange(4) % 2 == 1)[None, :, None, None]
  below = lambda stop: (jnp.arange(clean.k.shape[2]) < stop)[None, None, :, None]
  corrupt = lambda x, stop: jnp.where(members & below(stop), noise, x)
  tiles = flash_decode.DecodeTiles(split=32, block_k=16, share_prompts=True)
  sources = jnp.asarray([0, 0, 2, 0])
  attend = lambda c: np.asarray(
    flash_decode.cached_attention(q, kn, vn, 1, spec, pos, seg, pos // 4, c)
  )
  mk = lambda stop, t: dataclasses.replace(
    clean.with_prompt_sources(sources, jnp.full((4,), 37)),
    k=corrupt(clean.k, stop),
    v=corrupt(clean.v, stop),
    tiles=t,
  )
  np.testing.assert_allclose(attend(mk(32, tiles)), want, rtol=1e-5, atol=1e-5)
  for got in (
    attend(mk(40, tiles)),
    attend(mk(32, dataclasses.replace(tiles, share_prompts=False))),
  ):
    off = np.abs(got - want).max(axis=(1, 2, 3))
    assert off[1] > 1e-2 and off[3] > 1e-2, off  # the members read their own noisy slots
    np.testing.assert_allclose(got[[0, 2]], want[[0, 2]], rtol=1e-5, atol=1e-5)
  c = clean.with_prompt_sources(sources, jnp.full((4,), 37))
  np.testing.assert_array_equal(np.asarray(c.prompt_offset), [0, -1, 0, -3])
  np.testing.assert_array_equal(np.asarray(c.prompt_slots), [0, 37, 0, 37])


def _grouped_case(seed=4):
  """`_attention_case` with rows 1 and 3 holding copies of rows 0 and 2 (two groups of 2 sharing a
  prompt in their first 37 slots), every row filled to 40 or more, the members' own copies of the
  slots below `stop` overwritten by noise (`corrupt(stop)`), and the dense attention of the clean
  cache."""
  q, kn, vn, cache, spec, pos, seg = _attention_case(seed)
  seg = jnp.ones_like(seg)  # every query visible (the dense path's rows that see nothing differ)
  clean = _rows_copied(cache, [0, 0, 2, 2], [40, 52, 64, 45])
  want = np.asarray(
    transformer.cached_attention(q, kn, vn, clean.k[1], clean.v[1], spec, pos, seg, pos // 4, clean)
  )
  noise = jnp.asarray(np.random.RandomState(9).randn(*clean.k.shape), clean.k.dtype) * 5
  members = (jnp.arange(4) % 2 == 1)[None, :, None, None]

  def corrupt(c, stop):
    below = (jnp.arange(c.k.shape[2]) < stop)[None, None, :, None]
    return dataclasses.replace(
      c, k=jnp.where(members & below, noise, c.k), v=jnp.where(members & below, noise, c.v)
    )

  attend = lambda c: np.asarray(  # noqa: E731
    flash_decode.cached_attention(q, kn, vn, 1, spec, pos, seg, pos // 4, c)
  )
  return clean, corrupt, attend, want


@pytest.mark.parametrize(
  "options", [{}, {"fold_new": True, "splits": 2}, {"group_block_q": 16, "group_warps": 2}]
)
def test_groups_attend_their_shared_prompt_once_with_every_members_queries(monkeypatch, options):
  """`cascade`: rows 0-1 and 2-3 are groups of 2 (`prompt_group`); each group's whole tiles below
  its 37 shared slots ([0, 32)) are attended in one kernel row with both members' queries, reading
  the group's first row, and merged with each row's own rest. The members' own copies below 32
  are noise: still the dense attention of the clean cache. Noise up to 40 (the straddling tile,
  read by each row itself) shows in the members only."""
  clean, corrupt, attend, want = _grouped_case()
  tiles = flash_decode.DecodeTiles(split=32, block_k=16, cascade=True, prompt_group=2)
  tiles = dataclasses.replace(tiles, **options)
  strides = []
  launch = flash_decode._pallas_cache_part

  def spy(*args, **kwargs):
    strides.append(kwargs.get("row_stride", 1))
    launches.append((args[3].shape[2], kwargs["block_q"], kwargs["tiles"].num_warps))
    return launch(*args, **kwargs)

  launches = []
  monkeypatch.setattr(flash_decode, "_pallas_cache_part", spy)
  grouped = clean.with_prompt_sources(jnp.asarray([0, 0, 2, 2]), jnp.full((4,), 37))
  grouped = dataclasses.replace(grouped, tiles=tiles)
  np.testing.assert_allclose(attend(corrupt(grouped, 32)), want, rtol=1e-5, atol=1e-5)
  assert strides == [2, 1], strides  # the groups' launch, then the rows' own
  # the group launch: both members' 16 query rows in tiles of up to group_block_q; its warps
  assert launches[0] == (32, min(32, tiles.group_block_q), tiles.group_warps or 4), launches
  got = attend(corrupt(grouped, 40))
  off = np.abs(got - want).max(axis=(1, 2, 3))
  assert off[1] > 1e-2 and off[3] > 1e-2, off
  np.testing.assert_allclose(got[[0, 2]], want[[0, 2]], rtol=1e-5, atol=1e-5)


def test_a_row_outside_its_group_reads_its_own_prompt_slots():
  """Row 3's prompt source is row 0, not its group's first row (2): it is left out of group 1's
  launch and reads its own slots (its noise shows); row 1 is still its group's member."""
  clean, corrupt, attend, want = _grouped_case()
  tiles = flash_decode.DecodeTiles(split=32, block_k=16, cascade=True, prompt_group=2)
  odd = clean.with_prompt_sources(jnp.asarray([0, 0, 2, 0]), jnp.full((4,), 37))
  got = attend(corrupt(dataclasses.replace(odd, tiles=tiles), 32))
  off = np.abs(got - want).max(axis=(1, 2, 3))
  assert off[3] > 1e-2, off
  np.testing.assert_allclose(got[[0, 1, 2]], want[[0, 1, 2]], rtol=1e-5, atol=1e-5)


def test_prompt_group_is_the_size_of_contiguous_equal_groups_or_zero():
  assert sampler.prompt_group([0, 0, 0, 3, 3, 3]) == 3
  assert sampler.prompt_group([0, 1, 2, 3]) == 0  # no shared prompts
  assert sampler.prompt_group([0, 0, 2, 2, 4, 0, 6, 6]) == 0  # a prompt in two groups
  assert sampler.prompt_group([0, 0, 0, 3, 3]) == 0  # unequal groups
  with pytest.raises(ValueError, match="prompt_group"):
    flash_decode.DecodeTiles(prompt_group=1)
  with pytest.raises(ValueError, match="group_block_q must be a power of two >= 16"):
    flash_decode.DecodeTiles(group_block_q=48)
  with pytest.raises(ValueError, match="group_warps must be 0 or a power of two"):
    flash_decode.DecodeTiles(group_warps=3)


def test_sampler_sharing_prompts_decodes_what_the_dense_sampler_decodes(monkeypatch):
  """RL groups (each prompt four times, sampled at temperature 1 with log-probs, ragged dynamic
  decoding under a commit cap): with `share_prompts` every member reads its group's prompt from the
  group's first row (the kernel is handed the sources); with `cascade` on too (the RL default) the
  sampler finds the groups (`prompt_group` 4, handed to every decode forward's cache attention).
  Both decode the dense sampler's tokens, step map and log-probs."""
  handed = []
  part = flash_decode.cache_part

  def spy(*args, **kwargs):
    handed.append((kwargs.get("prompt_sources") is not None, kwargs.get("prompt_group", 0)))
    return part(*args, **kwargs)

  monkeypatch.setattr(flash_decode, "cache_part", spy)
  prompts = [p for p in _PROMPTS[:2] for _ in range(4)]
  np.testing.assert_array_equal(sampler.prompt_sources(prompts), [0, 0, 0, 0, 4, 4, 4, 4])
  cfg = sampler.SamplerConfig(
    strategy="low_confidence_dynamic",
    threshold=0.5,
    temperature=1.0,
    max_new_tokens=12,
    return_logprobs=True,
    commit_rows=4,
  )
  dense, flash = _sharpened_dense_and_flash()
  keys = sampler.row_keys(jax.random.key(3), len(prompts))
  want = sampler.generate(dense, prompts, cfg, keys=keys)
  share, rl_default = {"share_prompts": True}, {"share_prompts": True, "cascade": True}
  options = (share, rl_default)
  for option, group in zip(options, (0, 4)):
    handed.clear()
    tiles = flash_decode.DecodeTiles(split=32, block_k=16, **option)
    got = sampler.generate(flash, prompts, dataclasses.replace(cfg, decode_tiles=tiles), keys=keys)
    # every decode forward's cache attention (prefill: none)
    assert handed and set(handed) == {(True, group)}, (option, handed)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.step_map), np.asarray(want.step_map))
    # float32 sums in another order, so a relative bound: on an AVX2 host (no AVX-512) one log-prob
    # of -3.208 differed by 1.1e-5 (session 39)
    np.testing.assert_allclose(
      np.asarray(got.logprobs), np.asarray(want.logprobs), rtol=1e-5, atol=1e-5
    )


def test_sharing_prompts_on_8_devices_decodes_what_the_dense_sampler_decodes():
  """`share_prompts` with rows split over 4 row shards of 2 (and K/V heads over `tensor`): rows 1, 3
  and 7 read their prompt from the row before them on their own device; row 5's source (row 0) lives
  on another device, so it reads its own copy. The dense single-device sampler's tokens. `cascade` is
  on too, as in the RL default, and falls back to these reads on a mesh."""
  from dice_jax import sharding

  a, b, c, d = _PROMPTS
  prompts = [a, a, b, b, c, a, d, d]
  cfg = sampler.SamplerConfig(strategy="low_confidence_static", max_new_tokens=8)
  dense, _ = _sharpened_dense_and_flash()
  want = sampler.generate(dense, prompts, cfg)
  mcfg = get_config("tiny", dtype="float32", attention_impl="flash")
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  flash = sharding.create_sharded(lambda: transformer.Transformer(mcfg, rngs=nnx.Rngs(0)), mesh)
  flash.lm_head.set_value(flash.lm_head[...] * 60.0)
  # the RL default's flags: `cascade` applies on one device only, so here `share_prompts` reads
  tiles = flash_decode.DecodeTiles(split=32, block_k=16, share_prompts=True, cascade=True)
  cfg = dataclasses.replace(cfg, decode_tiles=tiles)
  layout = sampler.layout_prompts(prompts, cfg, mcfg.mask_token_id)
  np.testing.assert_array_equal(layout.prompt_source, [0, 0, 2, 2, 4, 0, 6, 6])
  rows = jax.NamedSharding(mesh, jax.P(("data", "fsdp")))
  layout = jax.tree.map(lambda x: jax.device_put(x, rows), layout)
  with jax.set_mesh(mesh):
    got = sampler.decode(flash, layout, cfg)
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_array_equal(np.asarray(got.step_map), np.asarray(want.step_map))
