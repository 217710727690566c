"""Learner-side gRPC client for the verifier service (DESIGN.md: talk to it only through the generated stubs).

``verify_batch([(task_id, reference_src, candidate_src), ...])`` sends the requests over the ``VerifyStream`` RPC
and returns one ``VerifyOutcome`` per request, in request order (the server answers in completion order; results
are matched by ``request_id``, a content hash, so a retried request is answered once).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from verifier.proto import verifier_pb2, verifier_pb2_grpc  # generated stubs only

_PREFIX = "FAILURE_KIND_"


@dataclasses.dataclass(frozen=True)
class VerifyOutcome:
  task_id: str
  correct: bool
  speedup: float
  failure_kind: (
    str  # "ok", "wrong_output", "compile_error", ... (proto enum name, lower case, no prefix)
  )
  reason: str
  compiled: bool = False
  reward: float = 0.0
  deceptive: bool = False
  candidate_ms: float = 0.0
  baseline_ms: float = 0.0
  strict_correct: bool = False  # also correct at fp32 atol = rtol = 1e-4
  device_name: str = ""  # the GPU (or "cpu") that ran it
  compile_s: float = 0.0
  run_s: float = 0.0


def request_id(
  task_id: str, reference_src: str, candidate_src: str, options: Mapping[str, Any]
) -> str:
  h = hashlib.sha256()
  for part in (task_id, reference_src, candidate_src, json.dumps(dict(options), sort_keys=True)):
    h.update(part.encode())
    h.update(b"\0")
  return h.hexdigest()[:32]


def failure_kind_name(value: int) -> str:
  name = verifier_pb2.FailureKind.Name(value)
  return name[len(_PREFIX) :].lower() if name.startswith(_PREFIX) else name.lower()


def outcome_from_proto(r) -> VerifyOutcome:
  return VerifyOutcome(
    task_id=r.task_id,
    correct=bool(r.correct),
    speedup=float(r.speedup),
    failure_kind=failure_kind_name(r.failure_kind),
    reason=r.reason,
    compiled=bool(r.compiled),
    reward=float(r.reward),
    deceptive=bool(r.deceptive),
    candidate_ms=float(r.candidate.mean_ms),
    baseline_ms=float(r.baseline.mean_ms),
    strict_correct=bool(r.strict_correct),
    device_name=r.device_name,
    compile_s=float(r.compile_s),
    run_s=float(r.run_s),
  )


class GrpcVerifierClient:
  """Blocking client. ``options`` are ``VerifyOptions`` fields (e.g. ``measure_performance=True``); the bearer
  token (the server's ``--token-file`` / ``VERIFIER_TOKEN``) defaults to ``$VERIFIER_TOKEN``."""

  def __init__(
    self,
    address: str,
    options: Mapping[str, Any] | None = None,
    timeout_s: float = 3600.0,
    token: str | None = None,
  ):
    if ":" not in address:
      raise ValueError(f"verifier address must be HOST:PORT, got {address!r}")
    self.address = address
    self.options = dict(options or {})
    self.timeout_s = timeout_s
    token = os.environ.get("VERIFIER_TOKEN", "") if token is None else token
    self._metadata = (("authorization", f"Bearer {token}"),) if token else None
    self._channel = grpc.insecure_channel(
      address,
      options=[
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.max_send_message_length", 64 << 20),
      ],
    )
    self._stub = verifier_pb2_grpc.VerifierStub(self._channel)

  def wait_ready(self, timeout_s: float = 30.0) -> None:
    grpc.channel_ready_future(self._channel).result(timeout=timeout_s)

  def _request(self, task_id: str, ref: str, cand: str):
    return verifier_pb2.VerifyRequest(
      request_id=request_id(task_id, ref, cand, self.options),
      task_id=task_id,
      reference_source=ref,
      candidate_source=cand,
      options=verifier_pb2.VerifyOptions(**self.options),
    )

  def verify(self, task_id: str, reference_src: str, candidate_src: str) -> VerifyOutcome:
    return outcome_from_proto(
      self._stub.Verify(
        self._request(task_id, reference_src, candidate_src),
        timeout=self.timeout_s,
        metadata=self._metadata,
      )
    )

  def verify_batch(self, items: Sequence[tuple[str, str, str]]) -> list[VerifyOutcome]:
    reqs = [self._request(*it) for it in items]
    by_id: dict[str, VerifyOutcome] = {}
    for r in self._stub.VerifyStream(iter(reqs), timeout=self.timeout_s, metadata=self._metadata):
      by_id[r.request_id] = outcome_from_proto(r)
    missing = [q.task_id for q in reqs if q.request_id not in by_id]
    if missing:
      raise RuntimeError(
        f"verifier at {self.address} returned no result for {len(missing)} requests: {missing[:5]}"
      )
    return [by_id[q.request_id] for q in reqs]

  def close(self) -> None:
    self._channel.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
