"""The learner's one client of the verifier service (DESIGN.md: RL, eval and the CuKe builder use it).

It talks to the service only through the generated stubs (`verifier/api/proto`), never through
`verifier`'s own Python code. What it guarantees:

* Request ids are content hashes of (task id, reference, candidate, options), so a retried request is
  answered once by the service, and two submissions of the same content share one verification.
* Every submitted request resolves exactly once: outcomes are joined by request id into one future
  per id; an answer for an id that already has one is ignored and counted (`stats`).
* Several endpoints (HOST:PORT): each request goes to the reachable endpoint with the fewest
  requests outstanding. An endpoint that fails (unreachable, connection lost, deadline) is marked
  down and retried after an exponential backoff (bounded, logged with its address); while every
  endpoint is down the learner waits. After `RetryPolicy.max_wait_s` without any answer a request
  fails with `VerifierUnavailable` naming the addresses and their last errors.

Two faces: `AsyncVerifierClient` (asyncio, one event loop) and `VerifierClient`, which owns a
background event-loop thread and offers `submit` (a `concurrent.futures.Future`) for the rollout,
which samples on the main thread while verification runs, and blocking `verify_batch` for the CuKe
builder.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import random
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from absl import logging

from verifier.api.proto import health_pb2, health_pb2_grpc, verifier_pb2, verifier_pb2_grpc

_PREFIX = "FAILURE_KIND_"
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
  """No endpoint answered a request within `RetryPolicy.max_wait_s`."""


@dataclasses.dataclass(frozen=True)
class VerifyOutcome:
  """The verdict on one candidate (a `VerifyResult` message as plain data)."""

  request_id: str
  task_id: str
  compiled: bool
  correct: bool
  deceptive: bool
  reward: float  # the service's binary reward
  failure_kind: str  # "ok", "wrong_output", "compile_error", ... (proto name, lower case)
  reason: str = ""
  speedup: float = 0.0  # 0 when not timed
  candidate_ms: float = 0.0
  baseline_ms: float = 0.0
  compile_s: float = 0.0
  run_s: float = 0.0
  build_cached: bool = False
  endpoint: str = ""  # the address that answered ("" for local judges)
  strict_correct: bool = False  # also correct at fp32 atol = rtol = 1e-4
  device_name: str = ""  # the GPU (or "cpu") that ran it; "" when it did not run

  @property
  def timed(self) -> bool:
    return self.speedup > 0


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
  """Waiting on unreachable endpoints: backoff doubles from `initial_backoff_s` to at most
  `max_backoff_s` (with +-25% jitter); a request gives up after `max_wait_s` without an answer."""

  initial_backoff_s: float = 0.5
  max_backoff_s: float = 30.0
  max_wait_s: float = 1800.0
  call_timeout_s: float = 3600.0  # one RPC; the service has its own build/run limits

  def __post_init__(self):
    for name in ("initial_backoff_s", "max_backoff_s", "max_wait_s", "call_timeout_s"):
      if not getattr(self, name) > 0:
        raise ValueError(f"RetryPolicy.{name} must be > 0, got {getattr(self, name)}")
    if self.max_backoff_s < self.initial_backoff_s:
      raise ValueError("RetryPolicy.max_backoff_s must be >= initial_backoff_s")

  def backoff_s(self, failures: int) -> float:
    base = min(self.max_backoff_s, self.initial_backoff_s * 2 ** max(0, failures - 1))
    return base * random.uniform(0.75, 1.25)


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


def failure_kind_name(value: int) -> str:
  name = verifier_pb2.FailureKind.Name(value)
  return name[len(_PREFIX) :].lower() if name.startswith(_PREFIX) else name.lower()


def outcome_from_proto(msg, endpoint: str = "") -> VerifyOutcome:
  return VerifyOutcome(
    request_id=msg.request_id,
    task_id=msg.task_id,
    compiled=bool(msg.compiled),
    correct=bool(msg.correct),
    deceptive=bool(msg.deceptive),
    reward=float(msg.reward),
    failure_kind=failure_kind_name(msg.failure_kind),
    reason=msg.reason,
    speedup=float(msg.speedup),
    candidate_ms=float(msg.candidate.mean_ms),
    baseline_ms=float(msg.baseline.mean_ms),
    compile_s=float(msg.compile_s),
    run_s=float(msg.run_s),
    build_cached=bool(msg.build_cached),
    endpoint=endpoint,
    strict_correct=bool(msg.strict_correct),
    device_name=msg.device_name,
  )


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


def _token(token: str | None) -> str:
  return os.environ.get("VERIFIER_TOKEN", "") if token is None else token


class _Endpoint:
  """One address: its channel, stubs and health."""

  def __init__(self, address: str, policy: RetryPolicy):
    self.address = address
    max_ms = int(policy.max_backoff_s * 1000)
    self.channel = grpc.aio.insecure_channel(
      address,
      options=[
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.max_send_message_length", 64 << 20),
        # Reconnect soon after a restarted service comes back (gRPC's default waits up to 120 s).
        ("grpc.initial_reconnect_backoff_ms", min(1000, max_ms)),
        ("grpc.min_reconnect_backoff_ms", min(500, max_ms)),
        ("grpc.max_reconnect_backoff_ms", max_ms),
      ],
    )
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
      logging.warning(
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
    logging.warning(
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


class AsyncVerifierClient:
  """asyncio client over several endpoints; create and use it inside one event loop.

  `options` are `VerifyOptions` fields (e.g. `{"measure_performance": True}`); the bearer token
  defaults to `$VERIFIER_TOKEN` ("" sends none)."""

  def __init__(
    self,
    endpoints: str | Sequence[str],
    *,
    options: Mapping[str, Any] | None = None,
    token: str | None = None,
    retry: RetryPolicy = RetryPolicy(),
    max_in_flight: int = 1024,
    cache_size: int = 100_000,
  ):
    self.retry = retry
    self.options = dict(options or {})
    verifier_pb2.VerifyOptions(**self.options)  # a bad option name or type fails here
    self._endpoints = [_Endpoint(a, retry) for a in parse_endpoints(endpoints)]
    tok = _token(token)
    self._metadata = (("authorization", f"Bearer {tok}"),) if tok else ()
    self._limit = asyncio.Semaphore(max_in_flight)
    self._futures: collections.OrderedDict[str, asyncio.Future] = collections.OrderedDict()
    self._cache_size = cache_size
    self._tasks: set[asyncio.Task] = set()
    self.stats = collections.Counter(
      {k: 0 for k in ("submitted", "deduplicated", "answered", "retries", "ignored")}
    )

  @property
  def addresses(self) -> list[str]:
    return [e.address for e in self._endpoints]

  def health(self) -> list[dict]:
    return [e.snapshot() for e in self._endpoints]

  def make_request(self, task_id: str, reference: str, candidate: str):
    return verifier_pb2.VerifyRequest(
      request_id=request_id(task_id, reference, candidate, self.options),
      task_id=task_id,
      reference_source=reference,
      candidate_source=candidate,
      options=verifier_pb2.VerifyOptions(**self.options),
    )

  def submit(self, task_id: str, reference: str, candidate: str) -> asyncio.Future:
    """The future outcome of one request; an id already submitted shares its future."""
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

  async def verify(self, task_id: str, reference: str, candidate: str) -> VerifyOutcome:
    return await self.submit(task_id, reference, candidate)

  async def verify_many(self, items: Sequence[tuple[str, str, str]]) -> list[VerifyOutcome]:
    """Outcomes in item order for (task_id, reference, candidate) items."""
    return list(await asyncio.gather(*(self.submit(*it) for it in items)))

  def _deliver(self, fut: asyncio.Future, outcome: VerifyOutcome) -> None:
    if fut.done():  # a second answer for an id that has one: ignored, never counted twice
      self.stats["ignored"] += 1
      return
    fut.set_result(outcome)
    self.stats["answered"] += 1

  async def _run(self, req, fut: asyncio.Future) -> None:
    try:
      async with self._limit:
        outcome = await self._call_until_answered(req)
      self._deliver(fut, outcome)
    except BaseException as e:  # noqa: BLE001 - the caller sees the error on its future
      if not fut.done():
        fut.set_exception(e)
      if isinstance(e, asyncio.CancelledError):
        raise

  def _give_up_if_late(self, started: float, req) -> None:
    waited = time.monotonic() - started
    if waited > self.retry.max_wait_s:
      raise VerifierUnavailable(
        f"no verifier answered request {req.request_id} (task {req.task_id!r}) for "
        f"{waited:.0f} s; endpoints: "
        + "; ".join(f"{e.address} ({e.last_error or 'no error'})" for e in self._endpoints)
      )

  async def _pick(self, started: float, req) -> _Endpoint:
    """The least-loaded endpoint whose backoff has passed; waits while none has."""
    while True:
      now = time.monotonic()
      ready = [e for e in self._endpoints if e.retry_at <= now]
      if ready:
        low = min(e.outstanding for e in ready)
        return random.choice([e for e in ready if e.outstanding == low])
      self._give_up_if_late(started, req)
      await asyncio.sleep(min(e.retry_at for e in self._endpoints) - now)

  async def _call_until_answered(self, req) -> VerifyOutcome:
    started = time.monotonic()
    busy = 0
    while True:
      ep = await self._pick(started, req)
      epoch = ep.epoch
      ep.outstanding += 1
      try:
        reply = await ep.stub.Verify(
          req, timeout=self.retry.call_timeout_s, metadata=self._metadata
        )
      except grpc.aio.AioRpcError as e:
        code = e.code()
        if code == grpc.StatusCode.UNAUTHENTICATED:
          raise PermissionError(
            f"verifier at {ep.address} refused the token: {e.details()}"
          ) from None
        self.stats["retries"] += 1
        if code == _BUSY:
          busy += 1
          await asyncio.sleep(self.retry.backoff_s(busy))
        elif code in _ENDPOINT_DOWN:
          ep.mark_failed(f"{code.name}: {e.details()}", self.retry, epoch)
        else:
          raise RuntimeError(
            f"verifier at {ep.address} rejected request {req.request_id} "
            f"(task {req.task_id!r}): {code.name}: {e.details()}"
          ) from None
        self._give_up_if_late(started, req)
        continue
      finally:
        ep.outstanding -= 1
      ep.mark_ok()
      ep.answered += 1
      if reply.request_id != req.request_id:
        raise RuntimeError(
          f"verifier at {ep.address} answered request {req.request_id} with id {reply.request_id}"
        )
      return outcome_from_proto(reply, ep.address)

  async def wait_ready(self, timeout_s: float = 60.0) -> None:
    """Waits until every endpoint's health service says SERVING; raises naming those that don't."""
    deadline = time.monotonic() + timeout_s

    async def one(ep: _Endpoint):
      while True:
        try:
          r = await ep.health_stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
          if r.status == health_pb2.HealthCheckResponse.SERVING:
            return None
          err = f"status {r.status}"
        except grpc.aio.AioRpcError as e:
          err = f"{e.code().name}: {e.details()}"
        if time.monotonic() > deadline:
          return f"{ep.address} ({err})"
        await asyncio.sleep(0.5)

    bad = [b for b in await asyncio.gather(*(one(e) for e in self._endpoints)) if b]
    if bad:
      raise VerifierUnavailable(f"verifier not ready after {timeout_s:.0f} s: {', '.join(bad)}")

  async def close(self) -> None:
    """Cancels unanswered requests (their futures raise CancelledError) and closes the channels."""
    for t in list(self._tasks):
      t.cancel()
    await asyncio.gather(*self._tasks, return_exceptions=True)
    await asyncio.gather(*(e.channel.close() for e in self._endpoints))


class VerifierClient:
  """Thread-safe blocking face of `AsyncVerifierClient`: its event loop runs in a daemon thread.

  with VerifierClient("127.0.0.1:50051", options={"measure_performance": True}) as client:
    client.wait_ready()
    fut = client.submit(task_id, reference, candidate)   # returns at once
    outcome = fut.result()
    outcomes = client.verify_batch([(task_id, reference, candidate), ...])
  """

  def __init__(self, endpoints: str | Sequence[str], **kwargs):
    self._loop = asyncio.new_event_loop()
    self._thread = threading.Thread(
      target=self._loop.run_forever, name="verifier-client", daemon=True
    )
    self._thread.start()

    async def make():
      return AsyncVerifierClient(endpoints, **kwargs)

    try:
      self._client = self._call(make())
    except BaseException:
      self._stop_loop()
      raise
    self.options = self._client.options

  def _call(self, coro, timeout: float | None = None):
    return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

  @property
  def addresses(self) -> list[str]:
    return self._client.addresses

  def submit(self, task_id: str, reference: str, candidate: str) -> concurrent.futures.Future:
    """Starts verifying one candidate; the returned future holds its `VerifyOutcome`."""
    out: concurrent.futures.Future = concurrent.futures.Future()

    async def run():
      try:
        out.set_result(await self._client.submit(task_id, reference, candidate))
      except asyncio.CancelledError:
        out.cancel()
      except Exception as e:  # noqa: BLE001 - handed to the caller
        out.set_exception(e)

    asyncio.run_coroutine_threadsafe(run(), self._loop)
    return out

  def verify(self, task_id: str, reference: str, candidate: str) -> VerifyOutcome:
    return self.submit(task_id, reference, candidate).result()

  def verify_batch(self, items: Sequence[tuple[str, str, str]]) -> list[VerifyOutcome]:
    """Outcomes in item order for (task_id, reference, candidate) items (the CuKe builder's call)."""
    return self._call(self._client.verify_many(list(items)))

  def wait_ready(self, timeout_s: float = 60.0) -> None:
    self._call(self._client.wait_ready(timeout_s))

  def health(self) -> list[dict]:
    return self._call(_value(self._client.health))

  def stats(self) -> dict:
    return self._call(_value(lambda: dict(self._client.stats)))

  def _stop_loop(self) -> None:
    self._loop.call_soon_threadsafe(self._loop.stop)
    self._thread.join(timeout=10)
    self._loop.close()

  def close(self) -> None:
    if self._loop.is_closed():
      return
    self._call(self._client.close(), timeout=10)
    self._stop_loop()

  def __enter__(self) -> "VerifierClient":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


async def _value(fn):
  return fn()


def _failed(fut: asyncio.Future) -> bool:
  return fut.cancelled() or (fut.done() and fut.exception() is not None)
