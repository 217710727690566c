"""The block grid shared by SFT, sampling and RL.

Convention (decided for dice-jax; the sampler, the SFT objective and TraceRL all use it):
  `response` alignment (default): blocks start at the response. A token at position p of a sample
  whose response starts at position r is in block floor((p - r) / b). Prompt tokens get negative
  block ids: the prompt is split into blocks counted backwards from the response start. Training
  therefore reproduces the sampler's exact states (the first response block is all-mask at the
  start of decoding, as in the sampler).
  `absolute` alignment: block = p // b (SDAR's `generate.py` / JetEngine; the first decoded block
  may then hold the prompt's tail). Kept as a switch for checkpoints trained that way.

DICE's code uses absolute alignment at rollout and response alignment in TraceRL training
(reference §1.7 "Block-alignment mismatch", §6.6); we do not copy that mismatch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dice_jax.model import masks as masks_lib

BLOCK_ALIGNMENTS = ("response", "absolute")


def check_alignment(block_alignment: str) -> None:
  if block_alignment not in BLOCK_ALIGNMENTS:
    raise ValueError(f"block_alignment must be one of {BLOCK_ALIGNMENTS}, got {block_alignment!r}")


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
  """Block id of every token (`[B, T]` int32) under the chosen alignment (module docstring)."""
  check_alignment(block_alignment)
  if block_alignment == "absolute":
    return jnp.floor_divide(positions_bt, block_size).astype(jnp.int32)
  start = response_start_per_token(positions_bt, segment_ids_bt, loss_mask_bt)
  return masks_lib.block_ids_from_response_start(positions_bt, start, block_size).astype(jnp.int32)
