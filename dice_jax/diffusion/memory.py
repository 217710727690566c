"""Device-memory estimate of a sampler setting, checked before anything is compiled.

weights + KV cache (rows x cache slots, K and V of every layer) + the larger of the two phases'
activations: a decode forward (2b tokens per row: hidden states, MLP, f32 logits and the sampling
temporaries over the vocabulary; an upper bound for `SamplerConfig.commit_rows`, whose forward runs
the per-token work on b + R*b/rows tokens a row and scatters q/k/v back to 2b) or a prefill chunk (its rows x width tokens, and the K/V of every
layer it returns before they are written into the cache). The cache is stored in the layout the
TPU cache kernel reads (`kv_cache.KVCache`: `[L, B, S, K*H]`), so no step copies it (before issue
38 a `[L, B, S, K, H]` cache was relaid out into a temporary every TPU decode step: 5.7 of the 6.2
GiB of temporaries of sdar_1p7b's decode on a v5e-8, docs/tpu.md). The estimate is an upper-bound-minded
sum, not XLA's exact plan: it exists to fail early with a readable message instead of an
out-of-memory error from inside a compiled call.
"""

from __future__ import annotations

import os
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
  weights_dtype=None,
  row_shards: int = 1,
  head_shards: int = 1,
  param_shards: int = 1,
  prefill_group: int = 1,
) -> dict:
  """Bytes by part on one device: `weights` (the parameters, plus their per-layer compute-dtype
  copy when `decode_weights`: `transformer.DecodeWeights`, its projections in `weights_dtype`
  when given), `kv_cache` (of `cache_dtype`, default the compute dtype), `activations`, and their `total`. On a mesh (`placement.Placement.shards`)
  the weights are split `param_shards` ways, the cache over `row_shards` x `head_shards` and the
  activations over `row_shards` (rows that do not divide count whole: `-(-rows // row_shards)`).
  `prefill_group` > 1: one row of each group of that many runs the prefill forward
  (`SamplerConfig.prefill_once_per_group`); its K/V are written to each member's cache row in
  place (`slots.admit`), so the prefill's buffers are the leaders' alone.
  `decode` and `prefill` are each phase's activations (`activations` the larger). The same on
  every platform: the TPU decode reads the cache in place (module docstring)."""
  c = model_cfg
  rows = -(-rows // row_shards)
  prefill_rows = -(-prefill_rows // row_shards)
  act = jnp.dtype(c.compute_dtype).itemsize
  weights = c.num_params() * jnp.dtype(c.weight_dtype).itemsize
  if decode_weights:  # every layer and the LM head; not the embedding (gathered in place)
    embed = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
    split = c.num_params() - embed - c.hidden_size
    if weights_dtype is not None:  # float8 projections (1 byte; scales negligible), the rest as is
      proj = c.num_layers * _projection_params(c)
      weights += (split - proj) * act + proj * jnp.dtype(weights_dtype).itemsize
    else:
      weights += split * act
  cache = KVCache.num_bytes(c, rows, cache_len, cache_dtype)
  per_token = act * (4 * c.hidden_size + 3 * c.intermediate_size + 2 * c.num_heads * c.head_dim)
  decode_tokens = rows * 2 * block_size
  decode = decode_tokens * per_token + 4 * 4 * rows * block_size * c.vocab_size
  # Split-merge buffers of the flash cache kernel: f32 [rows, K, splits, 2b * G, H].
  decode += 4 * rows * c.num_heads * 2 * block_size * c.head_dim * max(1, cache_len // 512)
  lead_tokens = -(-prefill_rows // prefill_group) * prefill_width
  kv_bytes = lambda tokens: 2 * c.num_layers * tokens * c.num_kv_heads * c.head_dim * act
  # the leaders' K/V, and the copy the cache write takes of them (fused heads, cache dtype)
  prefill = lead_tokens * per_token + 2 * kv_bytes(lead_tokens)
  weights, cache = -(-weights // param_shards), -(-cache // head_shards)
  activations = max(decode, prefill)
  return dict(
    weights=weights,
    kv_cache=cache,
    activations=activations,
    decode=decode,
    prefill=prefill,
    total=weights + cache + activations,
  )


def _projection_params(c) -> int:
  """Parameters of one layer's projection matrices (q/k/v, o, gate/up, down)."""
  attn = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
  return attn + 3 * c.hidden_size * c.intermediate_size


def device_limit() -> Optional[int]:
  """Bytes the first local device may allocate: the backend's limit, or on CPU the host's memory
  (`host_memory`); None where neither is known."""
  device = jax.local_devices()[0]
  stats = device.memory_stats() or {}
  if "bytes_limit" in stats:
    return stats["bytes_limit"]
  return host_memory() if device.platform == "cpu" else None


def limit_name() -> str:
  """What `device_limit` measures here: 'host memory' (CPU) or 'device memory'."""
  return "host memory" if jax.local_devices()[0].platform == "cpu" else "device memory"


def host_memory() -> Optional[int]:
  """The machine's physical memory (`MemTotal`), or the process's cgroup limit when smaller (a
  container); None where neither can be read. A fixed figure, not what is free now: a plan made
  from it is the same at every start of a run on this host (a resume makes the same choice)."""
  sizes = []
  try:
    sizes.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
  except (ValueError, OSError, AttributeError):
    pass
  for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
    try:
      with open(path) as f:
        text = f.read().strip()
    except OSError:
      continue
    if text.isdigit() and int(text) < 1 << 60:  # 'max' or a huge number: no limit
      sizes.append(int(text))
  return min(sizes) if sizes else None


def peak_bytes() -> Optional[int]:
  """Peak bytes in use on the first local device so far; on CPU the process's peak resident
  memory (`ru_maxrss`); None where unknown."""
  device = jax.local_devices()[0]
  stats = device.memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    return stats["peak_bytes_in_use"]
  if device.platform != "cpu":
    return None
  import resource

  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


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
    f"prompts, a smaller prefill chunk, or a float8 K/V cache (kv_cache_dtype=float8_e4m3fn: half "
    f"the cache's bytes, approximate decoding)"
  )
