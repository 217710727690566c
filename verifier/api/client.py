"""The one client of the verifier service (asyncio, no torch): the learner (through a thread adapter in
``dice_jax.verifier_client``), ``python -m verifier check --address`` and the tests use it.

What it guarantees:

* Requests keep their ``request_id`` across retries, so a retry after a lost answer is answered once by the
  service. ``submit`` makes ids from content (``request_id``), so two submissions of the same content share
  one verification; every submitted request resolves exactly once (a second answer for an id is ignored and
  counted in ``stats``).
* Several endpoints (HOST:PORT): each request goes to the reachable endpoint with the fewest requests
  outstanding. An endpoint that fails (unreachable, connection lost, deadline) is marked down and retried
  after an exponential backoff with jitter (logged with its address); a busy service (RESOURCE_EXHAUSTED)
  is backed off, not marked down. A request gives up after ``RetryPolicy.max_wait_s`` without an answer or
  after ``RetryPolicy.max_attempts`` calls: ``submit`` then fails with ``VerifierUnavailable`` naming the
  addresses and their last errors, ``verify`` answers an OVERLOADED or INTERNAL_ERROR result.
* Results are ``contract.VerifyResult``; ``wire`` is the one converter from and to the proto messages.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc

from verifier.api import waiting, wire
from verifier.api.contract import FailureKind, VerifyRequest, VerifyResult
from verifier.api.proto import health_pb2, health_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from verifier.api.waiting import RetryPolicy

log = logging.getLogger(__name__)

# Codes after which the same request may be sent again (to this or another endpoint).
_ENDPOINT_DOWN = frozenset(
  {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,  # server shut down mid-call
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
  }
)
_BUSY = grpc.StatusCode.RESOURCE_EXHAUSTED  # the service's queue is full: back off, not down


class VerifierUnavailable(RuntimeError):
  """No endpoint answered a request within the retry policy; ``code`` is the last gRPC status name."""

  def __init__(self, message: str, code: str = ""):
    super().__init__(message)
    self.code = code


class VerifierRejected(RuntimeError):
  """The service refused a request with a status that a retry does not change (``code``)."""

  def __init__(self, message: str, code: str = ""):
    super().__init__(message)
    self.code = code


def request_id(
  task_id: str, reference: str, candidate: str, options: Mapping[str, Any] | None = None
) -> str:
  """Content hash of a request: equal content -> equal id (the service answers an id once)."""
  h = hashlib.sha256()
  opts = json.dumps(dict(options or {}), sort_keys=True)
  for part in (task_id, reference, candidate, opts):
    h.update(part.encode())
    h.update(b"\0")
  return h.hexdigest()[:32]


def parse_endpoints(spec: str | Sequence[str]) -> list[str]:
  """'h1:p1,h2:p2' (or a list) -> addresses; raises ValueError naming a malformed one."""
  items = spec.split(",") if isinstance(spec, str) else list(spec)
  out = []
  for raw in items:
    addr = raw.strip()
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise ValueError(f"verifier endpoint {raw!r} is not HOST:PORT")
    out.append(addr)
  if not out:
    raise ValueError("no verifier endpoint given (expected HOST:PORT[,HOST:PORT...])")
  if len(set(out)) != len(out):
    raise ValueError(f"verifier endpoints repeat an address: {out}")
  return out


class _Endpoint:
  """One address: its channel, stubs and health."""

  def __init__(self, address: str, policy: RetryPolicy, root_certificates: bytes | None):
    self.address = address
    max_ms = int(policy.max_backoff_s * 1000)
    options = [
      ("grpc.max_receive_message_length", 64 << 20),
      ("grpc.max_send_message_length", 64 << 20),
      # Reconnect soon after a restarted service comes back (gRPC's default waits up to 120 s).
      ("grpc.initial_reconnect_backoff_ms", min(1000, max_ms)),
      ("grpc.min_reconnect_backoff_ms", min(500, max_ms)),
      ("grpc.max_reconnect_backoff_ms", max_ms),
    ]
    if root_certificates is None:
      self.channel = grpc.aio.insecure_channel(address, options=options)
    else:  # TLS: the server's certificate must chain to these roots (PEM)
      creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
      self.channel = grpc.aio.secure_channel(address, creds, options=options)
    self.stub = verifier_pb2_grpc.VerifierStub(self.channel)
    self.health_stub = health_pb2_grpc.HealthStub(self.channel)
    self.outstanding = 0
    self.failures = 0  # consecutive
    self.retry_at = 0.0  # monotonic time before which it is not tried again
    self.down_since: float | None = None
    self.last_error = ""
    self.answered = 0
    self.errors = 0
    self.epoch = 0  # failures marked so far: a call that started before the last one adds none

  @property
  def up(self) -> bool:
    return self.down_since is None

  def mark_ok(self) -> None:
    if self.down_since is not None:
      log.warning(
        "verifier %s answers again after %.1f s down",
        self.address,
        time.monotonic() - self.down_since,
      )
    self.failures, self.retry_at, self.down_since = 0, 0.0, None

  def mark_failed(self, error: str, policy: RetryPolicy, epoch: int) -> None:
    """A call that started at failure epoch `epoch` failed; counted once per epoch, so that the
    calls in flight when a service dies make one failure, not one each."""
    if epoch != self.epoch:
      return
    self.epoch += 1
    self.failures += 1
    self.errors += 1
    self.last_error = error
    wait = policy.backoff_s(self.failures)
    self.retry_at = time.monotonic() + wait
    if self.down_since is None:
      self.down_since = time.monotonic()
    log.warning(
      "verifier %s failed (%s); retrying it in %.1f s (failure %d in a row)",
      self.address,
      error,
      wait,
      self.failures,
    )

  def snapshot(self) -> dict:
    return {
      "address": self.address,
      "up": self.up,
      "outstanding": self.outstanding,
      "answered": self.answered,
      "errors": self.errors,
      "consecutive_failures": self.failures,
      "last_error": self.last_error,
    }


class VerifierClient:
  """asyncio client over several endpoints; create and use it inside one event loop.

  ``options`` are ``VerifyOptions`` fields for ``submit`` (e.g. ``{"measure_performance": True}``); the
  bearer token defaults to ``$VERIFIER_TOKEN`` ("" sends none)."""

  def __init__(
    self,
    endpoints: str | Sequence[str],
    *,
    options: Mapping[str, Any] | None = None,
    token: str | None = None,
    retry: RetryPolicy | None = None,
    max_in_flight: int = 1024,
    cache_size: int = 100_000,
    root_certificates: bytes | None = None,
  ):
    self.retry = retry or RetryPolicy()
    self.options = dict(options or {})
    verifier_pb2.VerifyOptions(**self.options)  # a bad option name or type fails here
    self.endpoints = [
      _Endpoint(a, self.retry, root_certificates) for a in parse_endpoints(endpoints)
    ]
    tok = os.environ.get("VERIFIER_TOKEN", "") if token is None else token
    self._metadata = (("authorization", f"Bearer {tok}"),) if tok else ()
    self._limit = asyncio.Semaphore(max_in_flight)
    self._futures: collections.OrderedDict[str, asyncio.Future] = collections.OrderedDict()
    self._cache_size = cache_size
    self._tasks: set[asyncio.Task] = set()
    self._closed = False  # set by close(): a call cut by it ends its request, never a retry
    self.stats = collections.Counter(
      {k: 0 for k in ("submitted", "deduplicated", "answered", "retries", "ignored")}
    )

  @property
  def addresses(self) -> list[str]:
    return [e.address for e in self.endpoints]

  def health(self) -> list[dict]:
    return [e.snapshot() for e in self.endpoints]

  # ---- requests by content (the learner) ---------------------------------------------------------
  def make_request(
    self, task_id: str, reference: str, candidate: str
  ) -> verifier_pb2.VerifyRequest:
    """The request for one candidate under this client's options; its id is the content hash. Only the
    options given to the client are set, so the service fills in its own defaults (e.g. its device)."""
    return verifier_pb2.VerifyRequest(
      request_id=request_id(task_id, reference, candidate, self.options),
      task_id=task_id,
      reference_source=reference,
      candidate_source=candidate,
      options=verifier_pb2.VerifyOptions(**self.options),
    )

  def submit(self, task_id: str, reference: str, candidate: str) -> asyncio.Future:
    """The future ``VerifyResult`` of one candidate; an id already submitted shares its future. Fails
    with ``VerifierUnavailable`` when the retry policy gives up."""
    req = self.make_request(task_id, reference, candidate)
    self.stats["submitted"] += 1
    fut = self._futures.get(req.request_id)
    if fut is not None and not _failed(fut):
      self.stats["deduplicated"] += 1
      self._futures.move_to_end(req.request_id)
      return fut
    fut = asyncio.get_running_loop().create_future()
    self._futures[req.request_id] = fut
    while len(self._futures) > self._cache_size:
      old_id, old = next(iter(self._futures.items()))
      if not old.done():
        break
      del self._futures[old_id]
    task = asyncio.ensure_future(self._run(req, fut))
    self._tasks.add(task)
    task.add_done_callback(self._tasks.discard)
    return fut

  async def verify_many(self, items: Sequence[tuple[str, str, str]]) -> list[VerifyResult]:
    """Results in item order for (task_id, reference, candidate) items."""
    return list(await asyncio.gather(*(self.submit(*it) for it in items)))

  def _deliver(self, fut: asyncio.Future, result: VerifyResult) -> None:
    if fut.done():  # a second answer for an id that has one: ignored, never counted twice
      self.stats["ignored"] += 1
      return
    fut.set_result(result)
    self.stats["answered"] += 1

  async def _run(self, msg, fut: asyncio.Future) -> None:
    try:
      async with self._limit:
        result = await self._call_until_answered("Verify", msg)
      self._deliver(fut, result)
    except BaseException as e:  # noqa: BLE001 - the caller sees the error on its future
      if not fut.done():
        fut.set_exception(e)
      if isinstance(e, asyncio.CancelledError):
        raise

  # ---- requests as contract types (the CLI, tests) ------------------------------------------------
  async def verify(self, request: VerifyRequest) -> VerifyResult:
    """One request as given (its id and options); when the retry policy gives up or the service rejects
    it, an OVERLOADED (busy) or INTERNAL_ERROR result names why. A refused token raises PermissionError."""
    try:
      return await self.verify_answered(request)
    except VerifierUnavailable as e:
      return _error_result(request, e)

  async def verify_answered(self, request: VerifyRequest) -> VerifyResult:
    """``verify``, but raising ``VerifierUnavailable`` when no endpoint answered within the retry
    policy (no verdict exists) instead of answering a result for it."""
    try:
      async with self._limit:
        return await self._call_until_answered("Verify", wire.request_to_proto(request))
    except VerifierRejected as e:
      return _error_result(request, e)

  async def verify_batch(self, requests: Sequence[VerifyRequest]) -> list[VerifyResult]:
    """Results in request order."""
    return list(await asyncio.gather(*(self.verify(r) for r in requests)))

  async def build_batch(self, requests: Sequence[VerifyRequest]) -> list[VerifyResult]:
    """Build stage only, on compile hosts (servers started with --build-only); raises when the retry
    policy gives up."""

    async def one(r):
      async with self._limit:
        return await self._call_until_answered("Build", wire.request_to_proto(r))

    return list(await asyncio.gather(*(one(r) for r in requests)))

  async def verify_stream(self, requests: Sequence[VerifyRequest]) -> list[VerifyResult]:
    """One streaming call to the least-loaded endpoint; results come back in completion order and are
    returned in request order (matched by request_id). No retries: use verify_batch for those."""
    ep = await self._pick(time.monotonic(), "stream", "")
    ep.outstanding += len(requests)
    try:
      call = ep.stub.VerifyStream(
        iter([wire.request_to_proto(r) for r in requests]),
        timeout=self.retry.call_timeout_s,
        metadata=self._metadata,
      )
      by_id = {}
      async for reply in call:
        by_id[reply.request_id] = wire.result_from_proto(reply)
    finally:
      ep.outstanding -= len(requests)
    return [by_id[r.request_id] for r in requests]

  # ---- the call loop -------------------------------------------------------------------------------
  def _give_up(self, started: float, attempts: int, rid: str, task_id: str, code: str) -> None:
    waited = time.monotonic() - started
    limit = self.retry.max_attempts
    if waited > self.retry.max_wait_s or (limit and attempts >= limit):
      raise VerifierUnavailable(
        f"no verifier answered request {rid} (task {task_id!r}) after {attempts} attempts in "
        f"{waited:.0f} s; endpoints: "
        + "; ".join(f"{e.address} ({e.last_error or 'no error'})" for e in self.endpoints),
        code,
      )

  async def _pick(self, started: float, rid: str, task_id: str, attempts: int = 0) -> _Endpoint:
    """The least-loaded endpoint whose backoff has passed; waits while none has."""
    while True:
      if self._closed:
        raise VerifierUnavailable(f"request {rid} (task {task_id!r}): the client is closed")
      now = time.monotonic()
      ready = [e for e in self.endpoints if e.retry_at <= now]
      if ready:
        low = min(e.outstanding for e in ready)
        return random.choice([e for e in ready if e.outstanding == low])
      self._give_up(started, attempts, rid, task_id, grpc.StatusCode.UNAVAILABLE.name)
      await asyncio.sleep(min(e.retry_at for e in self.endpoints) - now)

  async def _call_until_answered(self, method: str, req) -> VerifyResult:
    started = time.monotonic()
    busy = attempts = 0
    while True:
      ep = await self._pick(started, req.request_id, req.task_id, attempts)
      epoch = ep.epoch
      ep.outstanding += 1
      attempts += 1
      try:
        reply = await getattr(ep.stub, method)(
          req, timeout=self.retry.call_timeout_s, metadata=self._metadata
        )
      except grpc.aio.AioRpcError as e:
        code = e.code()
        if code == grpc.StatusCode.UNAUTHENTICATED:
          raise PermissionError(
            f"verifier at {ep.address} refused the token: {e.details()}"
          ) from None
        if self._closed:
          raise VerifierUnavailable(
            f"request {req.request_id} (task {req.task_id!r}) was in flight when the client closed",
            code.name,
          ) from None
        self.stats["retries"] += 1
        if code == _BUSY:
          busy += 1
          ep.last_error = f"{code.name}: {e.details()}"
          self._give_up(started, attempts, req.request_id, req.task_id, code.name)
          await asyncio.sleep(self.retry.backoff_s(busy))
        elif code in _ENDPOINT_DOWN:
          ep.mark_failed(f"{code.name}: {e.details()}", self.retry, epoch)
        else:
          raise VerifierRejected(
            f"verifier at {ep.address} rejected request {req.request_id} "
            f"(task {req.task_id!r}): {code.name}: {e.details()}",
            code.name,
          ) from None
        self._give_up(started, attempts, req.request_id, req.task_id, code.name)
        continue
      finally:
        ep.outstanding -= 1
      ep.mark_ok()
      ep.answered += 1
      if reply.request_id != req.request_id:
        raise RuntimeError(
          f"verifier at {ep.address} answered request {req.request_id} with id {reply.request_id}"
        )
      return wire.result_from_proto(reply)

  # ---- service state -------------------------------------------------------------------------------
  async def wait_ready(
    self,
    timeout_s: float = waiting.VERIFIER_WAIT_S,
    report: Callable[[str], None] | None = None,
  ) -> None:
    """Waits until every endpoint's health service says SERVING; ``report`` gets a progress line
    (addresses, time waited) when the first check fails and then every
    ``waiting.WAIT_PROGRESS_EVERY_S``. Raises ``VerifierUnavailable`` naming those that never did."""

    async def probe(call_s: float) -> list[str]:
      errors = await asyncio.gather(*(self._not_serving(e, call_s) for e in self.endpoints))
      return [f"{e.address} ({err})" for e, err in zip(self.endpoints, errors) if err]

    bad = await waiting.wait_for(probe, self.addresses, timeout_s, report)
    if bad:
      raise VerifierUnavailable(
        f"verifier not ready after {timeout_s:g} s: {', '.join(bad)}; is `python -m verifier "
        f"serve` running there? ({waiting.WAIT_FLAG} waits longer)",
        grpc.StatusCode.UNAVAILABLE.name,
      )

  async def _not_serving(self, ep: _Endpoint, call_s: float) -> str:
    """'' when the endpoint's health service says SERVING, else why not."""
    try:
      r = await ep.health_stub.Check(health_pb2.HealthCheckRequest(), timeout=call_s)
    except grpc.aio.AioRpcError as e:
      return f"{e.code().name}: {e.details()}"
    if r.status == health_pb2.HealthCheckResponse.SERVING:
      return ""
    return f"status {health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)}"

  async def healthy(self) -> list[bool]:
    """Whether each endpoint's health service says SERVING now (one check each)."""
    return [not await self._not_serving(e, waiting.HEALTH_CALL_S) for e in self.endpoints]

  async def metrics(self) -> list[dict]:
    out = []
    for e in self.endpoints:
      m = await e.stub.Metrics(
        verifier_pb2.MetricsRequest(), timeout=waiting.METRICS_CALL_S, metadata=self._metadata
      )
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

  async def close(self) -> None:
    """Cancels unanswered submissions (their futures raise CancelledError) and closes the channels."""
    self._closed = True  # calls the channels' close cuts end their requests instead of retrying
    for t in list(self._tasks):
      t.cancel()
    await asyncio.gather(*self._tasks, return_exceptions=True)
    await asyncio.gather(*(e.channel.close() for e in self.endpoints))


def _error_result(
  request: VerifyRequest, e: VerifierUnavailable | VerifierRejected
) -> VerifyResult:
  kind = FailureKind.OVERLOADED if e.code == _BUSY.name else FailureKind.INTERNAL_ERROR
  return VerifyResult(request.request_id, request.task_id, failure_kind=kind, reason=str(e))


def _failed(fut: asyncio.Future) -> bool:
  return fut.cancelled() or (fut.done() and fut.exception() is not None)
