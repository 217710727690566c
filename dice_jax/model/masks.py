"""Attention masks as data, and the pure functions that turn them into boolean masks.

The model never receives a caller-built `[T, T]` matrix: it receives an `AttentionSpec` (the kind of
mask, the block size, segment ids and block ids) so that a fused attention kernel can consume the
same description. `dense_mask` is the reference construction used by the dense attention path.

Block convention (shared by SFT, sampling and RL; see `block_ids_from_response_start`):
blocks start at the response. Token i of a sequence whose response starts at position r belongs to
block floor((pos_i - r) / b); prompt tokens get negative block ids, so the prompt is split into
blocks counted backwards from the response start. When no block ids are given, block = pos // b
(SDAR's absolute alignment).

Masks (SDAR, JetAstra/SDAR `modeling_sdar.py` and `generate.py`; BD3-LM, kuleshov-group/bd3lms
`block_diff_mask`):
  causal          q sees k iff same segment and pos_k <= pos_q.
  block_causal    q sees k iff same segment and block_k <= block_q (inference / prefill).
  block_diffusion the 2L `[x_t ; x_0]` SFT layout: the input is [x_t (T) ; x_0 (T)] with shared
                  positions/segments/blocks. x_t->x_t: same block (M_BD); x_t->x_0: block_k <
                  block_q (M_OBC); x_0->x_0: block_k <= block_q (M_BC); x_0->x_t: never.
Segment id 0 marks padding, which attends to and is attended by nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

MASK_KINDS = ("causal", "block_causal", "block_diffusion", "full", "trace")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """What the attention may see. `kind` and `block_size` are static; arrays are `[B, T]`."""

  kind: str = dataclasses.field(metadata=dict(static=True))
  block_size: int = dataclasses.field(default=1, metadata=dict(static=True))
  segment_ids: Optional[jax.Array] = None  # 0 = padding; None = one segment, no padding
  block_ids: Optional[jax.Array] = None  # None = positions // block_size
  round_ids: Optional[jax.Array] = None  # trace only: 0 = prompt / clean response, r >= 1 = noisy

  def __post_init__(self):
    if self.kind not in MASK_KINDS:
      raise ValueError(f"AttentionSpec.kind must be one of {MASK_KINDS}, got {self.kind!r}")
    if not isinstance(self.block_size, int) or self.block_size < 1:
      raise ValueError(f"AttentionSpec.block_size must be a positive int, got {self.block_size!r}")
    if (self.kind == "trace") != (self.round_ids is not None):
      raise ValueError(
        f"AttentionSpec: round_ids are required for kind 'trace' and only for it "
        f"(kind {self.kind!r}, round_ids {'set' if self.round_ids is not None else 'None'})"
      )
    if self.kind == "trace" and self.block_ids is None:
      raise ValueError("AttentionSpec: kind 'trace' needs explicit (response-aligned) block_ids")

  @classmethod
  def causal(cls, segment_ids=None):
    return cls("causal", 1, segment_ids, None)

  @classmethod
  def block_causal(cls, block_size, segment_ids=None, block_ids=None):
    return cls("block_causal", block_size, segment_ids, block_ids)

  @classmethod
  def block_diffusion(cls, block_size, segment_ids=None, block_ids=None):
    """For a `[x_t ; x_0]` input of length 2T; arrays here describe one half (`[B, T]`)."""
    return cls("block_diffusion", block_size, segment_ids, block_ids)

  @classmethod
  def trace(cls, block_size, segment_ids, block_ids, round_ids):
    """TraceRL rows: arrays describe every token of the input (`[B, T]`, noisy copies included)."""
    return cls("trace", block_size, segment_ids, block_ids, round_ids)

  def resolve(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(segment_ids, block_ids) for tokens at `positions` (`[B, T]`, T = one half for diffusion)."""
    seg = jnp.ones_like(positions) if self.segment_ids is None else self.segment_ids
    blk = positions // self.block_size if self.block_ids is None else self.block_ids
    return seg.astype(jnp.int32), blk.astype(jnp.int32)


