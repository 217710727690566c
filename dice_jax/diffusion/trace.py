"""Replaying a sampled trajectory from its step map (TraceRL's contract; reference §1.7).

The sampler records, per row, the denoising step at which each response token was unmasked
(`SampleOutput.step_map`, -1 outside the response). Before step s the model saw: every earlier
block final, and in the active block the tokens unmasked at steps < s, all others [MASK]. Because
attention is block-causal, masking every token with step >= s (later blocks included) gives the
same visible state, so one `where` reproduces the input of any step.
"""

from __future__ import annotations

import jax.numpy as jnp


def state_before_step(tokens_bc, step_map_bc, step_b, mask_token_id: int):
  """Canvas `[B, C]` as the sampler's model saw it at step `step_b[b]` of row b."""
  hide = step_map_bc >= jnp.asarray(step_b)[:, None]
  return jnp.where(hide, jnp.asarray(mask_token_id, tokens_bc.dtype), tokens_bc)


def active_columns(step_map_bc, step_b):
  """Bool `[B, C]`: the slots unmasked at step `step_b[b]` (they lie in the step's active block)."""
  return step_map_bc == jnp.asarray(step_b)[:, None]
