"""The Pallas flash path (CPU: Pallas interpreter) against the dense reference attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dice_jax import sharding
from dice_jax.model import flash_bd, masks
from dice_jax.model.transformer import Transformer, dense_attention

from ._helpers import packed_batch


def _qkv(b, s, n, k, h, seed=0):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.normal(size=(b, s, m, h)), jnp.float32) for m in (n, k, k))


def _packed_ids(b, t):
  """Two rows: three packed segments + padding, and one full segment; response-aligned blocks."""
  seg = np.zeros((b, t), np.int32)
  pos = np.zeros((b, t), np.int32)
  starts = np.zeros((b, t), np.int32)
  for r, lens in enumerate([(13, 7, 6), (t,)][:b]):
    at = 0
    for i, n in enumerate(lens):
      seg[r, at : at + n], pos[r, at : at + n], starts[r, at : at + n] = i + 1, np.arange(n), 3 + i
      at += n
  blk = masks.block_ids_from_response_start(pos, starts, 4)
  return jnp.asarray(seg), jnp.asarray(pos), jnp.asarray(blk)


def test_rank_vectors_encode_exactly_the_block_diffusion_mask():
  seg, pos, blk = _packed_ids(2, 32)
  want = masks.block_diffusion_mask(blk, seg)
  got = flash_bd.mask_from_vectors(*flash_bd.bd_mask_vectors(seg, blk))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("kind", ["block_diffusion", "block_causal", "causal"])
def test_flash_matches_dense_values_and_gradients(kind):
  b, t, n, k, h = 2, 32, 4, 2, 16
  seg, pos, blk = _packed_ids(b, t)
  if kind == "block_diffusion":
    spec = masks.AttentionSpec.block_diffusion(4, seg, blk)
    positions = jnp.concatenate([pos, pos], 1)
    valid = jnp.concatenate([seg, seg], 1) > 0
  else:
    spec = masks.AttentionSpec(kind, 4, seg, blk)
    positions, valid = pos, seg > 0
  q, kk, v = _qkv(b, positions.shape[1], n, k, h)
  mask = masks.dense_mask(spec, positions)
  ct = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)
  ct = ct * valid[:, :, None, None]  # padding rows are never read downstream
  ref = lambda *a: (dense_attention(*a, mask) * ct).sum()  # noqa: E731
  fla = lambda *a: (
    flash_bd.attention(
      *a,
      spec,
      positions,
      block_q=16,
      block_k=8,  # noqa: E731
      block_bwd=16,
    )
    * ct
  ).sum()
  np.testing.assert_allclose(fla(q, kk, v), ref(q, kk, v), rtol=1e-5)
  for g_ref, g_fla in zip(jax.grad(ref, (0, 1, 2))(q, kk, v), jax.grad(fla, (0, 1, 2))(q, kk, v)):
    np.testing.assert_allclose(np.asarray(g_fla), np.asarray(g_ref), atol=2e-5)


def test_flash_model_matches_dense_model_on_a_sharded_mesh(tiny_cfg):
  batch = packed_batch(4, 16, 250, seed=0)
  spec = masks.AttentionSpec.block_diffusion(4, jnp.asarray(batch["segment_ids"]))
  tokens = jnp.asarray(np.concatenate([batch["tokens"]] * 2, 1))
  positions = jnp.asarray(np.concatenate([batch["positions"]] * 2, 1))
  dense = Transformer(tiny_cfg, rngs=nnx.Rngs(0))
  want = dense(tokens, positions, spec)
  mesh = sharding.make_mesh(1, 4, 2)
  flash = sharding.create_sharded(
    lambda: Transformer(tiny_cfg.replace(attention_impl="flash"), rngs=nnx.Rngs(0)), mesh
  )
  rows = NamedSharding(mesh, P(("data", "fsdp"), None))
  with jax.set_mesh(mesh):  # the kernel runs per shard (shard_map) under a mesh
    got = jax.jit(lambda m, t, p, s: m(t, p, s))(
      flash, jax.device_put(tokens, rows), jax.device_put(positions, rows), spec
    )
  valid = np.concatenate([batch["segment_ids"]] * 2, 1) > 0
  np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], atol=1e-4)


def test_lengths_that_do_not_fit_the_tiles_are_refused():
  q, k, v = _qkv(1, 24, 2, 2, 16)
  pos = jnp.arange(24)[None]
  with pytest.raises(ValueError, match="multiple of the tiles"):
    flash_bd.attention(
      q, k, v, masks.AttentionSpec.causal(), pos, block_q=16, block_k=16, block_bwd=16
    )


def test_model_config_flash_tiles_reach_the_kernel(tiny_cfg):
  """The tiles are a model parameter (no module global): a 24-token input does not fit 16-tiles."""
  tokens = jnp.zeros((1, 24), jnp.int32)
  positions = jnp.arange(24)[None]
  model = Transformer(
    tiny_cfg.replace(attention_impl="flash", flash_tiles=(16, 16, 16)), rngs=nnx.Rngs(0)
  )
  with pytest.raises(ValueError, match="multiple of the tiles 16, 16, 16"):
    model(tokens, positions, masks.AttentionSpec.causal())
  fits = Transformer(
    tiny_cfg.replace(attention_impl="flash", flash_tiles=(8, 8, 8)), rngs=nnx.Rngs(0)
  )
  dense = Transformer(tiny_cfg, rngs=nnx.Rngs(0))
  spec = masks.AttentionSpec.causal()
  np.testing.assert_allclose(
    np.asarray(fits(tokens, positions, spec)), np.asarray(dense(tokens, positions, spec)), atol=1e-4
  )


def _trace_rows():
  """Packed TraceRL rows of four random responses (several rounds per block, stop ids)."""
  from dice_jax.rl import tracerl
  from tests.rl.test_tracerl_layouts import trajectories

  cfg = tracerl.TraceRLConfig(layout="packed")
  (batch,) = tracerl.build_batches(
    trajectories(), cfg, block_size=4, mask_token_id=255, rows_per_batch=4, length_multiple=32
  )
  spec = tracerl.trace_spec(batch, 4)
  return spec, jnp.asarray(batch["positions"]), jnp.asarray(batch["segment_ids"]) > 0


def test_live_tile_loops_equal_the_skipping_loops_and_dense_on_trace_rows():
  spec, positions, valid = _trace_rows()
  b, t = positions.shape
  q, kk, v = _qkv(b, t, 4, 2, 16, seed=2)
  ct = jnp.asarray(np.random.default_rng(3).normal(size=q.shape), jnp.float32)
  ct = ct * valid[:, :, None, None]
  mask = masks.dense_mask(spec, positions)
  tiles = dict(block_q=16, block_k=8, block_bwd=16)

  def run(live_only):
    f = lambda *a: (  # noqa: E731
      flash_bd.attention(*a, spec, positions, live_only=live_only, **tiles) * ct
    ).sum()
    return jax.jit(jax.value_and_grad(f, (0, 1, 2)))(q, kk, v)

  (val, grads), (val0, grads0) = run(True), run(False)
  # the same tiles in the same order: the same numbers
  np.testing.assert_array_equal(np.asarray(val), np.asarray(val0))
  for g, g0 in zip(grads, grads0):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(g0))
  ref = lambda *a: (dense_attention(*a, mask) * ct).sum()  # noqa: E731
  np.testing.assert_allclose(val, ref(q, kk, v), rtol=1e-5)
  for g_ref, g in zip(jax.grad(ref, (0, 1, 2))(q, kk, v), grads):
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), atol=2e-5)


def test_the_live_schedule_lists_every_tile_with_a_visible_pair_and_few_others():
  spec, positions, _ = _trace_rows()
  seg, rank, klo = flash_bd.mask_vectors(spec, positions)
  live = np.asarray(flash_bd.live_tiles(seg, rank, klo, 16, 8))
  dense = np.asarray(flash_bd.mask_from_vectors(seg, rank, klo))  # [B, S, S]
  b, s, _ = dense.shape
  has_pair = dense.reshape(b, s // 16, 16, s // 8, 8).any(axis=(2, 4))
  assert (live >= has_pair).all()  # no tile with a visible pair is left out
  assert not live.all()  # and some are not visited
  index, count = (np.asarray(x) for x in flash_bd.live_schedule(jnp.asarray(live)))
  for r in range(b):
    for i in range(live.shape[1]):
      listed = index[r, i, : count[r, i]]
      np.testing.assert_array_equal(listed, np.nonzero(live[r, i])[0])  # ascending, live only
