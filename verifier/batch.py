"""Batch checks for ``python -m verifier check``: read candidates, verify them as one batch, summarise.

Inputs (``load_candidates``):
  * one ``--reference`` and one ``--candidate`` file;
  * a JSONL file, one candidate per row: ``{"id"?, "candidate" | "candidate_path", "reference" |
    "reference_path" | "task_id" ("kernelbench/L1/19") | "level" + "problem_id"}`` (paths relative to
    the file; rows whose candidate is null, e.g. ``experiments.eval`` records without a code block,
    are skipped);
  * a directory: KernelBench's generation files ``level_L_problem_P_sample_S_kernel.py``
    (``scripts/generate_samples.py``), sub-directories with ``reference.py`` and ``candidate.py``, or
    any ``*.py`` files checked against ``--reference``.
KernelBench references (by problem id) come from ``--kernelbench``: ``level{N}.jsonl`` rows
``{level, problem_id, name, code}``, a directory of them, or a KernelBench checkout (``level{N}/*.py``).

Each candidate keeps an ``id``: its JSONL row's ``id`` (its 1-based line number when it has none) or
its file's name. The batch goes to a ``VerifierService`` started in this process, or to running
services through ``verifier.api.client.VerifierClient`` once they answer (``--verifier_wait_s``).
Verdicts are handed on as they arrive (``verdict_file`` writes them); progress goes to stderr, with a
heartbeat (what is building or running, elapsed time) whenever ``HEARTBEAT_S`` passes without a line.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import glob
import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Sequence

from verifier.api.contract import VerifyOptions, VerifyRequest, VerifyResult
from verifier.api.waiting import VERIFIER_WAIT_S

_KB_FILE = re.compile(r"level_(\d+)_problem_(\d+)_sample_(\d+)_kernel\.py$")
_TASK_ID = re.compile(r"(?:kernelbench/)?L(\d+)/(\d+)$")
HEARTBEAT_S = 15.0  # off a terminal, a progress line at least this often


class InputError(ValueError):
  """Bad input to ``check``; the message is one line naming the file and the problem."""


@dataclasses.dataclass(frozen=True)
class Candidate:
  name: str  # shown in the summary
  task_id: str
  reference: str
  candidate: str
  id: str | int = ""  # the input row's "id" (its 1-based line without one), or the file's name


def read_source(path: str, what: str) -> str:
  """The text of ``path``; an ``InputError`` naming it when it is missing, a directory or unreadable."""
  if not os.path.exists(path):
    raise InputError(f"{what} {path}: no such file")
  if os.path.isdir(path):
    raise InputError(f"{what} {path}: is a directory, expected a Python file")
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except (OSError, UnicodeDecodeError) as e:
    raise InputError(f"{what} {path}: cannot be read ({e})") from None
  if not text.strip():
    raise InputError(f"{what} {path}: is empty")
  return text


class KernelBenchProblems:
  """KernelBench reference sources by (level, problem id)."""

  def __init__(self, path: str):
    self.path = path
    self.code: dict[tuple[int, int], str] = {}
    if os.path.isfile(path):
      self._jsonl(path)
    elif os.path.isdir(path):
      files = sorted(glob.glob(os.path.join(path, "level*.jsonl")))
      root = os.path.join(path, "KernelBench") if os.path.isdir(f"{path}/KernelBench") else path
      for f in files:
        self._jsonl(f)
      if not files:
        for d in sorted(glob.glob(os.path.join(root, "level[0-9]*"))):
          level = int(re.search(r"(\d+)$", d).group(1))
          for py in glob.glob(os.path.join(d, "*.py")):
            m = re.match(r"(\d+)_", os.path.basename(py))
            if m:
              self.code[(level, int(m.group(1)))] = read_source(py, "KernelBench problem")
    else:
      raise InputError(f"--kernelbench {path}: no such file or directory")
    if not self.code:
      raise InputError(f"--kernelbench {path}: no KernelBench problems found")

  def _jsonl(self, path: str) -> None:
    with open(path, encoding="utf-8") as f:
      for n, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          row = json.loads(line)
          self.code[(int(row["level"]), int(row["problem_id"]))] = row["code"]
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
          raise InputError(f"{path}:{n}: not a KernelBench row ({type(e).__name__}: {e})") from None

  def get(self, level: int, problem_id: int, where: str) -> str:
    try:
      return self.code[(level, problem_id)]
    except KeyError:
      raise InputError(
        f"{where}: level {level} problem {problem_id} is not in --kernelbench {self.path}"
      ) from None


def _problems(kernelbench: str | None, where: str) -> KernelBenchProblems:
  if not kernelbench:
    raise InputError(
      f"{where} names a KernelBench problem: pass --kernelbench (level*.jsonl or dir)"
    )
  return KernelBenchProblems(kernelbench)


def _from_jsonl(path: str, kernelbench: str | None) -> tuple[list[Candidate], int]:
  base = os.path.dirname(os.path.abspath(path))
  out, skipped, kb = [], 0, None
  with open(path, encoding="utf-8") as f:
    lines = list(enumerate(f, 1))
  for n, line in lines:
    if not line.strip():
      continue
    where = f"{path}:{n}"
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      raise InputError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
      raise InputError(f"{where}: expected a JSON object")
    if "candidate_path" in row:
      cand = read_source(os.path.join(base, row["candidate_path"]), f"{where}: candidate")
    elif "candidate" in row:
      cand = row["candidate"]
      if cand is None:
        skipped += 1
        continue
    else:
      raise InputError(f"{where}: needs 'candidate' or 'candidate_path'")
    task_id = str(row.get("task_id") or row.get("id") or f"row{n}")
    if "reference_path" in row:
      ref = read_source(os.path.join(base, row["reference_path"]), f"{where}: reference")
    elif "reference" in row:
      ref = row["reference"]
    else:
      m = _TASK_ID.search(str(row.get("task_id", "")))
      if m:
        level, pid = int(m.group(1)), int(m.group(2))
      elif "level" in row and "problem_id" in row:
        level, pid = int(row["level"]), int(row["problem_id"])
        task_id = f"kernelbench/L{level}/{pid}"
      else:
        raise InputError(
          f"{where}: needs 'reference', 'reference_path', a task_id like kernelbench/L1/19, "
          "or 'level' and 'problem_id'"
        )
      kb = kb or _problems(kernelbench, where)
      ref = kb.get(level, pid, where)
    sample = row.get("sample")
    name = str(row.get("id") or task_id) + (f"#{sample}" if sample is not None else "")
    row_id = row.get("id")
    out.append(Candidate(name, task_id, ref, cand, n if row_id is None else row_id))
  return out, skipped


def _from_dir(path: str, reference: str | None, kernelbench: str | None) -> list[Candidate]:
  files = sorted(glob.glob(os.path.join(path, "*.py")))
  kb_files = [(f, _KB_FILE.search(os.path.basename(f))) for f in files]
  if reference is not None:
    ref = read_source(reference, "reference")
    return [
      Candidate(b, b[:-3], ref, read_source(f, "candidate"), b)
      for f, b in ((f, os.path.basename(f)) for f in files)
    ]
  if any(m for _, m in kb_files):
    kb = _problems(kernelbench, path)
    out = []
    for f, m in kb_files:
      if m:
        level, pid, sample = map(int, m.groups())
        task = f"kernelbench/L{level}/{pid}"
        ref = kb.get(level, pid, f)
        name = os.path.basename(f)
        out.append(Candidate(f"{task}#{sample}", task, ref, read_source(f, "candidate"), name))
    return out
  pairs = sorted(glob.glob(os.path.join(path, "*", "candidate.py")))
  out = []
  for c in pairs:
    name = os.path.basename(os.path.dirname(c))
    ref = read_source(os.path.join(os.path.dirname(c), "reference.py"), "reference")
    out.append(Candidate(name, name, ref, read_source(c, "candidate"), name))
  return out


def load_candidates(
  path: str | None,
  reference: str | None = None,
  candidate: str | None = None,
  kernelbench: str | None = None,
) -> tuple[list[Candidate], int]:
  """(candidates, rows skipped for having no candidate) from the inputs in the module docstring."""
  if path is None:
    if not (reference and candidate):
      raise InputError("pass a directory or JSONL of candidates, or --reference and --candidate")
    ref, cand = read_source(reference, "reference"), read_source(candidate, "candidate")
    name = os.path.basename(candidate)
    task = os.path.splitext(os.path.basename(reference))[0]
    return [Candidate(name, task, ref, cand, name)], 0
  if candidate:
    raise InputError("pass either a directory/JSONL of candidates or --candidate, not both")
  if not os.path.exists(path):
    raise InputError(f"{path}: no such file or directory")
  if os.path.isdir(path):
    found, skipped = _from_dir(path, reference, kernelbench), 0
  elif path.endswith(".jsonl"):
    found, skipped = _from_jsonl(path, kernelbench)
  else:
    raise InputError(f"{path}: expected a directory or a .jsonl file of candidates")
  if not found:
    raise InputError(
      f"{path}: no candidates found (JSONL rows, level_L_problem_P_sample_S_kernel.py files, "
      "NAME/reference.py + NAME/candidate.py, or *.py with --reference)"
    )
  return found, skipped


def request_id(c: Candidate, opts: VerifyOptions) -> str:
  h = hashlib.sha256()
  for part in (c.task_id, c.reference, c.candidate, json.dumps(opts.to_dict(), sort_keys=True)):
    h.update(part.encode())
    h.update(b"\0")
  return h.hexdigest()[:32]


class Progress:
  """Progress on stderr: done / total, passed, elapsed, and what the service is doing. Off a
  terminal: a line per verdict, and a heartbeat line whenever ``every_s`` passed without a line; on
  a terminal: one live line. ``clock`` is injectable (tests use a fake one)."""

  def __init__(self, total: int, stream=None, every_s: float = HEARTBEAT_S, clock=time.monotonic):
    self.total, self.done, self.passed = total, 0, 0
    self.stream = stream or sys.stderr
    self.tty = self.stream.isatty()
    self.every_s = every_s
    self.clock = clock
    self.t0 = clock()
    self.last_line = self.t0  # when a line was last written (off a terminal)
    self.status = ""

  def line(self) -> str:
    el = self.clock() - self.t0
    s = f"check: {self.done}/{self.total} verified, {self.passed} passed, {el:.0f} s"
    return s + (f" ({self.status})" if self.status else "")

  def _write(self, text: str) -> None:
    self.stream.write(text)
    self.stream.flush()
    self.last_line = self.clock()

  def show(self, force: bool = False) -> None:
    """The live line on a terminal; off one, the status line when forced or a heartbeat is due."""
    if self.tty:
      self._write("\r\033[K" + self.line())
    elif force or self.clock() - self.last_line >= self.every_s:
      self._write(self.line() + "\n")

  def result(self, c: Candidate, r: VerifyResult) -> None:
    self.done += 1
    self.passed += r.reward > 0
    if self.tty:
      self.show()
    else:
      self._write(f"check: [{self.done}/{self.total}] {c.name}: {r.failure_kind.value}\n")

  def close(self) -> None:
    if self.tty:
      self.stream.write("\n")
      self.stream.flush()


CLOSE_S = 10.0  # how long ending a batch waits for a remote service's connections to close


async def heartbeat(progress: Progress, status, sleep=asyncio.sleep, tick_s: float = 1.0) -> None:
  """Refreshes ``progress`` with ``status()`` every ``tick_s`` until cancelled."""
  while True:
    await sleep(tick_s)
    progress.status = status()
    progress.show()


async def verify_batch(
  candidates: Sequence[Candidate],
  opts: VerifyOptions,
  *,
  service_config=None,
  addresses: Sequence[str] = (),
  token: str = "",
  progress: Progress | None = None,
  on_result=None,
  wait_s: float = VERIFIER_WAIT_S,
  report=None,
) -> list[VerifyResult | None]:
  """Verdicts in candidate order, from a service started here (``service_config``) or from the
  services at ``addresses``; ``on_result(i, result)`` is called as each arrives. Remote services
  must answer within ``wait_s`` (progress lines to ``report``) or ``VerifierUnavailable`` is raised;
  a candidate that no service answered later (the retry policy gave up) is None."""
  reqs = [
    VerifyRequest(request_id(c, opts), c.task_id, c.reference, c.candidate, opts)
    for c in candidates
  ]
  if addresses:
    from verifier.api.client import VerifierClient, VerifierUnavailable

    client = VerifierClient(list(addresses), token=token)
    try:
      await client.wait_ready(wait_s, report)
    except BaseException:
      await client.close()
      raise

    async def verify(req):
      try:
        return await client.verify_answered(req)
      except VerifierUnavailable as e:
        if report is not None:
          report(f"no verdict for {req.task_id}: {e}")
        return None

    def status():
      n = sum(e["outstanding"] for e in client.health())
      return f"{n} in flight at {', '.join(addresses)}"

    close = client.close
  else:
    from verifier.serve.service import VerifierService

    service = VerifierService(service_config)
    if progress is not None:
      progress.status = "starting the verifier"
      progress.show(force=True)
    await service.start()

    def status():
      m = service.metrics
      return f"{m.in_build} building, {m.in_run} running, {m.pending} waiting"

    verify, close = service.verify, service.close
  results: list[VerifyResult | None] = [None] * len(reqs)
  beat = asyncio.create_task(heartbeat(progress, status)) if progress is not None else None

  async def one(i: int):
    return i, await verify(reqs[i])

  calls = [asyncio.ensure_future(one(i)) for i in range(len(reqs))]
  try:
    for fut in asyncio.as_completed(calls):
      i, r = await fut
      if r is None:
        continue
      results[i] = r
      if on_result is not None:
        on_result(i, r)
      if progress is not None:
        progress.result(candidates[i], r)
  finally:
    if beat is not None:
      beat.cancel()
    for c in calls:  # a Ctrl-C or an error ends the calls still out
      c.cancel()
    if addresses:  # a remote service that does not let go of its calls does not hold up the exit
      gather = lambda: asyncio.gather(*calls, return_exceptions=True)  # noqa: E731
      await _within(CLOSE_S, gather, close, report=report)
    else:  # the service started here stops its workers, however long that takes
      await asyncio.gather(*calls, return_exceptions=True)
      await close()
  return results


async def _within(seconds: float, *steps, report=None) -> None:
  """Awaits each of ``steps`` (functions returning awaitables) in turn for at most ``seconds`` in all;
  past that the rest is left (cancelled, not waited for) and ``report`` says so."""

  async def run():
    for step in steps:
      await step()

  task = asyncio.ensure_future(run())
  done, _ = await asyncio.wait([task], timeout=seconds)
  if not done:
    task.cancel()
    if report is not None:
      report(f"the verifier's connections did not close within {seconds:g} s; left open")


def summary(candidates: Sequence[Candidate], results: Sequence[VerifyResult]) -> str:
  """A table of the verdicts and the count of each failure kind."""
  w = max(12, *(len(c.name) for c in candidates))
  rows = [f"{'candidate':<{w}}  {'verdict':<20}{'speedup':>9}{'compile s':>11}{'run s':>8}  reason"]
  for c, r in zip(candidates, results):
    speed = f"{r.speedup:.3f}" if r.speedup else "-"
    reason = r.reason.replace("\n", " ")[:70]
    rows.append(
      f"{c.name:<{w}}  {r.failure_kind.value:<20}{speed:>9}{r.compile_s:>11.1f}{r.run_s:>8.1f}  "
      f"{reason}"
    )
  kinds = collections.Counter(r.failure_kind.value for r in results)
  passed = sum(r.reward > 0 for r in results)
  devices = sorted({r.device_name for r in results if r.device_name})
  rows.append(
    f"{passed} of {len(results)} passed; "
    + ", ".join(f"{k} {n}" for k, n in kinds.most_common())
    + (f"; device {', '.join(devices)}" if devices else "")
  )
  return "\n".join(rows)
