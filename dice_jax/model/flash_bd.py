"""Flash attention for the block-diffusion masks (Pallas; Triton on GPU, interpreter on CPU).

Adapted from `jax.experimental.pallas.ops.gpu.attention` (Apache-2.0): the causal/segment mask is
replaced by a mask computed per tile from three int32 vectors per row, and the work follows the
mask, not the (2T)^2 square: before the launch, `live_schedule` lists for every query tile the key
tiles whose mask may hold a true (`live_tiles`, from per-tile bounds of the vectors; for the
backward's dK/dV also the transpose), and each program loops over its list only (a dynamic-bound
loop). `live_only=False` is the earlier kernel: every program visits every tile and skips the
all-false ones with `lax.cond` (at TraceRL's 24,576-token rows ~89 % of the visits are skips, each
loading three index vectors).

Rank encoding (for the 2L `[x_t ; x_0]` input; `half` = 0 on x_t, 1 on x_0):
  rank = 2 * block + half            (queries and keys)
  klo  = 2 * block on x_t keys, BIG on x_0 keys
  q sees k  iff  seg_q == seg_k > 0  and  rank_k <= rank_q  and  klo_k >= rank_q
which is exactly M_BD (x_t->x_t same block), M_OBC (x_t->x_0 earlier blocks), M_BC (x_0->x_0
block-causal) and nothing for x_0->x_t. Block-causal attention (one half, no x_t) is the same
with half = 1 everywhere. Grouped-query attention: K/V heads are shared by `N // K` query heads.

The TraceRL layout (`trace` kind, masks.py) fits the same test (`trace_mask_vectors`). With R >= the
largest round id of the batch and u = R + 1:
  prompt / clean token in block b:  rank = u * b + R,        klo = BIG
  noisy token of round r in block b: rank = klo = u * b + (r - 1)     (0 <= r - 1 < R)
clean -> clean: u b_k + R <= u b_q + R iff b_k <= b_q. noisy -> clean: u b_k + R <= u b_q + r - 1
iff b_k < b_q (the gap u (b_q - b_k) must reach R - r + 1 in [1, R]). noisy -> noisy: rank_k <=
rank_q <= klo_k = rank_k forces equal ranks, i.e. the same block and round (r - 1 < u). clean ->
noisy: rank_q <= klo_k needs b_k > b_q, and then rank_k - rank_q >= u - R > 0: never.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from dice_jax import sharding as sharding_lib

try:  # the Triton backend's helpers (GPU); the interpreter needs only pl.
  from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
  plgpu = None

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
BIG = 2**30


def bd_mask_vectors(seg_bt, blk_bt):
  """(seg, rank, klo) `[B, 2T]` of the `[x_t ; x_0]` layout from one half's ids `[B, T]`."""
  seg = jnp.concatenate([seg_bt, seg_bt], 1).astype(jnp.int32)
  blk = blk_bt.astype(jnp.int32)
  rank = jnp.concatenate([2 * blk, 2 * blk + 1], 1)
  klo = jnp.concatenate([2 * blk, jnp.full_like(blk, BIG)], 1)
  return seg, rank, klo


def trace_mask_vectors(seg_bt, blk_bt, rnd_bt):
  """(seg, rank, klo) `[B, T]` of the TraceRL layout from per-token ids (module docstring)."""
  blk, rnd = blk_bt.astype(jnp.int32), rnd_bt.astype(jnp.int32)
  rounds = jnp.max(rnd, initial=0)
  u = rounds + 1
  noisy = rnd > 0
  rank = jnp.where(noisy, u * blk + rnd - 1, u * blk + rounds)
  klo = jnp.where(noisy, rank, BIG)
  return seg_bt.astype(jnp.int32), rank, klo


def mask_from_vectors(seg, rank, klo):
  """The dense `[B, S, S]` mask the vectors describe (reference / tests)."""
  same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
  return same & (rank[:, None, :] <= rank[:, :, None]) & (klo[:, None, :] >= rank[:, :, None])


def _tile_mask(q_seg, q_rank, k_seg, k_rank, k_lo):
  same = (q_seg[:, None] == k_seg[None, :]) & (q_seg[:, None] > 0)
  return same & (k_rank[None, :] <= q_rank[:, None]) & (k_lo[None, :] >= q_rank[:, None])


