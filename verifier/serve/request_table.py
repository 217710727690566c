"""Request ids: a retried request is answered once; an id reused for a different payload is refused.

An id maps to the fingerprint (sha256) of its payload (reference, candidate, options, task id). The same id
with the same fingerprint gets the answer in flight or recently given; with another fingerprint it is
refused with a reason naming the id, whatever happened to the first one (answered, in flight or evicted
from the answers but still remembered by fingerprint).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import json

from verifier.api.contract import VerifyRequest, VerifyResult


def fingerprint(req: VerifyRequest) -> str:
  payload = {
    "task_id": req.task_id,
    "reference": req.reference_source,
    "candidate": req.candidate_source,
    "options": dataclasses.asdict(req.options),
  }
  return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


class IdReused(ValueError):
  pass


class RequestTable:
  def __init__(self, max_answers: int = 20000, max_ids: int = 200000):
    self.max_answers, self.max_ids = max_answers, max_ids
    self.prints: collections.OrderedDict[str, str] = collections.OrderedDict()
    self.answered: collections.OrderedDict[str, VerifyResult] = collections.OrderedDict()
    self.inflight: dict[str, asyncio.Future] = {}

  def claim(self, req: VerifyRequest) -> tuple[VerifyResult | asyncio.Future | None, str]:
    """(earlier answer or in-flight future or None, fingerprint). Raises IdReused for another payload."""
    fp = fingerprint(req)
    known = self.prints.get(req.request_id)
    if known is not None and known != fp:
      raise IdReused(
        f"request_id {req.request_id!r} was already used for a different request (another candidate, "
        "reference, task or options); use a new id per request"
      )
    if known is not None:
      if req.request_id in self.answered:
        return self.answered[req.request_id], fp
      if req.request_id in self.inflight:
        return self.inflight[req.request_id], fp
    self.prints[req.request_id] = fp
    self.prints.move_to_end(req.request_id)
    while len(self.prints) > self.max_ids:
      self.prints.popitem(last=False)
    self.inflight[req.request_id] = asyncio.get_running_loop().create_future()
    return None, fp

  def answer(self, req: VerifyRequest, result: VerifyResult) -> None:
    fut = self.inflight.pop(req.request_id, None)
    self.answered[req.request_id] = result
    while len(self.answered) > self.max_answers:
      self.answered.popitem(last=False)
    if fut is not None and not fut.done():
      fut.set_result(result)

  def fail(self, req: VerifyRequest, exc: BaseException) -> None:
    fut = self.inflight.pop(req.request_id, None)
    self.prints.pop(req.request_id, None)
    if fut is not None and not fut.done():
      fut.set_exception(exc)
      fut.exception()
