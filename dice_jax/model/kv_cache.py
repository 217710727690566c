"""Key/value cache for block-wise decoding, one region per row.

Row b of the cache belongs to one sequence (a batch row, or a slot of the continuous-batching
engine). Its slots hold keys/values per layer and the metadata the masks need (position, segment
id, block id). A slot is visible when it is below the row's `length` and its segment id is > 0
(0 marks a slot that holds no token: padding, or a stale slot of the row's previous sequence).

K and V are stored `[L, B, S, K*H]`: each K/V head an H-wide column block, the layout the TPU cache
kernel reads (`flash_tpu.cache_part`; TPU tiles the two minor dimensions, so `[.., K, H]` would be
another layout that XLA relays out into a copy of the whole cache every decode step). On GPU/CPU
`[.., K*H]` and `[.., K, H]` are the same bytes (row-major), so readers that want heads apart
reshape (`KVCache.heads`) for free; the writes take `[.., K, H]` and fuse them.

Writes go to each row's own offset (`append` at `length[b]`, `write_rows` for whole rows), so rows
advance independently. Every write is an in-place update of the (donated or loop-carried) buffer:
no copy of the cache is made (`tests/diffusion/test_engine.py` checks the compiled memory).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dice_jax.model.flash_decode import DecodeTiles

FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448

# Logical axes of each field (`dice_jax.sharding.RULES`): rows over the data axes, K/V heads over
# `tensor`; a row's slots stay on the device that decodes the row. K and V are named by their
# unfused view `[L, B, S, K, H]` (`KVCache.kv_shape`), so `tensor` splits K only where it divides
# K; `fused_spec` gives the stored `[L, B, S, K*H]` that split (whole heads per device).
_KV_AXES = ("layers", "batch", "cache_length", "kv_heads", "head_dim")
_SLOT_AXES = ("batch", "cache_length")
LOGICAL_AXES = dict(
  k=_KV_AXES,
  v=_KV_AXES,
  positions=_SLOT_AXES,
  segment_ids=_SLOT_AXES,
  block_ids=_SLOT_AXES,
  length=("batch",),
  prompt_offset=("batch",),
  prompt_slots=("batch",),
)


def fused_spec(spec) -> P:
  """The `PartitionSpec` of a stored K/V `[L, B, S, K*H]` from that of its `[L, B, S, K, H]`
  view: the fused axis split as K is (whole heads per shard); H is never split."""
  spec = tuple(spec) + (None,) * (5 - len(spec))
  if spec[4] is not None:
    raise ValueError(f"kv_cache: the head_dim axis cannot be split, got {P(*spec)}")
  return P(*spec[:4])


def fuse_heads(x):
  """`[..., K, H]` -> `[..., K*H]` (the stored layout; a free reshape in row-major order)."""
  return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def to_cache_dtype(x, dtype):
  """`x` stored as `dtype`; a float8 cache saturates at its largest finite value (a plain cast
  of anything beyond it gives NaN: e4m3fn has no infinity)."""
  if jnp.dtype(dtype) == jnp.float8_e4m3fn:
    x = jnp.clip(x, -FP8_MAX, FP8_MAX)
  return x.astype(dtype)


def put_rows(buf, new, at, row_axis: int):
  """Writes `new` into every row b of `buf` (rows on `row_axis`) at offset `at[b]` along the axis
  right after the rows (slots). One scatter in `buf`'s own layout (a vmapped dynamic-update-slice
  would transpose the rows, and XLA then copies the whole buffer back to its layout). Its (row,
  slot) indices are distinct and in lexicographic order by construction, and the scatter says so:
  XLA:GPU may then write with plain stores instead of atomic compare-and-swap loops on the 32-bit
  words that hold 2 bf16 or 4 float8 elements (neighbouring elements are other threads' updates)."""
  rows, t = new.shape[row_axis], new.shape[row_axis + 1]
  r = jnp.arange(rows, dtype=jnp.int32)[:, None]
  c = at.astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  idx = (slice(None),) * row_axis + (jnp.broadcast_to(r, (rows, t)), c)
  return buf.at[idx].set(
    to_cache_dtype(new, buf.dtype),
    mode="promise_in_bounds",
    indices_are_sorted=True,
    unique_indices=True,
  )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  k: jax.Array  # [L, B, S, K*H], compute dtype or float8_e4m3fn (flash attention only)
  v: jax.Array  # [L, B, S, K*H]
  positions: jax.Array  # [B, S] int32
  segment_ids: jax.Array  # [B, S] int32, 0 = empty
  block_ids: jax.Array  # [B, S] int32
  length: jax.Array  # [B] int32: slots below it may be visible; appends write there
  head_dim: int = dataclasses.field(metadata=dict(static=True))  # H: the width of a head's block
  tiles: DecodeTiles = dataclasses.field(default=DecodeTiles(), metadata=dict(static=True))
  # Shared prompts (`with_prompt_sources`): row b's slots below `prompt_slots[b]` hold the same
  # K/V as row `b + prompt_offset[b]`'s (the same prompt, prefilled the same way), and the flash
  # kernel reads them there, so the rows of a group read one copy of their prompt (the 16
  # programs of an RL group hit L2 instead of HBM). None: every row reads its own slots.
  prompt_offset: jax.Array | None = None  # [B] int32, <= 0: the source row's offset from b
  prompt_slots: jax.Array | None = None  # [B] int32: slots [0, prompt_slots) are the source's

  def __post_init__(self):
    if not isinstance(self.head_dim, int) or self.head_dim < 1:
      raise ValueError(f"KVCache.head_dim must be a positive int, got {self.head_dim!r}")
    k = getattr(self.k, "shape", None)  # not an array under some tree maps (shardings, specs)
    if k is not None and len(k) == 5:
      raise ValueError(f"KVCache: K/V are stored [L, B, S, K*H] (heads fused), got {k}")

  @property
  def max_len(self) -> int:
    return self.k.shape[2]

  @property
  def kv_shape(self) -> tuple:
    """The shape of K (and V) with the heads apart, `(L, B, S, K, H)`."""
    *lead, kh = self.k.shape
    return (*lead, kh // self.head_dim, self.head_dim)

  def heads(self, x):
    """`x` `[..., K*H]` (K, V or a slice of them) as `[..., K, H]`: a free reshape off TPU."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // self.head_dim, self.head_dim)

  @staticmethod
  def num_bytes(cfg, batch: int, max_len: int, dtype=None) -> int:
    """Bytes of a cache of `batch` rows x `max_len` slots (K and V plus metadata)."""
    item = jnp.dtype(dtype or cfg.compute_dtype).itemsize
    kv = 2 * cfg.num_layers * batch * max_len * cfg.num_kv_heads * cfg.head_dim * item
    return kv + 3 * batch * max_len * 4 + batch * 4

  @classmethod
  def empty(cls, cfg, batch: int, max_len: int, dtype=None, tiles=None) -> "KVCache":
    dtype = dtype or cfg.compute_dtype
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads * cfg.head_dim)
    z = lambda: jnp.zeros((batch, max_len), jnp.int32)  # distinct buffers (donation)
    return cls(
      jnp.zeros(shape, dtype),
      jnp.zeros(shape, dtype),
      z(),
      z(),
      z(),
      jnp.zeros((batch,), jnp.int32),
      cfg.head_dim,
      tiles or DecodeTiles(),
    )

  def with_prompt_sources(self, source, slots) -> "KVCache":
    """Rows whose first `slots[b]` slots equal row `source[b]`'s (`source[b] <= b`) read them
    there (the fields' comment). Only a reader that honours them (the flash kernel) changes; the
    values are the same either way, so every other reader is unaffected."""
    rows = jnp.arange(self.length.shape[0], dtype=jnp.int32)
    source = jnp.asarray(source, jnp.int32)
    return dataclasses.replace(
      self,
      prompt_offset=source - rows,
      prompt_slots=jnp.where(source < rows, jnp.asarray(slots, jnp.int32), 0),
    )

  def with_length(self, length) -> "KVCache":
    return dataclasses.replace(self, length=jnp.broadcast_to(length, self.length.shape))

  def append(self, k, v, positions, segment_ids, block_ids, at=None) -> "KVCache":
    """Writes `k, v [L,B,T,K,H]` and their metadata `[B,T]` at each row's slots
    [at[b], at[b] + T) (default `at = length`), and sets `length` to `at + T`."""
    at = self.length if at is None else at
    return dataclasses.replace(
      self,
      k=put_rows(self.k, fuse_heads(k), at, 1),
      v=put_rows(self.v, fuse_heads(v), at, 1),
      positions=put_rows(self.positions, positions, at, 0),
      segment_ids=put_rows(self.segment_ids, segment_ids, at, 0),
      block_ids=put_rows(self.block_ids, block_ids, at, 0),
      length=at + k.shape[2],
    )

  def write_rows(self, rows, k, v, offset: int, positions, segment_ids, block_ids, length):
    """Replaces rows `rows` `[R]` (int32, distinct): K/V `[L,R,T,K,H]` go to slots
    [offset, offset + T); the rows' metadata become `positions/segment_ids/block_ids [R, S]`
    (whole rows: stale slots of a previous sequence must get segment 0) and `length [R]`.
    A row index >= the cache's rows writes nothing (a padding row of an admission)."""
    t = k.shape[2]
    sl = slice(offset, offset + t)
    put = lambda buf, idx, new: buf.at[idx].set(to_cache_dtype(new, buf.dtype), mode="drop")
    return dataclasses.replace(
      self,
      k=put(self.k, (slice(None), rows, sl), fuse_heads(k)),
      v=put(self.v, (slice(None), rows, sl), fuse_heads(v)),
      positions=put(self.positions, rows, positions),
      segment_ids=put(self.segment_ids, rows, segment_ids),
      block_ids=put(self.block_ids, rows, block_ids),
      length=put(self.length, rows, length),
    )