def _tile_live(q_seg, q_rank, k_seg, k_rank, k_lo):
  """False only when the (q tile, k tile) mask is certainly all-false."""
  return (
    (jnp.min(k_rank) <= jnp.max(q_rank))
    & (jnp.max(k_lo) >= jnp.min(q_rank))
    & (jnp.max(k_seg) >= jnp.min(q_seg))
    & (jnp.min(k_seg) <= jnp.max(q_seg))
    & (jnp.max(q_seg) > 0)
  )


def live_tiles(seg, rank, klo, block_q: int, block_k: int):
  """`[B, S / block_q, S / block_k]` bool: the (query tile, key tile) pairs `_tile_live` keeps
  (those whose mask may hold a true), from per-tile bounds of the `[B, S]` vectors."""
  b = seg.shape[0]

  def bounds(x, block):
    x = x.reshape(b, -1, block)
    return x.min(-1), x.max(-1)

  qs_lo, qs_hi = bounds(seg, block_q)
  qr_lo, qr_hi = bounds(rank, block_q)
  ks_lo, ks_hi = bounds(seg, block_k)
  kr_lo, _ = bounds(rank, block_k)
  _, kl_hi = bounds(klo, block_k)
  q = lambda x: x[:, :, None]  # noqa: E731
  k = lambda x: x[:, None, :]  # noqa: E731
  return (
    (k(kr_lo) <= q(qr_hi))
    & (k(kl_hi) >= q(qr_lo))
    & (k(ks_hi) >= q(qs_lo))
    & (k(ks_lo) <= q(qs_hi))
    & (q(qs_hi) > 0)
  )


def live_schedule(live):
  """(index, count) of a `[B, N, M]` live matrix: `index[b, n]` lists the live columns of row n
  in ascending order, then the dead ones; `count[b, n]` how many are live. int32."""
  index = jnp.argsort(~live, axis=-1, stable=True).astype(jnp.int32)
  return index, live.sum(-1).astype(jnp.int32)


