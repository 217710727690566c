"""Flash attention for the block-diffusion masks as Pallas TPU (Mosaic) kernels.

The TPU counterpart of `flash_bd.py` (training / prefill) and `flash_decode.py` (new tokens over
the KV cache): the same (seg, rank, klo) mask vectors, so the same three masks of `dice_jax/model/masks.py`
(block-causal, the 2L `[x_t ; x_0]` SFT mask, the TraceRL mask) and causal / full:

  q sees k  iff  seg_q == seg_k > 0  and  rank_k <= rank_q  and  klo_k >= rank_q

The vectors are per-row data (segment ids, prompt lengths, rounds), so splash attention's static
numpy masks cannot hold them. Instead, per (row, q tile, k tile) a liveness bit is computed from
tile bounds of the vectors (`tile_plan`) and given to the kernel by scalar prefetch: a dead tile
does no compute (`pl.when`) and no DMA (its k/v block index repeats the last live one, and the
pipeline does not re-fetch an unchanged block). Layout follows `pallas.ops.tpu.flash_attention`:
heads are `H`-wide column blocks of `[B, T, N*H]` (free reshapes, no transposes), q vectors are
broadcast over 128 lanes, k vectors stacked on 8 sublanes, softmax statistics kept lane-wide.

Forward: online softmax over k tiles (grid `(B, N, nq, nk)`, k innermost). Backward: a dq kernel
(k innermost) and a dk/dv kernel (q innermost), both with the forward's log-sum-exp; dk/dv are
computed per query head and summed over each K/V head's group. Runs in interpret mode off TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dice_jax import sharding as sharding_lib
from dice_jax.model.flash_bd import LSE_NAME, OUT_NAME

LANES, SUBLANES = 128, 8
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
EMPTY_LSE = -1e30  # log-sum-exp of a query that sees no key (padding)
BIG = 2**30
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_TN = (((0,), (0,)), ((), ()))  # a.T @ b


def _bounds(seg, vec, tile, lo):
  """Per-tile min (`lo`) or max of `vec` over the tile's live tokens (seg > 0)."""
  b, t = seg.shape
  live = (seg > 0).reshape(b, t // tile, tile)
  v = vec.reshape(b, t // tile, tile)
  if lo:
    return jnp.min(jnp.where(live, v, BIG), -1)
  return jnp.max(jnp.where(live, v, -BIG), -1)


def tile_plan(q_seg, q_rank, k_seg, k_rank, k_lo, block_q, block_k):
  """`live [B, nq, nk]` (0/1: the tile's mask may be non-zero) and the block each grid step
  fetches: `kidx [B, nq, nk]` (k tile index, the last live one where dead) and `qidx [B, nk, nq]`
  (the same over q tiles, for the dk/dv kernel). Conservative: live is 1 whenever any pair of the
  tile is visible, so skipping is exact."""
  qs_lo, qs_hi = _bounds(q_seg, q_seg, block_q, True), _bounds(q_seg, q_seg, block_q, False)
  qr_lo, qr_hi = _bounds(q_seg, q_rank, block_q, True), _bounds(q_seg, q_rank, block_q, False)
  ks_lo, ks_hi = _bounds(k_seg, k_seg, block_k, True), _bounds(k_seg, k_seg, block_k, False)
  kr_lo, kl_hi = _bounds(k_seg, k_rank, block_k, True), _bounds(k_seg, k_lo, block_k, False)
  q_, k_ = (lambda a: a[:, :, None]), (lambda a: a[:, None, :])
  live = (
    (q_(qs_hi) > 0)
    & (k_(ks_hi) > 0)
    & (k_(ks_lo) <= q_(qs_hi))
    & (k_(ks_hi) >= q_(qs_lo))
    & (k_(kr_lo) <= q_(qr_hi))
    & (k_(kl_hi) >= q_(qr_lo))
  )
  return live.astype(jnp.int32), _fetch_index(live), _fetch_index(live.transpose(0, 2, 1))


def _fetch_index(live):
  """Along the last axis: the index itself where live, else the last live one before it (the
  first live one, or 0, before any)."""
  n = live.shape[-1]
  idx = jnp.where(live, jnp.arange(n, dtype=jnp.int32), -1)
  last = lax.cummax(idx, axis=live.ndim - 1)
  first = jnp.argmax(live, axis=-1).astype(jnp.int32)[..., None]
  return jnp.where(last >= 0, last, first).astype(jnp.int32)


def _lane_tile(x, width):
  """A lane-wide `[rows, 128]` statistic widened (or cut) to `width` columns."""
  reps, rem = divmod(width, LANES)
  if rem:
    if reps:
      raise ValueError(f"flash_tpu: width {width} must be a multiple of {LANES} above it")
    return x[:, :width]
  return x if reps == 1 else jnp.tile(x, (1, reps))


def _tile_mask(qseg_ref, qrank_ref, kvec_ref, block_k):
  q_seg = _lane_tile(qseg_ref[...], block_k)
  q_rank = _lane_tile(qrank_ref[...], block_k)
  kv = kvec_ref[...]
  k_seg, k_rank, k_lo = kv[0:1], kv[1:2], kv[2:3]
  return (q_seg == k_seg) & (q_seg > 0) & (k_rank <= q_rank) & (k_lo >= q_rank)


def _flat(b, i, j, n_i, n_j):
  return (b * n_i + i) * n_j + j


def _fwd_kernel(
  layer_ref,
  live_ref,
  kidx_ref,
  q_ref,
  k_ref,
  v_ref,
  qseg_ref,
  qrank_ref,
  kvec_ref,
  o_ref,
  lse_ref,
  m_sc,
  l_sc,
  acc_sc,
  *,
  scale,
  nq,
  nk,
):
  del layer_ref, kidx_ref
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  block_k, h = k_ref.shape

  @pl.when(j == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  @pl.when(live_ref[_flat(b, i, j, nq, nk)] != 0)
  def _step():
    q = q_ref[...]
    k = k_ref[...].astype(q.dtype)  # a float8 cache is widened tile by tile
    s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * scale
    mask = _tile_mask(qseg_ref, qrank_ref, kvec_ref, block_k)
    s = jnp.where(mask, s, MASK_VALUE)
    m_prev, l_prev = m_sc[...], l_sc[...]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1)[:, None])
    p = jnp.where(mask, jnp.exp(s - _lane_tile(m_next, block_k)), 0.0)
    alpha = jnp.exp(m_prev - m_next)
    l_sc[...] = alpha * l_prev + jnp.sum(p, axis=1)[:, None]
    m_sc[...] = m_next
    v = v_ref[...].astype(q.dtype)
    pv = lax.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    acc_sc[...] = acc_sc[...] * _lane_tile(alpha, h) + pv

  @pl.when(j == nk - 1)
  def _finish():
    l, m = l_sc[...], m_sc[...]
    empty = l == 0.0
    safe = jnp.where(empty, 1.0, l)
    o_ref[...] = (acc_sc[...] / _lane_tile(safe, h)).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, EMPTY_LSE, m + jnp.log(safe))


