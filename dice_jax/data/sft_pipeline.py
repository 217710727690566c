"""Grain SFT pipeline: chat-template tokenisation, block padding, packing into fixed rows, shuffle, batch, shard.

Batch contract (consumed by the SFT train step; keep it exactly). Each batch is a dict of numpy arrays, all of
shape ``[batch, seq_len]``:

  ``tokens``       int32  the clean sequence x_0 (row padding holds ``pad_token_id``);
  ``positions``    int32  position ids, restarting at 0 at the start of every packed segment (0 on row padding);
  ``segment_ids``  int32  1, 2, 3, ... for the packed samples of a row; 0 = row padding;
  ``loss_mask``    bool   True on response tokens *including* the pad tokens appended to reach a block multiple
                          (SDAR trains them); False on prompt tokens and on row padding.

SDAR packing (JetAstra/SDAR training): every sample is padded with ``pad_token_id`` to whole blocks of
the config's ``grid`` (``dice_jax.diffusion.blocks.BlockGrid``, the grid the objective uses): its response
with ``response`` alignment (the default), the whole sample with ``absolute`` (SDAR's own grid); prompt
labels are ignored; positions restart per sample. Samples longer than ``seq_len`` are dropped (DICE: ``cutoff_len: 6144``,
``truncate_mode: drop``), each drop logged with the sample id and counted in ``PackingStats`` (in the caller's, also for drops
made in grain worker processes).

The response text is what the chat template appends after the generation prompt for an assistant turn (for the
SDAR template: ``<think>\\n\\n</think>\\n\\n{response}<|im_end|>\\n``), so SFT sees the template exactly.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import grain
import numpy as np
from absl import flags, logging
from grain.experimental import FirstFitPackIterDataset

from dice_jax.data.prompts import SFTSample
from dice_jax.diffusion.blocks import BlockGrid

FEATURES = ("tokens", "positions", "segment_ids", "loss_mask")


@dataclasses.dataclass(frozen=True)
class SFTPipelineConfig:
  seq_len: int = 6144
  # samples longer than this (block-padded) are dropped; 0: seq_len. LLaMA-Factory with packing
  # cuts at cutoff_len - 1 (DICE: 6143 with rows of 6144)
  max_sample_len: int = 0
  grid: BlockGrid = BlockGrid()  # "response" pads each response, "absolute" each sample
  batch_size: int = 8  # rows per batch on this process
  seed: int = 0
  shuffle: bool = True
  num_epochs: int | None = 1  # None = repeat forever
  num_packing_bins: int = 16
  process_index: int = 0
  process_count: int = 1
  read_threads: int = 4
  worker_count: int = 0  # > 0: grain mp_prefetch worker processes after batching
  drop_remainder: bool = True

  def __post_init__(self):
    if not isinstance(self.grid, BlockGrid):
      raise ValueError(f"SFTPipelineConfig.grid must be a BlockGrid, got {self.grid!r}")
    b = self.grid.size
    if self.seq_len < b or self.seq_len % b:
      raise ValueError(
        f"seq_len ({self.seq_len}) must be a positive multiple of the block size ({b})"
      )
    if not 0 <= self.max_sample_len <= self.seq_len:
      raise ValueError(
        f"max_sample_len must be in [0, seq_len={self.seq_len}], got {self.max_sample_len}"
      )
    if self.worker_count < 0:
      raise ValueError(f"worker_count must be >= 0, got {self.worker_count}")
    if self.batch_size < 1 or self.num_packing_bins < 1:
      raise ValueError("batch_size and num_packing_bins must be >= 1")
    if not 0 <= self.process_index < self.process_count:
      raise ValueError(f"process_index {self.process_index} not in [0, {self.process_count})")
    if self.num_epochs is not None and self.num_epochs < 1:
      raise ValueError(f"num_epochs must be >= 1 or None, got {self.num_epochs}")


def sft_texts(sample: SFTSample, tokenizer) -> tuple[str, str]:
  """(prompt text, response text) rendered with the chat template; prompt + response == full conversation."""
  user = [{"role": "user", "content": sample.prompt}]
  prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True)
  full = tokenizer.apply_chat_template(
    user + [{"role": "assistant", "content": sample.response}], add_generation_prompt=False
  )
  if not full.startswith(prompt):
    raise ValueError(
      "chat template: the rendered conversation does not start with the rendered prompt"
    )
  return prompt, full[len(prompt) :]


def tokenize_sample(
  prompt_ids: Sequence[int], response_ids: Sequence[int], grid: BlockGrid, pad_id: int
) -> dict[str, np.ndarray]:
  """One SDAR sample: prompt + response + pad to whole blocks; loss on response and the block pad.

  On a ``response`` grid (the project's convention: blocks start at the response) the *response* is
  padded to a block multiple, so its last block is whole, as in sampling; on an ``absolute`` grid
  (SDAR's packing) the whole sample is (``BlockGrid.padded_length``).
  """
  n = len(prompt_ids) + len(response_ids)
  total = grid.padded_length(len(prompt_ids), len(response_ids))
  tokens = np.full(total, pad_id, np.int32)
  tokens[: len(prompt_ids)] = prompt_ids
  tokens[len(prompt_ids) : n] = response_ids
  loss = np.ones(total, bool)
  loss[: len(prompt_ids)] = False
  return {"tokens": tokens, "loss_mask": loss}


@dataclasses.dataclass
class PackingStats:
  """Counts shared by the pipeline's stages (thread-safe increments)."""

  samples_dropped: int = 0
  tokens_dropped: int = 0
  dropped_ids: list = dataclasses.field(default_factory=list)
  _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

  # picklable: a grain worker gets a copy (`_DropsOut` sends its counts back)
  def __getstate__(self):
    return {k: v for k, v in self.__dict__.items() if k != "_lock"}

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._lock = threading.Lock()

  def drop(self, sample_id: str, n: int) -> None:
    with self._lock:
      self.samples_dropped += 1
      self.tokens_dropped += n
      self.dropped_ids.append(sample_id)

  def since(self, seen: int) -> tuple[list, int]:
    """(ids dropped after the first `seen`, their tokens): what a worker has not yet sent."""
    with self._lock:
      return self.dropped_ids[seen:], self.tokens_dropped

  def add(self, ids: Sequence[str], tokens: int) -> None:
    """Counts drops another process made (`tokens` of them over `ids`)."""
    with self._lock:
      self.samples_dropped += len(ids)
      self.tokens_dropped += tokens
      self.dropped_ids.extend(ids)


_DROPS = "_dropped"  # the batch key a worker's new drops travel under (removed in the parent)


class _DropsOut(grain.transforms.Map):
  """In a grain worker: puts the drops made since its last batch into the batch (`_DROPS`: ids,
  tokens), so the parent's `PackingStats` counts them (the worker's copy would keep them). A drop
  travels with the next batch its worker emits; one after its last batch is not counted."""

  def __init__(self, stats: PackingStats):
    self.stats, self.ids_sent, self.tokens_sent = stats, 0, 0

  def map(self, batch: dict) -> dict:
    ids, tokens = self.stats.since(self.ids_sent)
    self.ids_sent += len(ids)
    batch[_DROPS] = (ids, tokens - self.tokens_sent)
    self.tokens_sent = tokens
    return batch


class _DropsIn(grain.transforms.Map):
  """In the parent: adds a batch's `_DROPS` to the run's `PackingStats` and removes the key."""

  def __init__(self, stats: PackingStats):
    self.stats = stats

  def map(self, batch: dict) -> dict:
    ids, tokens = batch.pop(_DROPS)
    self.stats.add(ids, tokens)
    return batch


class _Tokenize(grain.transforms.Map):
  def __init__(self, tokenizer, grid: BlockGrid):
    self.tok, self.grid = tokenizer, grid

  def map(self, sample: SFTSample) -> dict:
    prompt, response = sft_texts(sample, self.tok)
    out = tokenize_sample(
      self.tok.encode(prompt), self.tok.encode(response), self.grid, self.tok.pad_token_id
    )
    out["sample_id"] = sample.sample_id
    return out


def _to_contract(pad_id: int):
  def f(row: dict) -> dict:
    seg = row["tokens_segment_ids"].astype(np.int32)
    tokens = np.where(seg > 0, row["tokens"], pad_id).astype(np.int32)
    return {
      "tokens": tokens,
      "positions": row["tokens_positions"].astype(np.int32),
      "segment_ids": seg,
      "loss_mask": (row["loss_mask"] & (seg > 0)).astype(bool),
    }

  return f


def make_sft_dataset(
  samples: Sequence[SFTSample],
  tokenizer,
  cfg: SFTPipelineConfig,
  stats: PackingStats | None = None,
  batched: bool = True,
) -> grain.IterDataset:
  """The SFT pipeline over in-memory samples. Iterate it with ``iter(ds)``; the iterator's
  ``get_state()`` / ``set_state()`` checkpoint and restore it exactly."""
  if not samples:
    raise ValueError("no SFT samples")
  stats = stats if stats is not None else PackingStats()
  ds = grain.MapDataset.source(list(samples))
  if cfg.shuffle:
    ds = ds.seed(cfg.seed).shuffle()
  if cfg.num_epochs != 1:
    ds = ds.repeat(cfg.num_epochs)
  if cfg.process_count > 1:
    ds = ds[cfg.process_index :: cfg.process_count]
  ds = ds.map(_Tokenize(tokenizer, cfg.grid))
  ids = ds.to_iter_dataset(grain.ReadOptions(num_threads=cfg.read_threads, prefetch_buffer_size=64))

  per_pass = -(-len(samples) // cfg.process_count)  # samples this process sees per epoch
  in_a_row = [0]  # consecutive drops: a whole pass of them means nothing will ever fit

  limit = cfg.max_sample_len or cfg.seq_len

  def fits(x: dict) -> bool:
    n = len(x["tokens"])
    if n > limit:
      logging.warning("dropping SFT sample %s: %d tokens > %d", x["sample_id"], n, limit)
      stats.drop(x["sample_id"], n)
      in_a_row[0] += 1
      if in_a_row[0] > per_pass:  # a repeating dataset would otherwise wait forever
        raise ValueError(
          f"no SFT sample fits seq_len={limit}: {in_a_row[0]} samples in a row "
          f"were longer, a whole pass; raise seq_len or truncate the texts"
        )
      return False
    in_a_row[0] = 0
    return True

  ids = ids.filter(fits).map(lambda x: {"tokens": x["tokens"], "loss_mask": x["loss_mask"]})
  packed = FirstFitPackIterDataset(
    ids,
    length_struct={"tokens": cfg.seq_len, "loss_mask": cfg.seq_len},
    num_packing_bins=cfg.num_packing_bins,
    seed=cfg.seed,
    shuffle_bins=cfg.shuffle,
    padding_struct={"tokens": tokenizer.pad_token_id, "loss_mask": False},
  )
  rows = packed.map(_to_contract(tokenizer.pad_token_id))
  if not batched:
    return rows
  out = rows.batch(cfg.batch_size, drop_remainder=cfg.drop_remainder)
  if cfg.worker_count > 0:
    if not flags.FLAGS.is_parsed():  # grain's worker processes read absl flags (defaults are fine)
      flags.FLAGS.mark_as_parsed()
    out = out.map(_DropsOut(stats))
    out = out.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.worker_count))
    out = out.map(_DropsIn(stats))
  return out


def packing_efficiency(batch: dict) -> float:
  """Fraction of row slots holding a sample token (segment_ids > 0)."""
  return float((np.asarray(batch["segment_ids"]) > 0).mean())
