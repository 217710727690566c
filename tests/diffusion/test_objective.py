"""Block-diffusion SFT objective: blocks, noising, loss value, padding, gradients, leakage, sharding."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dice_jax.diffusion import blocks, noising, objective
from dice_jax.model import masks as masks_lib
from dice_jax.model.config import get_config
from dice_jax.model.transformer import Transformer
from dice_jax.train import sharding

B_SIZE = 4
MASK = 255


@pytest.fixture(scope="module")
def model():
  return Transformer(get_config("tiny", dtype="float32"), rngs=nnx.Rngs(0))


def _packed_batch(seed=0, rows=2, length=24):
  """Row r: segment 1 = prompt 5 + response 8 (13 tokens), segment 2 = prompt 3 + response 4,
  then row padding. Loss on responses only."""
  rs = np.random.RandomState(seed)
  tokens = rs.randint(2, 200, (rows, length)).astype(np.int32)
  positions = np.zeros((rows, length), np.int32)
  seg = np.zeros((rows, length), np.int32)
  loss = np.zeros((rows, length), bool)
  positions[:, :13] = np.arange(13)
  seg[:, :13] = 1
  loss[:, 5:13] = True
  positions[:, 13:20] = np.arange(7)
  seg[:, 13:20] = 2
  loss[:, 16:20] = True
  tokens[:, 20:] = 1  # padding tokens (segment 0)
  return dict(tokens=tokens, positions=positions, segment_ids=seg, loss_mask=loss)


def _mean_loss(model, batch, rng, cfg):
  """The per-token loss the step trains on: loss_sum / denominator."""
  loss_sum, metrics = objective.block_diffusion_loss(model, batch, rng, cfg)
  return loss_sum / metrics["denominator"], metrics


_loss_jit = jax.jit(_mean_loss, static_argnames="cfg")


def test_block_ids_start_at_each_segments_response():
  b = _packed_batch()
  blk = np.asarray(blocks.block_ids(b["positions"], b["segment_ids"], b["loss_mask"], B_SIZE))
  # segment 1: response starts at position 5; segment 2: at position 3.
  want1 = np.floor_divide(np.arange(13) - 5, 4)  # [-2,-2,-2,-1,-1, 0,0,0,0, 1,1,1,1]
  want2 = np.floor_divide(np.arange(7) - 3, 4)  # [-1,-1,-1, 0,0,0,0]
  np.testing.assert_array_equal(blk[0, :13], want1)
  np.testing.assert_array_equal(blk[0, 13:20], want2)
  absolute = np.asarray(
    blocks.block_ids(b["positions"], b["segment_ids"], b["loss_mask"], B_SIZE, "absolute")
  )
  np.testing.assert_array_equal(absolute[0, :13], np.arange(13) // 4)


def test_mask_only_response_at_least_one_and_rate_follows_t():
  b = _packed_batch(rows=1)
  seg, loss = jnp.asarray(b["segment_ids"]), jnp.asarray(b["loss_mask"])
  blk = blocks.block_ids(b["positions"], seg, loss, B_SIZE)
  draw = jax.jit(jax.vmap(lambda k: noising.sample_mask(k, seg, blk, loss)))
  masked, p = draw(jax.random.split(jax.random.key(1), 2000))
  masked, p = np.asarray(masked)[:, 0], np.asarray(p)[:, 0]
  assert not masked[:, ~b["loss_mask"][0]].any()
  assert (masked[:, 5:13].sum(1) >= 1).all() and (masked[:, 16:20].sum(1) >= 1).all()
  # One p per sample; p in [eps, 1]. E[mask fraction] over 8 tokens = E[p] + P(none)/8
  # = 0.5 + (1/9)/8 (t ~ U(0,1); eps negligible); 2000 draws give a std of ~0.0065.
  assert np.allclose(p[:, 5:13], p[:, 5:6]) and np.allclose(p[:, 16:20], p[:, 16:17])
  assert p.min() >= 1e-3 and p.max() <= 1.0
  frac = masked[:, 5:13].mean()
  assert abs(frac - (0.5 + 1 / 72)) < 0.03, frac
  # BD3-LM switch: per-block noise levels differ between the two blocks of segment 1.
  _, p_blk = noising.sample_mask(jax.random.key(1), seg, blk, loss, per_block_t=True)
  p_blk = np.asarray(p_blk)[0]
  assert np.allclose(p_blk[5:9], p_blk[5]) and not np.isclose(p_blk[5], p_blk[9])


def test_weighted_cross_entropy_by_hand():
  v = 8
  logits = jnp.zeros((1, 3, v))  # uniform -> CE = log v everywhere
  w = jnp.array([[2.0, 0.0, 4.0]])
  got = objective.weighted_cross_entropy(logits, jnp.array([[1, 2, 3]]), w)
  np.testing.assert_allclose(got, 6 * math.log(v), rtol=1e-6)
  logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25]]]))
  got = objective.weighted_cross_entropy(logits, jnp.array([[1]]), jnp.array([[3.0]]))
  np.testing.assert_allclose(got, 3 * math.log(4), rtol=1e-6)


def test_loss_by_hand_with_uniform_predictions():
  """LM head zeroed: every logit is 0, so every CE is log V and the loss is
  log(V) * sum_{masked} 1/p / N_ans, computable by hand from the mask draw."""
  m = Transformer(get_config("tiny", dtype="float32"), rngs=nnx.Rngs(0))
  m.lm_head.set_value(jnp.zeros_like(m.lm_head[...]))
  batch = _packed_batch()
  rng = jax.random.key(7)
  loss, metrics = _loss_jit(m, batch, rng, cfg=objective.ObjectiveConfig())
  blk = blocks.block_ids(batch["positions"], batch["segment_ids"], batch["loss_mask"], B_SIZE)
  masked, p = noising.sample_mask(
    rng, jnp.asarray(batch["segment_ids"]), blk, jnp.asarray(batch["loss_mask"])
  )
  masked, p = np.asarray(masked), np.asarray(p)
  want = math.log(256) * np.sum(1.0 / p[masked]) / 24
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  np.testing.assert_allclose(
    float(metrics["masked_ce_sum"]), math.log(256) * masked.sum(), rtol=1e-5
  )


def _reference_loss(model, batch, masked, p):
  """sum (1/p) CE / N_ans, with each block's logits from a plain block-causal forward over
  [x_0 of earlier blocks ; x_t of this block] (the meaning of the 2L mask), per segment."""
  total = 0.0
  for r in range(batch["tokens"].shape[0]):
    seg_r = batch["segment_ids"][r]
    for s in set(seg_r[seg_r > 0].tolist()):
      cols = np.nonzero(seg_r == s)[0]
      x0 = batch["tokens"][r, cols]
      pos = batch["positions"][r, cols]
      loss = batch["loss_mask"][r, cols]
      start = pos[loss].min()
      blk = (pos - start) // B_SIZE
      m, pp = masked[r, cols], p[r, cols]
      xt = np.where(m, MASK, x0)
      for k in sorted(set(blk[m].tolist())):
        keep = blk <= k
        inp = np.where(blk == k, xt, x0)[keep]
        spec = masks_lib.AttentionSpec.block_causal(B_SIZE, block_ids=jnp.asarray(blk[keep])[None])
        logits = np.asarray(model(jnp.asarray(inp)[None], jnp.asarray(pos[keep])[None], spec))[0]
        mx = logits.max(-1, keepdims=True)
        logp = logits - mx - np.log(np.exp(logits - mx).sum(-1, keepdims=True))
        sel = (blk[keep] == k) & m[keep]
        total += np.sum(-logp[sel, x0[keep][sel]] / pp[keep][sel])
  return total / batch["loss_mask"].sum()


def test_loss_matches_blockwise_reference(model):
  batch = _packed_batch()
  rng = jax.random.key(3)
  loss, metrics = _loss_jit(model, batch, rng, cfg=objective.ObjectiveConfig())
  blk = blocks.block_ids(batch["positions"], batch["segment_ids"], batch["loss_mask"], B_SIZE)
  masked, p = noising.sample_mask(
    rng, jnp.asarray(batch["segment_ids"]), blk, jnp.asarray(batch["loss_mask"])
  )
  masked, p = np.asarray(masked), np.asarray(p)
  want = _reference_loss(model, batch, masked, p)
  np.testing.assert_allclose(float(loss), want, rtol=2e-5)
  assert float(metrics["answer_tokens"]) == batch["loss_mask"].sum() == 24
  assert float(metrics["masked_tokens"]) == masked.sum()
  np.testing.assert_allclose(float(metrics["weighted_ce_sum"]) / 24, float(loss), rtol=1e-6)
  # Chunked CE gives the same value as one pass.
  chunked, _ = _loss_jit(model, batch, rng, cfg=objective.ObjectiveConfig(ce_chunk=5))
  np.testing.assert_allclose(float(chunked), float(loss), rtol=1e-6)


def test_loss_invariant_to_padding(model):
  batch = _packed_batch()
  padded = {}
  for k, v in batch.items():
    v = np.pad(v, ((0, 1), (0, 8)))  # one all-padding row and 8 padding columns
    padded[k] = v
  padded["tokens"][:, 24:] = 7  # padding token values must not matter either
  padded["tokens"][2] = 9
  rng = jax.random.key(5)
  cfg = objective.ObjectiveConfig()
  a, ma = _loss_jit(model, batch, rng, cfg=cfg)
  b, mb = _loss_jit(model, padded, rng, cfg=cfg)
  np.testing.assert_allclose(float(a), float(b), rtol=1e-6)
  for k in ("answer_tokens", "masked_tokens"):
    assert float(ma[k]) == float(mb[k])


def test_gradients_flow_only_through_masked_positions(model):
  batch = _packed_batch()
  x0 = jnp.asarray(batch["tokens"])
  blk = blocks.block_ids(batch["positions"], batch["segment_ids"], batch["loss_mask"], B_SIZE)
  masked, p = noising.sample_mask(
    jax.random.key(2), jnp.asarray(batch["segment_ids"]), blk, jnp.asarray(batch["loss_mask"])
  )
  xt = noising.apply_mask(x0, masked, MASK)
  hidden = objective.xt_hidden(
    model, x0, xt, jnp.asarray(batch["positions"]), jnp.asarray(batch["segment_ids"]), blk
  )
  w = jnp.where(masked, 1.0 / p, 0.0)
  g = jax.grad(lambda h: objective.chunked_weighted_ce(model, h, x0, w, chunk=7))(hidden)
  g_norm = np.abs(np.asarray(g)).sum(-1)
  assert (g_norm[np.asarray(masked)] > 0).all()
  assert (g_norm[~np.asarray(masked)] == 0).all()


def test_later_block_x0_does_not_leak_into_earlier_block(model):
  batch = _packed_batch()
  pos, seg = jnp.asarray(batch["positions"]), jnp.asarray(batch["segment_ids"])
  blk = blocks.block_ids(pos, seg, batch["loss_mask"], B_SIZE)
  masked = jnp.asarray(batch["loss_mask"])  # every response token masked

  def per_token_ce(x0):
    xt = noising.apply_mask(x0, masked, MASK)
    logits = model.logits_from_hidden(objective.xt_hidden(model, x0, xt, pos, seg, blk))
    return np.asarray(-jnp.take_along_axis(jax.nn.log_softmax(logits), x0[..., None], -1)[..., 0])

  x0 = jnp.asarray(batch["tokens"])
  changed = x0.at[:, 9:13].set(42)  # segment 1, response block 1
  before, after = per_token_ce(x0), per_token_ce(changed)
  np.testing.assert_array_equal(before[:, 5:9], after[:, 5:9])  # block 0 of segment 1
  np.testing.assert_array_equal(before[:, 13:20], after[:, 13:20])  # the other segment
  assert not np.allclose(before[:, 9:13], after[:, 9:13])
  # Control: changing block 0's x_0 does change block 1's loss (it is visible to block 1).
  changed0 = x0.at[:, 5:9].set(42)
  assert not np.allclose(before[:, 9:13], per_token_ce(changed0)[:, 9:13])


def test_loss_on_8_devices_equals_single_device():
  assert jax.device_count() == 8
  cfg = get_config("tiny", dtype="float32")
  batch = _packed_batch(seed=4, rows=8)
  rng = jax.random.key(11)
  ocfg = objective.ObjectiveConfig()
  single = Transformer(cfg, rngs=nnx.Rngs(0))
  want, _ = _loss_jit(single, batch, rng, cfg=ocfg)
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  sharded = sharding.create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
  bs = sharding.batch_sharding(mesh)
  sbatch = {k: jax.device_put(v, bs) for k, v in batch.items()}
  got, metrics = _loss_jit(sharded, sbatch, rng, cfg=ocfg)
  assert len(sbatch["tokens"].sharding.device_set) == 8
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
  assert float(metrics["answer_tokens"]) == batch["loss_mask"].sum()
