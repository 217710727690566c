"""Framed record messages over a connected AF_UNIX stream socket, with file descriptors (SCM_RIGHTS).

A frame is an 8-byte header (body length, number of descriptors), sent together with the descriptors,
then the JSON body of one ``records`` record. The receiver reads exactly one frame at a time, so a socket
can be handed to another process between frames (the service reads a worker's ``WorkerReady``, then passes
the socket to the checker). Bodies above ``max_bytes`` and descriptors the receiver did not ask for are
refused, so an untrusted peer can neither exhaust memory nor plant descriptors.
"""

from __future__ import annotations

import array
import asyncio
import json
import os
import socket
import struct
import time

from verifier.ipc import records

HEADER = struct.Struct("!II")
MAX_FDS = 64
DEFAULT_MAX_BYTES = 64 << 20


class ChannelClosed(ConnectionError):
  """The peer closed its end (or died)."""


class ChannelTimeout(TimeoutError):
  """No complete frame arrived before the deadline."""


class ProtocolError(ValueError):
  """The peer sent something that is not a frame of a valid record."""


def _close_all(fds) -> None:
  for fd in fds:
    try:
      os.close(fd)
    except OSError:
      pass


def encode(rec) -> bytes:
  return json.dumps(records.to_wire(rec), separators=(",", ":")).encode()


def frame(rec, n_fds: int = 0) -> bytes:
  """One record's whole frame (header and body), to be sent with ``n_fds`` descriptors."""
  body = encode(rec)
  return HEADER.pack(len(body), n_fds) + body


def decode(body: bytes, expected: tuple[type, ...]):
  """The record in a frame's body, or ``ProtocolError``: whatever a peer's bytes make the decoder raise is
  the peer's error (red team 43c: 5,000 digits made ``json.loads`` raise a plain ValueError, and deep
  nesting RecursionError, which escaped as the checker's own failure: INTERNAL_ERROR, not the candidate's
  CRASH, and two checkers restarted)."""
  try:
    msg = json.loads(body)
  except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, the digits limit
    raise ProtocolError(f"frame is not JSON: {type(e).__name__}: {str(e)[:200]}") from None
  try:
    return records.from_wire(msg, *expected)
  except records.RecordError as e:
    raise ProtocolError(str(e)) from None
  except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError) as e:
    raise ProtocolError(f"frame is no valid record: {type(e).__name__}: {str(e)[:200]}") from None


