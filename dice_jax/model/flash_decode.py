"""Attention of a few new tokens over a KV cache, without materialising scores (Pallas).

The dense `cached_attention` writes `[B, K, G, T, S]` float32 scores for the whole cache buffer and
reads them back several times; at decode shapes (T = 4..8 new tokens per row, S = thousands of
slots) that traffic is as large as reading the cache itself. Here one program per (row, K/V head,
query tile, cache split) streams its share of the cache in `block_k` tiles with an online softmax,
and returns the share's output and log-sum-exp; the shares are merged by log-sum-exp
(flash-decoding). A program visits only the tiles below its row's fill (`KVCache.length`), and
none when the row has no live query (a finished or empty slot). The new tokens' own keys (a few)
are attended densely and merged the same way, or (`DecodeTiles.fold_new`) as one more tile of the
row's first program, so the result is the joint softmax over (cache slots, new tokens) of
`transformer.cached_attention`.

Only block-causal / full / causal masks of the cache part are needed: visibility is
`seg_q == seg_k > 0 and rank_k <= rank_q`, with rank = block id (block_causal), position (causal)
or 0 (full). The cache is in the queries' dtype or float8_e4m3fn (`SamplerConfig.kv_cache_dtype`: each
tile is widened as it is read, so the kernel reads half the bytes; `DecodeTiles.fp8_widen` says
how). Triton on GPU, the Pallas interpreter elsewhere. Tile sizes are a `DecodeTiles`
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


FP8_WIDENS = ("cast", "asm", "bits", "f16")


@dataclasses.dataclass(frozen=True)
class DecodeTiles:
  """Tiling of the cache-attention kernel (cache slots per program `split`, or programs per row
  `splits`; slots per inner tile `block_k`; the Triton launch parameters) and the options of the
  decode forward's attention measured in docs/performance.md ("Sampler: one decode forward").
  Every option is off by default and exact in real arithmetic: it changes where the work runs and
  the order of its float32 sums, not what is summed. The `fp8_widen` variants are bit for bit the
  same; another partition (`split`, `splits`) or `fold_new` rounds a few bf16 outputs the other
  way (docs/performance.md, issue 39), after which a random model's near-ties decode other
  tokens. `splits` on the programs of some `split` is bit for bit that split."""

  # H200 tile sweep (docs/log.md, "Sampler: H200, issue 13 measurements"; sdar_4b, 128 rows, fill 1536): split 1024 / block_k 64
  # reads the cache at 3.76 TB/s, 8% faster than 512 / 128.
  split: int = 1024
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 2
  dynamic_loop: bool = True  # loop over the live tiles only; False: over all, skipping dead ones
  # > 0: that many programs per (row, K/V head), each an equal share of the row's live tiles (no
  # program runs above the fill; none does twice another's work); 0: one program per `split` slots.
  splits: int = 0
  # The new tokens' own keys as one more tile of each row's first program, instead of a dense
  # self part merged by a second log-sum-exp pass (a handful of small XLA kernels a layer).
  fold_new: bool = False
  # How a float8_e4m3fn tile becomes bf16: "cast" (Triton's convert: 1.5 cvt instructions per
  # value on sm_90, whose conversion pipe issues 16 a clock per SM), "asm" (byte permutes, masks
  # and one bf16x2 multiply by 2^120 per two values: no cvt; GPU only, the interpreter runs
  # "bits"), "bits" (integer ops for normal values, a float conversion for subnormal ones: the
  # portable reference of "asm"). All give the same bf16 values. "f16": widened to float16 instead
  # (one `cvt.rn.f16x2.e4m3x2` per two values on sm_89+; exact, every e4m3 value is a float16),
  # the queries cast to float16 (exact within float16's range, where normed queries stay) and the
  # probabilities rounded to float16 for the value dot (3 more mantissa bits than bf16): f16 x f16
  # -> f32 dots on the same tensor cores. Close to, not bit for bit, the bf16 variants.
  fp8_widen: str = "cast"
  # Schedule: the decode forward in two row halves, each half's cache attention on a second GPU
  # stream (`platform.on_gpu_stream`), so one half's attention (HBM-bound) can run beside the
  # other half's matmuls (tensor cores). `transformer.Transformer._unrolled_halves`.
  halves: bool = False
  # A program of 32 or more query rows whose first half sees nothing runs its dots on the second
  # half only: the capped loop's forward is 2b tokens wide for every row (slots.py, commit cap) and
  # a mid-block row's first b tokens are invisible, so at sdar_4b (4 query heads a K/V head) each
  # such program would do twice the q.k and p.v work its visible rows need. The rows are
  # token-major, so those are the first half. Invisible rows get what the full program gives them
  # (output 0, EMPTY_LSE); the visible rows' sums run over the same keys in the same order.
  visible_half: bool = False
  # Rows with the same prompt (an RL group's members) read its cached K/V from one row, the first
  # with that prompt (`KVCache.with_prompt_sources`, set by the sampler): those reads hit L2
  # instead of HBM. Whole tiles below the shared slots only; the values read are the same.
  share_prompts: bool = False
  # Cascade attention (Hydragen; Juravsky et al. 2024): rows in contiguous groups that share a
  # prompt (an RL group) attend to its whole shared tiles once per group, with every member's
  # queries stacked into one program's tile (a matmul over the prompt instead of a GEMV per row),
  # and to the rest of their slots alone; the two parts merge by log-sum-exp like two programs of
  # a row. `prompt_group` is the group size: set by `sampler.decode` from the layout's prompt
  # sources (0 where the rows are not such groups), never by hand; the grouped prefill
  # (`SamplerConfig.prefill_once_per_group`) reads it too. Single device, no `halves`; elsewhere
  # `share_prompts`' reads, if on, else each row's own.
  cascade: bool = False
  prompt_group: int = 0
  # The cascade's group launch: its largest query tile (a group's m * R query rows in tiles of up to
  # this many; each tile reads the group's prompt once) and its warps (0: `num_warps`).
  group_block_q: int = 64
  group_warps: int = 0

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
    if not isinstance(self.splits, int) or isinstance(self.splits, bool) or self.splits < 0:
      raise ValueError(f"DecodeTiles.splits must be an int >= 0, got {self.splits!r}")
    if self.fp8_widen not in FP8_WIDENS:
      raise ValueError(f"DecodeTiles.fp8_widen must be one of {FP8_WIDENS}, got {self.fp8_widen!r}")
    if not isinstance(self.prompt_group, int) or isinstance(self.prompt_group, bool):
      raise ValueError(f"DecodeTiles.prompt_group must be an int, got {self.prompt_group!r}")
    if self.prompt_group < 0 or self.prompt_group == 1:
      raise ValueError(
        f"DecodeTiles.prompt_group must be 0 (no groups) or a group size >= 2, got "
        f"{self.prompt_group}"
      )
    pow2 = lambda v, lo: (
      isinstance(v, int) and not isinstance(v, bool) and v >= lo and not v & (v - 1)
    )  # noqa: E731
    if not pow2(self.group_block_q, 16):
      raise ValueError(
        f"DecodeTiles.group_block_q must be a power of two >= 16, got {self.group_block_q!r}"
      )
    if self.group_warps != 0 and not pow2(self.group_warps, 1):
      raise ValueError(
        f"DecodeTiles.group_warps must be 0 or a power of two, got {self.group_warps!r}"
      )
    for name in ("dynamic_loop", "fold_new", "halves", "visible_half", "share_prompts", "cascade"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"DecodeTiles.{name} must be a bool, got {getattr(self, name)!r}")


MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
EMPTY_LSE = -1e30  # log-sum-exp of a row that sees no key
NEW_TILE = 16  # the new tokens' keys are padded to this many (a dot's smallest side on Triton)

# float8_e4m3fn -> bf16, four values per instance (Triton's own e5m2 -> bf16 sequence, with e4m3's
# shift): each byte to the high byte of a 16-bit lane (prmt), sign off, exponent and mantissa
# shifted into bf16's fields (>> 4), sign back (lop3), then x 2^120 (the biases differ by 120;
# fp8 subnormals land on bf16 subnormals, which the bf16 multiply keeps). No cvt instruction.
_E4M3_TO_BF16_ASM = """{
.reg .b32 a<2>, b<2>, s;
mov.b32 s, 0x7b807b80;
prmt.b32 a0, 0, $2, 0x5140;
prmt.b32 a1, 0, $2, 0x7362;
and.b32 b0, a0, 0x7fff7fff;
and.b32 b1, a1, 0x7fff7fff;
shr.b32 b0, b0, 4;
shr.b32 b1, b1, 4;
lop3.b32 b0, b0, 0x80008000, a0, 0xf8;
lop3.b32 b1, b1, 0x80008000, a1, 0xf8;
mul.rn.bf16x2 $0, b0, s;
mul.rn.bf16x2 $1, b1, s;
}"""


def e4m3_bits_to_bf16(u):
  """float8_e4m3fn bytes `u` (uint8) as bf16 without a float conversion of normal values: sign to
  bit 15, exponent and mantissa into bf16's fields with the bias difference (120) added to the
  exponent. Subnormal bytes (|x| < 2^-6, exponent field 0) are m * 2^-9, made in float32 (exact;
  `_E4M3_TO_BF16_ASM` gets them from bf16 subnormals instead, which XLA's CPU flushes). The values
  of `_E4M3_TO_BF16_ASM` and of a cast; NaN bytes (0x7f, 0xff) are not mapped: the cache never
  holds them (`kv_cache.to_cache_dtype` saturates)."""
  w = u.astype(jnp.uint16)
  mag, sign = w & 0x7F, (w & 0x80) << 8
  normal = lax.bitcast_convert_type(((mag << 4) + (120 << 7)) | sign, jnp.bfloat16)
  sub = jnp.where(sign > 0, -1.0, 1.0) * mag.astype(jnp.float32) * 2.0**-9
  return jnp.where(mag < 8, sub.astype(jnp.bfloat16), normal)


def _widen(x, dtype, how: str):
  """A cache tile in the queries' dtype (`DecodeTiles.fp8_widen`; other dtypes: a plain cast)."""
  if x.dtype != jnp.float8_e4m3fn or how == "cast" or jnp.dtype(dtype) != jnp.bfloat16:
    return x.astype(dtype)
  u = lax.bitcast_convert_type(x, jnp.uint8)
  if how == "asm":
    (y,) = plgpu.elementwise_inline_asm(
      _E4M3_TO_BF16_ASM,
      args=[u],
      constraints="=r,=r,r",
      pack=4,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)],
    )
    return y
  return e4m3_bits_to_bf16(u)


