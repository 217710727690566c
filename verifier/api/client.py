"""Async client (no JAX): batch verify over several endpoints with deadlines, retries and load balancing.

Requests keep their ``request_id`` across retries, so a retry after a lost answer is answered once by the
server. Each request goes to the endpoint with the fewest requests outstanding from this client; on
UNAVAILABLE / RESOURCE_EXHAUSTED / DEADLINE_EXCEEDED it is retried with exponential backoff and jitter
(on another endpoint when there is one).
"""

from __future__ import annotations

import asyncio
import random
from typing import Sequence

import grpc

from verifier.api import wire
from verifier.api.contract import FailureKind, VerifyRequest, VerifyResult
from verifier.api.proto import health_pb2, health_pb2_grpc, verifier_pb2, verifier_pb2_grpc

RETRYABLE = {
  grpc.StatusCode.UNAVAILABLE,
  grpc.StatusCode.RESOURCE_EXHAUSTED,
  grpc.StatusCode.DEADLINE_EXCEEDED,
}


class _Endpoint:
  def __init__(self, address: str, root_certificates: bytes | None = None):
    self.address = address
    options = [
      ("grpc.max_receive_message_length", 16 << 20),
      ("grpc.max_send_message_length", 16 << 20),
    ]
    if root_certificates is None:
      self.channel = grpc.aio.insecure_channel(address, options=options)
    else:  # TLS: the server's certificate must chain to these roots (PEM)
      creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
      self.channel = grpc.aio.secure_channel(address, creds, options=options)
    self.stub = verifier_pb2_grpc.VerifierStub(self.channel)
    self.health = health_pb2_grpc.HealthStub(self.channel)
    self.outstanding = 0


class VerifierClient:
  def __init__(
    self,
    endpoints: Sequence[str],
    token: str = "",
    deadline_s: float = 900.0,
    retries: int = 4,
    backoff_s: float = 0.5,
    max_concurrency: int = 1024,
    root_certificates: bytes | None = None,
  ):
    if not endpoints:
      raise ValueError("VerifierClient needs at least one endpoint (host:port)")
    self.endpoints = [_Endpoint(a, root_certificates) for a in endpoints]
    self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
    self.deadline_s, self.retries, self.backoff_s = deadline_s, retries, backoff_s
    self.limit = asyncio.Semaphore(max_concurrency)

  def _pick(self, exclude: _Endpoint | None) -> _Endpoint:
    pool = [e for e in self.endpoints if e is not exclude] or self.endpoints
    low = min(e.outstanding for e in pool)
    return random.choice([e for e in pool if e.outstanding == low])

  async def verify(self, request: VerifyRequest) -> VerifyResult:
    msg = wire.request_to_proto(request)
    last: Exception | None = None
    ep = None
    async with self.limit:
      for attempt in range(self.retries + 1):
        ep = self._pick(ep if attempt else None)
        ep.outstanding += 1
        try:
          reply = await ep.stub.Verify(msg, timeout=self.deadline_s, metadata=self.metadata)
          return wire.result_from_proto(reply)
        except grpc.aio.AioRpcError as e:
          last = e
          if e.code() not in RETRYABLE or attempt == self.retries:
            break
          await asyncio.sleep(self.backoff_s * (2**attempt) * (0.5 + random.random()))
        finally:
          ep.outstanding -= 1
    code = last.code() if isinstance(last, grpc.aio.AioRpcError) else None
    if code == grpc.StatusCode.UNAUTHENTICATED:
      raise PermissionError(f"verifier at {ep.address} refused the token: {last.details()}")
    kind = (
      FailureKind.OVERLOADED
      if code == grpc.StatusCode.RESOURCE_EXHAUSTED
      else FailureKind.INTERNAL_ERROR
    )
    detail = last.details() if isinstance(last, grpc.aio.AioRpcError) else str(last)
    return VerifyResult(
      request.request_id,
      request.task_id,
      failure_kind=kind,
      reason=f"verifier call failed after {self.retries + 1} attempts: {code}: {detail}",
    )

  async def verify_batch(self, requests: Sequence[VerifyRequest]) -> list[VerifyResult]:
    """Results in request order."""
    return list(await asyncio.gather(*(self.verify(r) for r in requests)))

  async def verify_stream(self, requests: Sequence[VerifyRequest]) -> list[VerifyResult]:
    """One streaming call to the least-loaded endpoint; results come back in completion order and are
    returned in request order (matched by request_id). No retries: use verify_batch for those."""
    ep = self._pick(None)
    ep.outstanding += len(requests)
    try:
      call = ep.stub.VerifyStream(
        iter([wire.request_to_proto(r) for r in requests]),
        timeout=self.deadline_s,
        metadata=self.metadata,
      )
      by_id = {}
      async for reply in call:
        by_id[reply.request_id] = wire.result_from_proto(reply)
    finally:
      ep.outstanding -= len(requests)
    return [by_id[r.request_id] for r in requests]

  async def build_batch(self, requests: Sequence[VerifyRequest]) -> list[VerifyResult]:
    """Build stage only, on compile hosts (servers started with --build-only)."""

    async def one(r):
      ep = self._pick(None)
      ep.outstanding += 1
      try:
        reply = await ep.stub.Build(
          wire.request_to_proto(r), timeout=self.deadline_s, metadata=self.metadata
        )
        return wire.result_from_proto(reply)
      finally:
        ep.outstanding -= 1

    return list(await asyncio.gather(*(one(r) for r in requests)))

  async def metrics(self) -> list[dict]:
    out = []
    for e in self.endpoints:
      m = await e.stub.Metrics(verifier_pb2.MetricsRequest(), timeout=10, metadata=self.metadata)
      out.append(
        {
          "endpoint": e.address,
          "queue_depth": m.queue_depth,
          "completed": m.completed,
          "candidates_per_minute": m.candidates_per_minute,
          "failure_kinds": dict(m.failure_kinds),
        }
      )
    return out

  async def healthy(self) -> list[bool]:
    res = []
    for e in self.endpoints:
      try:
        r = await e.health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        res.append(r.status == health_pb2.HealthCheckResponse.SERVING)
      except grpc.aio.AioRpcError:
        res.append(False)
    return res

  async def close(self) -> None:
    await asyncio.gather(*(e.channel.close() for e in self.endpoints))
