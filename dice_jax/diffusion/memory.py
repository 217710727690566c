"""Device-memory estimate of a sampler setting, checked before anything is compiled.

weights + KV cache (rows x cache slots, K and V of every layer) + the larger of the two phases'
activations: a decode forward (2b tokens per row: hidden states, MLP, f32 logits and the sampling
temporaries over the vocabulary) or a prefill chunk (its rows x width tokens, and the K/V of every
layer it returns before they are written into the cache). The estimate is an upper-bound-minded
sum, not XLA's exact plan: it exists to fail early with a readable message instead of an
out-of-memory error from inside a compiled call.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from dice_jax.model.kv_cache import KVCache

GIB = 1024**3


def estimate(
  model_cfg,
  *,
  rows: int,
  cache_len: int,
  block_size: int,
  prefill_rows: int,
  prefill_width: int,
  decode_weights: bool = False,
  cache_dtype=None,
  row_shards: int = 1,
  head_shards: int = 1,
  param_shards: int = 1,
) -> dict:
  """Bytes by part on one device: `weights` (the parameters, plus their per-layer compute-dtype
  copy when `decode_weights`: `transformer.DecodeWeights`), `kv_cache` (of `cache_dtype`, default
  the compute dtype), `activations`, and their `total`. On a mesh (`placement.Placement.shards`)
  the weights are split `param_shards` ways, the cache over `row_shards` x `head_shards` and the
  activations over `row_shards` (rows that do not divide count whole: `-(-rows // row_shards)`)."""
  c = model_cfg
  rows = -(-rows // row_shards)
  prefill_rows = -(-prefill_rows // row_shards)
  act = jnp.dtype(c.compute_dtype).itemsize
  weights = c.num_params() * jnp.dtype(c.weight_dtype).itemsize
  if decode_weights:  # every layer and the LM head; not the embedding (gathered in place)
    embed = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
    weights += (c.num_params() - embed - c.hidden_size) * act
  cache = KVCache.num_bytes(c, rows, cache_len, cache_dtype)
  per_token = act * (4 * c.hidden_size + 3 * c.intermediate_size + 2 * c.num_heads * c.head_dim)
  decode_tokens = rows * 2 * block_size
  decode = decode_tokens * per_token + 4 * 4 * rows * block_size * c.vocab_size
  # Split-merge buffers of the flash cache kernel: f32 [rows, K, splits, 2b * G, H].
  decode += 4 * rows * c.num_heads * 2 * block_size * c.head_dim * max(1, cache_len // 512)
  pre_tokens = prefill_rows * prefill_width
  kv_layers = 2 * c.num_layers * pre_tokens * c.num_kv_heads * c.head_dim * act
  prefill = pre_tokens * per_token + 2 * kv_layers
  activations = max(decode, prefill)
  weights, cache = -(-weights // param_shards), -(-cache // head_shards)
  return dict(
    weights=weights, kv_cache=cache, activations=activations, total=weights + cache + activations
  )


def device_limit() -> Optional[int]:
  """Bytes the first local device may allocate (None where the backend does not say, e.g. CPU)."""
  stats = jax.local_devices()[0].memory_stats() or {}
  return stats.get("bytes_limit")


def peak_bytes() -> Optional[int]:
  """Peak bytes in use on the first local device so far (None where unknown)."""
  stats = jax.local_devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def check_fits(est: dict, device_bytes: Optional[int] = None, *, what: str = "sampler") -> None:
  """Raises ValueError naming the parts when `est['total']` exceeds the device memory
  (`device_bytes`, default `device_limit()`; nothing is checked where that is unknown)."""
  limit = device_limit() if device_bytes is None else device_bytes
  if limit is None or est["total"] <= limit:
    return
  g = lambda k: est[k] / GIB
  raise ValueError(
    f"{what} does not fit in device memory: needs ~{g('total'):.1f} GiB (weights "
    f"{g('weights'):.1f}, K/V cache {g('kv_cache'):.1f}, activations {g('activations'):.1f}) but "
    f"the device has {limit / GIB:.1f} GiB; use fewer rows/slots, fewer max_new_tokens, shorter "
    f"prompts or a smaller prefill chunk"
  )