def _p_ds(q, k, v, do, lse, di, mask, scale, block_k):
  """Probabilities and score gradients of one tile (from the forward's log-sum-exp)."""
  s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * scale
  p = jnp.where(mask, jnp.exp(s - _lane_tile(lse, block_k)), 0.0)
  dp = lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32)
  return p, p * (dp - _lane_tile(di, block_k)) * scale


def _dq_kernel(
  layer_ref,
  live_ref,
  kidx_ref,
  q_ref,
  k_ref,
  v_ref,
  qseg_ref,
  qrank_ref,
  kvec_ref,
  do_ref,
  lse_ref,
  di_ref,
  dq_ref,
  dq_sc,
  *,
  scale,
  nq,
  nk,
):
  del layer_ref, kidx_ref
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  block_k = k_ref.shape[0]

  @pl.when(j == 0)
  def _init():
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

  @pl.when(live_ref[_flat(b, i, j, nq, nk)] != 0)
  def _step():
    k = k_ref[...]
    mask = _tile_mask(qseg_ref, qrank_ref, kvec_ref, block_k)
    _, ds = _p_ds(
      q_ref[...], k, v_ref[...], do_ref[...], lse_ref[...], di_ref[...], mask, scale, block_k
    )
    dq_sc[...] += lax.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

  @pl.when(j == nk - 1)
  def _finish():
    dq_ref[...] = dq_sc[...].astype(dq_ref.dtype)


