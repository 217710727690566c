"""The build role of a worker: execute the candidate module on CPU with the cached ``load_inline``
(``build_cache``) so its extensions land in the shared build cache, then instantiate ``ModelNew`` once to
trigger builds done lazily in ``__init__``.

It runs candidate code, so it is sandboxed like a run worker (its cache directory is writable); what it
reports only decides an early COMPILE_ERROR and build metrics, never a reward. After the module imported
it says so (``BuildProgress``): the service then frees the compile slot and gives instantiation the
request's own timeout, so a candidate spinning in ``__init__`` cannot hold a compile worker.
"""

from __future__ import annotations

from verifier import build_cache
from verifier.channel import Channel
from verifier.contract import FailureKind
from verifier.records import BuildJob, BuildProgress, BuildReport


def _exec(source: str, name: str) -> dict:
  namespace = {"__name__": name, "__builtins__": __builtins__}
  exec(compile(source, name, "exec"), namespace)
  return namespace


def _short(exc: BaseException, limit: int = 500) -> str:
  text = f"{type(exc).__name__}: {exc}"
  return text if len(text) <= limit else text[:limit] + " ..."


def build(job: BuildJob, chan: Channel) -> BuildReport:
  if job.pch_request is not None:  # the service asks for a precompiled torch header (pch.py)
    from verifier import pch

    return BuildReport(FailureKind.OK, pch=pch.build(job.pch_request))
  import torch

  cache = build_cache.install(job.build_root, split=job.split_build, use_pch=job.use_pch)
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


def run(chan: Channel) -> None:
  job, _ = chan.recv(BuildJob)
  chan.send(build(job, chan))
