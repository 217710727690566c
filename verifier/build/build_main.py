"""The build roles of a worker.

``build`` (runs candidate code, sees the build cache read-only): execute the candidate module on CPU with
a ``load_inline`` whose cache misses go to the service (``CompileNeeded``), then instantiate ``ModelNew``
once to trigger builds done lazily in ``__init__``. What it reports only decides an early COMPILE_ERROR and
build metrics, never a reward. After the module imported it says so (``BuildProgress``): the service then
frees the compile slot and gives instantiation the request's own timeout, so a candidate spinning in
``__init__`` cannot hold a compile worker.

``compile`` (runs no candidate code, the cache writable): build one ``load_inline`` call whose arguments
passed ``build_request.check`` and publish it, without importing it (its static initialisers are candidate
code), or build a precompiled torch header. So every cache entry is what its key's sources compile to: a
candidate cannot write into the cache, only ask for honest builds.
"""

from __future__ import annotations

from verifier.api.contract import FailureKind
from verifier.build import build_cache, build_request
from verifier.ipc.channel import Channel
from verifier.ipc.records import BuildJob, BuildProgress, BuildReport, CompileNeeded, CompileResult


def _exec(source: str, name: str) -> dict:
  namespace = {"__name__": name, "__builtins__": __builtins__}
  exec(compile(source, name, "exec"), namespace)
  return namespace


def _short(exc: BaseException, limit: int = 500) -> str:
  text = f"{type(exc).__name__}: {exc}"
  return text if len(text) <= limit else text[:limit] + " ..."


def build(job: BuildJob, chan: Channel) -> BuildReport:
  if job.pch_request is not None:  # the service asks for a precompiled torch header (pch.py)
    from verifier.build import pch

    return BuildReport(FailureKind.OK, pch=pch.build(job.pch_request))
  if job.compile_request is not None:
    return compile_one(job)
  import torch

  cache = build_cache.install(
    job.build_root, split=job.split_build, use_pch=job.use_pch, publish=False, remote=_remote(chan)
  )
  kind, reason = FailureKind.OK, ""
  try:
    ns = _exec(job.candidate_source, "candidate")
    chan.send(BuildProgress(tuple(cache.events)))
    if "ModelNew" in ns and not any(e["error"] for e in cache.events):
      ref = _exec(job.reference_source, "reference")
      torch.manual_seed(job.seed)
      ns["ModelNew"](*ref["get_init_inputs"]())  # triggers builds done lazily in __init__
  except BaseException as e:  # noqa: BLE001 - anything else is re-examined in the run stage
    failed = [ev for ev in cache.events if ev["error"]]
    if failed:
      kind, reason = (
        FailureKind.COMPILE_ERROR,
        f"building extension {failed[0]['name']!r} failed: {failed[0]['error']}",
      )
    elif not cache.events:
      reason = f"candidate raised before any build (re-checked in the run stage): {_short(e)}"
  events = tuple(cache.events)
  return BuildReport(
    kind, reason, events, cached=bool(events) and all(ev["cached"] for ev in events)
  )


def _remote(chan: Channel):
  """A cache miss of the candidate's load_inline, built by the service's compile worker."""

  def compile_remotely(params: dict) -> dict:
    try:
      checked = build_request.check(params)
    except build_request.BuildRefused as e:
      return {"error": str(e), "cached": False}
    chan.send(CompileNeeded(checked))
    result, _ = chan.recv(CompileResult)
    return dict(result.event)

  return compile_remotely


def compile_one(job: BuildJob) -> BuildReport:
  """The compile role: one checked load_inline call built into the cache, nothing imported."""
  name = str(job.compile_request.get("name", "?"))
  try:
    params = build_request.check(job.compile_request)
  except build_request.BuildRefused as e:
    event = {"name": name, "key": "", "cached": False, "seconds": 0.0, "error": str(e)}
    return BuildReport(FailureKind.COMPILE_ERROR, str(e), (event,))
  cache = build_cache.install(
    job.build_root,
    split=job.split_build,
    use_pch=job.use_pch,
    build_only=True,
    tmp_tag=job.tmp_tag,
  )
  kind, reason = FailureKind.OK, ""
  try:
    cache(**params)
  except Exception as e:  # noqa: BLE001 - a compiler error: the event holds its text
    kind, reason = FailureKind.COMPILE_ERROR, f"building extension {name!r} failed: {_short(e)}"
  event = cache.events[-1]
  return BuildReport(kind, reason, (event,), cached=event["cached"])


def run(chan: Channel) -> None:
  job, _ = chan.recv(BuildJob)
  chan.send(build(job, chan))
