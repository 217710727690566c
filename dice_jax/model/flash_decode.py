"""Attention of a few new tokens over a KV cache, without materialising scores (Pallas).

The dense `cached_attention` writes `[B, K, G, T, S]` float32 scores for the whole cache buffer and
reads them back several times; at decode shapes (T = 4..8 new tokens per row, S = thousands of
slots) that traffic is as large as reading the cache itself. Here one program per (row, K/V head,
query tile) streams the cache in `block_k` tiles with an online softmax, skips tiles that no query
may see (unfilled slots, left padding: segment id 0), and returns the cache part's output and
log-sum-exp. The new tokens' own keys (a few) are attended densely and merged by log-sum-exp, so
the result is the joint softmax over (cache slots, new tokens) of `transformer.cached_attention`.

Only block-causal / full / causal masks of the cache part are needed: visibility is
`seg_q == seg_k > 0 and rank_k <= rank_q`, with rank = block id (block_causal), position (causal)
or 0 (full). Triton on GPU, the Pallas interpreter elsewhere.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

try:
  from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
  plgpu = None

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
EMPTY_LSE = -1e30  # log-sum-exp of a row that sees no key


def _dot(a, b):
  return lax.dot_general(a, b, (((a.ndim - 1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32)


def _kernel(q_ref, k_ref, v_ref, qseg_ref, qrank_ref, kseg_ref, krank_ref, o_ref, lse_ref, *,
            scale, block_k):
  q = q_ref[...]  # [BQ, H]
  q_seg, q_rank = qseg_ref[...], qrank_ref[...]
  h = q.shape[-1]
  qk_scale = scale * math.log2(math.e)

  def body(j, carry):
    sl = pl.ds(j * block_k, block_k)
    k_seg, k_rank = kseg_ref[sl], krank_ref[sl]

    def compute(carry):
      o_prev, m_prev, l_prev = carry
      k = k_ref[sl, :]
      qk = _dot(q, k.T) * qk_scale
      vis = ((q_seg[:, None] == k_seg[None, :]) & (q_seg[:, None] > 0)
             & (k_rank[None, :] <= q_rank[:, None]))
      qk = jnp.where(vis, qk, MASK_VALUE)
      m_next = jnp.maximum(m_prev, jnp.max(qk, axis=-1))
      corr = jnp.exp2(m_prev - m_next)
      s = jnp.where(vis, jnp.exp2(qk - m_next[:, None]), 0.0)
      l_next = corr * l_prev + s.sum(axis=-1)
      v = v_ref[sl, :]
      o_next = corr[:, None] * o_prev + _dot(s.astype(v.dtype), v)
      return o_next, m_next, l_next

    live = ((jnp.max(k_seg) >= jnp.min(q_seg)) & (jnp.min(k_seg) <= jnp.max(q_seg))
            & (jnp.max(q_seg) > 0) & (jnp.min(k_rank) <= jnp.max(q_rank)))
    return lax.cond(live, compute, lambda c: c, carry)

  o = jnp.zeros((q.shape[0], h), jnp.float32)
  m = jnp.full((q.shape[0],), MASK_VALUE, jnp.float32)
  l = jnp.zeros((q.shape[0],), jnp.float32)
  o, m, l = lax.fori_loop(0, k_ref.shape[0] // block_k, body, (o, m, l))
  empty = l == 0.0
  o_ref[...] = jnp.where(empty[:, None], 0.0, o / jnp.where(empty, 1.0, l)[:, None])
  lse_ref[...] = jnp.where(empty, EMPTY_LSE, (m + jnp.log2(jnp.where(empty, 1.0, l))) * math.log(2))


def _pick_block_k(s: int) -> int:
  for bk in (128, 64, 32, 16):
    if s % bk == 0:
      return bk
  raise ValueError(f"flash_decode: cache length {s} must be a multiple of 16")


def cache_part(q_bknh, k_bskh, v_bskh, q_seg_bn, q_rank_bn, k_seg_bs, k_rank_bs, *,
               interpret=None):
  """Softmax attention of query rows over cache slots only.

  q `[B, K, R, H]` (R query rows per K/V head), k/v `[B, S, K, H]`, int32 vectors: query rows
  `[B, R]`, cache slots `[B, S]` (segment 0 = invisible). Returns (o `[B, K, R, H]` f32,
  lse `[B, K, R]` f32, natural log; EMPTY_LSE where no slot is visible).
  """
  b, kh, r, h = q_bknh.shape
  s = k_bskh.shape[1]
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  block_q = 16
  while block_q < min(r, 64):
    block_q *= 2
  pad = (-r) % block_q
  if pad:
    q_bknh = jnp.pad(q_bknh, ((0, 0), (0, 0), (0, pad), (0, 0)))
    q_seg_bn = jnp.pad(q_seg_bn, ((0, 0), (0, pad)))
    q_rank_bn = jnp.pad(q_rank_bn, ((0, 0), (0, pad)))
  rp = r + pad
  block_k = _pick_block_k(s)
  params = plgpu.CompilerParams(num_warps=4, num_stages=2) if plgpu is not None else None
  qrow = pl.BlockSpec((None, block_q), lambda i, j, t: (i, t))
  krow = pl.BlockSpec((None, s), lambda i, j, t: (i, 0))
  kv = pl.BlockSpec((None, s, None, h), lambda i, j, t: (i, 0, j, 0))
  o, lse = pl.pallas_call(
      functools.partial(_kernel, scale=h ** -0.5, block_k=block_k),
      grid=(b, kh, rp // block_q),
      in_specs=[pl.BlockSpec((None, None, block_q, h), lambda i, j, t: (i, j, t, 0)),
                kv, kv, qrow, qrow, krow, krow],
      out_specs=[pl.BlockSpec((None, None, block_q, h), lambda i, j, t: (i, j, t, 0)),
                 pl.BlockSpec((None, None, block_q), lambda i, j, t: (i, j, t))],
      out_shape=[jax.ShapeDtypeStruct((b, kh, rp, h), jnp.float32),
                 jax.ShapeDtypeStruct((b, kh, rp), jnp.float32)],
      compiler_params=params, interpret=interpret, name="flash_decode_cache",
  )(q_bknh, k_bskh, v_bskh, q_seg_bn.astype(jnp.int32), q_rank_bn.astype(jnp.int32),
    k_seg_bs.astype(jnp.int32), k_rank_bs.astype(jnp.int32))
  return o[:, :, :r], lse[:, :, :r]


def cached_attention(q, k, v, cache_k, cache_v, spec, positions, seg, blk, cache, *,
                     interpret=None):
  """Drop-in for `transformer.cached_attention`: q `[B,T,N,H]`, k/v `[B,T,K,H]` (new tokens),
  cache_k/v `[B,S,K,H]` (this layer's cache) -> `[B,T,N,H]`."""
  from dice_jax.model import masks as masks_lib  # local: avoids an import cycle

  if spec.kind == "block_diffusion":
    raise ValueError("block_diffusion attention is a training layout; it takes no KV cache")
  b, t, n, h = q.shape
  kh = k.shape[2]
  g = n // kh
  filled = jnp.arange(cache.max_len)[None, :] < cache.length
  k_seg = jnp.where(filled, cache.segment_ids, 0)
  if spec.kind == "causal":
    q_rank, k_rank = positions, cache.positions
    m_self = masks_lib.causal_mask(positions, positions, seg, seg)
  elif spec.kind == "block_causal":
    q_rank, k_rank = blk, cache.block_ids
    m_self = masks_lib.block_causal_mask(blk, blk, seg, seg)
  else:
    q_rank, k_rank = jnp.zeros_like(blk), jnp.zeros_like(cache.block_ids)
    m_self = masks_lib.full_mask(seg, seg)
  # Query rows per K/V head, ordered (t, g).
  qg = q.reshape(b, t, kh, g, h)
  q_rows = qg.transpose(0, 2, 1, 3, 4).reshape(b, kh, t * g, h)
  rep = lambda x: jnp.repeat(x, g, axis=1)
  o_c, lse_c = cache_part(q_rows, cache_k.astype(q.dtype), cache_v.astype(q.dtype), rep(seg),
                          rep(q_rank), k_seg, k_rank, interpret=interpret)
  o_c = o_c.reshape(b, kh, t, g, h)
  lse_c = lse_c.reshape(b, kh, t, g)
  # The new tokens' own keys, dense.
  s_self = jnp.einsum("btkgh,bskh->bktgs", qg, k, preferred_element_type=jnp.float32) * h ** -0.5
  s_self = jnp.where(m_self[:, None, :, None, :], s_self, MASK_VALUE)
  lse_s = jax.nn.logsumexp(s_self, axis=-1)
  lse_s = jnp.where(jnp.any(m_self, -1)[:, None, :, None], lse_s, EMPTY_LSE)
  p_self = jnp.exp(s_self - lse_s[..., None])
  o_s = jnp.einsum("bktgs,bskh->bktgh", p_self.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  m = jnp.maximum(lse_c, lse_s)
  w_c, w_s = jnp.exp(lse_c - m), jnp.exp(lse_s - m)
  o = (w_c[..., None] * o_c + w_s[..., None] * o_s) / (w_c + w_s)[..., None]
  return o.transpose(0, 2, 1, 3, 4).reshape(b, t, n, h).astype(q.dtype)
