"""Attention of a few new tokens over a KV cache, without materialising scores (Pallas).

The dense `cached_attention` writes `[B, K, G, T, S]` float32 scores for the whole cache buffer and
reads them back several times; at decode shapes (T = 4..8 new tokens per row, S = thousands of
slots) that traffic is as large as reading the cache itself. Here one program per (row, K/V head,
query tile, cache split) streams its split of the cache in `block_k` tiles with an online softmax,
and returns the split's output and log-sum-exp; the splits are merged by log-sum-exp
(flash-decoding). A program visits only the tiles below its row's fill (`KVCache.length`), and
none when the row has no live query (a finished or empty slot). The new tokens' own keys (a few)
are attended densely and merged the same way, so the result is the joint softmax over (cache
slots, new tokens) of `transformer.cached_attention`.

Only block-causal / full / causal masks of the cache part are needed: visibility is
`seg_q == seg_k > 0 and rank_k <= rank_q`, with rank = block id (block_causal), position (causal)
or 0 (full). The cache is in the queries' dtype or float8_e4m3fn (`SamplerConfig.kv_cache_dtype`: each
tile is widened as it is read, so the kernel reads half the bytes). Triton on GPU, the Pallas
interpreter elsewhere. Tile sizes are a `DecodeTiles`
value carried by the cache (`KVCache.tiles`), so a benchmark can sweep them without globals.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from dice_jax import sharding as sharding_lib

try:
  from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
  plgpu = None


@dataclasses.dataclass(frozen=True)
class DecodeTiles:
  """Tiling of the cache-attention kernel: cache slots per program (`split`), slots per inner
  tile (`block_k`), and the Triton launch parameters. `split` is a multiple of `block_k`."""

  # H200 tile sweep (docs/log.md, "Sampler: H200, issue 13 measurements"; sdar_4b, 128 rows, fill 1536): split 1024 / block_k 64
  # reads the cache at 3.76 TB/s, 8% faster than 512 / 128.
  split: int = 1024
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 2
  dynamic_loop: bool = True  # loop over the live tiles only; False: over all, skipping dead ones

  def __post_init__(self):
    for name in ("split", "block_k", "num_warps", "num_stages"):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"DecodeTiles.{name} must be a positive int, got {v!r}")
    if self.block_k < 16 or self.block_k & (self.block_k - 1) or self.split % self.block_k:
      raise ValueError(
        f"DecodeTiles: block_k ({self.block_k}) must be a power of two >= 16 dividing split "
        f"({self.split})"
      )


MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
EMPTY_LSE = -1e30  # log-sum-exp of a row that sees no key


def _dot(a, b):
  return lax.dot_general(
    a, b, (((a.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32
  )


def _kernel(
  layer_ref,
  ntiles_ref,
  q_ref,
  k_ref,
  v_ref,
  qseg_ref,
  qrank_ref,
  kseg_ref,
  krank_ref,
  o_ref,
  lse_ref,
  *,
  scale,
  split,
  block_k,
  dynamic_loop,
):
  """One (row, K/V head, query tile, cache split): online softmax over the split's live tiles
  (`ntiles_ref`: how many of its `block_k` tiles lie below the row's fill; 0 = none)."""
  layer = layer_ref[0]
  q = q_ref[...]  # [BQ, H]
  q_seg, q_rank = qseg_ref[...], qrank_ref[...]
  rows, h = q.shape
  qk_scale = scale * math.log2(math.e)
  base = pl.program_id(3) * split

  def tile(j, carry):
    o_prev, m_prev, l_prev = carry
    sl = pl.ds(pl.multiple_of(base + j * block_k, block_k), block_k)
    k_seg, k_rank = kseg_ref[sl], krank_ref[sl]
    k = k_ref[layer, sl, :].astype(q.dtype)  # a float8 cache is widened tile by tile
    qk = _dot(q, k.T) * qk_scale
    vis = (
      (q_seg[:, None] == k_seg[None, :])
      & (q_seg[:, None] > 0)
      & (k_rank[None, :] <= q_rank[:, None])
    )
    qk = jnp.where(vis, qk, MASK_VALUE)
    m_next = jnp.maximum(m_prev, jnp.max(qk, axis=-1))
    corr = jnp.exp2(m_prev - m_next)
    p = jnp.where(vis, jnp.exp2(qk - m_next[:, None]), 0.0)
    l_next = corr * l_prev + p.sum(axis=-1)
    v = v_ref[layer, sl, :].astype(q.dtype)
    o_next = corr[:, None] * o_prev + _dot(p.astype(v.dtype), v)
    return o_next, m_next, l_next

  init = (
    jnp.zeros((rows, h), jnp.float32),
    jnp.full((rows,), MASK_VALUE, jnp.float32),
    jnp.zeros((rows,), jnp.float32),
  )
  n_live = ntiles_ref[0]
  if dynamic_loop:  # a dynamic-bound scf.for on Triton
    o, m, l = lax.fori_loop(0, n_live, tile, init)
  else:
    skip = lambda j, carry: lax.cond(j < n_live, tile, lambda _, c: c, j, carry)
    o, m, l = lax.fori_loop(0, split // block_k, skip, init)
  empty = l == 0.0
  o_ref[...] = jnp.where(empty[:, None], 0.0, o / jnp.where(empty, 1.0, l)[:, None])
  lse_ref[...] = jnp.where(empty, EMPTY_LSE, (m + jnp.log2(jnp.where(empty, 1.0, l))) * math.log(2))


def _pallas_cache_part(
  layer,
  ntiles,
  q_bkrh,
  k_lbskh,
  v_lbskh,
  q_seg,
  q_rank,
  k_seg,
  k_rank,
  *,
  tiles,
  block_q,
  interpret,
):
  """The kernel launch on (local) arrays; returns per-split (o, lse)."""
  b, kh, rp, h = q_bkrh.shape
  n_layers, s = k_lbskh.shape[0], k_lbskh.shape[2]
  n_split = ntiles.shape[1]
  params = (
    plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if plgpu is not None
    else None
  )
  qrow = pl.BlockSpec((None, block_q), lambda i, j, t, c: (i, t))
  krow = pl.BlockSpec((None, s), lambda i, j, t, c: (i, 0))
  kv = pl.BlockSpec((n_layers, None, s, None, h), lambda i, j, t, c: (0, i, 0, j, 0))
  out_o = pl.BlockSpec((None, None, None, block_q, h), lambda i, j, t, c: (i, j, c, t, 0))
  out_l = pl.BlockSpec((None, None, None, block_q), lambda i, j, t, c: (i, j, c, t))
  return pl.pallas_call(
    functools.partial(
      _kernel,
      scale=h**-0.5,
      split=tiles.split,
      block_k=tiles.block_k,
      dynamic_loop=tiles.dynamic_loop,
    ),
    grid=(b, kh, rp // block_q, n_split),
    in_specs=[
      pl.BlockSpec((1,), lambda i, j, t, c: (0,)),
      pl.BlockSpec((None, 1), lambda i, j, t, c: (i, c)),
      pl.BlockSpec((None, None, block_q, h), lambda i, j, t, c: (i, j, t, 0)),
      kv,
      kv,
      qrow,
      qrow,
      krow,
      krow,
    ],
    out_specs=[out_o, out_l],
    out_shape=[
      jax.ShapeDtypeStruct((b, kh, n_split, rp, h), jnp.float32),
      jax.ShapeDtypeStruct((b, kh, n_split, rp), jnp.float32),
    ],
    compiler_params=params,
    interpret=interpret,
    name="flash_decode_cache",
  )(layer, ntiles, q_bkrh, k_lbskh, v_lbskh, q_seg, q_rank, k_seg, k_rank)


def _shard_mapped(fn, rows: int, kv_heads: int):
  """Under a mesh context (`jax.set_mesh`), launch the kernel per shard: rows over data/fsdp and
  K/V heads over `tensor` where they divide (a Pallas call has no partitioning rule; without this
  XLA would gather the whole cache onto every device). Mirrors `flash_bd._shard_mapped`."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or mesh.size == 1:
    return fn
  P = jax.sharding.PartitionSpec
  row, head = sharding_lib.kernel_axes(mesh, rows, (kv_heads,))
  vec = P(row, None)
  in_specs = (
    P(None),
    vec,
    P(row, head, None, None),
    P(None, row, None, head, None),
    P(None, row, None, head, None),
    vec,
    vec,
    vec,
    vec,
  )
  out_specs = (P(row, head, None, None, None), P(row, head, None, None))
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def live_tiles(fill_b, row_live_b, max_len: int, tiles: DecodeTiles):
  """`[B, n_split]` int32: per row and cache split, the `block_k` tiles below the row's fill
  (`fill_b` slots), 0 for rows with no live query."""
  n_split = -(-max_len // tiles.split)
  lo = jnp.arange(n_split, dtype=jnp.int32) * tiles.split
  fill = jnp.clip(jnp.minimum(fill_b, max_len)[:, None] - lo[None, :], 0, tiles.split)
  n = -(-fill // tiles.block_k)
  return jnp.where(row_live_b[:, None], n, 0).astype(jnp.int32)


def cache_part(
  q_bkrh,
  k_lbskh,
  v_lbskh,
  layer,
  q_seg_br,
  q_rank_br,
  k_seg_bs,
  k_rank_bs,
  fill_b,
  *,
  tiles: DecodeTiles = DecodeTiles(),
  interpret=None,
):
  """Softmax attention of query rows over the cache slots of one layer.

  q `[B, K, R, H]` (R query rows per K/V head); k/v the stacked cache `[L, B, S, K, H]` and the
  layer index `layer` (scalar): the kernel reads that layer in place, so no per-layer copy of the
  cache is made. int32 vectors: query rows `[B, R]`, slots `[B, S]` (segment 0 = invisible);
  `fill_b [B]`: slots at or above it are never read. S must be a multiple of `tiles.block_k`.
  Returns (o `[B, K, R, H]` f32, lse `[B, K, R]` f32, natural log; EMPTY_LSE where no slot is
  visible).
  """
  b, kh, r, _ = q_bkrh.shape
  s = k_lbskh.shape[2]
  if s % tiles.block_k:
    raise ValueError(
      f"flash_decode: cache length {s} must be a multiple of block_k {tiles.block_k}"
    )
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  block_q = 16
  while block_q < min(r, 64):
    block_q *= 2
  pad = (-r) % block_q
  if pad:
    q_bkrh = jnp.pad(q_bkrh, ((0, 0), (0, 0), (0, pad), (0, 0)))
    q_seg_br = jnp.pad(q_seg_br, ((0, 0), (0, pad)))
    q_rank_br = jnp.pad(q_rank_br, ((0, 0), (0, pad)))
  ntiles = live_tiles(fill_b, jnp.any(q_seg_br > 0, axis=-1), s, tiles)
  layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
  args = (
    layer,
    ntiles,
    q_bkrh,
    k_lbskh,
    v_lbskh,
    q_seg_br.astype(jnp.int32),
    q_rank_br.astype(jnp.int32),
    k_seg_bs.astype(jnp.int32),
    k_rank_bs.astype(jnp.int32),
  )
  call = functools.partial(_pallas_cache_part, tiles=tiles, block_q=block_q, interpret=interpret)
  o, lse = _shard_mapped(call, b, kh)(*args)
  o, lse = o[..., :r, :], lse[..., :r]
  # Merge the splits by log-sum-exp.
  m = jnp.max(lse, axis=2)
  w = jnp.exp(lse - m[:, :, None])
  total = jnp.sum(w, axis=2)
  o = jnp.sum(w[..., None] * o, axis=2) / total[..., None]
  return o, m + jnp.log(total)


def cached_attention(
  q, k, v, layer, spec, positions, seg, blk, cache, *, interpret=None, cache_part_fn=None
):
  """`transformer.cached_attention` for layer `layer` of `cache` (its stacked `[L,B,S,K,H]` K/V
  are read in place): q `[B,T,N,H]`, k/v `[B,T,K,H]` (new tokens) -> `[B,T,N,H]`.
  `cache_part_fn`: another kernel with `cache_part`'s contract (`flash_tpu.cache_part` on TPU)."""
  from dice_jax.model import masks as masks_lib  # local: avoids an import cycle

  if spec.kind == "block_diffusion":
    raise ValueError("block_diffusion attention is a training layout; it takes no KV cache")
  b, t, n, h = q.shape
  kh = k.shape[2]
  g = n // kh
  filled = jnp.arange(cache.max_len)[None, :] < cache.length[:, None]
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
  if cache.k.dtype not in (q.dtype, jnp.float8_e4m3fn):  # a cast would copy the whole cache
    raise ValueError(
      f"flash_decode: cache dtype {cache.k.dtype} is neither the queries' {q.dtype} nor float8_e4m3fn"
    )
  part = cache_part if cache_part_fn is None else cache_part_fn
  o_c, lse_c = part(
    q_rows,
    cache.k,
    cache.v,
    layer,
    rep(seg),
    rep(q_rank),
    k_seg,
    k_rank,
    cache.length,
    tiles=cache.tiles,
    interpret=interpret,
  )
  o_c = o_c.reshape(b, kh, t, g, h)
  lse_c = lse_c.reshape(b, kh, t, g)
  # The new tokens' own keys, dense.
  s_self = jnp.einsum("btkgh,bskh->bktgs", qg, k, preferred_element_type=jnp.float32) * h**-0.5
  s_self = jnp.where(m_self[:, None, :, None, :], s_self, MASK_VALUE)
  lse_s = jax.nn.logsumexp(s_self, axis=-1)
  lse_s = jnp.where(jnp.any(m_self, -1)[:, None, :, None], lse_s, EMPTY_LSE)
  p_self = jnp.exp(s_self - lse_s[..., None])
  o_s = jnp.einsum(
    "bktgs,bskh->bktgh", p_self.astype(v.dtype), v, preferred_element_type=jnp.float32
  )
  m = jnp.maximum(lse_c, lse_s)
  w_c, w_s = jnp.exp(lse_c - m), jnp.exp(lse_s - m)
  o = (w_c[..., None] * o_c + w_s[..., None] * o_s) / (w_c + w_s)[..., None]
  return o.transpose(0, 2, 1, 3, 4).reshape(b, t, n, h).astype(q.dtype)