def _dkv_kernel(
  layer_ref,
  live_ref,
  qidx_ref,
  q_ref,
  k_ref,
  v_ref,
  qseg_ref,
  qrank_ref,
  kvec_ref,
  do_ref,
  lse_ref,
  di_ref,
  dk_ref,
  dv_ref,
  dk_sc,
  dv_sc,
  *,
  scale,
  nq,
  nk,
):
  del layer_ref, qidx_ref
  b, j, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  block_k = k_ref.shape[0]

  @pl.when(i == 0)
  def _init():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  @pl.when(live_ref[_flat(b, i, j, nq, nk)] != 0)
  def _step():
    q, do = q_ref[...], do_ref[...]
    mask = _tile_mask(qseg_ref, qrank_ref, kvec_ref, block_k)
    p, ds = _p_ds(q, k_ref[...], v_ref[...], do, lse_ref[...], di_ref[...], mask, scale, block_k)
    dv_sc[...] += lax.dot_general(p.astype(do.dtype), do, _TN, preferred_element_type=jnp.float32)
    dk_sc[...] += lax.dot_general(ds.astype(q.dtype), q, _TN, preferred_element_type=jnp.float32)

  @pl.when(i == nq - 1)
  def _finish():
    dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
    dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _lane_vectors(q_seg, q_rank, k_seg, k_rank, k_lo):
  """q vectors broadcast over 128 lanes `[B, Tq, 128]`; k vectors on sublanes `[B, 8, Tk]`."""
  lanes = lambda x: jnp.broadcast_to(x.astype(jnp.int32)[:, :, None], (*x.shape, LANES))
  kvec = jnp.stack([k_seg, k_rank, k_lo], 1).astype(jnp.int32)
  kvec = jnp.pad(kvec, ((0, 0), (0, SUBLANES - 3), (0, 0)))
  return lanes(q_seg), lanes(q_rank), kvec


def _params(interpret):
  sem = ("parallel", "parallel", "parallel", "arbitrary")
  return None if interpret else pltpu.CompilerParams(dimension_semantics=sem)


def forward(q, k, v, layer, vecs, plan, *, h, scale, block_q, block_k, interpret):
  """o `[B, Tq, N*H]`, lse `[B, N, Tq, 128]` (natural log, lane-wide) of q `[B, Tq, N*H]` over
  layer `layer` (`[1]` int32) of k/v `[L, B, Tk, K*H]`; `vecs` from `_lane_vectors`, `plan`
  from `tile_plan`; `h` the head width."""
  b, tq, nh = q.shape
  tk, kh_h = k.shape[2], k.shape[3]
  n, g = nh // h, nh // kh_h
  nq, nk = tq // block_q, tk // block_k
  live, kidx, _ = plan
  qseg, qrank, kvec = vecs

  def kv_map(bi, hi, i, j, layer_ref, live_ref, kidx_ref):
    return layer_ref[0], bi, kidx_ref[_flat(bi, i, j, nq, nk)], lax.div(hi, g)

  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=3,
    grid=(b, n, nq, nk),
    in_specs=[
      pl.BlockSpec((None, block_q, h), lambda bi, hi, i, j, *_: (bi, i, hi)),
      pl.BlockSpec((None, None, block_k, h), kv_map),
      pl.BlockSpec((None, None, block_k, h), kv_map),
      pl.BlockSpec((None, block_q, LANES), lambda bi, hi, i, j, *_: (bi, i, 0)),
      pl.BlockSpec((None, block_q, LANES), lambda bi, hi, i, j, *_: (bi, i, 0)),
      pl.BlockSpec(
        (None, SUBLANES, block_k),
        lambda bi, hi, i, j, lr, lv, kx: (bi, 0, kx[_flat(bi, i, j, nq, nk)]),
      ),
    ],
    out_specs=[
      pl.BlockSpec((None, block_q, h), lambda bi, hi, i, j, *_: (bi, i, hi)),
      pl.BlockSpec((None, None, block_q, LANES), lambda bi, hi, i, j, *_: (bi, hi, i, 0)),
    ],
    scratch_shapes=[
      pltpu.VMEM((block_q, LANES), jnp.float32),
      pltpu.VMEM((block_q, LANES), jnp.float32),
      pltpu.VMEM((block_q, h), jnp.float32),
    ],
  )
  return pl.pallas_call(
    functools.partial(_fwd_kernel, scale=scale, nq=nq, nk=nk),
    grid_spec=grid_spec,
    out_shape=[
      jax.ShapeDtypeStruct((b, tq, nh), q.dtype),
      jax.ShapeDtypeStruct((b, n, tq, LANES), jnp.float32),
    ],
    compiler_params=_params(interpret),
    interpret=interpret,
    name="bd_flash_tpu_fwd",
  )(layer, live.reshape(-1), kidx.reshape(-1), q, k, v, qseg, qrank, kvec)


