"""Print rendered examples, token counts and packing efficiency of the data pipelines.

  python -m experiments.show_data --pipeline=e2e --n=2    # or --pipeline=infill, --pipeline=sft

Defaults read the data root (`--data_root`, $DICE_DATA_ROOT, else ../shared/data): the SDAR tokenizer, DICE's RL task files, and for
``sft`` either ``--sft_data`` (a CuKe jsonl from experiments.build_cuke) or, when absent, SFT samples made from the
99 DICE infilling tasks' (pytorch_code, cuda_code) pairs. ``--throughput_rows`` times the SFT pipeline on CPU.
"""

from __future__ import annotations

import os
import time

import numpy as np
from absl import flags
from tqdm import tqdm

from dice_jax.data import prompts
from dice_jax.data.rl_stream import RLStreamConfig, make_rl_stream, next_step, task_prompt
from dice_jax.data.sft_pipeline import PackingStats, SFTPipelineConfig, make_sft_dataset, sft_texts
from dice_jax.data.tasks import (
  load_e2e_tasks,
  load_infilling_tasks,
  load_kernelbench,
  load_sft_samples,
)
from dice_jax.data.tokenizer import Tokenizer
from dice_jax.errors import UserError
from dice_jax.diffusion.blocks import BlockGrid
from experiments import _cli
from experiments.data_root import data_path

_E2E_FILE = "end_to_end_kernel_generation_4000.json"


_PIPELINE = flags.DEFINE_enum("pipeline", "e2e", ["sft", "infill", "e2e"], "which pipeline to show")
_N = flags.DEFINE_integer("n", 2, "examples to print")
_TOKENIZER = flags.DEFINE_string(
  "tokenizer", None, "HF tokenizer directory (default: DATA_ROOT/sdar_chat)"
)
_E2E = flags.DEFINE_string(
  "e2e_tasks",
  None,
  "(default: DATA_ROOT/dice_rl/end_to_end_kernel_generation_4000.json) DICE end-to-end JSON, or KernelBench problems (level*.jsonl dir/file, checkout, parquet)",
)
_INFILL = flags.DEFINE_string(
  "infill_tasks", None, "default: DATA_ROOT/dice_rl/kernel_infilling_evaluation.json"
)
_SFT = flags.DEFINE_string(
  "sft_data", "", "CuKe jsonl (prompt/response); default: pairs from --infill_tasks"
)
_STYLE = flags.DEFINE_enum("prompt_style", "dice", ["dice", "chat"], "RL prompt rendering")
_SEQ = flags.DEFINE_integer("seq_len", 6144, "SFT row length (DICE cutoff_len)")
_BLOCK = flags.DEFINE_integer("block_size", 0, "block size (0: the SDAR preset's, sdar_1p7b)")
_BATCH = flags.DEFINE_integer("batch_size", 8, "SFT rows per batch")
_BINS = flags.DEFINE_integer("packing_bins", 16, "first-fit packing bins")
_ROWS = flags.DEFINE_integer(
  "throughput_rows", 0, "time the SFT pipeline over this many rows (0: skip)"
)
_WORKERS = flags.DEFINE_integer(
  "workers", 0, "grain mp_prefetch worker processes for the throughput run"
)
_CHARS = flags.DEFINE_integer(
  "max_chars", 1500, "truncate printed texts to head/tail of this many chars"
)


def _clip(s: str) -> str:
  n = _CHARS.value
  return s if len(s) <= n else f"{s[: n // 2]}\n[... {len(s) - n} chars ...]\n{s[-n // 2 :]}"


def _pct(xs) -> str:
  a = np.asarray(xs)
  return (
    " ".join(f"p{q}={int(np.percentile(a, q))}" for q in (50, 90, 95, 99))
    + f" max={a.max()} n={len(a)}"
  )


