"""Key/value cache for block-wise decoding, one region per row.

Row b of the cache belongs to one sequence (a batch row, or a slot of the continuous-batching
engine). Its slots hold keys/values per layer and the metadata the masks need (position, segment
id, block id). A slot is visible when it is below the row's `length` and its segment id is > 0
(0 marks a slot that holds no token: padding, or a stale slot of the row's previous sequence).

Writes go to each row's own offset (`append` at `length[b]`, `write_rows` for whole rows), so rows
advance independently. Every write is an in-place update of the (donated or loop-carried) buffer:
no copy of the cache is made (`tests/diffusion/test_engine.py` checks the compiled memory).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dice_jax.model.flash_decode import DecodeTiles

FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448

# Logical axes of each field (`dice_jax.sharding.RULES`): rows over the data axes, K/V heads over
# `tensor`; a row's slots stay on the device that decodes the row.
_KV_AXES = ("layers", "batch", "cache_length", "kv_heads", "head_dim")
_SLOT_AXES = ("batch", "cache_length")
LOGICAL_AXES = dict(
  k=_KV_AXES,
  v=_KV_AXES,
  positions=_SLOT_AXES,
  segment_ids=_SLOT_AXES,
  block_ids=_SLOT_AXES,
  length=("batch",),
)


def to_cache_dtype(x, dtype):
  """`x` stored as `dtype`; a float8 cache saturates at its largest finite value (a plain cast
  of anything beyond it gives NaN: e4m3fn has no infinity)."""
  if jnp.dtype(dtype) == jnp.float8_e4m3fn:
    x = jnp.clip(x, -FP8_MAX, FP8_MAX)
  return x.astype(dtype)


def put_rows(buf, new, at, row_axis: int):
  """Writes `new` into every row b of `buf` (rows on `row_axis`) at offset `at[b]` along the axis
  right after the rows (slots). One scatter in `buf`'s own layout (a vmapped dynamic-update-slice
  would transpose the rows, and XLA then copies the whole buffer back to its layout)."""
  rows, t = new.shape[row_axis], new.shape[row_axis + 1]
  r = jnp.arange(rows, dtype=jnp.int32)[:, None]
  c = at.astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  idx = (slice(None),) * row_axis + (jnp.broadcast_to(r, (rows, t)), c)
  return buf.at[idx].set(to_cache_dtype(new, buf.dtype), mode="promise_in_bounds")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  k: jax.Array  # [L, B, S, K, H], compute dtype or float8_e4m3fn (flash attention only)
  v: jax.Array  # [L, B, S, K, H]
  positions: jax.Array  # [B, S] int32
  segment_ids: jax.Array  # [B, S] int32, 0 = empty
  block_ids: jax.Array  # [B, S] int32
  length: jax.Array  # [B] int32: slots below it may be visible; appends write there
  tiles: DecodeTiles = dataclasses.field(default=DecodeTiles(), metadata=dict(static=True))

  @property
  def max_len(self) -> int:
    return self.k.shape[2]

  @staticmethod
  def num_bytes(cfg, batch: int, max_len: int, dtype=None) -> int:
    """Bytes of a cache of `batch` rows x `max_len` slots (K and V plus metadata)."""
    item = jnp.dtype(dtype or cfg.compute_dtype).itemsize
    kv = 2 * cfg.num_layers * batch * max_len * cfg.num_kv_heads * cfg.head_dim * item
    return kv + 3 * batch * max_len * 4 + batch * 4

  @classmethod
  def empty(cls, cfg, batch: int, max_len: int, dtype=None, tiles=None) -> "KVCache":
    dtype = dtype or cfg.compute_dtype
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    z = lambda: jnp.zeros((batch, max_len), jnp.int32)  # distinct buffers (donation)
    return cls(
      jnp.zeros(shape, dtype),
      jnp.zeros(shape, dtype),
      z(),
      z(),
      z(),
      jnp.zeros((batch,), jnp.int32),
      tiles or DecodeTiles(),
    )

  def with_length(self, length) -> "KVCache":
    return dataclasses.replace(self, length=jnp.broadcast_to(length, self.length.shape))

  def append(self, k, v, positions, segment_ids, block_ids, at=None) -> "KVCache":
    """Writes `k, v [L,B,T,K,H]` and their metadata `[B,T]` at each row's slots
    [at[b], at[b] + T) (default `at = length`), and sets `length` to `at + T`."""
    at = self.length if at is None else at
    return dataclasses.replace(
      self,
      k=put_rows(self.k, k, at, 1),
      v=put_rows(self.v, v, at, 1),
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
      k=put(self.k, (slice(None), rows, sl), k),
      v=put(self.v, (slice(None), rows, sl), v),
      positions=put(self.positions, rows, positions),
      segment_ids=put(self.segment_ids, rows, segment_ids),
      block_ids=put(self.block_ids, rows, block_ids),
      length=put(self.length, rows, length),
    )
