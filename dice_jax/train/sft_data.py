"""SFT data for the launcher: tokenizer, samples and the resumable grain iterator.

Imports the grain pipeline lazily so that the train step and benchmarks run on hosts
without grain.
"""

from __future__ import annotations


import numpy as np

from dice_jax.errors import UserError
from dice_jax.train import data_shards
from dice_jax.train.config import SFTConfig


def load_samples(cfg: SFTConfig) -> list:
  """SFT samples of the configured source, optionally truncated (tiny CPU runs)."""
  from dice_jax.data import prompts, tasks

  if not cfg.data_path:
    raise UserError("SFTConfig.data_path is empty: pass --set=data_path=FILE")
  if cfg.data_source == "cuke":
    samples, _ = tasks.load_sft_samples(cfg.data_path)
  elif cfg.data_source == "pairs":
    rows, _ = tasks.load_pairs(cfg.data_path)
    samples = [
      prompts.sft_sample_from_pair(
        p.pytorch_code, p.cuda_code, p.reasoning, level=p.level, sample_id=p.pair_id
      )
      for p in rows
    ]
  else:  # infill_pairs: each task's reference -> its known CUDA solution (CuKe-style e2e sample)
    rows, _ = tasks.load_infilling_tasks(cfg.data_path)
    samples = [
      prompts.sft_sample_from_pair(
        t.reference_code, t.cuda_code, level=t.level, sample_id=t.task_id
      )
      for t in rows
    ]
  if not samples:
    raise tasks.DataError(
      f"{cfg.data_path}: no SFT samples (the file is empty or has no valid {cfg.data_source} rows)"
    )
  if cfg.max_prompt_chars or cfg.max_response_chars:
    samples = [
      prompts.SFTSample(
        s.prompt[: cfg.max_prompt_chars or None],
        s.response[: cfg.max_response_chars or None],
        s.level,
        s.sample_id,
      )
      for s in samples
    ]
  return samples


def make_iterator(cfg: SFTConfig, samples, tokenizer, rows=None):
  """This process's `rows` of every global batch (default: all `batch_size`), repeating forever;
  `get_state()` / `set_state()` checkpoint it (`data_shards.global_state` across processes).
  Packed on `cfg.objective.grid`.

  The batch is drawn from `cfg.data_shards` grain streams: stream j packs samples j, j+k, ...
  of the shuffled data into `batch_size / k` rows (`data_shards.py`)."""
  from dice_jax.data.sft_pipeline import SFTPipelineConfig, make_sft_dataset

  k = cfg.data_shards

  def stream(j: int):
    pcfg = SFTPipelineConfig(
      seq_len=cfg.seq_len,
      max_sample_len=cfg.max_sample_len,
      grid=cfg.objective.grid,
      batch_size=cfg.batch_size // k,
      seed=cfg.run.seed,
      num_epochs=None,
      process_index=j,
      process_count=k,
      read_threads=1,
    )
    return iter(make_sft_dataset(samples, tokenizer, pcfg))

  rows = np.arange(cfg.batch_size) if rows is None else rows
  return data_shards.ShardedBatches(stream, k, cfg.batch_size, rows)


def check_some_fit(samples, tokenizer, seq_len: int, grid, probe: int = 64) -> None:
  """Fails when none of the first `probe` samples fits `seq_len` once padded on `grid` (the
  pipeline drops longer samples, and a repeating pipeline that drops everything would wait
  forever)."""
  from dice_jax.data.sft_pipeline import sft_texts

  if not samples:
    raise UserError("no SFT samples to train on")
  lengths = []
  for s in samples[:probe]:
    prompt, response = sft_texts(s, tokenizer)
    n = grid.padded_length(len(tokenizer.encode(prompt)), len(tokenizer.encode(response)))
    if n <= seq_len:
      return
    lengths.append(n)
  raise UserError(
    f"none of the first {len(lengths)} SFT samples fits seq_len={seq_len} "
    f"(shortest is {min(lengths)} tokens): raise seq_len or truncate the texts"
  )
