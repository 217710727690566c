"""Forward (absorbing-state) noising for block-diffusion SFT (SDAR, JetAstra/SDAR `modeling_sdar.py` training branch; BD3-LM §4).

SDAR: one noise level per packed sample, t ~ U(0,1), p = (1-eps) t + eps; each non-prompt token is
replaced by [MASK] with probability p; at least one token per sample is masked. BD3-LM instead
draws t per block (`per_block_t=True`; its antithetic sampling is not reproduced here).

Random draws are keyed by (row, column) for tokens and by (row, segment[, block]) for noise levels
via `fold_in`, so a token's draw does not depend on the row length: appending padding, or sharding
the batch, leaves every mask unchanged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_BLOCK_OFFSET = 1 << 20  # keeps (possibly negative) block ids non-negative for fold_in


def _uniform_keyed(key, *ids_bt):
  """U(0,1) per element of `[B, T]` id arrays: a function of (key, row index, the element's ids)."""
  rows = jnp.arange(ids_bt[0].shape[0])

  def one(kr, *ids):
    for i in ids:
      kr = jax.random.fold_in(kr, i)
    return jax.random.uniform(kr)

  def row(r, *ids_t):
    return jax.vmap(functools.partial(one, jax.random.fold_in(key, r)))(*ids_t)

  return jax.vmap(row)(rows, *ids_bt)


def noise_level(key, segment_ids_bt, block_ids_bt, *, eps: float, per_block_t: bool):
  """p = (1-eps) t + eps per token, with t shared by the token's sample (or sample-and-block)."""
  seg = segment_ids_bt.astype(jnp.int32)
  if per_block_t:
    t = _uniform_keyed(key, seg, block_ids_bt.astype(jnp.int32) + _BLOCK_OFFSET)
  else:
    t = _uniform_keyed(key, seg)
  return (1.0 - eps) * t + eps


def sample_mask(
  key, segment_ids_bt, block_ids_bt, loss_mask_bt, *, eps: float = 1e-3, per_block_t: bool = False
):
  """Which tokens are masked in x_t, and each token's masking probability p.

  Returns (masked_bt bool, p_bt f32). Only loss tokens are ever masked. Every segment with at least
  one loss token has at least one masked token: if the Bernoulli draws masked none, the loss token
  with the smallest uniform draw is masked (with one p per sample this is the token that would
  have been masked first as p grows).
  """
  k_level, k_token = jax.random.split(key)
  seg = segment_ids_bt.astype(jnp.int32)
  loss = loss_mask_bt.astype(bool) & (seg > 0)
  p = noise_level(k_level, seg, block_ids_bt, eps=eps, per_block_t=per_block_t)
  cols = jnp.broadcast_to(jnp.arange(seg.shape[1]), seg.shape)
  u = _uniform_keyed(k_token, cols)
  masked = loss & (u < p)

  n = seg.shape[1] + 1

  def force_one(seg_t, loss_t, masked_t, u_t):
    count = jax.ops.segment_sum(masked_t.astype(jnp.int32), seg_t, num_segments=n)
    u_loss = jnp.where(loss_t, u_t, 2.0)
    u_min = jax.ops.segment_min(u_loss, seg_t, num_segments=n)
    first = loss_t & (u_loss == u_min[seg_t])
    # Ties in u are measure-zero; if they occur, all tied tokens are masked (still >= 1).
    return masked_t | (first & (count[seg_t] == 0))

  masked = jax.vmap(force_one)(seg, loss, masked, u)
  return masked, p


def sample_mask_per_row(
  key, segment_ids_bt, block_ids_bt, loss_mask_bt, *, eps: float = 1e-3, tries: int = 10
):
  """SDAR's `forward_add_noise_packed` rule (DICE's SFT): "at least one masked" per *row*.

  Each try draws one t per packed sample and a Bernoulli(p) per token; a row keeps its first try
  that masks at least one loss token. A row whose `tries` all miss keeps its last try's p and has
  one loss token, chosen uniformly, forced. A sample of a row may end with no masked token.
  Returns (masked_bt, p_bt) as `sample_mask`.
  """
  seg = segment_ids_bt.astype(jnp.int32)
  loss = loss_mask_bt.astype(bool) & (seg > 0)
  cols = jnp.broadcast_to(jnp.arange(seg.shape[1]), seg.shape)

  def one_try(k):
    k_level, k_token = jax.random.split(jax.random.fold_in(key, k))
    p = noise_level(k_level, seg, block_ids_bt, eps=eps, per_block_t=False)
    return loss & (_uniform_keyed(k_token, cols) < p), p

  masked_k, p_k = jax.vmap(one_try)(jnp.arange(tries))  # [tries, B, T]
  hit_k = jnp.any(masked_k, axis=-1)  # [tries, B]
  found = jnp.any(hit_k, axis=0)  # [B]
  first = jnp.where(found, jnp.argmax(hit_k, axis=0), tries - 1)  # [B]
  pick = lambda x: jnp.take_along_axis(x, first[None, :, None], axis=0)[0]  # noqa: E731
  masked, p = pick(masked_k), pick(p_k)
  v = jnp.where(loss, _uniform_keyed(jax.random.fold_in(key, tries), cols), 2.0)
  forced = loss & (v == jnp.min(v, axis=-1, keepdims=True)) & ~found[:, None]
  return masked | forced, p


def apply_mask(tokens_bt, masked_bt, mask_token_id: int):
  """x_t: x_0 with the masked tokens replaced by [MASK]."""
  return jnp.where(masked_bt, jnp.asarray(mask_token_id, tokens_bt.dtype), tokens_bt)
