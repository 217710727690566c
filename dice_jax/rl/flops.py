"""The useful FLOPs of a TraceRL update: what its model FLOPs utilisation (MFU) counts.

For the rows of one optimizer step (every micro-batch), with 2 FLOPs per multiply-add and the
backward pass counted as twice the forward (training = 3 x forward):

  linear     6 x W x N          W: the decoder layers' matmul weights (q, k, v, o, gate, up, down,
                                all layers); N: real tokens (segment > 0), padding not counted
  attention  12 x layers x heads x head_dim x A
                                A: (query, key) pairs the trace mask allows (QK^T and PV)
  lm_head    6 x D x V x M      M: trained positions (p_mask)

Not counted (work that runs but is not useful): rematerialised forwards (of a layer or of the
attention kernel), attention over pairs the mask forbids (inside the tiles the flash kernel
computes), the LM head at untrained positions, padding tokens, the old log-prob forward,
embedding lookups, norms, RoPE and other elementwise work, the optimizer update.

This is the mask-aware convention of `train/metrics.sft_flops_per_row` (bench_train's `mfu`),
applied to TraceRL rows; `mfu` divides by the chip's peak (`train/metrics.peak_flops`).
"""

from __future__ import annotations

import numpy as np

from dice_jax.model import flash_bd

PARTS = ("linear", "attention", "lm_head")


def layer_matmul_weights(mcfg) -> int:
  """W: the weights of every decoder layer's matmuls (no embedding, no LM head, no norms)."""
  d, f = mcfg.hidden_size, mcfg.intermediate_size
  nq, kv = mcfg.num_heads * mcfg.head_dim, mcfg.num_kv_heads * mcfg.head_dim
  return mcfg.num_layers * (2 * d * nq + 2 * d * kv + 3 * d * f)


def visible_pairs(seg: np.ndarray, rank: np.ndarray, klo: np.ndarray) -> np.ndarray:
  """`[B]` (query, key) pairs a row's mask allows, from the flash kernel's vectors
  (`flash_bd`: q sees k iff seg_q == seg_k > 0 and rank_k <= rank_q <= klo_k), each `[B, S]`.

  Every key's klo is either >= BIG (a prompt / clean key: seen by every later rank) or its own
  rank (a noisy key: seen by its rank only), as all the kernel's encodings make it; then a
  query's count is (clean keys of its segment with rank <= its rank) + (noisy keys of its
  segment with its rank), found by sorting: O(S log S) per row, no [S, S] mask.
  """
  seg, rank, klo = (np.asarray(x, np.int64) for x in (seg, rank, klo))
  clean = klo >= flash_bd.BIG
  if not (clean | (klo == rank)).all():
    raise ValueError("visible_pairs: every key's klo must be >= BIG or equal to its rank")
  out = np.zeros(seg.shape[0], np.int64)
  for b in range(seg.shape[0]):
    live = seg[b] > 0
    shift = rank[b].min(initial=0)
    key = seg[b] * (2**40) + (rank[b] - shift)  # (segment, rank) as one sortable int
    clean_keys = np.sort(key[live & clean[b]])
    first = np.searchsorted(clean_keys, seg[b] * (2**40), side="left")
    seen = np.searchsorted(clean_keys, key, side="right") - first
    noisy_keys, counts = np.unique(key[live & ~clean[b]], return_counts=True)
    if noisy_keys.size:
      at = np.minimum(np.searchsorted(noisy_keys, key), noisy_keys.size - 1)
      seen = seen + np.where(noisy_keys[at] == key, counts[at], 0)
    out[b] = int(seen[live].sum())
  return out


def trace_vectors(batch: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(seg, rank, klo) `[B, T]` of a TraceRL host batch (`tracerl.build_batches`)."""
  vecs = flash_bd.trace_mask_vectors(
    np.asarray(batch["segment_ids"]), np.asarray(batch["block_ids"]), np.asarray(batch["round_ids"])
  )
  return tuple(np.asarray(v) for v in vecs)


def update_flops(mcfg, batch: dict) -> dict:
  """Useful FLOPs of the update on TraceRL host `batch` (module docstring): dict with `linear`,
  `attention`, `lm_head`, `total`, and the counts behind them (`tokens`, `pairs`, `trained`)."""
  seg = np.asarray(batch["segment_ids"])
  tokens = int((seg > 0).sum())
  trained = int((np.asarray(batch["p_mask"]).astype(bool) & (seg > 0)).sum())
  pairs = int(visible_pairs(*trace_vectors(batch)).sum())
  c = mcfg
  parts = dict(
    linear=6.0 * layer_matmul_weights(c) * tokens,
    attention=12.0 * c.num_layers * c.num_heads * c.head_dim * pairs,
    lm_head=6.0 * c.hidden_size * c.vocab_size * trained,
  )
  return dict(parts, total=sum(parts.values()), tokens=tokens, pairs=pairs, trained=trained)


def mfu(flops: float, seconds: float, peak_flops: float) -> float:
  """Model FLOPs utilisation: `flops` done in `seconds` over the chip's `peak_flops` per second."""
  if seconds <= 0 or peak_flops <= 0:
    raise ValueError(f"mfu needs seconds > 0 and peak_flops > 0, got {seconds}, {peak_flops}")
  return flops / seconds / peak_flops
