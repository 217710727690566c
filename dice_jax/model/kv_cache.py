"""Key/value cache for block-wise decoding.

Slots are columns of a fixed-size buffer shared by the whole batch: `length` slots are filled,
each with its key/value per layer and the metadata the masks need (position, segment id, block id).
Segment id 0 marks a slot that holds no token (e.g. left padding of a shorter prompt).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  k: jax.Array  # [L, B, S, K, H]
  v: jax.Array  # [L, B, S, K, H]
  positions: jax.Array  # [B, S] int32
  segment_ids: jax.Array  # [B, S] int32, 0 = empty
  block_ids: jax.Array  # [B, S] int32
  length: jax.Array  # [] int32: number of filled slots

  @property
  def max_len(self) -> int:
    return self.k.shape[2]

  @classmethod
  def empty(cls, cfg, batch: int, max_len: int, dtype=None) -> "KVCache":
    dtype = dtype or cfg.compute_dtype
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    z = jnp.zeros((batch, max_len), jnp.int32)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), z, z, z, jnp.zeros((), jnp.int32))

  def append(self, k, v, positions, segment_ids, block_ids) -> "KVCache":
    """Writes `k, v [L,B,T,K,H]` and their metadata `[B,T]` at slots [length, length+T)."""
    at = self.length
    upd = lambda buf, new, axis: jax.lax.dynamic_update_slice_in_dim(
      buf, new.astype(buf.dtype), at, axis=axis
    )
    return KVCache(
      k=upd(self.k, k, 2),
      v=upd(self.v, v, 2),
      positions=upd(self.positions, positions, 1),
      segment_ids=upd(self.segment_ids, segment_ids, 1),
      block_ids=upd(self.block_ids, block_ids, 1),
      length=self.length + k.shape[2],
    )