def _dot(a, b):
  """a @ b with float32 accumulation (what the removed `pl.dot` did)."""
  return lax.dot_general(
    a, b, (((a.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32
  )


def _fwd_kernel(
  q_ref,
  k_ref,
  v_ref,
  seg_ref,
  rank_ref,
  klo_ref,
  kidx_ref,
  kcnt_ref,
  o_ref,
  lse_ref,
  *,
  scale,
  block_q,
  block_k,
  live_only,
):
  seq_len = k_ref.shape[0]
  start_q = pl.program_id(0)
  q_slice = pl.ds(start_q * block_q, block_q)
  q = q_ref[...]
  q_seg, q_rank = seg_ref[q_slice], rank_ref[q_slice]
  h = q.shape[-1]
  qk_scale = scale * math.log2(math.e)

  def compute(start_k, carry):
    k_slice = pl.ds(pl.multiple_of(start_k * block_k, block_k), block_k)
    k_seg, k_rank, k_lo = seg_ref[k_slice], rank_ref[k_slice], klo_ref[k_slice]
    o_prev, m_prev, l_prev = carry
    k = k_ref[k_slice, :]
    qk = _dot(q, k.T) * qk_scale
    qk = jnp.where(_tile_mask(q_seg, q_rank, k_seg, k_rank, k_lo), qk, MASK_VALUE)
    m_next = jnp.maximum(m_prev, jnp.max(qk, axis=-1))
    corr = jnp.exp2(m_prev - m_next)
    s = jnp.exp2(qk - m_next[:, None])
    l_next = corr * l_prev + s.sum(axis=-1)
    v = v_ref[k_slice, :]
    o_next = corr[:, None] * o_prev + _dot(s.astype(v.dtype), v)
    return o_next, m_next, l_next

  o = jnp.zeros((block_q, h), jnp.float32)
  m = jnp.full((block_q,), -jnp.inf, jnp.float32)
  l = jnp.zeros((block_q,), jnp.float32)
  o, m, l = _tile_loop(
    compute,
    (o, m, l),
    kidx_ref,
    kcnt_ref,
    pl.cdiv(seq_len, block_k),
    live_only,
    lambda start_k: _tile_live(
      q_seg, q_rank, *(r[pl.ds(start_k * block_k, block_k)] for r in (seg_ref, rank_ref, klo_ref))
    ),
  )
  empty = l == 0.0  # rows with no visible key (padding): output 0, finite lse
  l = jnp.where(empty, 1.0, l)
  m = jnp.where(empty, 0.0, m)
  o_ref[...] = (o / l[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log2(l)  # base-2 log-sum-exp of the scaled scores


def _tile_loop(compute, carry, idx_ref, cnt_ref, n_tiles, live_only, is_live):
  """`compute(tile, carry)` over the program's live tiles: the `cnt_ref[0]` first entries of
  `idx_ref` (`live_schedule`), or (live_only=False) every tile, skipping those `is_live` rejects."""
  if live_only:
    return lax.fori_loop(0, cnt_ref[0], lambda i, c: compute(idx_ref[i], c), carry)

  def visit(tile, c):
    return lax.cond(is_live(tile), lambda c: compute(tile, c), lambda c: c, c)

  return lax.fori_loop(0, n_tiles, visit, carry)


def _bwd_kernel(
  q_ref,
  k_ref,
  v_ref,
  seg_ref,
  rank_ref,
  klo_ref,
  do_ref,
  lse_ref,
  delta_ref,
  qidx_ref,
  qcnt_ref,
  kidx_ref,
  kcnt_ref,
  dq_ref,
  dk_ref,
  dv_ref,
  *,
  scale,
  block_q,
  block_k,
  live_only,
):
  """dK/dV for one k tile (loop over its live q tiles), then dQ for one q tile (loop over its
  live k tiles)."""
  q_len = q_ref.shape[0]
  qk_scale = scale * math.log2(math.e)
  h = q_ref.shape[-1]
  vectors = lambda tile, block: tuple(  # noqa: E731
    r[pl.ds(pl.multiple_of(tile * block, block), block)] for r in (seg_ref, rank_ref, klo_ref)
  )

  def p_and_ds(q, k, v, do, lse, di, mask):
    qk = jnp.where(mask, _dot(q, k.T) * qk_scale, MASK_VALUE)
    p = jnp.exp2(qk - lse[:, None])
    dp = _dot(do, v.T) - di[:, None]
    return p, p * dp * scale

  # dK, dV
  start_k = pl.program_id(2)
  k_slice = pl.ds(start_k * block_k, block_k)
  k, v = k_ref[k_slice, :], v_ref[k_slice, :]
  k_seg, k_rank, k_lo = seg_ref[k_slice], rank_ref[k_slice], klo_ref[k_slice]

  def dkdv(start_q, carry):
    dk, dv = carry
    q_slice = pl.ds(pl.multiple_of(start_q * block_q, block_q), block_q)
    q_seg, q_rank = seg_ref[q_slice], rank_ref[q_slice]
    q, do = q_ref[q_slice, :], do_ref[q_slice, :]
    mask = _tile_mask(q_seg, q_rank, k_seg, k_rank, k_lo)
    p, ds = p_and_ds(q, k, v, do, lse_ref[q_slice], delta_ref[q_slice], mask)
    dv = dv + _dot(p.astype(do.dtype).T, do)
    dk = dk + _dot(ds.astype(q.dtype).T, q)
    return dk, dv

  zeros = jnp.zeros((block_k, h), jnp.float32)
  dk, dv = _tile_loop(
    dkdv,
    (zeros, zeros),
    qidx_ref,
    qcnt_ref,
    pl.cdiv(q_len, block_q),
    live_only,
    lambda start_q: _tile_live(*vectors(start_q, block_q)[:2], k_seg, k_rank, k_lo),
  )
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)

  # dQ (the same grid index, read as a q tile of size block_q; block_q == block_k here)
  start_q = pl.program_id(2)
  q_slice = pl.ds(start_q * block_q, block_q)
  q, do = q_ref[q_slice, :], do_ref[q_slice, :]
  lse, di = lse_ref[q_slice], delta_ref[q_slice]
  q_seg, q_rank = seg_ref[q_slice], rank_ref[q_slice]

  def dq_tile(start_k, dq):
    k_slice = pl.ds(pl.multiple_of(start_k * block_k, block_k), block_k)
    k_seg, k_rank, k_lo = seg_ref[k_slice], rank_ref[k_slice], klo_ref[k_slice]
    k, v = k_ref[k_slice, :], v_ref[k_slice, :]
    _, ds = p_and_ds(q, k, v, do, lse, di, _tile_mask(q_seg, q_rank, k_seg, k_rank, k_lo))
    return dq + _dot(ds.astype(k.dtype), k)

  dq = _tile_loop(
    dq_tile,
    jnp.zeros((block_q, h), jnp.float32),
    kidx_ref,
    kcnt_ref,
    pl.cdiv(k_ref.shape[0], block_k),
    live_only,
    lambda start_k: _tile_live(q_seg, q_rank, *vectors(start_k, block_k)),
  )
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _params(num_warps, num_stages):
  if plgpu is None:
    return None
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _forward(q, k, v, seg, rank, klo, scale, block_q, block_k, interpret, live_only=True):
  b, s, n, h = q.shape
  g = n // k.shape[2]
  nq, nk = s // block_q, s // block_k
  kidx, kcnt = live_schedule(live_tiles(seg, rank, klo, block_q, block_k))
  row = pl.BlockSpec((None, s), lambda i, j, hh: (j, 0))
  out, lse = pl.pallas_call(
    functools.partial(
      _fwd_kernel, scale=scale, block_q=block_q, block_k=block_k, live_only=live_only
    ),
    grid=(nq, b, n),
    in_specs=[
      pl.BlockSpec((None, block_q, None, h), lambda i, j, hh: (j, i, hh, 0)),
      pl.BlockSpec((None, s, None, h), lambda i, j, hh: (j, 0, hh // g, 0)),
      pl.BlockSpec((None, s, None, h), lambda i, j, hh: (j, 0, hh // g, 0)),
      row,
      row,
      row,
      pl.BlockSpec((None, None, nk), lambda i, j, hh: (j, i, 0)),  # this q tile's key tiles
      pl.BlockSpec((None, 1), lambda i, j, hh: (j, i)),  # how many are live
    ],
    out_specs=[
      pl.BlockSpec((None, block_q, None, h), lambda i, j, hh: (j, i, hh, 0)),
      pl.BlockSpec((None, None, block_q), lambda i, j, hh: (j, hh, i)),
    ],
    out_shape=[
      jax.ShapeDtypeStruct(q.shape, q.dtype),
      jax.ShapeDtypeStruct((b, n, s), jnp.float32),
    ],
    compiler_params=_params(8 if h > 64 else 4, 2),
    interpret=interpret,
    name="bd_flash_fwd",
  )(q, k, v, seg, rank, klo, kidx, kcnt)
  return out, lse


def _backward(q, k, v, seg, rank, klo, out, lse, do, scale, block, interpret, live_only=True):
  b, s, n, h = q.shape
  kh = k.shape[2]
  g = n // kh
  nt = s // block
  live = live_tiles(seg, rank, klo, block, block)  # [B, q tile, k tile]
  kidx, kcnt = live_schedule(live)  # per q tile: its key tiles (dQ)
  qidx, qcnt = live_schedule(live.swapaxes(1, 2))  # per k tile: its query tiles (dK, dV)
  delta = jnp.einsum("bsnh,bsnh->bns", out.astype(jnp.float32), do.astype(jnp.float32))
  full_q = pl.BlockSpec((None, s, None, h), lambda i, j, t: (i, 0, j, 0))
  full_kv = pl.BlockSpec((None, s, None, h), lambda i, j, t: (i, 0, j // g, 0))
  row = pl.BlockSpec((None, s), lambda i, j, t: (i, 0))
  stat = pl.BlockSpec((None, None, s), lambda i, j, t: (i, j, 0))
  tile = pl.BlockSpec((None, block, None, h), lambda i, j, t: (i, t, j, 0))
  index = pl.BlockSpec((None, None, nt), lambda i, j, t: (i, t, 0))
  count = pl.BlockSpec((None, 1), lambda i, j, t: (i, t))
  dq, dk, dv = pl.pallas_call(
    functools.partial(_bwd_kernel, scale=scale, block_q=block, block_k=block, live_only=live_only),
    grid=(b, n, nt),
    in_specs=[full_q, full_kv, full_kv, row, row, row, full_q, stat, stat]
    + [index, count, index, count],
    out_specs=[tile, tile, tile],
    out_shape=[
      jax.ShapeDtypeStruct(q.shape, q.dtype),
      jax.ShapeDtypeStruct((b, s, n, h), jnp.float32),
      jax.ShapeDtypeStruct((b, s, n, h), jnp.float32),
    ],
    compiler_params=_params(4 if block <= 64 else 8, 2),
    interpret=interpret,
    name="bd_flash_bwd",
  )(q, k, v, seg, rank, klo, do, lse, delta, qidx, qcnt, kidx, kcnt)
  # Query heads sharing a K/V head: sum their dK/dV.
  dk = dk.reshape(b, s, kh, g, h).sum(3).astype(k.dtype)
  dv = dv.reshape(b, s, kh, g, h).sum(3).astype(v.dtype)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def flash_attention(
  q,
  k,
  v,
  seg,
  rank,
  klo,
  scale,
  block_q=128,
  block_k=64,
  block_bwd=64,
  interpret=False,
  live_only=True,
):
  """q `[B,S,N,H]`, k/v `[B,S,K,H]`, int32 vectors `[B,S]` (see module doc) -> `[B,S,N,H]`."""
  return _forward(q, k, v, seg, rank, klo, scale, block_q, block_k, interpret, live_only)[0]


# Names of the forward's residuals: a remat policy that saves them (model/config.py `dots_attn`,
# `full_attn`) keeps the backward pass from running the forward kernel again.
OUT_NAME, LSE_NAME = "flash_out", "flash_lse"


def _fa_fwd(q, k, v, seg, rank, klo, scale, block_q, block_k, block_bwd, interpret, live_only):
  out, lse = _forward(q, k, v, seg, rank, klo, scale, block_q, block_k, interpret, live_only)
  out, lse = checkpoint_name(out, OUT_NAME), checkpoint_name(lse, LSE_NAME)
  return out, (q, k, v, seg, rank, klo, out, lse)


def _fa_bwd(scale, block_q, block_k, block_bwd, interpret, live_only, res, do):
  q, k, v, seg, rank, klo, out, lse = res
  dq, dk, dv = _backward(
    q, k, v, seg, rank, klo, out, lse, do, scale, block_bwd, interpret, live_only
  )
  return dq, dk, dv, None, None, None


flash_attention.defvjp(_fa_fwd, _fa_bwd)


def mask_vectors(spec, positions):
  """(seg, rank, klo) `[B, S]` for any `AttentionSpec` kind over a self-attention input."""
  if spec.kind == "block_diffusion":
    seg, blk = spec.resolve(positions[:, : positions.shape[1] // 2])
    return bd_mask_vectors(seg, blk)
  seg, blk = spec.resolve(positions)
  if spec.kind == "trace":
    return trace_mask_vectors(seg, blk, spec.round_ids)
  rank = {"causal": positions, "block_causal": blk, "full": jnp.zeros_like(blk)}[spec.kind].astype(
    jnp.int32
  )
  return seg.astype(jnp.int32), rank, jnp.full_like(rank, BIG)


def attention(
  q,
  k,
  v,
  spec,
  positions,
  *,
  block_q=128,
  block_k=64,
  block_bwd=64,
  interpret=None,
  live_only=True,
):
  """Flash attention for an `AttentionSpec` (the `attention_impl='flash'` path).

  `block_q`/`block_k` are the forward tiles, `block_bwd` the backward one (ModelConfig.flash_tiles);
  each is clipped to the input length, which must be a multiple of it. `live_only`: loop over the
  live tiles only (module docstring; ModelConfig.flash_live_only).
  """
  s = q.shape[1]
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  bq, bk, bb = min(block_q, s), min(block_k, s), min(block_bwd, s)
  if s % bq or s % bk or s % bb:
    raise ValueError(
      f"flash attention: input length {s} must be a multiple of the tiles {bq}, {bk}, {bb}"
    )
  seg, rank, klo = mask_vectors(spec, positions)
  fn = functools.partial(
    flash_attention,
    scale=q.shape[-1] ** -0.5,
    block_q=bq,
    block_k=bk,
    block_bwd=bb,
    interpret=interpret,
    live_only=live_only,
  )
  return _shard_mapped(fn, q, k)(q, k, v, seg, rank, klo)


def _shard_mapped(fn, q, k):
  """Under a mesh context (`jax.set_mesh`), run the kernel per shard: rows over the data/fsdp
  axes and heads over `tensor` where they divide (a Pallas call has no partitioning rule, so
  without this XLA would gather whole arrays onto every device)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or mesh.size == 1:
    return fn
  P = jax.sharding.PartitionSpec
  row_axis, head_axis = sharding_lib.kernel_axes(mesh, q.shape[0], (q.shape[2], k.shape[2]))
  heads = P(row_axis, None, head_axis, None)
  vec = P(row_axis, None)
  return jax.shard_map(
    lambda *a: fn(*a),
    mesh=mesh,
    in_specs=(heads, heads, heads, vec, vec, vec),
    out_specs=heads,
    check_vma=False,
  )
