"""The ``--out`` file of ``python -m verifier check``: one JSON line per verdict, written and flushed
as the verdict arrives, so an interrupted run keeps every verdict it got; a rerun with the same file
reads it and skips the candidates already judged.

A line is ``VerifyResult.to_dict()`` plus ``id`` (the input row's ``id``, or its 1-based line number
when it has none; a file's name for directory inputs) and ``name`` (as in the summary). A candidate
counts as judged when a line carries its ``request_id`` (a hash of its task, sources and options:
other options judge it again).
"""

from __future__ import annotations

import json
import os

from verifier.api.contract import VerifyResult
from verifier.batch import Candidate, InputError


def record(c: Candidate, r: VerifyResult) -> dict:
  """The line of one verdict."""
  return {"id": c.id, "name": c.name, **r.to_dict()}


def load(path: str) -> tuple[dict[str, dict], int]:
  """(request_id -> record, bytes of whole records) of ``path``; ({}, 0) when it does not exist. A
  last line cut short (the run was killed while writing it) is not counted; any other line that is
  not a record is an ``InputError`` naming it."""
  if not os.path.exists(path):
    return {}, 0
  if os.path.isdir(path):
    raise InputError(f"--out {path}: is a directory, expected a file")
  with open(path, "rb") as f:
    data = f.read()
  records: dict[str, dict] = {}
  pos = n = 0
  while pos < len(data):
    n += 1
    end = data.find(b"\n", pos)
    whole = end != -1  # else the text after the last newline
    raw = data[pos : end if whole else len(data)]
    if raw.strip():
      rec = _record(raw)
      if rec is None:
        if not whole:
          break  # cut short while it was written: dropped
        raise InputError(
          f"--out {path}:{n}: not a `verifier check` verdict line (pass another --out)"
        )
      records[rec["request_id"]] = rec
    pos = end + 1 if whole else len(data)
  return records, pos


def _record(raw: bytes) -> dict | None:
  try:
    rec = json.loads(raw)
  except (json.JSONDecodeError, UnicodeDecodeError):
    return None
  ok = isinstance(rec, dict) and isinstance(rec.get("request_id"), str) and rec["request_id"]
  return rec if ok else None


class VerdictWriter:
  """Appends verdict lines to ``path`` after its first ``keep_bytes`` (a line cut short by an
  interrupted run is dropped), one write and flush per line. The file is opened at the first
  verdict: a run that judges nothing leaves it as it was."""

  def __init__(self, path: str, keep_bytes: int = 0):
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
      raise InputError(f"--out {path}: no such directory {parent}")
    self.path, self.keep_bytes = path, keep_bytes
    self._f = None

  def _open(self):
    f = open(self.path, "a+b")  # appends land at the end, which truncate() sets
    f.truncate(self.keep_bytes)
    if self.keep_bytes:
      f.seek(self.keep_bytes - 1)
      if f.read(1) != b"\n":
        f.write(b"\n")
    return f

  def write(self, c: Candidate, r: VerifyResult) -> None:
    if self._f is None:
      self._f = self._open()
    self._f.write(json.dumps(record(c, r)).encode() + b"\n")
    self._f.flush()

  def close(self) -> None:
    if self._f is not None:
      self._f.close()