def _backward(q, k, v, vecs, plan, o, lse, do, *, h, scale, block_q, block_k, interpret):
  """(dq `[B,T,N*H]`, dk/dv `[B,T,N*H]` f32 per query head) of the self-attention forward."""
  b, t, nh = q.shape
  n = nh // h
  g = nh // k.shape[3]
  nq, nk = t // block_q, t // block_k
  live, kidx, qidx = plan
  qseg, qrank, kvec = vecs
  di = jnp.einsum(
    "btnh,btnh->bnt",
    o.reshape(b, t, n, h).astype(jnp.float32),
    do.reshape(b, t, n, h).astype(jnp.float32),
  )
  di = jnp.broadcast_to(di[..., None], (b, n, t, LANES))
  layer = jnp.zeros((1,), jnp.int32)

  # dq: grid (b, n, q tile, k tile), k innermost.
  def kv_map(bi, hi, i, j, lr, lv, kx):
    return 0, bi, kx[_flat(bi, i, j, nq, nk)], lax.div(hi, g)

  q_map = lambda bi, hi, i, j, *_: (bi, i, hi)
  qv_map = lambda bi, hi, i, j, *_: (bi, i, 0)
  st_map = lambda bi, hi, i, j, *_: (bi, hi, i, 0)
  kvec_map = lambda bi, hi, i, j, lr, lv, kx: (bi, 0, kx[_flat(bi, i, j, nq, nk)])
  qblk = pl.BlockSpec((None, block_q, h), q_map)
  stat = pl.BlockSpec((None, None, block_q, LANES), st_map)
  dq = pl.pallas_call(
    functools.partial(_dq_kernel, scale=scale, nq=nq, nk=nk),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=3,
      grid=(b, n, nq, nk),
      in_specs=[
        qblk,
        pl.BlockSpec((None, None, block_k, h), kv_map),
        pl.BlockSpec((None, None, block_k, h), kv_map),
        pl.BlockSpec((None, block_q, LANES), qv_map),
        pl.BlockSpec((None, block_q, LANES), qv_map),
        pl.BlockSpec((None, SUBLANES, block_k), kvec_map),
        qblk,
        stat,
        stat,
      ],
      out_specs=qblk,
      scratch_shapes=[pltpu.VMEM((block_q, h), jnp.float32)],
    ),
    out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
    compiler_params=_params(interpret),
    interpret=interpret,
    name="bd_flash_tpu_dq",
  )(layer, live.reshape(-1), kidx.reshape(-1), q, k, v, qseg, qrank, kvec, do, lse, di)

  # dk, dv: grid (b, n, k tile, q tile), q innermost; q-side blocks follow qidx.
  def qx(bi, j, i, qx_ref):
    return qx_ref[_flat(bi, j, i, nk, nq)]

  q_map2 = lambda bi, hi, j, i, lr, lv, qr: (bi, qx(bi, j, i, qr), hi)
  qv_map2 = lambda bi, hi, j, i, lr, lv, qr: (bi, qx(bi, j, i, qr), 0)
  st_map2 = lambda bi, hi, j, i, lr, lv, qr: (bi, hi, qx(bi, j, i, qr), 0)
  kv_map2 = lambda bi, hi, j, i, *_: (0, bi, j, lax.div(hi, g))
  qblk2 = pl.BlockSpec((None, block_q, h), q_map2)
  stat2 = pl.BlockSpec((None, None, block_q, LANES), st_map2)
  out = pl.BlockSpec((None, block_k, h), lambda bi, hi, j, i, *_: (bi, j, hi))
  dk, dv = pl.pallas_call(
    functools.partial(_dkv_kernel, scale=scale, nq=nq, nk=nk),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=3,
      grid=(b, n, nk, nq),
      in_specs=[
        qblk2,
        pl.BlockSpec((None, None, block_k, h), kv_map2),
        pl.BlockSpec((None, None, block_k, h), kv_map2),
        pl.BlockSpec((None, block_q, LANES), qv_map2),
        pl.BlockSpec((None, block_q, LANES), qv_map2),
        pl.BlockSpec((None, SUBLANES, block_k), lambda bi, hi, j, i, *_: (bi, 0, j)),
        qblk2,
        stat2,
        stat2,
      ],
      out_specs=[out, out],
      scratch_shapes=[pltpu.VMEM((block_k, h), jnp.float32)] * 2,
    ),
    out_shape=[jax.ShapeDtypeStruct((b, t, nh), jnp.float32)] * 2,
    compiler_params=_params(interpret),
    interpret=interpret,
    name="bd_flash_tpu_dkv",
  )(layer, live.reshape(-1), qidx.reshape(-1), q, k, v, qseg, qrank, kvec, do, lse, di)
  return dq, dk, dv


