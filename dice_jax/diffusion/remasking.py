"""Pure functions of one denoising step: draw candidate tokens, choose which positions to unmask.

SDAR (JetAstra/SDAR `generate.py`, `huggingface_bd3.py`) and JetEngine (DICE `training/RL/`, as used by
DICE/TraceRL rollouts):
  * candidates: logits -> top-k -> temperature -> top-p -> sample (argmax when temperature = 0).
    The mask token is never a candidate (its logit is removed first), so no sampler emits [MASK].
  * a position's confidence (`confidence=`):
      "filtered"    the candidate's probability under the filtered distribution (top-k / top-p /
                    temperature, mask removed): JetEngine's rollouts. With top_k = 1 every
                    confidence is 1 and low_confidence_static becomes left-to-right;
      "unfiltered"  its probability under softmax(logits / temperature) before any filtering
                    (temperature 1 when greedy): SDAR's evaluation decoder `huggingface_bd3.py`,
                    behind DICE's published eval settings (temperature 1, top_k 1, static).
  * per step, `num_transfer[s]` = block // steps, the remainder spread over the earliest steps.
  * strategies:
      sequential              the leftmost k masked positions;
      low_confidence_static   the k masked positions of highest confidence;
      low_confidence_dynamic  every masked position with confidence > threshold, or the top-k
                              when fewer than k pass;
      entropy_bounded         positions sorted by entropy; the longest prefix whose cumulative
                              entropy is <= eb_threshold, at least one.
  * at the last allowed step every remaining masked position is unmasked (so a block always
    finishes within `steps` forwards; only `entropy_bounded` can need this).
Arrays are `[B, N]` over the N positions of the active block; ties break towards the left.
Randomness: one key for the whole batch, or one key per row (`[B]`), so that a row's draws depend
on its own key only (the same tokens alone or batched).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

STRATEGIES = ("sequential", "low_confidence_static", "low_confidence_dynamic", "entropy_bounded")
CONFIDENCES = ("filtered", "unfiltered")


def transfer_schedule(block_size: int, steps: int) -> np.ndarray:
  """Tokens to unmask at each of `steps` steps: block // steps, remainder to the earliest."""
  base, rem = divmod(block_size, steps)
  return np.array([base + (1 if s < rem else 0) for s in range(steps)], np.int32)