def _rl(tok: Tokenizer, infill: bool) -> None:
  path = _infill_path() if infill else _E2E.value or data_path("dice_rl", _E2E_FILE)
  if infill:
    tasks, rep = load_infilling_tasks(path, on_error="skip")
    reports = [rep]
  elif os.path.isdir(path) or path.endswith((".jsonl", ".parquet")):  # KernelBench problems
    tasks, reports = load_kernelbench(path, on_error="skip")
  else:
    tasks, rep = load_e2e_tasks(path, on_error="skip")
    reports = [rep]
  skipped = sum(len(r.skipped) for r in reports)
  if not tasks:
    raise UserError(f"{path}: no tasks ({skipped} bad rows skipped)")
  print(f"{len(tasks)} tasks from {path} ({skipped} bad rows skipped)")
  cfg = RLStreamConfig(
    group_size=2, tasks_per_step=max(1, _N.value), num_steps=1, prompt_style=_STYLE.value
  )
  for e in next_step(iter(make_rl_stream(tasks, tok, cfg)), cfg)[::2]:
    print(
      f"\n===== {e['task_id']} level={e['level']} stage={e['stage']} prompt_tokens={len(e['prompt_ids'])}"
    )
    print(_clip(e["prompt"]))
  t0 = time.perf_counter()
  lengths = []
  chunk = 200
  with tqdm(total=len(tasks), desc="tokenising prompts", unit="task", mininterval=1) as bar:
    for i in range(0, len(tasks), chunk):
      part = tasks[i : i + chunk]
      ids = tok.encode_batch([task_prompt(t, tok, _STYLE.value) for t in part])
      lengths += [len(x) for x in ids]
      bar.update(len(part))
  print(
    f"\nprompt tokens over all {len(tasks)} tasks ({_STYLE.value} style): {_pct(lengths)} "
    f"[{time.perf_counter() - t0:.1f} s]"
  )
  for lv in sorted({t.level for t in tasks}):
    sel = [n for n, t in zip(lengths, tasks) if t.level == lv]
    print(f"  level {lv}: {_pct(sel)}")
  limit = 2000 if infill else 1500  # DICE max prompt len (infilling / end-to-end)
  print(f"  prompts over DICE's max_prompt_len {limit}: {sum(n > limit for n in lengths)}")


def _sft_samples():
  if _SFT.value:
    samples, _ = load_sft_samples(_SFT.value, on_error="skip")
    return samples
  tasks, _ = load_infilling_tasks(_infill_path(), on_error="skip")
  return [
    prompts.sft_sample_from_pair(t.reference_code, t.cuda_code, level=t.level, sample_id=t.task_id)
    for t in tasks
  ]


def _sft(tok: Tokenizer) -> None:
  samples = _sft_samples()
  if not samples:
    raise UserError(f"{_SFT.value or _infill_path()}: no SFT samples")
  print(f"{len(samples)} SFT samples")
  for s in samples[: _N.value]:
    p, r = sft_texts(s, tok)
    print(
      f"\n===== {s.sample_id}: prompt_tokens={len(tok.encode(p))} response_tokens={len(tok.encode(r))}"
    )
    print(_clip(p + r))
  with _cli.user_errors_from(ValueError):  # --seq_len, --block_size, --batch_size, --packing_bins
    cfg = SFTPipelineConfig(
      seq_len=_SEQ.value,
      grid=BlockGrid(_block_size()),
      batch_size=_BATCH.value,
      num_packing_bins=_BINS.value,
      drop_remainder=False,
    )
  stats = PackingStats()
  rows = used = loss = 0
  batches = make_sft_dataset(samples, tok, cfg, stats)
  for b in tqdm(batches, desc="packing one epoch", unit="batch", mininterval=1):
    rows += b["tokens"].shape[0]
    used += int((b["segment_ids"] > 0).sum())
    loss += int(b["loss_mask"].sum())
  print(
    f"\none epoch: {rows} rows of {cfg.seq_len}, packing efficiency {used / (rows * cfg.seq_len):.3f}, "
    f"{used} sample tokens ({loss} with loss), {stats.samples_dropped} samples dropped (> seq_len)"
  )
  if _ROWS.value:
    cfg = SFTPipelineConfig(
      seq_len=_SEQ.value,
      grid=BlockGrid(_block_size()),
      batch_size=_BATCH.value,
      num_packing_bins=_BINS.value,
      num_epochs=None,
      worker_count=_WORKERS.value,
    )
    it = iter(make_sft_dataset(samples, tok, cfg))
    next(it)  # warm-up: threads, first fills
    n, t0 = 0, time.perf_counter()
    while n < _ROWS.value:
      n += next(it)["tokens"].shape[0]
    dt = time.perf_counter() - t0
    print(
      f"throughput: {n / dt:.1f} rows/s = {n * cfg.seq_len / dt / 1e3:.0f}k tokens/s "
      f"({n} rows in {dt:.1f} s, {_WORKERS.value} worker processes, {os.cpu_count()} CPUs)"
    )


def _block_size() -> int:
  from dice_jax.model.config import get_config

  return _BLOCK.value or get_config("sdar_1p7b").block_size


def _infill_path() -> str:
  return _INFILL.value or data_path("dice_rl", "kernel_infilling_evaluation.json")


def main(argv):
  del argv
  tok_dir = _TOKENIZER.value or data_path("sdar_chat")
  print(f"loading the tokenizer from {tok_dir} ...", flush=True)
  tok = Tokenizer.from_dir(tok_dir)
  if _PIPELINE.value == "sft":
    _sft(tok)
  else:
    _rl(tok, infill=_PIPELINE.value == "infill")


if __name__ == "__main__":
  _cli.run(main)