def _prepare(seg, rank, klo, block_q, block_k):
  vecs = _lane_vectors(seg, rank, seg, rank, klo)
  plan = tile_plan(seg, rank, seg, rank, klo, block_q, block_k)
  return vecs, plan


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def flash_attention(q, k, v, seg, rank, klo, scale, block_q=512, block_k=512, interpret=False):
  """q `[B,T,N,H]`, k/v `[B,T,K,H]`, int32 vectors `[B,T]` (flash_bd's encoding) -> `[B,T,N,H]`."""
  return _fa_fwd(q, k, v, seg, rank, klo, scale, block_q, block_k, interpret)[0]


def _fa_fwd(q, k, v, seg, rank, klo, scale, block_q, block_k, interpret):
  b, t, n, h = q.shape
  vecs, plan = _prepare(seg, rank, klo, block_q, block_k)
  flat = lambda x: x.reshape(*x.shape[:2], -1)
  o, lse = forward(
    flat(q),
    flat(k)[None],
    flat(v)[None],
    jnp.zeros((1,), jnp.int32),
    vecs,
    plan,
    h=h,
    scale=scale,
    block_q=block_q,
    block_k=block_k,
    interpret=interpret,
  )
  # The residuals under flash_bd's names: a remat policy that saves them (model/config.py
  # `dots_attn`, `full_attn`) keeps the backward pass from running this forward kernel again.
  # The output is kept as returned, `[B, T, N, H]`; the log-sum-exp one lane wide, `[B, N, T]` f32
  # (1/128 of the kernel's), and widened again for the backward kernels.
  o, lse = checkpoint_name(o.reshape(q.shape), OUT_NAME), checkpoint_name(lse[..., 0], LSE_NAME)
  return o, (q, k, v, seg, rank, klo, o, lse)


