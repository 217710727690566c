"""Loaders for kernel tasks and PyTorch->CUDA pairs, with row-level schema validation.

Sources (facts from KernelBench, ScalingIntelligence/KernelBench, and DICE's RL task files, DICE `training/RL/`):
  * KernelBench problems: JSONL rows ``{level, problem_id, name, code}`` (DATA_ROOT/kernelbench), a
    KernelBench checkout (``KernelBench/level{N}/{id}_{Name}.py``), or its HF parquet export (same columns).
  * DICE RL task files: end-to-end ``[{idx, level: "0".."3", pytorch_code, cuda_code: "", raw_answer}]``,
    ``kernelbench_level1.json`` ``[{pytorch_code}]``, and infilling
    ``[{id, pytorch_code, cuda_code, prefix, middle, suffix}]`` with ``prefix + middle + suffix == cuda_code``.
  * ConCuR-style pairs: ``{pytorch_code, cuda_code, reasoning?, speedup?, level?, id?}`` (JSON list or JSONL).

Every bad row is reported as ``file:LINE: problem`` (JSONL, lines from 1, as ``verifier check`` and
the candidates file report them) or ``file: record N: problem`` (a JSON list or parquet table, records
from 1). ``on_error="raise"`` stops at the first bad row;
``on_error="skip"`` skips it, logs it and records it in the returned ``LoadReport`` -- nothing is dropped silently.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal

from absl import logging

from dice_jax.errors import UserError

OnError = Literal["raise", "skip"]

# Curriculum stages (DICE's data scheduling: single operations -> fused operations -> model structures).
STAGE_NAMES = ("single_op", "fused_op", "model")


def curriculum_stage(level: int) -> int:
  """0 single ops (DICE level 0/1, KernelBench L1), 1 fused ops (L2), 2 model structures (L3, L4)."""
  return 0 if level <= 1 else (1 if level == 2 else 2)


class DataError(UserError):
  """A data row or file does not match its schema; the message names the file and row."""


def where(path: str, row: int) -> str:
  """Where row `row` (0-based: a JSONL line index, or a record's index in a JSON list or table) is,
  as a reader counts: ``file:LINE`` for JSONL, ``file: record N`` otherwise (both from 1)."""
  return f"{path}:{row + 1}" if path.endswith(".jsonl") else f"{path}: record {row + 1}"


@dataclasses.dataclass(frozen=True)
class RowIssue:
  path: str
  row: int  # 0-based index of the record in the file (JSON list index or JSONL line number - 1)
  message: str

  def __str__(self) -> str:
    return f"{where(self.path, self.row)}: {self.message}"


@dataclasses.dataclass
class LoadReport:
  """What a loader read: how many rows were accepted and which were skipped (with reasons)."""

  path: str
  accepted: int = 0
  skipped: list[RowIssue] = dataclasses.field(default_factory=list)

  @property
  def total(self) -> int:
    return self.accepted + len(self.skipped)


@dataclasses.dataclass(frozen=True)
class KernelTask:
  """One RL / evaluation task. ``reference_code`` is the PyTorch ``Model`` file.

  For infilling tasks ``prefix``/``middle``/``suffix`` hold the skeleton and the ground-truth middle and
  ``cuda_code`` the whole ground-truth file."""

  task_id: str
  level: int
  reference_code: str
  name: str = ""
  kind: Literal["e2e", "infill"] = "e2e"
  prefix: str | None = None
  middle: str | None = None
  suffix: str | None = None
  cuda_code: str | None = None
  origin: str = ""  # where it was read (`where`), or its file

  @property
  def stage(self) -> int:
    return curriculum_stage(self.level)


@dataclasses.dataclass(frozen=True)
class KernelPair:
  """A ConCuR-style (PyTorch reference, CUDA candidate) pair, optionally with reasoning and a speedup."""

  pair_id: str
  pytorch_code: str
  cuda_code: str
  reasoning: str | None = None
  speedup: float | None = None
  level: int | None = None
  origin: str = ""


# ------------------------------------------------------------------ reading records
def _records(path: str) -> Iterator[tuple[int, Any]]:
  """(row index, record) from a JSON list or a JSONL file; malformed JSONL lines are yielded as DataError."""
  if not os.path.exists(path):
    raise DataError(f"{path}: file not found")
  if path.endswith(".jsonl"):
    with open(path, encoding="utf-8") as f:
      for i, line in enumerate(f):
        if not line.strip():
          continue
        try:
          yield i, json.loads(line)
        except json.JSONDecodeError as e:
          yield i, DataError(f"invalid JSON: {e.msg} at column {e.colno}")
    return
  with open(path, encoding="utf-8") as f:
    try:
      data = json.load(f)
    except json.JSONDecodeError as e:
      raise DataError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from e
  if isinstance(data, Mapping):  # {"data": [...]} or {id: row}
    data = data.get("data", data.get("rows", list(data.values())))
  if not isinstance(data, list):
    raise DataError(f"{path}: expected a JSON list of rows, got {type(data).__name__}")
  yield from enumerate(data)


class _Validator:
  """Collects row issues for one file and applies the on_error policy."""

  def __init__(self, path: str, on_error: OnError):
    if on_error not in ("raise", "skip"):
      raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    self.report = LoadReport(path)
    self.on_error = on_error

  def bad(self, row: int, message: str) -> None:
    issue = RowIssue(self.report.path, row, message)
    if self.on_error == "raise":
      raise DataError(str(issue))
    logging.warning("skipping bad row %s", issue)
    self.report.skipped.append(issue)

  def ok(self) -> None:
    self.report.accepted += 1


def _need_str(rec: Mapping, key: str, *, allow_empty: bool = False) -> str:
  if key not in rec:
    raise DataError(f"missing field {key!r}")
  v = rec[key]
  if not isinstance(v, str):
    raise DataError(f"field {key!r} must be a string, got {type(v).__name__}")
  if not allow_empty and not v.strip():
    raise DataError(f"field {key!r} is empty")
  return v


def _opt_str(rec: Mapping, key: str) -> str | None:
  v = rec.get(key)
  if v is None:
    return None
  if not isinstance(v, str):
    raise DataError(f"field {key!r} must be a string or null, got {type(v).__name__}")
  return v


def _level(rec: Mapping, key: str = "level", default: int | None = None) -> int:
  if key not in rec or rec[key] is None:
    if default is None:
      raise DataError(f"missing field {key!r}")
    return default
  v = rec[key]
  if isinstance(v, bool):
    raise DataError(f"field {key!r} must be an integer level, got bool")
  if isinstance(v, int):
    lv = v
  elif isinstance(v, str) and re.fullmatch(r"\s*\d+\s*", v):
    lv = int(v)
  else:
    raise DataError(f"field {key!r} must be an integer level (or a digit string), got {v!r}")
  if lv < 0:
    raise DataError(f"field {key!r} must be >= 0, got {lv}")
  return lv


def _load(path: str, on_error: OnError, parse) -> tuple[list, LoadReport]:
  v = _Validator(path, on_error)
  out = []
  for row, rec in _records(path):
    try:
      if isinstance(rec, DataError):
        raise rec
      if not isinstance(rec, Mapping):
        raise DataError(f"row must be a JSON object, got {type(rec).__name__}")
      out.append(parse(row, rec))
    except DataError as e:
      v.bad(row, str(e))
      continue
    v.ok()
  if v.report.skipped:
    logging.warning("%s: skipped %d of %d rows", path, len(v.report.skipped), v.report.total)
  return out, v.report


# ------------------------------------------------------------------ DICE RL task files
def load_e2e_tasks(
  path: str, on_error: OnError = "raise", default_level: int | None = None
) -> tuple[list[KernelTask], LoadReport]:
  """DICE end-to-end tasks (``end_to_end_kernel_generation_4000.json``; ``kernelbench_level1.json`` needs
  ``default_level=1`` since it has no level). Order is file order (DICE's sequential schedule relies on it)."""
  stem = os.path.splitext(os.path.basename(path))[0]

  def parse(row, rec):
    code = _need_str(rec, "pytorch_code")
    tid = rec.get("idx", rec.get("id", row))
    return KernelTask(
      task_id=f"{stem}/{tid}",
      level=_level(rec, default=default_level),
      reference_code=code,
      name=str(rec.get("name", "")),
      kind="e2e",
      origin=where(path, row),
    )

  return _load(path, on_error, parse)


def load_infilling_tasks(
  path: str, on_error: OnError = "raise", default_level: int = 1
) -> tuple[list[KernelTask], LoadReport]:
  """DICE infilling tasks ``{id, pytorch_code, cuda_code, prefix, middle, suffix}`` (level optional)."""
  stem = os.path.splitext(os.path.basename(path))[0]

  def parse(row, rec):
    code = _need_str(rec, "pytorch_code")
    prefix = _need_str(rec, "prefix", allow_empty=True)
    middle = _need_str(rec, "middle")
    suffix = _need_str(rec, "suffix", allow_empty=True)
    cuda = _opt_str(rec, "cuda_code")
    if cuda is None:
      cuda = prefix + middle + suffix
    elif prefix + middle + suffix != cuda:
      raise DataError("prefix + middle + suffix != cuda_code")
    tid = rec.get("id", rec.get("idx", row))
    return KernelTask(
      task_id=f"{stem}/{tid}",
      level=_level(rec, default=default_level),
      reference_code=code,
      kind="infill",
      prefix=prefix,
      middle=middle,
      suffix=suffix,
      cuda_code=cuda,
      origin=where(path, row),
    )

  return _load(path, on_error, parse)


# ------------------------------------------------------------------ KernelBench
def load_kernelbench(
  path: str, levels: Iterable[int] | None = None, on_error: OnError = "raise"
) -> tuple[list[KernelTask], list[LoadReport]]:
  """KernelBench problems from a ``level{N}.jsonl`` file, a directory of them, a KernelBench checkout
  (``level{N}/*.py``, also under ``KernelBench/``), or a ``.parquet`` HF export. Sorted by (level, id)."""
  want = set(levels) if levels is not None else None
  tasks: list[KernelTask] = []
  reports: list[LoadReport] = []

  def parse_row(origin_path):
    def parse(row, rec):
      code = _need_str(rec, "code")
      level = _level(rec)
      pid = rec.get("problem_id")
      if isinstance(pid, bool) or not isinstance(pid, int):
        raise DataError(f"field 'problem_id' must be an integer, got {pid!r}")
      name = _need_str(rec, "name")
      return KernelTask(
        task_id=f"kernelbench/L{level}/{pid}",
        level=level,
        reference_code=code,
        name=name,
        origin=where(origin_path, row),
      )

    return parse

  if os.path.isfile(path) and path.endswith(".parquet"):
    rows, rep = _load_parquet(path, on_error, parse_row(path))
    tasks += rows
    reports.append(rep)
  elif os.path.isfile(path):
    rows, rep = _load(path, on_error, parse_row(path))
    tasks += rows
    reports.append(rep)
  elif os.path.isdir(path):
    jsonls = sorted(glob.glob(os.path.join(path, "level*.jsonl")))
    root = (
      os.path.join(path, "KernelBench")
      if os.path.isdir(os.path.join(path, "KernelBench"))
      else path
    )
    level_dirs = sorted(glob.glob(os.path.join(root, "level[0-9]*")))
    if jsonls:
      for p in jsonls:
        rows, rep = _load(p, on_error, parse_row(p))
        tasks += rows
        reports.append(rep)
    elif level_dirs:
      for d in level_dirs:
        t, rep = _load_checkout_level(d, on_error)
        tasks += t
        reports.append(rep)
    else:
      raise DataError(f"{path}: no level*.jsonl files and no KernelBench level*/ directories")
  else:
    raise DataError(f"{path}: not found")
  if want is not None:
    tasks = [t for t in tasks if t.level in want]
  tasks.sort(key=lambda t: (t.level, int(t.task_id.rsplit("/", 1)[1])))
  return tasks, reports


def _load_checkout_level(d: str, on_error: OnError) -> tuple[list[KernelTask], LoadReport]:
  m = re.search(r"level(\d+)$", d.rstrip("/"))
  level = int(m.group(1))
  v = _Validator(d, on_error)
  out = []
  for row, f in enumerate(sorted(glob.glob(os.path.join(d, "*.py")))):
    base = os.path.basename(f)
    pm = re.match(r"(\d+)_(.+)\.py$", base)
    if pm is None:
      v.bad(row, f"file name {base!r} is not '<problem_id>_<Name>.py'")
      continue
    with open(f, encoding="utf-8") as fh:
      code = fh.read()
    if not code.strip():
      v.bad(row, f"{base} is empty")
      continue
    out.append(
      KernelTask(
        task_id=f"kernelbench/L{level}/{int(pm.group(1))}",
        level=level,
        reference_code=code,
        name=base[:-3],
        origin=f,
      )
    )
    v.ok()
  return out, v.report


def _load_parquet(path: str, on_error: OnError, parse) -> tuple[list, LoadReport]:
  try:
    import pyarrow.parquet as pq  # optional: only for the HF parquet export
  except ImportError as e:
    raise DataError(f"{path}: reading parquet needs pyarrow, which is not installed") from e
  records = pq.read_table(path).to_pylist()
  v = _Validator(path, on_error)
  out = []
  for row, rec in enumerate(records):
    try:
      out.append(parse(row, rec))
    except DataError as e:
      v.bad(row, str(e))
      continue
    v.ok()
  return out, v.report


# ------------------------------------------------------------------ ConCuR-style pairs
def load_pairs(path: str, on_error: OnError = "raise") -> tuple[list[KernelPair], LoadReport]:
  """PyTorch->CUDA pairs. Required: ``pytorch_code``, ``cuda_code`` (non-empty strings). Optional:
  ``reasoning`` (str), ``speedup`` (number > 0), ``level`` (int), ``id``."""
  stem = os.path.splitext(os.path.basename(path))[0]

  def parse(row, rec):
    py = _need_str(rec, "pytorch_code")
    cu = _need_str(rec, "cuda_code")
    reasoning = _opt_str(rec, "reasoning")
    sp = rec.get("speedup")
    if sp is not None and (isinstance(sp, bool) or not isinstance(sp, (int, float)) or not sp > 0):
      raise DataError(f"field 'speedup' must be a positive number or null, got {sp!r}")
    level = _level(rec) if rec.get("level") is not None else None
    pid = rec.get("id", rec.get("idx", row))
    return KernelPair(
      pair_id=f"{stem}/{pid}",
      pytorch_code=py,
      cuda_code=cu,
      reasoning=reasoning,
      speedup=None if sp is None else float(sp),
      level=level,
      origin=where(path, row),
    )

  return _load(path, on_error, parse)


def load_sft_samples(path: str, on_error: OnError = "raise"):
  """CuKe-format SFT rows ``{prompt, response, level?, id?}`` (what ``experiments.build_cuke`` writes)."""
  from dice_jax.data.prompts import SFTSample

  def parse(row, rec):
    prompt = _need_str(rec, "prompt")
    response = _need_str(rec, "response")
    level = _level(rec) if rec.get("level") is not None else None
    return SFTSample(
      prompt=prompt, response=response, level=level, sample_id=str(rec.get("id", row))
    )

  return _load(path, on_error, parse)