def _filtered_logits(logits_bnv, *, temperature: float, top_k: int, top_p: float):
  x = logits_bnv.astype(jnp.float32)
  if top_k > 0:
    kth = jax.lax.top_k(x, top_k)[0][..., -1:]
    x = jnp.where(x < kth, -jnp.inf, x)
  if temperature > 0:
    x = x / temperature
  if top_p < 1.0:
    srt = jnp.sort(x, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(srt, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted entry
    n_keep = jnp.maximum(jnp.sum(before < top_p, axis=-1, keepdims=True), 1)
    cutoff = jnp.take_along_axis(srt, n_keep - 1, axis=-1)
    x = jnp.where(x < cutoff, -jnp.inf, x)
  return x


def _per_row_keys(key, rows: int) -> bool:
  """True when `key` holds one PRNG key per row (typed `[B]` or raw `[B, 2]`)."""
  if key is None:
    return False
  typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
  per_row = key.ndim == (1 if typed else 2)
  if per_row and key.shape[0] != rows:
    raise ValueError(f"sample_candidates: {key.shape[0]} row keys for {rows} rows of logits")
  return per_row


def sample_candidates(
  key,
  logits_bnv,
  *,
  temperature: float = 0.0,
  top_k: int = 0,
  top_p: float = 1.0,
  confidence: str = "filtered",
  mask_token_id: int | None = None,
  want_entropy: bool = False,
  want_logprob: bool = False,
):
  """Candidate token per position and its statistics.

  `key`: one PRNG key, or one per row (`[B]`); unused when greedy. `mask_token_id`: never drawn.
  Returns dict: `token` [B,N] int32, `confidence` [B,N] (module docstring), `entropy` [B,N] (of
  the filtered distribution; zeros unless `want_entropy`), `logprob` [B,N] (log-probability under
  the unfiltered model distribution, temperature 1, mask included: what the trainer computes;
  zeros unless `want_logprob`).
  """
  if confidence not in CONFIDENCES:
    raise ValueError(f"confidence must be one of {CONFIDENCES}, got {confidence!r}")
  raw = logits_bnv.astype(jnp.float32)
  allowed = raw if mask_token_id is None else raw.at[..., mask_token_id].set(-jnp.inf)
  x = _filtered_logits(allowed, temperature=temperature, top_k=top_k, top_p=top_p)
  if temperature > 0:
    if _per_row_keys(key, x.shape[0]):
      token = jax.vmap(lambda k, xb: jax.random.categorical(k, xb, axis=-1))(key, x)
    else:
      token = jax.random.categorical(key, x, axis=-1)
  else:
    token = jnp.argmax(x, axis=-1)
  token = token.astype(jnp.int32)
  pick = lambda a: jnp.take_along_axis(a, token[..., None], axis=-1)[..., 0]
  lse = jax.nn.logsumexp(x, axis=-1)
  picked = pick(x)
  if confidence == "filtered":
    conf = jnp.exp(picked - lse)
  else:
    scaled = raw / temperature if temperature > 0 else raw
    conf = jnp.exp(pick(scaled) - jax.nn.logsumexp(scaled, axis=-1))
  out = dict(token=token, confidence=conf)
  if want_entropy:
    logp = x - lse[..., None]
    out["entropy"] = -jnp.sum(jnp.where(jnp.isfinite(logp), jnp.exp(logp) * logp, 0.0), axis=-1)
  else:
    out["entropy"] = jnp.zeros_like(picked)
  if want_logprob:
    out["logprob"] = pick(raw) - jax.nn.logsumexp(raw, axis=-1)
  else:
    out["logprob"] = jnp.zeros_like(picked)
  return out


def _rank(key_bn, masked_bn):
  """Rank of each masked position by ascending key (ties: leftmost first); unmasked rank last."""
  n = key_bn.shape[-1]
  order_key = jnp.where(masked_bn, key_bn, jnp.inf)
  order = jnp.argsort(order_key, axis=-1, stable=True)
  return jnp.argsort(order, axis=-1, stable=True), order, n


def select_transfer(
  strategy: str,
  masked_bn,
  confidence_bn,
  entropy_bn,
  k_b,
  *,
  threshold: float = 0.9,
  eb_threshold: float = 0.35,
  flush=False,
):
  """Positions to unmask this step (`[B, N]` bool, a subset of `masked_bn`).

  `k_b` [B]: this step's transfer count; `flush`: scalar bool, unmask everything left.
  """
  if strategy not in STRATEGIES:
    raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
  k = k_b[:, None]
  pos = jnp.broadcast_to(jnp.arange(masked_bn.shape[-1], dtype=jnp.float32), masked_bn.shape)
  if strategy == "sequential":
    rank, _, _ = _rank(pos, masked_bn)
    sel = rank < k
  elif strategy == "low_confidence_static":
    rank, _, _ = _rank(-confidence_bn, masked_bn)
    sel = rank < k
  elif strategy == "low_confidence_dynamic":
    rank, _, _ = _rank(-confidence_bn, masked_bn)
    high = masked_bn & (confidence_bn > threshold)
    enough = jnp.sum(high, axis=-1, keepdims=True) >= k
    sel = jnp.where(enough, high, rank < k)
  else:  # entropy_bounded
    rank, order, _ = _rank(entropy_bn, masked_bn)
    ent_sorted = jnp.take_along_axis(jnp.where(masked_bn, entropy_bn, jnp.inf), order, axis=-1)
    n_ok = jnp.sum(jnp.cumsum(ent_sorted, axis=-1) <= eb_threshold, axis=-1, keepdims=True)
    sel = rank < jnp.maximum(n_ok, 1)
  sel = masked_bn & sel
  return jnp.where(flush, masked_bn, sel)