def _fa_bwd(scale, block_q, block_k, interpret, res, do):
  q, k, v, seg, rank, klo, o, lse = res
  b, t, n, h = q.shape
  kh = k.shape[2]
  vecs, plan = _prepare(seg, rank, klo, block_q, block_k)
  flat = lambda x: x.reshape(*x.shape[:2], -1)
  dq, dk, dv = _backward(
    flat(q),
    flat(k)[None],
    flat(v)[None],
    vecs,
    plan,
    flat(o),
    jnp.broadcast_to(lse[..., None], (*lse.shape, LANES)),
    flat(do).astype(q.dtype),
    h=h,
    scale=scale,
    block_q=block_q,
    block_k=block_k,
    interpret=interpret,
  )
  # Query heads sharing a K/V head: sum their dK/dV.
  dk = dk.reshape(b, t, kh, n // kh, h).sum(3).astype(k.dtype)
  dv = dv.reshape(b, t, kh, n // kh, h).sum(3).astype(v.dtype)
  return dq.reshape(q.shape), dk, dv, None, None, None


flash_attention.defvjp(_fa_fwd, _fa_bwd)


def _tile(size, length, what, interpret):
  """The largest tile <= `size` dividing `length`: a multiple of 128 for k tiles on TPU (lanes),
  of 8 otherwise (sublanes); the whole length when it fits."""
  if length <= size:
    return length
  step = LANES if what == "k" and not interpret else SUBLANES
  t = size - size % step
  while t >= step and length % t:
    t -= step
  if t < step:
    raise ValueError(
      f"flash_tpu: {what} length {length} has no tile <= {size} that is a multiple "
      f"of {step} dividing it"
    )
  return t


def attention(q, k, v, spec, positions, *, block_q=512, block_k=512, interpret=False):
  """Flash attention for an `AttentionSpec` on TPU (`attention_impl='flash'` there): the
  `flash_bd.attention` contract. Tiles are the largest <= `block_q`/`block_k` dividing the length."""
  from dice_jax.model import flash_bd  # the mask encoding (pure functions, no Triton needed)

  s = q.shape[1]
  bq, bk = _tile(block_q, s, "q", interpret), _tile(block_k, s, "k", interpret)
  seg, rank, klo = flash_bd.mask_vectors(spec, positions)
  fn = functools.partial(
    flash_attention, scale=q.shape[-1] ** -0.5, block_q=bq, block_k=bk, interpret=interpret
  )
  return flash_bd._shard_mapped(fn, q, k)(q, k, v, seg, rank, klo)


def _cache_call(q_rows, k_cache, v_cache, layer, q_seg, q_rank, k_seg, k_rank, *, bk, interpret):
  """Local (per-shard) launch for `cache_part`: q rows `[B, K, R, H]`, cache `[L, B, S, K*H]`
  (the stored layout, read in place: head kh is column block kh, as for q)."""
  b, kh, r, h = q_rows.shape
  q2 = q_rows.transpose(0, 2, 1, 3).reshape(b, r, kh * h)  # head kh = column block kh
  k_lo = jnp.full_like(k_rank, BIG)
  vecs = _lane_vectors(q_seg, q_rank, k_seg, k_rank, k_lo)
  plan = tile_plan(q_seg, q_rank, k_seg, k_rank, k_lo, r, bk)
  o, lse = forward(
    q2,
    k_cache,
    v_cache,
    layer,
    vecs,
    plan,
    h=h,
    scale=h**-0.5,
    block_q=r,
    block_k=bk,
    interpret=interpret,
  )
  return o.reshape(b, r, kh, h).transpose(0, 2, 1, 3), lse[..., 0]


def cache_part(
  q_bkrh,
  k_cache,
  v_cache,
  layer,
  q_seg_br,
  q_rank_br,
  k_seg_bs,
  k_rank_bs,
  fill_b,
  *,
  tiles,
  interpret=False,
):
  """`flash_decode.cache_part` on TPU: softmax attention of query rows over one layer of the
  stacked cache `[L, B, S, K*H]`, read in place (the stored layout is the kernel's: no copy);
  tiles above a row's fill (`k_seg_bs` is 0 there) and rows with no live query are skipped. The k tile is the largest of 512/256/128 dividing the cache length.
  Returns (o `[B, K, R, H]` f32, lse `[B, K, R]` natural log, EMPTY_LSE where nothing is visible).
  """
  del fill_b, tiles  # the fill is in k_seg_bs (0 above it); TPU tiles are fixed here
  b, kh, r, _ = q_bkrh.shape
  s = k_cache.shape[2]
  bk = next((t for t in (512, 256, 128) if s % t == 0), None)
  if bk is None:
    raise ValueError(f"flash_tpu: cache length {s} must be a multiple of 128 on TPU")
  pad = (-r) % SUBLANES
  if pad:
    q_bkrh = jnp.pad(q_bkrh, ((0, 0), (0, 0), (0, pad), (0, 0)))
    q_seg_br = jnp.pad(q_seg_br, ((0, 0), (0, pad)))
    q_rank_br = jnp.pad(q_rank_br, ((0, 0), (0, pad)))
  layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
  i32 = lambda x: x.astype(jnp.int32)
  call = functools.partial(_cache_call, bk=bk, interpret=interpret)
  o, lse = _cache_shard_mapped(call, b, kh)(
    q_bkrh, k_cache, v_cache, layer, i32(q_seg_br), i32(q_rank_br), i32(k_seg_bs), i32(k_rank_bs)
  )
  return o[..., :r, :].astype(jnp.float32), lse[..., :r]


def _cache_shard_mapped(fn, rows, kv_heads):
  """Rows over data/fsdp and K/V heads over `tensor` under a mesh (as flash_decode)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or mesh.size == 1:
    return fn
  P = jax.sharding.PartitionSpec
  row, head = sharding_lib.kernel_axes(mesh, rows, (kv_heads,))
  vec = P(row, None)
  cache = P(None, row, None, head)  # [L, B, S, K*H]: whole heads per shard
  in_specs = (P(row, head, None, None), cache, cache, P(None), vec, vec, vec, vec)
  out_specs = (P(row, head, None, None), P(row, head, None))
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