def block_ids_from_response_start(positions, response_start, block_size):
  """Block ids with blocks starting at the response: floor((pos - r) / b), negative in the prompt.

  `response_start` broadcasts against `positions` (one value per sequence, or per token for packed
  rows where each segment has its own start).
  """
  return jnp.floor_divide(positions - response_start, block_size)


def _pair(q, k):
  return q[:, :, None], k[:, None, :]


def causal_mask(q_pos, k_pos, q_seg, k_seg):
  qs, ks = _pair(q_seg, k_seg)
  qp, kp = _pair(q_pos, k_pos)
  return (qs == ks) & (qs > 0) & (kp <= qp)


def block_causal_mask(q_blk, k_blk, q_seg, k_seg):
  qs, ks = _pair(q_seg, k_seg)
  qb, kb = _pair(q_blk, k_blk)
  return (qs == ks) & (qs > 0) & (kb <= qb)


def full_mask(q_seg, k_seg):
  qs, ks = _pair(q_seg, k_seg)
  return (qs == ks) & (qs > 0)


def block_diffusion_mask(blk, seg):
  """`[B, 2T, 2T]` mask of the `[x_t ; x_0]` layout from one half's block and segment ids."""
  qs, ks = _pair(seg, seg)
  qb, kb = _pair(blk, blk)
  same = (qs == ks) & (qs > 0)
  xt_xt = same & (qb == kb)
  xt_x0 = same & (kb < qb)
  x0_x0 = same & (kb <= qb)
  x0_xt = jnp.zeros_like(same)
  top = jnp.concatenate([xt_xt, xt_x0], axis=2)
  bottom = jnp.concatenate([x0_xt, x0_x0], axis=2)
  return jnp.concatenate([top, bottom], axis=1)


def trace_mask(blk, seg, rnd):
  """`[B, T, T]` mask of the TraceRL layout (module docstring) from per-token ids `[B, T]`."""
  qs, ks = _pair(seg, seg)
  qb, kb = _pair(blk, blk)
  qr, kr = _pair(rnd, rnd)
  same = (qs == ks) & (qs > 0)
  clean_q, clean_k = qr == 0, kr == 0
  clean_clean = clean_q & clean_k & (kb <= qb)
  noisy_clean = ~clean_q & clean_k & (kb < qb)
  noisy_noisy = ~clean_q & ~clean_k & (qr == kr) & (qb == kb)
  return same & (clean_clean | noisy_clean | noisy_noisy)


def dense_mask(spec: AttentionSpec, positions: jax.Array) -> jax.Array:
  """The `[B, T, T]` boolean mask for a self-attention call described by `spec`.

  For `block_diffusion`, `positions` is the full `[B, 2T]` input; the two halves share positions.
  """
  if spec.kind == "block_diffusion":
    half = positions.shape[1] // 2
    seg, blk = spec.resolve(positions[:, :half])
    return block_diffusion_mask(blk, seg)
  seg, blk = spec.resolve(positions)
  if spec.kind == "causal":
    return causal_mask(positions, positions, seg, seg)
  if spec.kind == "block_causal":
    return block_causal_mask(blk, blk, seg, seg)
  if spec.kind == "trace":
    return trace_mask(blk, seg, spec.round_ids.astype(jnp.int32))
  return full_mask(seg, seg)


def token_segments_and_blocks(spec: AttentionSpec, positions: jax.Array):
  """Per-token (segment, block) ids of a self-attention input, doubled for the 2L layout."""
  if spec.kind == "block_diffusion":
    half = positions.shape[1] // 2
    seg, blk = spec.resolve(positions[:, :half])
    return jnp.concatenate([seg, seg], 1), jnp.concatenate([blk, blk], 1)
  return spec.resolve(positions)
