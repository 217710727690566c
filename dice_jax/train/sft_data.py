"""SFT data for the launcher: tokenizer, samples and the resumable grain iterator.

Imports `dice_jax.data` (and grain) lazily so that the train step and benchmarks run on hosts
without grain.
"""

from __future__ import annotations

import json
import os

import jax

from dice_jax.train.config import SFTConfig

BYTE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>")
BYTE_VOCAB_SIZE = 264  # 256 bytes + 4 specials, rounded up to a multiple of 8
_TEMPLATE = (
  "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + "
  "message.content + '<|im_end|>' + '\\n' }}{%- endfor %}"
  "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def write_byte_tokenizer(path: str) -> str:
  """A byte-level Qwen2-style tokenizer dir: 256 byte tokens (ids 0-255) + 4 specials (256-259)."""
  from tokenizers import pre_tokenizers

  os.makedirs(path, exist_ok=True)
  vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
  decoder = {
    str(256 + i): {
      "content": t,
      "lstrip": False,
      "normalized": False,
      "rstrip": False,
      "single_word": False,
      "special": t != "<|MASK|>",
    }
    for i, t in enumerate(BYTE_SPECIALS)
  }
  cfg = {
    "added_tokens_decoder": decoder,
    "eos_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
    "mask_token": "<|MASK|>",
    "tokenizer_class": "Qwen2Tokenizer",
    "add_prefix_space": False,
    "bos_token": None,
    "unk_token": None,
    "clean_up_tokenization_spaces": False,
  }
  files = {
    "vocab.json": json.dumps(vocab, ensure_ascii=False),
    "merges.txt": "#version: 0.2\n",
    "tokenizer_config.json": json.dumps(cfg),
    "chat_template.jinja": _TEMPLATE,
  }
  for name, text in files.items():
    tmp = os.path.join(path, name + ".tmp")
    with open(tmp, "w") as f:
      f.write(text)
    os.replace(tmp, os.path.join(path, name))
  return path


def byte_model_overrides() -> dict:
  """Model-config fields that match the byte tokenizer."""
  return dict(
    vocab_size=BYTE_VOCAB_SIZE,
    mask_token_id=259,
    pad_token_id=256,
    eos_token_id=256,
    bos_token_id=None,
  )


def load_tokenizer(cfg: SFTConfig, workdir: str):
  """(tokenizer, tokenizer_dir)."""
  from dice_jax.data.tokenizer import Tokenizer

  path = cfg.tokenizer
  if path == "byte":
    path = write_byte_tokenizer(os.path.join(workdir, "tokenizer"))
  tok = Tokenizer.from_dir(path)
  return tok, path


def load_samples(cfg: SFTConfig) -> list:
  """SFT samples of the configured source, optionally truncated (tiny CPU runs)."""
  from dice_jax.data import prompts, tasks

  if not cfg.data_path:
    raise ValueError("SFTConfig.data_path is empty: pass --set=data_path=FILE")
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


def make_iterator(cfg: SFTConfig, samples, tokenizer):
  """The grain iterator of this process's rows (`batch_size / process_count` per step), repeating
  forever; `get_state()` / `set_state()` checkpoint it. Packed on `cfg.objective.grid`."""
  from dice_jax.data.sft_pipeline import SFTPipelineConfig, make_sft_dataset

  grid = cfg.objective.grid
  check_some_fit(samples, tokenizer, cfg.seq_len, grid)
  nproc = jax.process_count()
  if cfg.batch_size % nproc:
    raise ValueError(f"batch_size {cfg.batch_size} not divisible by {nproc} processes")
  pcfg = SFTPipelineConfig(
    seq_len=cfg.seq_len,
    grid=grid,
    batch_size=cfg.batch_size // nproc,
    seed=cfg.seed,
    num_epochs=None,
    process_index=jax.process_index(),
    process_count=nproc,
    read_threads=1,
  )
  return iter(make_sft_dataset(samples, tokenizer, pcfg))


def check_some_fit(samples, tokenizer, seq_len: int, grid, probe: int = 64) -> None:
  """Fails when none of the first `probe` samples fits `seq_len` once padded on `grid` (the
  pipeline drops longer samples, and a repeating pipeline that drops everything would wait
  forever)."""
  from dice_jax.data.sft_pipeline import sft_texts

  lengths = []
  for s in samples[:probe]:
    prompt, response = sft_texts(s, tokenizer)
    n = grid.padded_length(len(tokenizer.encode(prompt)), len(tokenizer.encode(response)))
    if n <= seq_len:
      return
    lengths.append(n)
  raise ValueError(
    f"none of the first {len(lengths)} SFT samples fits seq_len={seq_len} "
    f"(shortest is {min(lengths)} tokens): raise seq_len or truncate the texts"
  )
