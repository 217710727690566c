"""Replaying a sampled trajectory from its step map (TraceRL's contract: Gen-Verse/dLLM-RL `train/rl_sdar.py`).

The sampler records, per row, the denoising step at which each response token was unmasked
(`SampleOutput.step_map`, -1 outside the response). Before step s the model saw: every earlier
block final, and in the active block the tokens unmasked at steps < s, all others [MASK]. Because
attention is block-causal, masking every token with step >= s (later blocks included) gives the
same visible state, so one `where` reproduces the input of any step.

TraceRL rounds (dLLM-RL `collapse_k_unique` + `one_round_vectorized`; host numpy):
  * shrink s: inside each block, every s consecutive distinct step ids are merged into one group;
  * rounds: in round k (1-based) every block trains its k-th group. A token's round is therefore
    1 + (rank of its step id among its block's distinct step ids) // s;
  * the noisy copy of block b for round k masks every token of b whose round is >= k: the tokens
    decoded at earlier groups stay visible. That is the state before the group's earliest step,
    i.e. exactly what the sampler fed the model at that step (`state_before_step`).
A response needs max(round) rounds (the most steps, after shrinking, that any of its blocks used).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def state_before_step(tokens_bc, step_map_bc, step_b, mask_token_id: int):
  """Canvas `[B, C]` as the sampler's model saw it at step `step_b[b]` of row b."""
  hide = step_map_bc >= jnp.asarray(step_b)[:, None]
  return jnp.where(hide, jnp.asarray(mask_token_id, tokens_bc.dtype), tokens_bc)


def active_columns(step_map_bc, step_b):
  """Bool `[B, C]`: the slots unmasked at step `step_b[b]` (they lie in the step's active block)."""
  return step_map_bc == jnp.asarray(step_b)[:, None]


def token_rounds(step_map, block_size: int, shrink: int = 1) -> np.ndarray:
  """The 1-based TraceRL round in which each response token is trained (`[L]` int32).

  `step_map` `[L]` (L a multiple of `block_size`): the step at which each token was unmasked.
  """
  if not isinstance(shrink, int) or shrink < 1:
    raise ValueError(f"shrink must be a positive int, got {shrink!r}")
  step_map = np.asarray(step_map)
  if step_map.ndim != 1 or step_map.size % block_size:
    raise ValueError(
      f"step_map must be 1-D with a length that is a multiple of block_size {block_size}, "
      f"got shape {step_map.shape}"
    )
  blocks = step_map.reshape(-1, block_size)
  srt = np.sort(blocks, axis=1)
  first = np.ones_like(srt, bool)
  first[:, 1:] = srt[:, 1:] != srt[:, :-1]  # the first copy of each distinct id
  # rank of a token's id = number of distinct ids of its block below it
  rank = np.sum(first[:, None, :] & (srt[:, None, :] < blocks[:, :, None]), axis=-1)
  return (rank // shrink + 1).reshape(-1).astype(np.int32)


def noisy_copy(response, rounds, round_: int, mask_token_id: int) -> np.ndarray:
  """The response as the model sees it in round `round_`: tokens of that round or later masked."""
  return np.where(np.asarray(rounds) >= round_, mask_token_id, response).astype(np.int32)
