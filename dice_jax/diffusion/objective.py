"""SDAR's block-diffusion SFT objective (JetAstra/SDAR `modeling_sdar.py::SDARForCausalLM.forward`, training; BD3-LM §4).

For each packed sample: t ~ U(0,1), p = (1-eps) t + eps, each response token masked with
probability p (at least one). The model reads `[x_t ; x_0]` (length 2T, shared positions, segment
and block ids) under the block-diffusion mask, and predicts the token at the same position (no
shift). With N_ans = number of answer (loss) tokens of the batch:

    L = (1 / N_ans) * sum_{samples s} sum_{j masked} (1 / p_s) * CE(logits_j, x0_j)        (SDAR)

`block_diffusion_loss` returns the sum and N_ans as its denominator (`train_step`'s contract), so
that gradient accumulation divides once by the N_ans of the whole batch.

Blocks follow `ObjectiveConfig.grid` (`dice_jax.diffusion.blocks.BlockGrid`; response alignment by
default, the response start of a packed segment being its first loss token); its size must be the
model's block size. Packing-aware: segment ids, positions and the block grid
restart per segment; row padding (segment 0) is never attended, masked or counted.

Batch contract (numpy or jax arrays, `[B, T]`): `tokens` int32 (x_0), `positions` int32,
`segment_ids` int32 (0 = padding), `loss_mask` bool (response tokens incl. block-fill pads).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dice_jax.diffusion import blocks as blocks_lib
from dice_jax.diffusion import noising
from dice_jax.model import masks as masks_lib

AT_LEAST_ONE = ("segment", "row")
NORMALIZATIONS = ("batch", "device")


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
  eps: float = 1e-3  # p = (1-eps) t + eps
  per_block_t: bool = False  # BD3-LM: one t per (sample, block) instead of per sample
  grid: blocks_lib.BlockGrid = (
    blocks_lib.BlockGrid()
  )  # block size + alignment (diffusion/blocks.py)
  ce_chunk: int = 2048  # tokens per chunk of the LM-head + CE (bounds the [T, V] logits memory)
  # "segment": every packed sample has a masked token (the min-u one is forced); "row": SDAR's
  # rule in DICE's SFT, per row: redraw the row up to `mask_tries` times, then force one token
  at_least_one: str = "segment"
  mask_tries: int = 10
  # "batch": sum / the batch's answer tokens; "device": DICE's per-device loss, each group of
  # `device_rows` consecutive rows divided by its own answer tokens, then the mean over groups
  normalization: str = "batch"
  device_rows: int = 1

  def __post_init__(self):
    if isinstance(self.grid, dict):  # from JSON
      object.__setattr__(self, "grid", blocks_lib.BlockGrid(**self.grid))
    if not isinstance(self.grid, blocks_lib.BlockGrid):
      raise ValueError(f"ObjectiveConfig.grid must be a BlockGrid, got {self.grid!r}")
    if not 0.0 < self.eps < 1.0:
      raise ValueError(f"ObjectiveConfig.eps must be in (0, 1), got {self.eps}")
    if self.at_least_one not in AT_LEAST_ONE:
      raise ValueError(
        f"ObjectiveConfig.at_least_one must be one of {AT_LEAST_ONE}, got {self.at_least_one!r}"
      )
    if self.normalization not in NORMALIZATIONS:
      raise ValueError(
        f"ObjectiveConfig.normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}"
      )
    if self.at_least_one == "row" and self.per_block_t:
      raise ValueError("ObjectiveConfig: at_least_one='row' (SDAR's rule) draws t per sample")
    for name in ("mask_tries", "device_rows"):
      if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
        raise ValueError(f"ObjectiveConfig.{name} must be a positive int")
    if self.ce_chunk < 1:
      raise ValueError(f"ObjectiveConfig.ce_chunk must be >= 1, got {self.ce_chunk}")


def weighted_cross_entropy(logits_btv, targets_bt, weights_bt):
  """sum_{b,t} w_bt * (logsumexp(logits_bt) - logits_bt[target]) in float32.

  Positions with weight 0 contribute neither value nor gradient. `weights_bt` may be `[B, T, W]`
  (W weightings of the same CE), giving a `[W]` result.
  """
  logits = logits_btv.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets_bt[..., None].astype(jnp.int32), axis=-1)[..., 0]
  ce = lse - picked
  w = weights_bt.astype(jnp.float32)
  if w.ndim == ce.ndim:
    return jnp.sum(jnp.where(w != 0, w * ce, 0.0))
  contrib = jnp.where(w != 0, w * ce[..., None], 0.0)
  return jnp.sum(contrib, axis=tuple(range(ce.ndim)))


def xt_hidden(model, x0_bt, xt_bt, positions_bt, segment_ids_bt, block_ids_bt):
  """Final hidden states of the x_t half of the `[x_t ; x_0]` input (`[B, T, D]`)."""
  t = x0_bt.shape[1]
  spec = masks_lib.AttentionSpec.block_diffusion(model.cfg.block_size, segment_ids_bt, block_ids_bt)
  tokens = jnp.concatenate([xt_bt, x0_bt], axis=1)
  positions = jnp.concatenate([positions_bt, positions_bt], axis=1)
  hidden = model(tokens, positions, spec, return_hidden=True)
  return hidden[:, :t]


def chunked_weighted_ce(model, hidden_btd, targets_bt, weights_bt, chunk: int):
  """`weighted_cross_entropy(model.logits_from_hidden(h), ...)` without materialising all logits.

  `weights_bt` may carry a trailing axis of several weightings (`[B, T, W]`); the result is then
  `[W]` sums from one pass over the logits.

  The sequence is cut into chunks of `chunk` tokens; each chunk's logits are recomputed in the
  backward pass (jax.checkpoint), so peak memory is one chunk's `[B, chunk, V]`.
  """
  b, t, d = hidden_btd.shape
  if t <= chunk:
    return weighted_cross_entropy(model.logits_from_hidden(hidden_btd), targets_bt, weights_bt)
  n = -(-t // chunk)
  pad = n * chunk - t

  def split(x):  # [B, T, ...] -> [n, B, chunk, ...]
    x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
    return x.reshape(b, n, chunk, *x.shape[2:]).swapaxes(0, 1)

  h, y, w = split(hidden_btd), split(targets_bt), split(weights_bt)

  @jax.checkpoint
  def one(h_c, y_c, w_c):
    return weighted_cross_entropy(model.logits_from_hidden(h_c), y_c, w_c)

  def body(total, xs):
    return total + one(*xs), None

  total, _ = jax.lax.scan(body, jnp.zeros(weights_bt.shape[2:], jnp.float32), (h, y, w))
  return total


METRIC_MEANS = {"masked_ce": ("masked_ce_sum", "masked_tokens")}  # for train_step.make_train_step


def block_diffusion_loss(model, batch, rng, cfg: ObjectiveConfig = ObjectiveConfig()):
  """SDAR SFT loss of one (micro-)batch as `(loss_sum, metrics)` (train_step's loss contract).

  loss_sum = weighted_ce_sum; the loss is loss_sum / metrics["denominator"] with denominator =
  answer_tokens. metrics carries the sums (`weighted_ce_sum`, `answer_tokens`, `masked_tokens`,
  `masked_ce_sum`) so that gradient accumulation forms token-weighted means as sum / sum.
  """
  tokens = jnp.asarray(batch["tokens"]).astype(jnp.int32)
  positions = jnp.asarray(batch["positions"]).astype(jnp.int32)
  segment_ids = jnp.asarray(batch["segment_ids"]).astype(jnp.int32)
  loss_mask = jnp.asarray(batch["loss_mask"]).astype(bool) & (segment_ids > 0)
  mcfg = model.cfg
  cfg.grid.check_model(mcfg, "ObjectiveConfig.grid")
  block_ids = cfg.grid.token_block_ids(positions, segment_ids, loss_mask)
  if cfg.at_least_one == "row":
    masked, p = noising.sample_mask_per_row(
      rng, segment_ids, block_ids, loss_mask, eps=cfg.eps, tries=cfg.mask_tries
    )
  else:
    masked, p = noising.sample_mask(
      rng, segment_ids, block_ids, loss_mask, eps=cfg.eps, per_block_t=cfg.per_block_t
    )
  xt = noising.apply_mask(tokens, masked, mcfg.mask_token_id)
  hidden = xt_hidden(model, tokens, xt, positions, segment_ids, block_ids)
  # Two weightings from one pass over the logits: 1/p (the loss) and 1 (plain masked CE, a metric).
  inv_p = jnp.where(masked, 1.0 / p, 0.0)
  answer_tokens = jnp.sum(loss_mask).astype(jnp.float32)
  denominator = answer_tokens
  if cfg.normalization == "device":  # each device micro-batch over its own answer tokens
    rows = tokens.shape[0]
    if rows % cfg.device_rows:
      raise ValueError(
        f"ObjectiveConfig.device_rows ({cfg.device_rows}) must divide the micro-batch's {rows} rows"
      )
    per_group = jnp.sum(loss_mask.reshape(-1, cfg.device_rows, loss_mask.shape[1]), axis=(1, 2))
    n_row = jnp.repeat(per_group.astype(jnp.float32), cfg.device_rows)[:, None]
    inv_p = inv_p / jnp.maximum(n_row, 1.0)
    denominator = jnp.asarray(rows // cfg.device_rows, jnp.float32)
  weights = jnp.stack([inv_p, masked.astype(jnp.float32)], axis=-1)
  sums = chunked_weighted_ce(model, hidden, tokens, weights, cfg.ce_chunk)
  weighted_ce_sum, masked_ce_sum = sums[0], sums[1]
  metrics = dict(
    denominator=denominator,
    weighted_ce_sum=jax.lax.stop_gradient(weighted_ce_sum),
    answer_tokens=answer_tokens,
    masked_tokens=jnp.sum(masked).astype(jnp.float32),
    masked_ce_sum=jax.lax.stop_gradient(masked_ce_sum),
  )
  return weighted_ce_sum, metrics