def _dot(a, b):
  return lax.dot_general(
    a, b, (((a.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32
  )


def _visible(q_seg, q_rank, k_seg, k_rank):
  return (
    (q_seg[:, None] == k_seg[None, :]) & (q_seg[:, None] > 0) & (k_rank[None, :] <= q_rank[:, None])
  )


def _online_tile(carry, q, k, load_v, vis, qk_scale):
  """One tile of the online softmax (base 2): (o, m, l) after keys `k` `[N, H]` visible where
  `vis` `[R, N]`; `load_v()` reads the tile's values (after the scores, as the loop always did)."""
  o_prev, m_prev, l_prev = carry
  qk = _dot(q, k.T) * qk_scale
  qk = jnp.where(vis, qk, MASK_VALUE)
  m_next = jnp.maximum(m_prev, jnp.max(qk, axis=-1))
  corr = jnp.exp2(m_prev - m_next)
  p = jnp.where(vis, jnp.exp2(qk - m_next[:, None]), 0.0)
  l_next = corr * l_prev + p.sum(axis=-1)
  v = load_v()
  o_next = corr[:, None] * o_prev + _dot(p.astype(v.dtype), v)
  return o_next, m_next, l_next


def _kernel(
  layer_ref,
  lo_ref,
  ntiles_ref,
  q_ref,
  k_ref,
  v_ref,
  qseg_ref,
  qrank_ref,
  kseg_ref,
  krank_ref,
  *refs,
  scale,
  block_k,
  max_tiles,
  dynamic_loop,
  fold_new,
  widen,
  half,
  shared,
  row_offset,
):
  """One (row, K/V head, query tile, program): online softmax over the program's live tiles
  (`block_k` slots each, from tile `lo_ref` on, `ntiles_ref` of them; 0 = none), then with
  `fold_new` the row's new keys (`refs[:4]`: k, v, segments, ranks) as one more tile of program 0.
  With `half` (`DecodeTiles.visible_half`) a tile whose first half of query rows is invisible
  attends with its second half only. With `shared` (`DecodeTiles.share_prompts`) k/v hold every
  row and a tile wholly below the row's shared prompt slots is read from the prompt's source row
  (`refs` after the new keys: the source's offset, the shared slots)."""
  o_ref, lse_ref = refs[-2:]
  layer = layer_ref[0]
  if not shared:

    def at_row(ref, sl):  # the program's own row block
      return ref[layer, sl, :]

  else:
    delta_ref, nshared_ref = refs[4 if fold_new else 0 :][:2]
    own = pl.program_id(0) + row_offset
    src = own + delta_ref[0]
    src = jnp.where(src >= 0, src, own)  # a source on another device: the row's own copy
    n_shared = nshared_ref[0]

    def at_row(ref, sl):
      t_end = sl.start + block_k  # the tile [start, start + block_k) is shared if wholly below
      return ref[layer, jnp.where(t_end <= n_shared, src, own), sl, :]

  # read before the half path's cond (the interpreter has no program_id inside one)
  first_program = pl.program_id(3) == 0 if fold_new and half else None

  def attend(rows):  # the query rows `rows` (a pl.ds; ... = all) of this tile: softmax, outputs
    by_row = ... if rows is ... else (rows, slice(None))  # [R, H] refs: all as before, or a part
    q = q_ref[by_row]
    if widen == "f16" and k_ref.dtype == jnp.float8_e4m3fn:  # f16 dots (`DecodeTiles.fp8_widen`)
      q = q.astype(jnp.float16)
    q_seg, q_rank = qseg_ref[rows], qrank_ref[rows]
    n, h = q.shape
    qk_scale = scale * math.log2(math.e)
    base = lo_ref[0] * block_k

    def tile(j, carry):
      sl = pl.ds(pl.multiple_of(base + j * block_k, block_k), block_k)
      k = _widen(at_row(k_ref, sl), q.dtype, widen)  # a float8 cache is widened tile by tile
      vis = _visible(q_seg, q_rank, kseg_ref[sl], krank_ref[sl])
      load_v = lambda: _widen(at_row(v_ref, sl), q.dtype, widen)
      return _online_tile(carry, q, k, load_v, vis, qk_scale)

    init = (
      jnp.zeros((n, h), jnp.float32),
      jnp.full((n,), MASK_VALUE, jnp.float32),
      jnp.zeros((n,), jnp.float32),
    )
    n_live = ntiles_ref[0]
    if dynamic_loop:  # a dynamic-bound scf.for on Triton
      carry = lax.fori_loop(0, n_live, tile, init)
    else:
      skip = lambda j, carry: lax.cond(j < n_live, tile, lambda _, c: c, j, carry)
      carry = lax.fori_loop(0, max_tiles, skip, init)
    if fold_new:
      kn_ref, vn_ref, nseg_ref, nrank_ref = refs[:4]
      vis = _visible(q_seg, q_rank, nseg_ref[...], nrank_ref[...]) & (
        pl.program_id(3) == 0 if first_program is None else first_program
      )
      kn, load_vn = kn_ref[...].astype(q.dtype), lambda: vn_ref[...].astype(q.dtype)
      carry = _online_tile(carry, q, kn, load_vn, vis, qk_scale)
    o, m, l = carry
    empty = l == 0.0
    o_ref[by_row] = jnp.where(empty[:, None], 0.0, o / jnp.where(empty, 1.0, l)[:, None])
    lse_ref[rows] = jnp.where(
      empty, EMPTY_LSE, (m + jnp.log2(jnp.where(empty, 1.0, l))) * math.log(2)
    )

  if not half:
    attend(...)  # the whole tile, indexed as before the half path existed
    return
  hq = q_ref.shape[0] // 2
  first_dead = jnp.max(qseg_ref[pl.ds(0, hq)]) <= 0  # no first-half row can see a key

  @pl.when(first_dead)
  def _():
    o_ref[pl.ds(0, hq), :] = jnp.zeros((hq, o_ref.shape[-1]), o_ref.dtype)
    lse_ref[pl.ds(0, hq)] = jnp.full((hq,), EMPTY_LSE, lse_ref.dtype)
    attend(pl.ds(hq, hq))

  @pl.when(jnp.logical_not(first_dead))
  def _():
    attend(...)


def _pallas_cache_part(
  layer,
  lo,
  ntiles,
  q_bkrh,
  k_cache,
  v_cache,
  q_seg,
  q_rank,
  k_seg,
  k_rank,
  *extra,
  tiles,
  block_q,
  max_tiles,
  row_offset,
  interpret,
  n_new,
  row_stride=1,
):
  """The kernel launch on (local) arrays; returns per-program (o, lse). `new`: the padded new
  keys, values, segments and ranks when `tiles.fold_new` (`n_new` = 4), then the prompt sources'
  offsets and shared slots `[B]` when `tiles.share_prompts`. Row i of q reads cache row
  `row_offset + i * row_stride` (a stride: the first rows of `DecodeTiles.cascade`'s groups);
  head j of the cache `[L, B, S, K*H]` is its j-th H-wide column block."""
  new, prefix = extra[:n_new], extra[n_new:]
  b, kh, rp, h = q_bkrh.shape
  n_layers, s = k_cache.shape[0], k_cache.shape[2]
  n_prog = ntiles.shape[1]
  params = (
    plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if plgpu is not None
    else None
  )
  per_prog = pl.BlockSpec((None, 1), lambda i, j, t, c: (i, c))
  qrow = pl.BlockSpec((None, block_q), lambda i, j, t, c: (i, t))
  krow = pl.BlockSpec((None, s), lambda i, j, t, c: (i, 0))
  kv = pl.BlockSpec(
    (n_layers, None, s, h), lambda i, j, t, c: (0, i * row_stride + row_offset, 0, j)
  )
  prefix_specs = []
  if prefix:  # every row's block: a tile may come from another row (`_kernel`'s `shared`)
    kv = pl.BlockSpec((n_layers, k_cache.shape[1], s, h), lambda i, j, t, c: (0, 0, 0, j))
    per_row = pl.BlockSpec((1,), lambda i, j, t, c: (i,))
    prefix_specs = [per_row, per_row]
  new_specs = []
  if new:
    tp = new[0].shape[1]
    new_kv = pl.BlockSpec((None, tp, None, h), lambda i, j, t, c: (i, 0, j, 0))
    new_row = pl.BlockSpec((None, tp), lambda i, j, t, c: (i, 0))
    new_specs = [new_kv, new_kv, new_row, new_row]
  out_o = pl.BlockSpec((None, None, None, block_q, h), lambda i, j, t, c: (i, j, c, t, 0))
  out_l = pl.BlockSpec((None, None, None, block_q), lambda i, j, t, c: (i, j, c, t))
  widen = "bits" if interpret and tiles.fp8_widen == "asm" else tiles.fp8_widen
  return pl.pallas_call(
    functools.partial(
      _kernel,
      scale=h**-0.5,
      block_k=tiles.block_k,
      max_tiles=max_tiles,
      dynamic_loop=tiles.dynamic_loop,
      fold_new=bool(new),
      widen=widen,
      half=tiles.visible_half and block_q >= 32,  # each half a dot's 16 rows at least
      shared=bool(prefix),
      row_offset=row_offset,
    ),
    grid=(b, kh, rp // block_q, n_prog),
    in_specs=[
      pl.BlockSpec((1,), lambda i, j, t, c: (0,)),
      per_prog,
      per_prog,
      pl.BlockSpec((None, None, block_q, h), lambda i, j, t, c: (i, j, t, 0)),
      kv,
      kv,
      qrow,
      qrow,
      krow,
      krow,
      *new_specs,
      *prefix_specs,
    ],
    out_specs=[out_o, out_l],
    out_shape=[
      jax.ShapeDtypeStruct((b, kh, n_prog, rp, h), jnp.float32),
      jax.ShapeDtypeStruct((b, kh, n_prog, rp), jnp.float32),
    ],
    compiler_params=params,
    interpret=interpret,
    name="flash_decode_cache",
  )(layer, lo, ntiles, q_bkrh, k_cache, v_cache, q_seg, q_rank, k_seg, k_rank, *new, *prefix)


def _mesh_size() -> int:
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh is None or mesh.empty else mesh.size


def _shard_mapped(fn, rows: int, kv_heads: int, fold_new: bool = False, shared: bool = False):
  """Under a mesh context (`jax.set_mesh`), launch the kernel per shard: rows over data/fsdp and
  K/V heads over `tensor` where they divide (a Pallas call has no partitioning rule; without this
  XLA would gather the whole cache onto every device). Mirrors `flash_bd._shard_mapped`."""
  if _mesh_size() == 1:
    return fn
  mesh = jax.sharding.get_abstract_mesh()
  P = jax.sharding.PartitionSpec
  row, head = sharding_lib.kernel_axes(mesh, rows, (kv_heads,))
  vec = P(row, None)
  new_kv = P(row, None, head, None)
  in_specs = (
    P(None),
    vec,
    vec,
    P(row, head, None, None),
    P(None, row, None, head),  # the cache [L, B, S, K*H]: whole heads per shard
    P(None, row, None, head),
    vec,
    vec,
    vec,
    vec,
    *((new_kv, new_kv, vec, vec) if fold_new else ()),
    *((P(row), P(row)) if shared else ()),
  )
  out_specs = (P(row, head, None, None, None), P(row, head, None, None))
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def tile_plan(fill_b, row_live_b, max_len: int, tiles: DecodeTiles):
  """Where each of a row's programs reads: (first tile `[B, P]`, number of tiles `[B, P]`, the
  most tiles any program can get). `block_k` tiles below the row's fill (`fill_b` slots) are
  live; rows with no live query get none. P = `tiles.splits` programs sharing the live tiles
  equally, else one program per `tiles.split` slots."""
  n_tiles = max_len // tiles.block_k
  live = -(-jnp.clip(fill_b, 0, max_len) // tiles.block_k)
  if tiles.splits:
    n_prog, most = tiles.splits, -(-n_tiles // tiles.splits)
    per = -(-live // n_prog)
    lo = jnp.arange(n_prog, dtype=jnp.int32)[None, :] * per[:, None]
    n = jnp.clip(live[:, None] - lo, 0, per[:, None])
  else:
    n_prog, most = -(-max_len // tiles.split), tiles.split // tiles.block_k
    lo = jnp.broadcast_to(jnp.arange(n_prog, dtype=jnp.int32) * most, (fill_b.shape[0], n_prog))
    n = jnp.clip(live[:, None] - lo, 0, most)
  n = jnp.where(row_live_b[:, None], n, 0)
  return lo.astype(jnp.int32), n.astype(jnp.int32), most


def live_tiles(fill_b, row_live_b, max_len: int, tiles: DecodeTiles):
  """`[B, P]` int32: per row and program, the `block_k` tiles it reads (`tile_plan`)."""
  return tile_plan(fill_b, row_live_b, max_len, tiles)[1]


def _pad_rows(x, to: int, axis: int):
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, to - x.shape[axis])
  return jnp.pad(x, pad) if to > x.shape[axis] else x


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
  tiles: DecodeTiles = DecodeTiles(),
  interpret=None,
  new_kv=None,
  row_offset: int = 0,
  prompt_sources=None,
  prompt_group: int = 0,
):
  """Softmax attention of query rows over the cache slots of one layer.

  q `[B, K, R, H]` (R query rows per K/V head); k/v the stacked cache `[L, B', S, K*H]` (head j
  the j-th H-wide column block: `kv_cache.KVCache`'s layout) and the layer index `layer` (scalar): the kernel reads that layer in place, so no per-layer copy of the
  cache is made; query row b reads cache row `row_offset + b` (a part of the rows, on one device).
  int32 vectors: query rows `[B, R]`, slots `[B, S]` (segment 0 = invisible); `fill_b [B]`: slots
  at or above it are never read. S must be a multiple of `tiles.block_k`. `new_kv`: (keys, values
  `[B, T, K, H]`, segments, ranks `[B, T]`) of the new tokens, attended in the kernel under the
  same rule (`tiles.fold_new`). `prompt_sources`: (offset of the source row `[B]`, shared slots
  `[B]`) of `KVCache.with_prompt_sources`, honoured when `tiles.share_prompts`. `prompt_group`
  (with `prompt_sources`, one device): rows in groups of this many attend to their group's shared
  tiles together (`DecodeTiles.cascade`, `_group_prompt_part`). Returns (o `[B, K, R, H]` f32, lse
  `[B, K, R]` f32, natural log; EMPTY_LSE where no slot is visible).
  """
  b, kh, r, _ = q_bkrh.shape
  s = k_cache.shape[2]
  if s % tiles.block_k:
    raise ValueError(
      f"flash_decode: cache length {s} must be a multiple of block_k {tiles.block_k}"
    )
  if row_offset and _mesh_size() > 1:
    raise ValueError("flash_decode: row_offset (DecodeTiles.halves) needs a single-device mesh")
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
  lo, ntiles, most = tile_plan(fill_b, jnp.any(q_seg_br > 0, axis=-1), s, tiles)
  layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
  grouped = None
  if prompt_group > 1 and prompt_sources is not None:
    if row_offset or _mesh_size() > 1 or b % prompt_group:
      raise ValueError(
        f"flash_decode: prompt_group {prompt_group} needs one device, no row_offset and rows "
        f"({b}) in whole groups"
      )
    grouped = _group_prompt_part(
      q_bkrh, k_cache, v_cache, layer, q_seg_br, q_rank_br, k_seg_bs, k_rank_bs,
      prompt_sources, prompt_group, tiles, interpret,
    )  # fmt: skip
    lo, ntiles = _above(lo, ntiles, grouped[2])
  new = ()
  if new_kv is not None:
    kn, vn, nseg, nrank = new_kv
    tp = -(-kn.shape[1] // NEW_TILE) * NEW_TILE
    new = (
      _pad_rows(kn, tp, 1),
      _pad_rows(vn, tp, 1),
      _pad_rows(nseg.astype(jnp.int32), tp, 1),
      _pad_rows(nrank.astype(jnp.int32), tp, 1),
    )
  prefix = ()
  if tiles.share_prompts and prompt_sources is not None and grouped is None:
    prefix = tuple(jnp.asarray(x, jnp.int32) for x in prompt_sources)
  args = (
    layer,
    lo,
    ntiles,
    q_bkrh,
    k_cache,
    v_cache,
    q_seg_br.astype(jnp.int32),
    q_rank_br.astype(jnp.int32),
    k_seg_bs.astype(jnp.int32),
    k_rank_bs.astype(jnp.int32),
    *new,
    *prefix,
  )
  call = functools.partial(
    _pallas_cache_part,
    tiles=tiles,
    block_q=block_q,
    max_tiles=most,
    row_offset=row_offset,
    interpret=interpret,
    n_new=len(new),
  )
  o, lse = _shard_mapped(call, b, kh, bool(new), bool(prefix))(*args)
  if grouped is not None:  # the group's prompt as one more program of each row
    o, lse = jnp.concatenate([grouped[0], o], axis=2), jnp.concatenate([grouped[1], lse], axis=2)
  o, lse = o[..., :r, :], lse[..., :r]
  if o.shape[2] == 1:  # one program a row (`split` >= the cache): nothing to merge
    return o[:, :, 0], lse[:, :, 0]
  # Merge the programs by log-sum-exp.
  m = jnp.max(lse, axis=2)
  w = jnp.exp(lse - m[:, :, None])
  total = jnp.sum(w, axis=2)
  o = jnp.sum(w[..., None] * o, axis=2) / total[..., None]
  return o, m + jnp.log(total)


def _above(lo, ntiles, floor_b):
  """A tile plan (`tile_plan`'s lo, n `[B, P]`) cut to the tiles at or above `floor_b` `[B]`."""
  start = jnp.maximum(lo, floor_b[:, None])
  return start, jnp.maximum(lo + ntiles - start, 0).astype(jnp.int32)


def _group_prompt_part(
  q_bkrh, k_cache, v_cache, layer, q_seg, q_rank, k_seg, k_rank, prompt_sources, m, tiles, interpret
):
  """`DecodeTiles.cascade`: each group of `m` rows attends to its shared prompt tiles once, all
  members' query rows `[m * R]` in one kernel row reading the group's first cache row. A row is
  in its group only where its source (`prompt_sources`' offsets) is that first row; the group's
  shared tiles are the whole tiles below every member's shared slots. Returns (o `[B, K, 1, R,
  H]`, lse `[B, K, 1, R]`) as one more program of each row, and each row's shared tiles `[B]`
  (0 outside a group: the row reads them itself)."""
  b, kh, r, h = q_bkrh.shape
  g = b // m
  offset, slots = (jnp.asarray(x, jnp.int32) for x in prompt_sources)
  rows = jnp.arange(b, dtype=jnp.int32)
  member = (rows + offset) == rows // m * m
  below = jnp.where(member & (offset < 0), slots // tiles.block_k, jnp.iinfo(jnp.int32).max)
  group_tiles = jnp.min(below.reshape(g, m), axis=1)
  group_tiles = jnp.where(group_tiles == jnp.iinfo(jnp.int32).max, 0, group_tiles)
  shared_b = jnp.where(member, jnp.repeat(group_tiles, m), 0)
  q_seg = jnp.where(member[:, None], q_seg, 0)  # a row outside its group: nothing visible here
  stack = lambda x: x.reshape(g, m, *x.shape[1:])  # noqa: E731
  q_g = stack(q_bkrh).transpose(0, 2, 1, 3, 4).reshape(g, kh, m * r, h)
  seg_g, rank_g = stack(q_seg).reshape(g, m * r), stack(q_rank).reshape(g, m * r)
  live = jnp.any(seg_g > 0, axis=-1)
  n = jnp.where(live, group_tiles, 0)[:, None].astype(jnp.int32)
  block_q = 16
  while block_q < min(m * r, tiles.group_block_q):
    block_q *= 2
  o, lse = _pallas_cache_part(
    layer,
    jnp.zeros_like(n),
    n,
    q_g,
    k_cache,
    v_cache,
    seg_g.astype(jnp.int32),
    rank_g.astype(jnp.int32),
    k_seg[::m].astype(jnp.int32),
    k_rank[::m].astype(jnp.int32),
    tiles=dataclasses.replace(
      tiles, fold_new=False, share_prompts=False, num_warps=tiles.group_warps or tiles.num_warps
    ),
    block_q=block_q,
    max_tiles=k_cache.shape[2] // tiles.block_k,
    row_offset=0,
    interpret=interpret,
    n_new=0,
    row_stride=m,
  )
  o = o.reshape(g, kh, 1, m, r, h).transpose(0, 3, 1, 2, 4, 5).reshape(b, kh, 1, r, h)
  lse = lse.reshape(g, kh, 1, m, r).transpose(0, 3, 1, 2, 4).reshape(b, kh, 1, r)
  return o, lse, shared_b


def _rows(x, start: int, n: int):
  return x if start == 0 and n == x.shape[0] else x[start : start + n]


def cached_attention(
  q,
  k,
  v,
  layer,
  spec,
  positions,
  seg,
  blk,
  cache,
  *,
  interpret=None,
  cache_part_fn=None,
  row_offset: int = 0,
):
  """`transformer.cached_attention` for layer `layer` of `cache` (its stacked `[L,B,S,K*H]` K/V
  are read in place): q `[B,T,N,H]`, k/v `[B,T,K,H]` (new tokens) -> `[B,T,N,H]`, for cache rows
  [row_offset, row_offset + B) (`DecodeTiles.halves`; all rows by default).
  `cache_part_fn`: another kernel with `cache_part`'s contract (`flash_tpu.cache_part` on TPU)."""
  from dice_jax.model import masks as masks_lib  # local: avoids an import cycle

  if spec.kind == "block_diffusion":
    raise ValueError("block_diffusion attention is a training layout; it takes no KV cache")
  b, t, n, h = q.shape
  kh = k.shape[2]
  g = n // kh
  if cache_part_fn is not None and row_offset:
    raise ValueError("flash_decode: row_offset is a Triton-kernel option (DecodeTiles.halves)")
  length = _rows(cache.length, row_offset, b)
  filled = jnp.arange(cache.max_len)[None, :] < length[:, None]
  k_seg = jnp.where(filled, _rows(cache.segment_ids, row_offset, b), 0)
  if spec.kind == "causal":
    q_rank, k_rank = positions, _rows(cache.positions, row_offset, b)
    m_self = masks_lib.causal_mask(positions, positions, seg, seg)
  elif spec.kind == "block_causal":
    q_rank, k_rank = blk, _rows(cache.block_ids, row_offset, b)
    m_self = masks_lib.block_causal_mask(blk, blk, seg, seg)
  else:
    q_rank, k_rank = jnp.zeros_like(blk), jnp.zeros_like(cache.block_ids[:b])
    m_self = masks_lib.full_mask(seg, seg)
  # Query rows per K/V head, ordered (t, g).
  qg = q.reshape(b, t, kh, g, h)
  q_rows = qg.transpose(0, 2, 1, 3, 4).reshape(b, kh, t * g, h)
  rep = lambda x: jnp.repeat(x, g, axis=1)
  if cache.k.dtype not in (q.dtype, jnp.float8_e4m3fn):  # a cast would copy the whole cache
    raise ValueError(
      f"flash_decode: cache dtype {cache.k.dtype} is neither the queries' {q.dtype} nor float8_e4m3fn"
    )
  fold = cache.tiles.fold_new and cache_part_fn is None
  part = cache_part if cache_part_fn is None else cache_part_fn
  extra = dict(new_kv=(k, v, seg, q_rank)) if fold else {}
  if row_offset:
    extra["row_offset"] = row_offset
  tiles = cache.tiles
  if (
    (tiles.share_prompts or tiles.cascade) and cache.prompt_offset is not None and not cache_part_fn
  ):
    extra["prompt_sources"] = (
      _rows(cache.prompt_offset, row_offset, b),
      _rows(cache.prompt_slots, row_offset, b),
    )
    m = tiles.prompt_group
    if tiles.cascade and m > 1 and not row_offset and _mesh_size() == 1 and b % m == 0:
      extra["prompt_group"] = m  # else share_prompts' reads (if on) or each row's own
  o_c, lse_c = part(
    q_rows,
    cache.k,
    cache.v,
    layer,
    rep(seg),
    rep(q_rank),
    k_seg,
    k_rank,
    length,
    tiles=cache.tiles,
    interpret=interpret,
    **extra,
  )
  o_c = o_c.reshape(b, kh, t, g, h)
  if fold:  # the kernel's softmax already covers the new keys
    return o_c.transpose(0, 2, 1, 3, 4).reshape(b, t, n, h).astype(q.dtype)
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
