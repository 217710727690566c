"""CuKe builder: verify and time PyTorch->CUDA pairs, keep correct ones at >= min_speedup (DICE, arXiv 2602.11715).

DICE keeps a pair only if the CUDA version is at least 2.0x faster than PyTorch. Steps:
  1. load pairs (row errors reported with file and row; skipped or fatal by ``on_error``);
  2. deduplicate identical pairs (whitespace-normalised PyTorch + CUDA source);
  3. measure each unique pair through a verifier (``verify_batch``), appending every result to
     ``measurements.jsonl`` as it arrives -- a rerun skips pairs already measured (resumable);
  4. write ``cuke.jsonl`` (SFT rows: prompt, response, level, measured speedup, sources) atomically, plus
     ``summary.json`` (counts by level, failure kinds) and ``speedup_hist.png``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

from absl import logging
from tqdm import tqdm

from dice_jax import atomic
from dice_jax.data.prompts import sft_sample_from_pair
from dice_jax.data.tasks import KernelPair, OnError, load_pairs

MEASUREMENTS = "measurements.jsonl"
DATASET = "cuke.jsonl"
SUMMARY = "summary.json"
HISTOGRAM = "speedup_hist.png"


class VerifyResultLike(Protocol):
  correct: bool
  speedup: float
  failure_kind: str
  reason: str


class BatchVerifier(Protocol):
  """What the builder needs from the verifier: results in request order."""

  def verify_batch(self, items: Sequence[tuple[str, str, str]]) -> Sequence[VerifyResultLike]:
    """items: (task_id, reference_src, candidate_src)."""
    ...


@dataclasses.dataclass(frozen=True)
class CukeConfig:
  min_speedup: float = 2.0
  batch_size: int = 16
  on_error: OnError = "skip"

  def __post_init__(self):
    if not self.min_speedup > 0:
      raise ValueError(f"min_speedup must be > 0, got {self.min_speedup}")
    if self.batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")


def _normalise(src: str) -> str:
  return "\n".join(re.sub(r"[ \t]+$", "", line) for line in src.strip().splitlines())


def pair_key(p: KernelPair) -> str:
  """Content hash of a pair (trailing whitespace and blank edges ignored); the dedup and resume key."""
  h = hashlib.sha256()
  h.update(_normalise(p.pytorch_code).encode())
  h.update(b"\0")
  h.update(_normalise(p.cuda_code).encode())
  return h.hexdigest()[:32]


def dedup_pairs(pairs: Sequence[KernelPair]) -> tuple[list[KernelPair], dict[str, list[str]]]:
  """First occurrence of each pair key, and for each kept key the ids of the duplicates dropped."""
  seen: dict[str, KernelPair] = {}
  dups: dict[str, list[str]] = {}
  for p in pairs:
    k = pair_key(p)
    if k in seen:
      dups.setdefault(k, []).append(p.pair_id)
    else:
      seen[k] = p
  return list(seen.values()), dups


def read_measurements(path: str) -> dict[str, dict]:
  """key -> measurement from a journal; a torn last line (crash mid-write) is ignored with a warning."""
  out: dict[str, dict] = {}
  if not os.path.exists(path):
    return out
  with open(path, encoding="utf-8") as f:
    lines = f.readlines()
  for i, line in enumerate(lines):
    try:
      rec = json.loads(line)
    except json.JSONDecodeError:
      if i == len(lines) - 1:
        logging.warning("%s: ignoring a torn last line (will re-measure that pair)", path)
        continue
      raise ValueError(f"{path}:{i + 1}: corrupt measurement journal line")
    out[rec["key"]] = rec
  return out


@dataclasses.dataclass
class CukeSummary:
  pairs_in: int
  invalid_rows: list[str]
  duplicates: int
  unique: int
  measured_now: int
  resumed: int
  correct: int
  kept: int
  min_speedup: float
  kept_by_level: dict[str, int]
  failure_kinds: dict[str, int]
  speedups_correct: list[float]

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d["speedups_correct"] = sorted(round(s, 4) for s in self.speedups_correct)
    return d


def build_cuke(
  pairs_path: str, verifier: BatchVerifier, out_dir: str, cfg: CukeConfig = CukeConfig()
) -> CukeSummary:
  pairs, report = load_pairs(pairs_path, on_error=cfg.on_error)
  os.makedirs(out_dir, exist_ok=True)
  unique, dups = dedup_pairs(pairs)
  n_dup = sum(len(v) for v in dups.values())
  logging.info(
    "CuKe: %d valid pairs (%d invalid rows), %d duplicates, %d unique",
    len(pairs),
    len(report.skipped),
    n_dup,
    len(unique),
  )
  journal = os.path.join(out_dir, MEASUREMENTS)
  done = read_measurements(journal)
  todo = [p for p in unique if pair_key(p) not in done]
  resumed = len(unique) - len(todo)
  if resumed:
    logging.info("CuKe: resuming, %d pairs already measured, %d to go", resumed, len(todo))
  with (
    open(journal, "a", encoding="utf-8") as jf,
    tqdm(total=len(todo), desc="verify+time", unit="pair") as bar,
  ):
    for start in range(0, len(todo), cfg.batch_size):
      chunk = todo[start : start + cfg.batch_size]
      results = verifier.verify_batch([(p.pair_id, p.pytorch_code, p.cuda_code) for p in chunk])
      if len(results) != len(chunk):
        raise RuntimeError(f"verifier returned {len(results)} results for {len(chunk)} requests")
      for p, r in zip(chunk, results):
        rec = {
          "key": pair_key(p),
          "pair_id": p.pair_id,
          "correct": bool(r.correct),
          "speedup": float(r.speedup or 0.0),
          "failure_kind": r.failure_kind.label,
          "reason": str(r.reason)[:500],
          "level": p.level,
          "claimed_speedup": p.speedup,
        }
        jf.write(json.dumps(rec) + "\n")
        done[rec["key"]] = rec
      jf.flush()
      os.fsync(jf.fileno())
      bar.update(len(chunk))

  rows, kept_levels, failures, speedups = [], Counter(), Counter(), []
  for p in unique:
    m = done[pair_key(p)]
    if not m["correct"]:
      failures[m["failure_kind"] or "incorrect"] += 1
      continue
    speedups.append(m["speedup"])
    if m["speedup"] < cfg.min_speedup:
      failures["below_min_speedup"] += 1
      continue
    s = sft_sample_from_pair(p.pytorch_code, p.cuda_code, p.reasoning, p.level, p.pair_id)
    rows.append(
      {
        **s.to_json(),
        "speedup": m["speedup"],
        "pytorch_code": p.pytorch_code,
        "cuda_code": p.cuda_code,
        "key": pair_key(p),
      }
    )
    kept_levels[str(p.level) if p.level is not None else "unknown"] += 1
  atomic.write_text(os.path.join(out_dir, DATASET), "".join(json.dumps(r) + "\n" for r in rows))
  summary = CukeSummary(
    pairs_in=report.total,
    invalid_rows=[str(i) for i in report.skipped],
    duplicates=n_dup,
    unique=len(unique),
    measured_now=len(todo),
    resumed=resumed,
    correct=len(speedups),
    kept=len(rows),
    min_speedup=cfg.min_speedup,
    kept_by_level=dict(sorted(kept_levels.items())),
    failure_kinds=dict(sorted(failures.items())),
    speedups_correct=speedups,
  )
  atomic.write_text(os.path.join(out_dir, SUMMARY), json.dumps(summary.to_json(), indent=2))
  atomic.write_file(
    os.path.join(out_dir, HISTOGRAM), lambda tmp: _plot_hist(tmp, speedups, cfg.min_speedup)
  )
  logging.info(
    "CuKe: kept %d of %d unique pairs (%d correct) at >= %.2fx",
    len(rows),
    len(unique),
    len(speedups),
    cfg.min_speedup,
  )
  return summary


def _plot_hist(path: str, speedups: Sequence[float], threshold: float) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  fig, ax = plt.subplots(figsize=(6, 3.5))
  if speedups:
    s = np.clip(np.asarray(speedups, float), 1e-3, None)
    bins = np.logspace(
      np.log10(min(s.min(), threshold) / 1.2), np.log10(max(s.max(), threshold) * 1.2), 30
    )
    ax.hist(s, bins=bins, color="tab:blue")
    ax.set_xscale("log")
  ax.axvline(threshold, color="tab:red", linestyle="--", label=f"keep >= {threshold:g}x")
  ax.set_xlabel("measured speedup over PyTorch (correct kernels)")
  ax.set_ylabel("pairs")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, format="png", dpi=100)
  plt.close(fig)
