"""One sampled response as the learner keeps it: the contract between rollout and TraceRL.

A `Trajectory` is host data (numpy), one per response. It holds what the TraceRL objective needs to
rebuild every state the sampler saw (Gen-Verse/dLLM-RL `train/rl_sdar.py`, as DICE `training/RL/` trims it):

  prompt_ids    [P]  the prompt tokens, as the sampler read them (positions 0..P-1).
  response_ids  [L]  every generated token, whole decoded blocks: tokens after the first stop id
                     inside the last decoded block are kept, because the model saw them while it
                     decoded that block. On the `response` block grid (`diffusion/blocks.py`) L is
                     a multiple of the block size and the response starts on a block boundary; on
                     the `absolute` grid (`block_alignment`) the first block also holds the
                     prompt's last P mod b tokens, fixed, so (P mod b) + L is.
  step_map      [L]  the row's denoising step at which each response token was unmasked (>= 0;
                     counts the row's forwards that had masks, across blocks, so it never
                     decreases from one block to the next).
  loss_mask     [L]  the tokens that are trained: up to and including the first stop id, within
                     the row's token budget.
  sampler_logp  [L]  log-probability of each token under the unfiltered model distribution at
                     the forward that unmasked it (0 where unknown), for checks and metrics.
  advantage          the response's scalar advantage, broadcast to its tokens (set after rewards).

`from_sample_output` cuts these out of a `diffusion.sampler.SampleOutput`.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass
class Trajectory:
  prompt_ids: np.ndarray
  response_ids: np.ndarray
  step_map: np.ndarray
  loss_mask: np.ndarray
  sampler_logp: np.ndarray
  advantage: float = 0.0
  task_id: str = ""
  group: int = -1  # global group number (the G responses of one task share it)
  member: int = -1  # index inside the group
  block_alignment: str = "response"  # the rollout's block grid: "response" | "absolute"

  def __post_init__(self):
    self.prompt_ids = np.asarray(self.prompt_ids, np.int32)
    self.response_ids = np.asarray(self.response_ids, np.int32)
    self.step_map = np.asarray(self.step_map, np.int32)
    self.loss_mask = np.asarray(self.loss_mask, bool)
    self.sampler_logp = np.asarray(self.sampler_logp, np.float32)
    n = self.response_ids.shape
    for name in ("step_map", "loss_mask", "sampler_logp"):
      if getattr(self, name).shape != n:
        raise ValueError(
          f"Trajectory {self.task_id!r}: {name} has shape {getattr(self, name).shape}, "
          f"response_ids has {n}"
        )
    if self.prompt_ids.ndim != 1 or self.prompt_ids.size == 0:
      raise ValueError(f"Trajectory {self.task_id!r}: prompt_ids must be a non-empty 1-D array")
    if self.step_map.size and self.step_map.min() < 0:
      raise ValueError(f"Trajectory {self.task_id!r}: step_map has negative entries")

  def fixed_prefix(self, block_size: int) -> int:
    """Prompt tokens in the response's first block: P mod b on the absolute grid, else 0."""
    return self.prompt_ids.size % block_size if self.block_alignment == "absolute" else 0

  def on_response_grid(self, block_size: int) -> "Trajectory":
    """The same rollout as a response-grid trajectory: on the absolute grid, the prompt's last
    P mod b tokens move to the front of the response (never trained; the step of the block's
    first decoded token, so that the ranks of the decoded tokens are unchanged). Use with
    `fixed_prefix` of the original, whose tokens are never masked."""
    k = self.fixed_prefix(block_size)
    if not k:
      return self
    first = self.step_map[: block_size - k]
    step0 = int(first.min()) if first.size else 0
    out = copy.copy(self)  # not validated again: the prompt may now be empty (P < b)
    out.prompt_ids = self.prompt_ids[:-k]
    out.response_ids = np.concatenate([self.prompt_ids[-k:], self.response_ids])
    out.step_map = np.concatenate([np.full(k, step0, np.int32), self.step_map])
    out.loss_mask = np.concatenate([np.zeros(k, bool), self.loss_mask])
    out.sampler_logp = np.concatenate([np.zeros(k, np.float32), self.sampler_logp])
    out.block_alignment = "response"
    return out

  def check_grid(self, block_size: int) -> None:
    """Raises unless the response is whole blocks whose step ids never go back across blocks."""
    if self.block_alignment not in ("response", "absolute"):
      raise ValueError(
        f"Trajectory {self.task_id!r}: block_alignment must be 'response' or 'absolute', got "
        f"{self.block_alignment!r}"
      )
    if self.fixed_prefix(block_size):
      self.on_response_grid(block_size).check_grid(block_size)
      return
    length = self.response_ids.size
    if length % block_size:
      raise ValueError(
        f"Trajectory {self.task_id!r}: response length {length} is not a multiple of the "
        f"block size {block_size}"
      )
    if length:
      blocks = self.step_map.reshape(-1, block_size)
      if (blocks.min(axis=1)[1:] <= blocks.max(axis=1)[:-1]).any():
        raise ValueError(
          f"Trajectory {self.task_id!r}: a block was unmasked before the previous block finished"
        )

  def without_stop_token(self, stop_ids) -> "Trajectory":
    """A copy whose final stop token (the last trained token, when it is one of `stop_ids`) is
    not trained."""
    trained = np.nonzero(self.loss_mask)[0]
    if not trained.size or int(self.response_ids[trained[-1]]) not in set(stop_ids):
      return self
    loss_mask = self.loss_mask.copy()
    loss_mask[trained[-1]] = False
    return dataclasses.replace(self, loss_mask=loss_mask)

  def without_token(self, token_id: int) -> "Trajectory":
    """A copy in which no token equal to `token_id` is trained (DICE's `post_num: 0` drops every
    pad token, `<|endoftext|>` for SDAR, from the loss: dLLM-RL `train/rl_sdar.py`)."""
    hit = self.loss_mask & (self.response_ids == int(token_id))
    if not hit.any():
      return self
    return dataclasses.replace(self, loss_mask=self.loss_mask & ~hit)

  @property
  def trained_tokens(self) -> int:
    return int(self.loss_mask.sum())


def from_sample_output(
  out, prompts: Sequence[Sequence[int]], *, block_size: int, block_alignment: str = "response"
) -> list[Trajectory]:
  """One `Trajectory` per row of a `SampleOutput` decoded on the `block_alignment` grid."""
  tokens, step_map = np.asarray(out.tokens), np.asarray(out.step_map)
  logp = None if out.logprobs is None else np.asarray(out.logprobs)
  start, lengths = np.asarray(out.response_start), np.asarray(out.response_lengths)
  trajs = []
  for i, prompt in enumerate(prompts):
    s = int(start[i])
    decoded = step_map[i, s:] >= 0
    n = int(decoded.sum())
    if not decoded[:n].all():
      raise ValueError(f"row {i}: decoded slots are not contiguous from the response start")
    if tokens[i, s - len(prompt) : s].tolist() != list(prompt):
      raise ValueError(f"row {i}: the prompt does not end at the response start column {s}")
    trajs.append(
      Trajectory(
        prompt_ids=np.asarray(prompt, np.int32),
        response_ids=tokens[i, s : s + n],
        step_map=step_map[i, s : s + n],
        loss_mask=np.arange(n) < int(lengths[i]),
        sampler_logp=np.zeros(n, np.float32) if logp is None else logp[i, s : s + n],
        block_alignment=block_alignment,
      )
    )
    trajs[-1].check_grid(block_size)
  return trajs
