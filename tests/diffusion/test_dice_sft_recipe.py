"""`recipe=dice` for SFT (docs/dice_recipe.md items 10-12) against brute-force constructions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dice_jax import recipe as recipe_lib
from dice_jax.data.sft_pipeline import tokenize_sample
from dice_jax.diffusion import blocks, noising, objective
from dice_jax.model import masks as masks_lib
from dice_jax.model.config import get_config
from dice_jax.model.transformer import Transformer
from dice_jax.train.config import SFTConfig, recipe_then_overrides

B_SIZE, MASK, PAD = 4, 255, 1


def _rows(seed=0):
  """4 packed rows, samples (prompt, response) lengths with prompts not multiples of 4, each
  padded as SDAR pads it on the absolute grid (the whole sample to whole blocks)."""
  rs = np.random.RandomState(seed)
  layout = [[(5, 6), (7, 5)], [(3, 2), (6, 10)], [(2, 13)], [(9, 3), (1, 1), (2, 2)]]
  grid = blocks.BlockGrid(B_SIZE, "absolute")
  length = 28
  out = {k: np.zeros((4, length), np.int32) for k in ("tokens", "positions", "segment_ids")}
  out["tokens"][:] = PAD
  out["loss_mask"] = np.zeros((4, length), bool)
  for r, samples in enumerate(layout):
    at = 0
    for s, (p, n) in enumerate(samples, 1):
      one = tokenize_sample(rs.randint(2, 200, p), rs.randint(2, 200, n), grid, PAD)
      m = one["tokens"].size
      assert m % B_SIZE == 0
      out["tokens"][r, at : at + m] = one["tokens"]
      out["loss_mask"][r, at : at + m] = one["loss_mask"]
      out["positions"][r, at : at + m] = np.arange(m)
      out["segment_ids"][r, at : at + m] = s
      at += m
  return out


def _brute_force(model, batch, masked, p, device_rows):
  """DICE/SDAR by hand: blocks = index in the sample // 4; each masked block's logits from a plain
  block-causal forward over the sample with x_t in that block and x_0 elsewhere (later blocks are
  not visible under block-causal attention); sum of CE/p over each device micro-batch (device_rows
  rows) / its answer tokens; the mean over devices."""
  width = batch["tokens"].shape[1]

  @jax.jit
  def logp_fn(inp, pos, blk, seg):
    spec = masks_lib.AttentionSpec.block_causal(B_SIZE, segment_ids=seg, block_ids=blk)
    return jax.nn.log_softmax(model(inp, pos, spec), axis=-1)[0]

  per_device = []
  for d in range(0, batch["tokens"].shape[0], device_rows):
    total, answer = 0.0, 0
    for r in range(d, d + device_rows):
      seg_r = batch["segment_ids"][r]
      answer += int(batch["loss_mask"][r].sum())
      for s in sorted(set(seg_r[seg_r > 0].tolist())):
        cols = np.nonzero(seg_r == s)[0]
        x0, pos = batch["tokens"][r, cols], batch["positions"][r, cols]
        blk = np.arange(cols.size) // B_SIZE  # SDAR: index within the sample // block
        m, pp = masked[r, cols], p[r, cols]
        xt = np.where(m, MASK, x0)
        pad = lambda x: np.pad(x, (0, width - cols.size))[None]  # noqa: E731
        seg = pad(np.ones(cols.size, np.int32))
        for k in sorted(set(blk[m].tolist())):
          inp = np.where(blk == k, xt, x0)
          logp = np.asarray(logp_fn(pad(inp), pad(pos), pad(blk), seg))[: cols.size]
          sel = (blk == k) & m
          total += float(np.sum(-logp[sel, x0[sel]] / pp[sel]))
    per_device.append(total / answer)
  return float(np.mean(per_device))


def test_dice_sft_loss_equals_brute_force_absolute_grid_row_rule_device_normalisation():
  model = Transformer(get_config("tiny", dtype="float32"), rngs=nnx.Rngs(0))
  cfg = recipe_lib.apply_recipe(SFTConfig(batch_size=4), "dice").objective
  assert (cfg.grid.alignment, cfg.at_least_one, cfg.normalization) == ("absolute", "row", "device")
  cfg = objective.ObjectiveConfig(
    grid=cfg.grid, at_least_one="row", normalization="device", device_rows=2
  )
  batch = _rows()
  loss_fn = nnx.jit(objective.block_diffusion_loss, static_argnums=3)
  for seed in (3,):
    rng = jax.random.key(seed)
    loss_sum, m = loss_fn(model, batch, rng, cfg)
    blk = cfg.grid.token_block_ids(
      jnp.asarray(batch["positions"]), jnp.asarray(batch["segment_ids"]), batch["loss_mask"]
    )
    masked, p = jax.jit(noising.sample_mask_per_row)(
      rng, jnp.asarray(batch["segment_ids"]), blk, jnp.asarray(batch["loss_mask"])
    )
    masked, p = np.asarray(masked), np.asarray(p)
    assert float(m["denominator"]) == 2  # two device micro-batches
    want = _brute_force(model, batch, masked, p, device_rows=2)
    np.testing.assert_allclose(float(loss_sum / m["denominator"]), want, rtol=2e-5)
    # ours (response grid, one division by the batch's answer tokens) is another number
    ours, mo = loss_fn(model, batch, rng, objective.ObjectiveConfig())
    assert abs(float(ours / mo["denominator"]) - want) > 1e-4


def _rate_seg1_masked(tries, at_least_one, n=2000):
  """Two samples of one loss token each in one row: P(sample 1's token is masked)."""
  seg = jnp.asarray([[1, 1, 2, 2]])
  loss = jnp.asarray([[False, True, False, True]])
  blk = jnp.zeros_like(seg)
  keys = jax.random.split(jax.random.key(0), n)
  if at_least_one == "row":
    f = lambda k: noising.sample_mask_per_row(k, seg, blk, loss, tries=tries)[0]  # noqa: E731
  else:
    f = lambda k: noising.sample_mask(k, seg, blk, loss)[0]  # noqa: E731
  masked = np.asarray(jax.jit(jax.vmap(f))(keys))[:, 0]
  assert (masked[:, [1, 3]].sum(1) >= 1).all() and not masked[:, [0, 2]].any()
  return masked[:, 1].mean(), (masked[:, [1, 3]].sum(1) == 1).mean()


def test_at_least_one_masked_per_row_redraws_then_forces_one():
  # p ~ U: a try misses both tokens with probability 1/4. One try then a forced token (chosen
  # uniformly): P(token 1) = 1/2 + 1/4 * 1/2 = 0.625. Ten tries: P = (1/2) / (3/4) = 2/3.
  one, _ = _rate_seg1_masked(1, "row")
  ten, _ = _rate_seg1_masked(10, "row")
  assert abs(one - 0.625) < 0.04 and abs(ten - 2 / 3) < 0.04, (one, ten)  # std 0.011
  # ours: each sample forces its own token, so both are always masked
  seg_rule, only_one = _rate_seg1_masked(10, "segment")
  assert seg_rule == 1.0 and only_one == 0.0


def test_sft_recipe_fields_and_errors():
  dice = recipe_then_overrides(SFTConfig(batch_size=4), ["recipe=dice", "objective.device_rows=2"])
  assert dice.recipe == "dice" and dice.objective.device_rows == 2
  assert dice.objective.grid.alignment == "absolute"
  ours = recipe_lib.apply_recipe(dice, "ours")
  assert (ours.objective.grid.alignment, ours.objective.normalization) == ("response", "batch")
  with pytest.raises(ValueError, match="device_rows"):
    SFTConfig(batch_size=4, objective=objective.ObjectiveConfig(device_rows=3))
  with pytest.raises(ValueError, match="at_least_one"):
    objective.ObjectiveConfig(at_least_one="sample")
