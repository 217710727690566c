"""A run's global batch, drawn from independent data streams; a process reads only its own.

The global batch of B rows comes from `num_shards` (k) independent streams: stream j yields
B/k rows per step, which are rows `[j*B/k, (j+1)*B/k)` of the batch. The batches depend on k,
not on how many processes train on them, so a run sees the same batches (and losses) on 1, 2 or
4 processes and resumes on another process count. A process builds only the streams its rows
(`train_step.local_rows`) come from: with k a multiple of the process count each process reads
k/n streams of its own and no sample is read twice; with k = 1 every process reads the one
stream and keeps its rows.

State: `{"streams": {"j": state of stream j}}`. `get_state` holds this process's streams,
`global_state` all of them (merged across processes); `set_state` takes what it needs from it.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from dice_jax import distributed
from dice_jax.errors import UserError


class ShardedBatches:
  """Iterator of this process's `rows` of every global batch (dicts of `[len(rows), ...]`)."""

  def __init__(
    self,
    make_stream: Callable[[int], Iterator[dict]],
    num_shards: int,
    batch_size: int,
    rows,
  ):
    if num_shards < 1 or batch_size % num_shards:
      raise ValueError(f"batch_size {batch_size} is not divisible by {num_shards} data shards")
    self.rows = np.asarray(rows, np.int64)
    if self.rows.size == 0 or self.rows.min() < 0 or self.rows.max() >= batch_size:
      raise ValueError(f"rows {self.rows.tolist()} not within a batch of {batch_size}")
    per = batch_size // num_shards
    needed = sorted(set((self.rows // per).tolist()))
    self._streams = {j: make_stream(j) for j in needed}
    slot = {j: i for i, j in enumerate(needed)}
    self._take = np.array([slot[r // per] * per + r % per for r in self.rows.tolist()])

  @property
  def shards(self) -> list[int]:
    """The streams this process reads."""
    return list(self._streams)

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    parts = [next(it) for it in self._streams.values()]
    return {k: np.concatenate([p[k] for p in parts])[self._take] for k in parts[0]}

  def get_state(self) -> dict:
    return {"streams": {str(j): it.get_state() for j, it in self._streams.items()}}

  def set_state(self, state: dict) -> None:
    """Restores this process's streams from a state holding them (e.g. `global_state`'s)."""
    streams = state["streams"] if "streams" in state else {"0": state}  # saved before shards
    missing = [j for j in self._streams if str(j) not in streams]
    if missing:
      raise UserError(
        f"the checkpoint's data state has streams {sorted(streams, key=int)} but this run reads "
        f"{self.shards}: data_shards differs from the run that saved it"
      )
    for j, it in self._streams.items():
      it.set_state(streams[str(j)])


def global_state(batches: ShardedBatches) -> dict:
  """The state of every stream of the run, merged from all processes (a collective)."""
  merged = {}
  for part in distributed.gather_json(batches.get_state()["streams"]):
    merged.update(part)
  return {"streams": {j: merged[j] for j in sorted(merged, key=int)}}
