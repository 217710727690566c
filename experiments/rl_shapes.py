"""Synthetic TraceRL inputs at a given shape, for the RL benchmarks (no sampler, no data files).

What random weights' rollouts look like: every response decodes all `new_tokens` (no stop id),
one token unmasked per forward (random weights pass no 0.9 threshold), so every block takes as
many rounds as it has tokens and every token is trained: the longest packed rows there are
(`rl/memory.row_length`).
"""

from __future__ import annotations

import numpy as np

from dice_jax.rl.trajectory import Trajectory

TOKEN_HI = 151_643  # random ids stay below SDAR's special tokens


def synthetic_trajectories(
  rng: np.random.Generator,
  *,
  tasks: int,
  group_size: int,
  prompt_len: int,
  new_tokens: int,
  vocab_size: int,
  block_size: int = 4,
) -> list[Trajectory]:
  """`tasks` x `group_size` responses (module docstring); members of a task share its prompt."""
  hi = min(vocab_size - 2, TOKEN_HI)
  n, out = new_tokens, []
  for g in range(tasks):
    prompt = rng.integers(2, hi, prompt_len)
    for i in range(group_size):
      order = np.concatenate([rng.permutation(block_size) for _ in range(n // block_size)])
      out.append(
        Trajectory(
          prompt_ids=prompt,
          response_ids=rng.integers(2, hi, n),
          step_map=np.arange(n) // block_size * block_size + order,
          loss_mask=np.ones(n, bool),
          sampler_logp=-rng.exponential(1.0, n).astype(np.float32),
          advantage=float(rng.standard_normal()),
          task_id=f"synthetic/{g}",
          group=g,
          member=i,
        )
      )
  return out
