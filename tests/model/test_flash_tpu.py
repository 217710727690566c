"""The Pallas TPU attention kernels (interpret mode on CPU) against the dense reference on the
masks' brute-force cases: values and gradients in fp32, padding, packed segments, prompts that end
inside a block, TraceRL rounds; the cache kernel of the sampler; platform selection and refusal."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_masks import (
  _masked_attention_np,
  _trace_layout,
  brute,
  brute_block_diffusion,
  brute_trace,
)

from dice_jax.model import flash_bd, flash_tpu, masks, platform, transformer
from dice_jax.model.kv_cache import KVCache

H = 128  # the TPU lane width: the kernel's head width


def _packed(t, block=4):
  """Two rows: three segments whose responses start at 3, 5, 2 (prompts end inside a block),
  then padding; and one segment filling the row with its response at 6."""
  seg, pos, start = (np.zeros((2, t), np.int32) for _ in range(3))
  for r, lens in enumerate([(t // 2 - 3, t // 4, t // 8), (t,)]):
    at = 0
    for i, n in enumerate(lens):
      sl = slice(at, at + n)
      seg[r, sl], pos[r, sl], start[r, sl] = i + 1, np.arange(n), (3, 5, 2)[i] if r == 0 else 6
      at += n
  blk = np.floor_divide(pos - start, block)
  return seg, pos, blk


def _qkv(b, s, n, k, seed=0):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.normal(size=(b, s, m, H)), jnp.float32) for m in (n, k, k))


def _check_values_and_grads(q, k, v, mask, valid, fn, seed=1):
  """fn vs the dense path on `mask`: live outputs, then the gradients of q, k, v (fp32)."""
  want = _masked_attention_np(*(np.asarray(x, np.float64) for x in (q, k, v)), np.asarray(mask))
  got = np.asarray(fn(q, k, v))
  assert np.all(np.isfinite(got))
  np.testing.assert_allclose(got[valid], want[valid], atol=2e-5)
  ct = jnp.asarray(np.random.default_rng(seed).normal(size=q.shape) * valid[..., None, None])
  ct = ct.astype(jnp.float32)
  ref = lambda *a: (transformer.dense_attention(*a, jnp.asarray(mask)) * ct).sum()
  imp = lambda *a: (fn(*a) * ct).sum()
  for g_ref, g_imp in zip(jax.grad(ref, (0, 1, 2))(q, k, v), jax.grad(imp, (0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(np.asarray(g_imp), np.asarray(g_ref), atol=3e-5)


@pytest.mark.parametrize("kind", ["block_diffusion", "block_causal"])
def test_tpu_kernel_matches_dense_on_the_brute_force_masks(kind):
  t = 64
  seg, pos, blk = _packed(t)
  if kind == "block_diffusion":
    spec = masks.AttentionSpec.block_diffusion(4, jnp.asarray(seg), jnp.asarray(blk))
    positions = jnp.asarray(np.concatenate([pos, pos], 1))
    mask, valid = brute_block_diffusion(seg, blk), np.concatenate([seg, seg], 1) > 0
  else:
    spec = masks.AttentionSpec.block_causal(4, jnp.asarray(seg), jnp.asarray(blk))
    positions, mask, valid = jnp.asarray(pos), brute(kind, pos, seg, blk), seg > 0
  q, k, v = _qkv(2, positions.shape[1], 2, 1)
  fn = lambda q, k, v: flash_tpu.attention(
    q, k, v, spec, positions, block_q=32, block_k=32, interpret=True
  )
  _check_values_and_grads(q, k, v, mask, valid, fn)


def test_tpu_kernel_matches_dense_on_the_trace_mask():
  rows, seg, blk, rnd, pos = _trace_layout(np.random.default_rng(7), packed=True, length=64)
  spec = masks.AttentionSpec.trace(4, *map(jnp.asarray, (seg, blk, rnd)))
  q, k, v = _qkv(2, 64, 2, 1, seed=3)
  fn = lambda q, k, v: flash_tpu.attention(
    q, k, v, spec, jnp.asarray(pos), block_q=16, block_k=32, interpret=True
  )
  _check_values_and_grads(q, k, v, brute_trace(rows), seg > 0, fn)


def test_tile_plan_covers_every_visible_pair_and_skips_the_dead_tiles():
  """live = 1 wherever a tile holds a visible pair (so skipping is exact); on the 2L SFT mask of
  512 tokens in 32-token tiles, most of the x_0 -> x_t quadrant and the padding are skipped."""
  t, bt = 256, 32
  seg, pos, blk = _packed(t)
  spec = masks.AttentionSpec.block_diffusion(4, jnp.asarray(seg), jnp.asarray(blk))
  vec = flash_bd.mask_vectors(spec, jnp.asarray(np.concatenate([pos, pos], 1)))
  live, kidx, qidx = (np.asarray(a) for a in flash_tpu.tile_plan(*vec[:2], *vec, bt, bt))
  mask = brute_block_diffusion(seg, blk)
  n = 2 * t // bt
  visible = mask.reshape(2, n, bt, n, bt).any(axis=(2, 4))
  assert np.all(live[visible] == 1)
  assert live.mean() < 0.5 and (visible.mean() > 0.3)  # a third of the tiles live, under half run
  # Dead tiles fetch the last live block: the fetched index never moves on a dead step.
  j = np.arange(n)
  assert np.all(kidx[live == 1] == np.broadcast_to(j, live.shape)[live == 1])
  assert np.all(np.diff(kidx, axis=-1)[live[..., 1:] == 0] == 0)
  assert np.all(np.diff(qidx, axis=-1)[live.transpose(0, 2, 1)[..., 1:] == 0] == 0)


@pytest.mark.parametrize("kind", ["block_causal", "causal"])
def test_tpu_cache_kernel_matches_dense_cached_attention(kind):
  """New tokens over a KV cache (layer 1 of 2, read in place): partly filled rows, left padding,
  a row with no live query; the TPU kernel through `attention_impl='flash'` equals dense."""
  b, t, s, n, k = 3, 4, 256, 4, 2
  r = np.random.RandomState(0)
  f = lambda *shape: jnp.asarray(r.randn(*shape), jnp.float32)
  q, kn, vn = f(b, t, n, H), f(b, t, k, H), f(b, t, k, H)
  ck, cv = f(2, b, s, k * H), f(2, b, s, k * H)  # the stored layout: heads fused
  cseg = np.ones((b, s), np.int32)
  cseg[0, :5], cseg[1, :20] = 0, 0
  cpos = np.tile(np.arange(s) - 20, (b, 1)).astype(np.int32)
  cache = KVCache(
    ck, cv, *map(jnp.asarray, (cpos, cseg, cpos // 4)), jnp.asarray([137, 20, 256], jnp.int32), H
  )
  pos = jnp.asarray(np.tile(np.arange(117, 117 + t), (b, 1)), jnp.int32)
  seg = jnp.asarray([[1] * t, [1] * t, [0] * t], jnp.int32)  # row 2: a finished slot
  blk = pos // 4
  spec = masks.AttentionSpec(kind, 4, seg, blk)
  args = (q, kn, vn, ck[1], cv[1], spec, pos, seg, blk, cache)
  want = np.asarray(transformer.cached_attention(*args, impl="dense"))
  with platform.lowering_for("tpu", interpret=True):
    got = np.asarray(transformer.cached_attention(*args, impl="flash", layer=1))
  np.testing.assert_allclose(got[:2], want[:2], rtol=1e-5, atol=1e-5)
  assert np.all(np.isfinite(got))


def test_attention_impl_picks_the_platform_kernel_and_refuses_the_rest():
  q = k = v = jnp.zeros((1, 4096, 2, H), jnp.bfloat16)
  pos = jnp.broadcast_to(jnp.arange(4096), (1, 4096))
  spec = masks.AttentionSpec.block_causal(4)

  def kernels(impl):
    fn = lambda q, k, v: transformer.self_attention(q, k, v, spec, pos, impl=impl)
    return str(jax.make_jaxpr(fn)(q, k, v))

  with platform.lowering_for("tpu"):
    assert "bd_flash_tpu_fwd" in kernels("flash")
    with pytest.raises(ValueError, match="'cudnn' is an NVIDIA GPU kernel; there is none on 'tpu'"):
      kernels("cudnn")
    with pytest.raises(ValueError, match=r"'dense' on TPU would materialise \[B, N, 4096, 4096\]"):
      kernels("dense")
    assert platform.check("dense", 8, 1024).platform == "tpu"  # decode-sized dense is fine
  assert "bd_flash_fwd" in kernels("flash")  # CPU: the GPU kernel, interpreted
  with pytest.raises(ValueError, match="there is none on 'cpu'"):
    kernels("cudnn")


def test_sampler_on_the_tpu_kernels_matches_the_dense_sampler():
  """Prefill and decode through `attention_impl='flash'` traced for TPU (interpreted): the same
  tokens and step map as the dense sampler (the kernels inside the whole decoding program)."""
  from flax import nnx

  from dice_jax.diffusion import sampler
  from dice_jax.model.config import get_config

  prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]  # ragged: left padding, prompt blocks
  cfg = sampler.SamplerConfig(strategy="low_confidence_static", max_new_tokens=4)

  def model(impl):
    m = transformer.Transformer(
      get_config("tiny", dtype="float32", attention_impl=impl), rngs=nnx.Rngs(0)
    )
    m.lm_head.set_value(m.lm_head[...] * 60.0)  # confident, so ties do not decide the order
    return m

  want = sampler.generate(model("dense"), prompts, cfg)
  with platform.lowering_for("tpu", interpret=True):
    got = sampler.generate(model("flash"), prompts, cfg)
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_array_equal(np.asarray(got.step_map), np.asarray(want.step_map))
  assert np.asarray(got.response_lengths).tolist() == [4, 4]


def test_tpu_kernel_under_a_mesh_equals_one_device():
  """On 8 devices (rows over fsdp, heads over tensor, via shard_map) the kernel gives the
  one-device values and gradients."""
  from dice_jax import sharding

  t = 32
  seg, pos, blk = _packed(t)
  seg, pos, blk = (np.concatenate([a, a[::-1]]) for a in (seg, pos, blk))  # 4 rows
  spec = masks.AttentionSpec.block_diffusion(4, jnp.asarray(seg), jnp.asarray(blk))
  positions = jnp.asarray(np.concatenate([pos, pos], 1))
  q, k, v = _qkv(4, 2 * t, 4, 2, seed=5)
  ct = jnp.asarray(np.random.default_rng(6).normal(size=q.shape), jnp.float32)
  f = lambda q, k, v: (flash_tpu.attention(q, k, v, spec, positions, interpret=True) * ct).sum()
  want = jax.value_and_grad(f, (0, 1, 2))(q, k, v)
  with jax.set_mesh(sharding.make_mesh(data=1, fsdp=4, tensor=2)):
    assert "shard_map" in str(jax.make_jaxpr(f)(q, k, v))
    got = jax.jit(jax.value_and_grad(f, (0, 1, 2)))(q, k, v)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_model_config_tpu_tiles_reach_the_kernel_and_are_validated():
  from dice_jax.model.config import get_config

  q = k = v = jnp.zeros((1, 512, 2, H), jnp.bfloat16)
  pos = jnp.broadcast_to(jnp.arange(512), (1, 512))
  spec = masks.AttentionSpec.block_causal(4)
  grids = {}
  for tiles in [(512, 512), (128, 256)]:
    cfg = get_config("tiny", head_dim=H, attention_impl="flash", flash_tpu_tiles=list(tiles))
    fn = lambda q, k, v: transformer.self_attention(
      q, k, v, spec, pos, impl="flash", flash_tpu_tiles=cfg.flash_tpu_tiles
    )
    with platform.lowering_for("tpu"):
      grids[tiles] = re.findall(r"grid=\(([^)]*)\)", str(jax.make_jaxpr(fn)(q, k, v)))
  assert grids == {(512, 512): ["1, 2, 1, 1"], (128, 256): ["1, 2, 4, 2"]}  # (B, N, nq, nk)
  with pytest.raises(ValueError, match="flash_tpu_tiles must be .* multiples of 8 and of 128"):
    get_config("tiny", flash_tpu_tiles=(512, 64))


@pytest.mark.parametrize("target,kernel", [("tpu", "bd_flash_tpu_fwd"), ("cpu", "bd_flash_fwd")])
def test_remat_attn_policies_keep_the_kernel_residuals_and_the_gradients(target, kernel):
  """`dots_attn`/`full_attn` save the flash kernel's output and log-sum-exp (`flash_bd.OUT_NAME`,
  `LSE_NAME`, named in the TPU kernel's custom-VJP forward as in flash_bd's), so the backward need
  not re-run its forward, and the layer names the output no second time (`attention_out`); the
  model's gradients (interpreted kernels, a two-layer block-diffusion 2L input) equal those
  without remat. The compiled program's kernel counts: tests/train/test_tpu_remat.py."""
  from flax import nnx

  from dice_jax.model.config import get_config

  t = 16
  seg, pos, blk = _packed(t)
  spec = masks.AttentionSpec.block_diffusion(4, jnp.asarray(seg), jnp.asarray(blk))
  positions = jnp.asarray(np.concatenate([pos, pos], 1))
  tokens = jnp.asarray(np.random.default_rng(7).integers(2, 250, size=(2, 2 * t)), jnp.int32)
  ct = jnp.asarray(np.random.default_rng(8).normal(size=(2, 2 * t, 256)), jnp.float32)
  params = nnx.split(
    transformer.Transformer(get_config("tiny", dtype="float32"), rngs=nnx.Rngs(0)), nnx.Param
  )[1]

  def grads(remat):
    cfg = get_config("tiny", dtype="float32", attention_impl="flash", remat=remat)
    graphdef = nnx.split(transformer.Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)[0]
    loss = lambda p: (nnx.merge(graphdef, p)(tokens, positions, spec) * ct).sum()
    with platform.lowering_for(target, interpret=True):
      text = str(jax.make_jaxpr(jax.grad(loss))(params))
      assert set(re.findall(r"name=(bd_flash\w*_fwd)", text)) == {kernel}
      return jax.jit(jax.value_and_grad(loss))(params), text

  (want_loss, want), _ = grads(False)
  scale = max(float(jnp.abs(x).max()) for x in jax.tree.leaves(want))
  for policy in ("dots_attn", "full_attn"):
    (loss, got), text = grads(policy)
    names = set(re.findall(r"name\[name=(\w+)\]", text))
    assert names == {flash_bd.OUT_NAME, flash_bd.LSE_NAME}, names
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5, err_msg=policy)
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale), got, want
    )
