"""gRPC server (grpc.aio) over :class:`verifier.serve.service.VerifierService`.

Auth: a bearer token in the ``authorization`` metadata (``Bearer <token>``) is required on every Verifier
call when the server has one; binding a non-loopback address without a token is refused. With a TLS
certificate and key (``tls``) the port speaks TLS (``grpc.ssl_server_credentials``), so the token does not
cross the network in the clear. The standard ``grpc.health.v1.Health`` service answers without a token
(it reveals only the serving status). Request bytes that do not decode are answered INVALID_ARGUMENT.
Back-pressure: a unary call is refused with RESOURCE_EXHAUSTED when ``max_pending`` requests are queued;
a stream stops reading requests while ``stream_window`` of its own are unanswered. The port is bound
before any worker starts, so an address in use fails at once with one line naming it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import ipaddress
import logging

import grpc
from google.protobuf.message import DecodeError

from verifier.api import wire
from verifier.api.contract import FailureKind
from verifier.api.proto import health_pb2, health_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from verifier.serve.service import ServiceConfig, VerifierService

log = logging.getLogger("verifier.serve.server")
LOOPBACK_NAMES = {"localhost", "ip6-localhost"}


def is_loopback(host: str) -> bool:
  host = host.strip("[]")
  if host in LOOPBACK_NAMES:
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


@dataclasses.dataclass(frozen=True)
class TlsFiles:
  cert_chain: str  # PEM certificate chain of this server
  private_key: str  # PEM private key

  def credentials(self) -> grpc.ServerCredentials:
    with open(self.private_key, "rb") as k, open(self.cert_chain, "rb") as c:
      return grpc.ssl_server_credentials([(k.read(), c.read())])


def _check_free(host: str, port: int, address: str) -> None:
  """Fail with one line naming the address if something listens there (grpc would log its own error
  and, with SO_REUSEPORT, could even share the port)."""
  import socket

  if not port:
    return
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  with socket.socket(family, socket.SOCK_STREAM) as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      s.bind((host.strip("[]"), port))
    except OSError as e:
      raise OSError(f"cannot listen on {address}: {e.strerror or e}") from None


class _Undecodable:
  """What a request deserializes to when its bytes are not a valid message."""

  def __init__(self, error: str):
    self.error = error


def _safe(parse):
  def deserialize(data: bytes):
    try:
      return parse(data)
    except (DecodeError, ValueError, TypeError) as e:
      return _Undecodable(f"{type(e).__name__}: {e}")

  return deserialize


def _handlers(servicer) -> grpc.GenericRpcHandler:
  """The Verifier service's handlers (as the generated ``add_VerifierServicer_to_server``), with
  deserializers that turn undecodable bytes into INVALID_ARGUMENT instead of UNKNOWN."""
  pb = verifier_pb2
  req = _safe(pb.VerifyRequest.FromString)
  out = pb.VerifyResult.SerializeToString
  return grpc.method_handlers_generic_handler(
    "dice.verifier.v1.Verifier",
    {
      "Verify": grpc.unary_unary_rpc_method_handler(servicer.Verify, req, out),
      "VerifyStream": grpc.stream_stream_rpc_method_handler(servicer.VerifyStream, req, out),
      "Metrics": grpc.unary_unary_rpc_method_handler(
        servicer.Metrics, _safe(pb.MetricsRequest.FromString), pb.MetricsReply.SerializeToString
      ),
      "Build": grpc.unary_unary_rpc_method_handler(servicer.Build, req, out),
    },
  )


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

  async def _decode(self, msg, context):
    if isinstance(msg, _Undecodable):
      await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT, f"request bytes are not a VerifyRequest: {msg.error}"
      )
    try:
      return wire.request_from_proto(msg, self.service.cfg.device)
    except (ValueError, TypeError) as e:
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad VerifyOptions: {e}")

  async def _one(self, msg, context) -> verifier_pb2.VerifyResult:
    req = await self._decode(msg, context)
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
    req = await self._decode(request, context)
    return wire.result_to_proto(await self.service.build(req))

  async def Metrics(self, request, context):
    await self._authorize(context)
    if isinstance(request, _Undecodable):
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad MetricsRequest: {request.error}")
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
    tls: TlsFiles | None = None,
  ):
    if not is_loopback(host) and not token:
      raise ValueError(
        f"refusing to bind non-loopback address {host!r} without an auth token "
        "(pass --token-file or set VERIFIER_TOKEN)"
      )
    self.cfg, self.host, self.requested_port, self.token = cfg, host, port, token
    self.tls = tls
    self.service = VerifierService(cfg)
    self.stream_window = stream_window
    self.server: grpc.aio.Server | None = None
    self.port = 0

  async def start(self) -> int:
    """Bind the port (refused at once if taken), then start the workers, then serve."""
    opts = [
      ("grpc.max_receive_message_length", 16 << 20),
      ("grpc.max_send_message_length", 16 << 20),
      ("grpc.so_reuseport", 0),
    ]
    self.server = grpc.aio.server(options=opts)
    self.server.add_generic_rpc_handlers(
      (_handlers(_Servicer(self.service, self.token, self.stream_window)),)
    )
    self.health = _Health()
    health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
    host = f"[{self.host}]" if ":" in self.host else self.host
    address = f"{host}:{self.requested_port}"
    _check_free(self.host, self.requested_port, address)
    try:
      if self.tls is not None:
        self.port = self.server.add_secure_port(address, self.tls.credentials())
      else:
        self.port = self.server.add_insecure_port(address)
    except RuntimeError as e:
      raise OSError(f"cannot listen on {address}: {e} (is the address already in use?)") from None
    if not self.port:
      raise OSError(f"cannot listen on {address}: the address is in use or not available")
    await self.service.start()
    await self.server.start()
    log.info(
      "verifier serving on %s:%d (device=%s, %s)",
      self.host,
      self.port,
      self.cfg.device,
      "TLS" if self.tls else "plaintext",
    )
    return self.port

  async def stop(self, grace: float = 2.0) -> None:
    if self.server is not None:
      self.health.status = health_pb2.HealthCheckResponse.NOT_SERVING
      await self.server.stop(grace)
    await self.service.close()

  async def wait(self) -> None:
    await self.server.wait_for_termination()


__all__ = ["VerifierServer", "TlsFiles", "is_loopback", "FailureKind"]
