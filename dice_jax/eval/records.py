"""One evaluation record per (problem, sample), kept in an append-only JSONL log that a rerun resumes.

The log (``records.jsonl`` in the run directory) gets one line per verified sample as soon as its
verdict is known; a rerun reads it and does only the (task, sample) pairs that are not there. A line cut
short by a crash is dropped (and cut off the file) on the next open. ``run.json`` beside it holds the
run's settings; a rerun with other settings is refused with the fields that differ.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dice_jax.eval import metrics

RECORDS = "records.jsonl"
MANIFEST = "run.json"
REVIEWS = "reviews.json"
NO_CODE_BLOCK = "NO_CODE_BLOCK"  # the response had no fenced code block: nothing to verify
REJECTED_IN_REVIEW = "REJECTED_IN_REVIEW"


class RunError(ValueError):
  """A run directory that does not match what was asked (the message names the file and fields)."""


@dataclasses.dataclass(frozen=True)
class Timing:
  """A timed comparison against one baseline (milliseconds, means over the timing trials)."""

  speedup: float = 0.0
  candidate_ms: float = 0.0
  baseline_ms: float = 0.0
  flagged: bool = False  # speedup above the run's review threshold


@dataclasses.dataclass(frozen=True)
class EvalRecord:
  """The verdict on one sample of one problem, with what produced it."""

  task_id: str
  level: int
  problem_id: int
  name: str
  sample: int
  compiled: bool = False
  correct: bool = False
  deceptive: bool = False
  failure_kind: str = "OK"
  reason: str = ""
  eager: Timing = Timing()  # against eager PyTorch (KernelBench's baseline_time_torch)
  compiled_baseline: Timing | None = None  # against torch.compile(reference), when asked
  speedup_flagged: bool = False  # a speedup (either baseline) above the run's review threshold
  strict_correct: bool = False  # also correct at fp32 atol = rtol = 1e-4
  device_name: str = ""
  prompt_tokens: int = 0  # as decoded
  prompt_cut: int = 0  # tokens cut from the prompt's end (DICE's 4,096-token limit)
  response_tokens: int = 0
  generation_s: float = 0.0  # this sample's share of its generation batch's wall time
  compile_s: float = 0.0
  run_s: float = 0.0
  candidate: str | None = None  # the code sent to the verifier (None: no code block)
  response: str = ""  # the model's whole response

  @property
  def key(self) -> str:
    return record_key(self.task_id, self.sample)

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> "EvalRecord":
    d = dict(d)
    d["eager"] = Timing(**d.get("eager", {}))
    if d.get("compiled_baseline") is not None:
      d["compiled_baseline"] = Timing(**d["compiled_baseline"])
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in known})

  def outcome(self, baseline: str = "eager", review: str = "") -> metrics.Outcome:
    """The metrics' view of this record against ``baseline`` ("eager" | "compile"), after ``review``
    ("accept" clears the speedup flag; "reject" makes the sample incorrect and deceptive)."""
    if review == "reject":
      return metrics.Outcome(
        self.compiled, False, deceptive=True, failure_kind=REJECTED_IN_REVIEW, flagged=False
      )
    timing = self.eager if baseline == "eager" else self.compiled_baseline
    speedup = timing.speedup if timing is not None else 0.0
    flagged = timing is not None and timing.flagged and review != "accept"
    return metrics.Outcome(
      self.compiled, self.correct, speedup, self.deceptive, self.failure_kind, flagged
    )


def record_key(task_id: str, sample: int) -> str:
  return f"{task_id}#{sample}"


class RecordLog:
  """The append-only ``records.jsonl`` of a run directory."""

  def __init__(self, run_dir: str):
    self.path = os.path.join(run_dir, RECORDS)
    self.records: dict[str, EvalRecord] = {}
    if os.path.exists(self.path):
      self._load()

  def _load(self) -> None:
    good_bytes = 0
    with open(self.path, "rb") as f:
      for raw in f:
        if not raw.endswith(b"\n"):
          break  # cut short by a crash: dropped below
        try:
          rec = EvalRecord.from_json(json.loads(raw))
        except (json.JSONDecodeError, TypeError, KeyError, UnicodeDecodeError) as e:
          raise RunError(f"{self.path}: line {len(self.records) + 1} is not a record ({e})") from e
        self.records[rec.key] = rec
        good_bytes += len(raw)
    if good_bytes != os.path.getsize(self.path):
      with open(self.path, "r+b") as f:
        f.truncate(good_bytes)

  def __contains__(self, key: str) -> bool:
    return key in self.records

  def __len__(self) -> int:
    return len(self.records)

  def append(self, rec: EvalRecord) -> None:
    with open(self.path, "a", encoding="utf-8") as f:
      f.write(json.dumps(rec.to_json(), ensure_ascii=False) + "\n")
    self.records[rec.key] = rec


def _normalised(settings: Mapping[str, Any]) -> dict[str, Any]:
  return json.loads(json.dumps(settings))  # as it will be read back


def check_manifest(run_dir: str, settings: Mapping[str, Any], allow_change: bool = False) -> None:
  """Refuses ``settings`` that differ from those in an existing ``run.json`` of ``run_dir`` (the
  message names the fields); writes nothing."""
  path = os.path.join(run_dir, MANIFEST)
  if not os.path.exists(path) or allow_change:
    return
  with open(path, encoding="utf-8") as f:
    old = json.load(f)
  old.pop("environment", None)
  new = _normalised(settings)
  diff = [
    f"{k}: {old.get(k)!r} -> {new.get(k)!r}"
    for k in sorted(set(old) | set(new))
    if old.get(k) != new.get(k)
  ]
  if diff:
    shown = "; ".join(d if len(d) < 300 else d[:300] + "..." for d in diff)
    raise RunError(
      f"{run_dir} holds a run with other settings ({shown}); use a new --out, or --allow_config_change"
    )


def write_manifest(
  run_dir: str, settings: Mapping[str, Any], environment: Mapping[str, Any] | None = None
) -> None:
  """Writes ``run.json``: ``settings`` plus ``environment`` (hardware and versions of the session that
  started the run; kept when a rerun writes it again)."""
  path = os.path.join(run_dir, MANIFEST)
  env = dict(environment or {})
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      env = json.load(f).get("environment", env)
  os.makedirs(run_dir, exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump({**_normalised(settings), "environment": env}, f, indent=2)
  os.replace(tmp, path)


def read_manifest(run_dir: str) -> dict[str, Any]:
  path = os.path.join(run_dir, MANIFEST)
  if not os.path.exists(path):
    raise RunError(f"{path} not found: {run_dir} is not an evaluation run directory")
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def read_reviews(run_dir: str) -> dict[str, str]:
  """``reviews.json``: {"TASK#SAMPLE": "accept" | "reject"} for flagged speedups (optional)."""
  path = os.path.join(run_dir, REVIEWS)
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    try:
      reviews = json.load(f)
    except json.JSONDecodeError as e:
      raise RunError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from e
  bad = {k: v for k, v in reviews.items() if v not in ("accept", "reject")}
  if bad:
    raise RunError(f"{path}: reviews must be 'accept' or 'reject', got {bad}")
  return reviews


@dataclasses.dataclass(frozen=True)
class Problem:
  """One problem of the run (what a level's denominator counts)."""

  task_id: str
  level: int
  name: str


def level_outcomes(
  problems: Sequence[Problem],
  records: Iterable[EvalRecord],
  samples: int,
  baseline: str = "eager",
  reviews: Mapping[str, str] | None = None,
) -> dict[int, tuple[list, list]]:
  """Per level: (sample 0's outcome per problem or None, every sample's outcomes per problem)."""
  reviews = reviews or {}
  by_key = {r.key: r for r in records}
  out: dict[int, tuple[list, list]] = {}
  for p in problems:
    first, every = out.setdefault(p.level, ([], []))
    outs = [
      by_key[k].outcome(baseline, reviews.get(k, ""))
      for k in (record_key(p.task_id, s) for s in range(samples))
      if k in by_key
    ]
    r0 = by_key.get(record_key(p.task_id, 0))
    first.append(None if r0 is None else outs[0])
    every.append(outs)
  return out