class Channel:
  """Blocking side (workers and the checker): ``send`` and ``recv`` with an optional deadline."""

  def __init__(self, sock: socket.socket, max_bytes: int = DEFAULT_MAX_BYTES):
    sock.setblocking(True)
    self.sock, self.max_bytes = sock, max_bytes
    self.broken = ""  # after an invalid frame the stream is out of step: nothing more is read

  @classmethod
  def from_fd(cls, fd: int, max_bytes: int = DEFAULT_MAX_BYTES) -> "Channel":
    return cls(socket.socket(fileno=fd), max_bytes)

  def fileno(self) -> int:
    return self.sock.fileno()

  def send(self, rec, fds=()) -> None:
    self.send_frame(frame(rec, len(fds)), fds)

  def send_frame(self, data: bytes, fds=()) -> None:
    """Send a frame made by ``frame`` (encoded ahead, e.g. outside a timed window) with its descriptors."""
    fds = list(fds)
    header, body = data[: HEADER.size], data[HEADER.size :]
    try:
      if fds:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        sent = self.sock.sendmsg([header], anc)
        self.sock.sendall(header[sent:] + body)
      else:
        self.sock.sendall(data)
    except (BrokenPipeError, ConnectionResetError) as e:
      raise ChannelClosed(f"peer closed the channel ({e})") from None

  def _deadline_timeout(self, deadline: float | None) -> None:
    if deadline is None:
      self.sock.settimeout(None)
      return
    left = deadline - time.monotonic()
    if left <= 0:
      raise ChannelTimeout("deadline passed")
    self.sock.settimeout(left)

  def _read_exact(self, n: int, deadline: float | None) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
      self._deadline_timeout(deadline)
      try:
        k = self.sock.recv_into(view[got:])
      except socket.timeout:
        raise ChannelTimeout("no complete frame before the deadline") from None
      except ConnectionResetError:
        k = 0
      if k == 0:
        raise ChannelClosed("peer closed the channel")
      got += k
    return bytes(buf)

  def recv(self, *expected: type, timeout: float | None = None, max_fds: int = 0):
    """One record (of one of ``expected`` types when given) and the descriptors sent with it. After a
    ``ProtocolError`` the channel is out of step and refuses every later frame."""
    if self.broken:
      raise ProtocolError(f"channel unusable after an earlier invalid frame ({self.broken})")
    deadline = None if timeout is None else time.monotonic() + timeout
    fds: list[int] = []
    head = b""
    try:
      while len(head) < HEADER.size:
        self._deadline_timeout(deadline)
        try:
          data, anc, flags, _ = self.sock.recvmsg(
            HEADER.size - len(head), socket.CMSG_SPACE(MAX_FDS * 4)
          )
        except socket.timeout:
          raise ChannelTimeout("no frame before the deadline") from None
        except ConnectionResetError:
          data, anc, flags = b"", [], 0
        for level, kind, payload in anc:
          if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += array.array("i", payload[: len(payload) - len(payload) % 4]).tolist()
        if not data:
          raise ChannelClosed("peer closed the channel")
        if flags & socket.MSG_CTRUNC:
          raise ProtocolError("too many descriptors in one frame")
        head += data
      length, n_fds = HEADER.unpack(head)
      if length > self.max_bytes:
        raise ProtocolError(f"frame of {length} bytes exceeds the limit of {self.max_bytes}")
      if n_fds != len(fds) or len(fds) > max_fds:
        raise ProtocolError(
          f"frame carries {len(fds)} descriptors (announced {n_fds}, allowed {max_fds})"
        )
      rec = decode(self._read_exact(length, deadline), expected)
    except ProtocolError as e:
      _close_all(fds)
      self.broken = str(e)[:200]
      raise
    except BaseException:
      _close_all(fds)
      raise
    return rec, fds

  def close(self) -> None:
    self.sock.close()


class AsyncChannel:
  """The service's side: asyncio reads (no descriptors accepted) and sends (descriptors allowed)."""

  def __init__(self, sock: socket.socket, max_bytes: int = DEFAULT_MAX_BYTES):
    sock.setblocking(False)
    self.sock, self.max_bytes = sock, max_bytes

  async def send(self, rec, fds=()) -> None:
    loop = asyncio.get_running_loop()
    body = encode(rec)
    fds = list(fds)
    header = HEADER.pack(len(body), len(fds))
    try:
      if fds:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        while True:
          try:
            sent = self.sock.sendmsg([header], anc)
            break
          except BlockingIOError:
            ready = loop.create_future()
            loop.add_writer(self.sock.fileno(), ready.set_result, None)
            try:
              await ready
            finally:
              loop.remove_writer(self.sock.fileno())
        await loop.sock_sendall(self.sock, header[sent:] + body)
      else:
        await loop.sock_sendall(self.sock, header + body)
    except (BrokenPipeError, ConnectionResetError) as e:
      raise ChannelClosed(f"peer closed the channel ({e})") from None

  async def _read_exact(self, n: int) -> bytes:
    loop = asyncio.get_running_loop()
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
      try:
        k = await loop.sock_recv_into(self.sock, view[got:])
      except ConnectionResetError:
        k = 0
      if k == 0:
        raise ChannelClosed("peer closed the channel")
      got += k
    return bytes(buf)

  async def recv(self, *expected: type):
    length, n_fds = HEADER.unpack(await self._read_exact(HEADER.size))
    if n_fds:
      raise ProtocolError("descriptors are not accepted on this channel")
    if length > self.max_bytes:
      raise ProtocolError(f"frame of {length} bytes exceeds the limit of {self.max_bytes}")
    return decode(await self._read_exact(length), expected)

  def detach(self) -> socket.socket:
    """Hand the socket over (e.g. to send it to another process); this channel is unusable after."""
    sock, self.sock = self.sock, None
    return sock

  def close(self) -> None:
    if self.sock is not None:
      self.sock.close()
