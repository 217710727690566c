"""The block grid shared by SFT (objective and packing), sampling, TraceRL rows and evaluation.

One frozen `BlockGrid` (docs/learner-spec.md "One block grid") says how a sequence is cut into blocks of
`size` tokens. Its `alignment` anchors the cut:

  `response` (default, the training convention): blocks start at the response. A token at position
  p of a sample whose response starts at position r is in block floor((p - r) / size); prompt
  tokens get negative ids, the prompt being cut backwards from r. Decoding starts with an all-mask
  block at r, and SFT / TraceRL see exactly the states the sampler saw.
  `absolute`: block = p // size (anchor 0). This is SDAR's `generate.py`, its evaluation decoder
  (`huggingface_bd3.py`) and JetEngine (JetAstra/SDAR; DICE `training/RL/`), hence the setting that reproduces
  SDAR's and DICE's published decoding: the first decoded block may hold the prompt's tail, which
  stays fixed. SFT packing pads the whole sample, not the response, to whole blocks.

DICE's code decodes on the absolute grid and trains TraceRL on the response grid (DICE `training/RL/`: JetEngine
decodes on absolute positions, `rl_sdar.py` trains from the response, as in Gen-Verse/dLLM-RL); here rollout and training read the same `BlockGrid`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dice_jax.errors import UserError
from dice_jax.model import masks as masks_lib

BLOCK_ALIGNMENTS = ("response", "absolute")


def check_alignment(block_alignment: str) -> None:
  if block_alignment not in BLOCK_ALIGNMENTS:
    raise ValueError(f"block_alignment must be one of {BLOCK_ALIGNMENTS}, got {block_alignment!r}")


MODEL_BLOCK_SIZE = 0  # a requested block size of 0: the model's (`resolve_block_size`)


def resolve_block_size(size: int, model_cfg, where: str) -> int:
  """The one check of a block size against the model (the model config is its source): 0 means
  the model's `block_size`; any other size must equal it."""
  if size == MODEL_BLOCK_SIZE:
    return model_cfg.block_size
  if size != model_cfg.block_size:
    raise UserError(
      f"{where}: block size {size} differs from the model's block_size "
      f"{model_cfg.block_size}; the grid must be the one the model was trained on (leave it "
      f"unset, 0, to take the model's)"
    )
  return size


@dataclasses.dataclass(frozen=True)
class BlockGrid:
  """Block size and alignment (module docstring). Methods work on ints, numpy and jax arrays."""

  size: int = 4
  alignment: str = "response"

  def __post_init__(self):
    if not isinstance(self.size, (int, np.integer)) or isinstance(self.size, bool) or self.size < 1:
      raise ValueError(f"BlockGrid.size must be a positive int, got {self.size!r}")
    if self.alignment not in BLOCK_ALIGNMENTS:
      raise ValueError(
        f"BlockGrid.alignment must be one of {BLOCK_ALIGNMENTS}, got {self.alignment!r}"
      )
    object.__setattr__(self, "size", int(self.size))

  def anchor(self, response_start):
    """Position at which block 0 starts: the response start (`response`) or 0 (`absolute`)."""
    return response_start if self.alignment == "response" else response_start * 0

  def block_of(self, positions, response_start):
    """Block id of tokens at `positions` of a sequence whose response starts at `response_start`
    (broadcasting; numpy in, numpy out; jax in, jax out)."""
    return (positions - self.anchor(response_start)) // self.size

  def first_block_start(self, prompt_len):
    """Position of the first block decoding works on: the response start (`response`), or the
    start of the block holding it (`absolute`; positions before it in that block are prompt)."""
    if self.alignment == "response":
      return prompt_len
    return (prompt_len // self.size) * self.size

  def padded_length(self, prompt_len: int, response_len: int) -> int:
    """SFT sample length after block padding: the response (`response`) or the whole sample
    (`absolute`) is padded to whole blocks."""
    b = self.size
    if self.alignment == "response":
      return prompt_len + -(-response_len // b) * b
    return -(-(prompt_len + response_len) // b) * b

  def token_block_ids(self, positions_bt, segment_ids_bt, loss_mask_bt):
    """Block id of every token of packed training rows (`[B, T]` int32). The response start of a
    packed segment is the position of its first loss token (`response_start_per_token`)."""
    if self.alignment == "absolute":
      return jnp.floor_divide(positions_bt, self.size).astype(jnp.int32)
    start = response_start_per_token(positions_bt, segment_ids_bt, loss_mask_bt)
    return masks_lib.block_ids_from_response_start(positions_bt, start, self.size).astype(jnp.int32)

  def check_model(self, model_cfg, where: str = "BlockGrid") -> None:
    """Raises unless the model was built for this block size (`resolve_block_size`)."""
    resolve_block_size(self.size, model_cfg, where)


def response_start_per_token(positions_bt, segment_ids_bt, loss_mask_bt):
  """Per token, the position at which its segment's response starts (`[B, T]` int32).

  The response start of a packed segment is the position of its first loss token. A segment with
  no loss token (prompt only) gets the position just past its last token. Padding (segment 0)
  gets 0. Packing-aware: segments are the ids of `segment_ids_bt` within each row.
  """
  b, t = positions_bt.shape
  big = jnp.iinfo(jnp.int32).max

  def one_row(pos_t, seg_t, loss_t):
    first_loss = jax.ops.segment_min(jnp.where(loss_t, pos_t, big), seg_t, num_segments=t + 1)
    past_end = jax.ops.segment_max(pos_t + 1, seg_t, num_segments=t + 1)
    start = jnp.where(first_loss == big, past_end, first_loss)
    return jnp.where(seg_t > 0, start[seg_t], 0)

  return jax.vmap(one_row)(
    positions_bt.astype(jnp.int32), segment_ids_bt.astype(jnp.int32), loss_mask_bt.astype(bool)
  )


def block_ids(
  positions_bt, segment_ids_bt, loss_mask_bt, block_size: int, block_alignment: str = "response"
):
  """`BlockGrid(block_size, block_alignment).token_block_ids(...)` (kept for callers by name)."""
  return BlockGrid(block_size, block_alignment).token_block_ids(
    positions_bt, segment_ids_bt, loss_mask_bt
  )
