"""gRPC server (grpc.aio) over :class:`verifier.service.VerifierService`.

Auth: a bearer token in the ``authorization`` metadata (``Bearer <token>``) is required on every Verifier
call when the server has one; binding a non-loopback address without a token is refused. The standard
``grpc.health.v1.Health`` service answers without a token (it reveals only the serving status).
Back-pressure: a unary call is refused with RESOURCE_EXHAUSTED when ``max_pending`` requests are queued;
a stream stops reading requests while ``stream_window`` of its own are unanswered.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging

import grpc

from verifier import wire
from verifier.contract import FailureKind
from verifier.proto import health_pb2, health_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from verifier.service import ServiceConfig, VerifierService

log = logging.getLogger("verifier.server")
LOOPBACK_NAMES = {"localhost", "ip6-localhost"}


def is_loopback(host: str) -> bool:
  host = host.strip("[]")
  if host in LOOPBACK_NAMES:
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


class _Servicer(verifier_pb2_grpc.VerifierServicer):
  def __init__(self, service: VerifierService, token: str, stream_window: int):
    self.service, self.token, self.stream_window = service, token, stream_window

  async def _authorize(self, context) -> None:
    if not self.token:
      return
    md = dict(context.invocation_metadata() or ())
    got = md.get("authorization", "")
    if not hmac.compare_digest(got.encode(), f"Bearer {self.token}".encode()):
      await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

  async def _one(self, msg, context) -> verifier_pb2.VerifyResult:
    try:
      req = wire.request_from_proto(msg, self.service.cfg.device)
    except (ValueError, TypeError) as e:
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad VerifyOptions: {e}")
    result = await self.service.verify(req)
    return wire.result_to_proto(result)

  async def Verify(self, request, context):
    await self._authorize(context)
    result = await self._one(request, context)
    if result.failure_kind == verifier_pb2.FAILURE_KIND_OVERLOADED:
      await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, result.reason)
    return result

  async def VerifyStream(self, request_iterator, context):
    await self._authorize(context)
    window = asyncio.Semaphore(self.stream_window)
    done: asyncio.Queue = asyncio.Queue()
    tasks = set()

    async def handle(msg):
      try:
        await done.put(await self._one(msg, context))
      finally:
        window.release()

    async def pump():
      async for msg in request_iterator:
        await window.acquire()  # back-pressure: stop reading while the window is full
        t = asyncio.ensure_future(handle(msg))
        tasks.add(t)
        t.add_done_callback(tasks.discard)
      await asyncio.gather(*list(tasks))
      await done.put(None)

    reader = asyncio.ensure_future(pump())
    try:
      while True:
        item = await done.get()
        if item is None:
          break
        yield item
    finally:
      reader.cancel()
      for t in list(tasks):
        t.cancel()

  async def Build(self, request, context):
    await self._authorize(context)
    try:
      req = wire.request_from_proto(request, self.service.cfg.device)
    except (ValueError, TypeError) as e:
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad VerifyOptions: {e}")
    return wire.result_to_proto(await self.service.build(req))

  async def Metrics(self, request, context):
    await self._authorize(context)
    return verifier_pb2.MetricsReply(**self.service.metrics.snapshot())


class _Health(health_pb2_grpc.HealthServicer):
  def __init__(self):
    self.status = health_pb2.HealthCheckResponse.SERVING

  async def Check(self, request, context):
    if request.service not in ("", "dice.verifier.v1.Verifier"):
      return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
    return health_pb2.HealthCheckResponse(status=self.status)

  async def Watch(self, request, context):
    yield await self.Check(request, context)
    while True:
      await asyncio.sleep(3600)


class VerifierServer:
  """Owns the grpc.aio server and the service; ``await start()``, ``await stop()``."""

  def __init__(
    self,
    cfg: ServiceConfig,
    host: str = "127.0.0.1",
    port: int = 50051,
    token: str = "",
    stream_window: int = 256,
  ):
    if not is_loopback(host) and not token:
      raise ValueError(
        f"refusing to bind non-loopback address {host!r} without an auth token "
        "(pass --token-file or set VERIFIER_TOKEN)"
      )
    self.cfg, self.host, self.requested_port, self.token = cfg, host, port, token
    self.service = VerifierService(cfg)
    self.stream_window = stream_window
    self.server: grpc.aio.Server | None = None
    self.port = 0

  async def start(self) -> int:
    await self.service.start()
    opts = [
      ("grpc.max_receive_message_length", 16 << 20),
      ("grpc.max_send_message_length", 16 << 20),
    ]
    self.server = grpc.aio.server(options=opts)
    verifier_pb2_grpc.add_VerifierServicer_to_server(
      _Servicer(self.service, self.token, self.stream_window), self.server
    )
    self.health = _Health()
    health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
    host = f"[{self.host}]" if ":" in self.host else self.host
    self.port = self.server.add_insecure_port(f"{host}:{self.requested_port}")
    if not self.port:
      raise OSError(f"could not bind {self.host}:{self.requested_port}")
    await self.server.start()
    log.info("verifier serving on %s:%d (device=%s)", self.host, self.port, self.cfg.device)
    return self.port

  async def stop(self, grace: float = 2.0) -> None:
    if self.server is not None:
      self.health.status = health_pb2.HealthCheckResponse.NOT_SERVING
      await self.server.stop(grace)
    await self.service.close()

  async def wait(self) -> None:
    await self.server.wait_for_termination()


__all__ = ["VerifierServer", "is_loopback", "FailureKind"]
