"""The static check in processes of its own, off the service's event loop and under a deadline.

``check_candidate`` is bounded by construction (``source.SourceLimits``), but it reads hostile text
with C code (the parser, regexes) that holds the GIL, so it runs here, never in the service process: a
small pool of long-lived ``python -m verifier.static.static_worker`` processes, each with an address-space
limit, no capabilities and no new sockets, serving one check at a time over its stdin/stdout (a
length-prefixed JSON frame each way). A check that outlives its deadline has its process killed, and a
process that dies while checking a source twice over gives the verdict too: SOURCE_TOO_COMPLEX, reward 0.
The health check never waits for any of it.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import struct
import sys

from verifier.api.contract import FailureKind, Strictness
from verifier.sandbox.import_path import child_pythonpath
from verifier.static.source import too_complex
from verifier.static.static_check import LIMITS, StaticVerdict, check_candidate

FRAME = struct.Struct("!Q")
MAX_REPLY_BYTES = 16 << 20
DEFAULT_MEM_MB = 1024  # address space of one static-check process
DEFAULT_TIMEOUT_S = 10.0
START_TIMEOUT_S = 60.0


class StaticWorkerLost(RuntimeError):
  """The process died or broke its framing; ``after_request``: once it had the whole request."""

  def __init__(self, message: str, after_request: bool = False):
    super().__init__(message)
    self.after_request = after_request


def verdict_to_dict(v: StaticVerdict) -> dict:
  return {
    "kind": v.kind.value,
    "reason": v.reason,
    "warnings": list(v.warnings),
    "kernel_names": list(v.kernel_names),
    "functions": list(v.functions),
  }


def verdict_from_dict(d: dict) -> StaticVerdict:
  return StaticVerdict(
    FailureKind(d["kind"]),
    str(d["reason"]),
    tuple(str(w) for w in d["warnings"]),
    tuple(str(k) for k in d["kernel_names"]),
    tuple(str(f) for f in d["functions"]),
  )


# ---- the process ---------------------------------------------------------------------------------
def _read_frame(stream) -> bytes | None:
  head = stream.read(FRAME.size)
  if len(head) < FRAME.size:
    return None
  (n,) = FRAME.unpack(head)
  body = stream.read(n)
  return body if len(body) == n else None


def _write_frame(stream, body: bytes) -> None:
  stream.write(FRAME.pack(len(body)) + body)
  stream.flush()


def _answer(request: dict) -> tuple[dict, bool]:
  """(the reply to one request, whether this process should exit after it)."""
  try:
    verdict = check_candidate(
      request["source"], Strictness.preset(request["strictness"]), request["device"]
    )
    return verdict_to_dict(verdict), False
  except (MemoryError, RecursionError) as e:  # its state may be damaged: a fresh process next time
    return verdict_to_dict(too_complex(f"{type(e).__name__} while checking")), True


def serve(stdin, stdout, mem_mb: int) -> None:
  """Answer check requests until stdin closes."""
  if mem_mb > 0:
    resource.setrlimit(resource.RLIMIT_AS, (mem_mb << 20, mem_mb << 20))
  resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
  from verifier.sandbox import confine
  from verifier.static import aten_ops

  aten_ops.operator_names()  # read the torch headers' names once, before the first deadline
  confine.drop_capabilities()  # it parses hostile text: no capabilities, no new sockets
  confine.block_sockets()
  _write_frame(stdout, json.dumps({"ready": True}).encode())
  while (body := _read_frame(stdin)) is not None:
    reply, leaving = _answer(json.loads(body))
    reply["exiting"] = leaving
    _write_frame(stdout, json.dumps(reply).encode())
    if leaving:
      return


# ---- the service's side --------------------------------------------------------------------------
def _environment() -> dict[str, str]:
  """A minimal environment that still imports this ``verifier`` package."""
  env = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL") if k in os.environ}
  env.update(PYTHONPATH=child_pythonpath(), PYTHONDONTWRITEBYTECODE="1")
  return env


class StaticProcess:
  """One static-check process and its pipes."""

  def __init__(self, proc: asyncio.subprocess.Process):
    self.proc = proc
    self.usable = True

  @classmethod
  async def start(cls, mem_mb: int) -> "StaticProcess":
    proc = await asyncio.create_subprocess_exec(
      sys.executable,
      "-m",
      "verifier.static.static_worker",
      "--mem-mb",
      str(mem_mb),
      stdin=asyncio.subprocess.PIPE,
      stdout=asyncio.subprocess.PIPE,
      start_new_session=True,
      env=_environment(),
    )
    p = cls(proc)
    try:  # a process that cannot even start is ours to fix, never a candidate's verdict
      ready = await asyncio.wait_for(p.receive(), START_TIMEOUT_S)
    except (StaticWorkerLost, asyncio.TimeoutError) as e:
      await p.close()
      raise StaticWorkerLost(f"a static-check process did not start ({type(e).__name__})") from None
    if ready != {"ready": True}:
      await p.close()
      raise StaticWorkerLost(f"a static-check process said {ready!r:.200} instead of ready")
    return p

  async def send(self, request: dict) -> None:
    """Raises StaticWorkerLost when the process was gone before it read anything."""
    body = json.dumps(request).encode()
    try:
      self.proc.stdin.write(FRAME.pack(len(body)) + body)
      await self.proc.stdin.drain()
    except (BrokenPipeError, ConnectionResetError) as e:
      self.usable = False
      raise StaticWorkerLost(f"the static check's process was gone ({e})") from None

  async def receive(self) -> dict:
    try:
      (n,) = FRAME.unpack(await self.proc.stdout.readexactly(FRAME.size))
      if n > MAX_REPLY_BYTES:
        raise ValueError(f"reply of {n} bytes")
      reply = json.loads(await self.proc.stdout.readexactly(n))
    except (asyncio.IncompleteReadError, ConnectionResetError, ValueError) as e:
      self.usable = False
      raise StaticWorkerLost(
        f"the static check's process died ({type(e).__name__})", after_request=True
      ) from None
    self.usable = not reply.pop("exiting", False)
    return reply

  async def ask(self, request: dict) -> dict:
    await self.send(request)
    return await self.receive()

  async def close(self) -> None:
    self.usable = False
    if self.proc.returncode is None:
      try:
        self.proc.kill()
      except ProcessLookupError:
        pass
    await self.proc.wait()


class StaticCheckPool:
  """Up to ``processes`` static-check processes, started on first use (or by ``start``)."""

  def __init__(
    self,
    processes: int = 2,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    mem_mb: int = DEFAULT_MEM_MB,
  ):
    self.timeout_s, self.mem_mb = timeout_s, mem_mb
    self.processes = max(1, processes)
    self.idle: list[StaticProcess] = []
    self.slots = asyncio.Semaphore(self.processes)
    self.live: set[StaticProcess] = set()

  async def start(self) -> None:
    """Start the processes now rather than at the first check."""
    while len(self.live) < self.processes:
      p = await StaticProcess.start(self.mem_mb)
      self.live.add(p)
      self.idle.append(p)

  async def check(
    self, source: str, strictness: str, device: str, timeout_s: float | None = None
  ) -> StaticVerdict:
    """The static verdict on ``source``; a check past ``timeout_s`` (at most the pool's) or one whose
    process dies twice is SOURCE_TOO_COMPLEX."""
    if len(source) > LIMITS.max_chars:
      return too_complex(f"{len(source):,} characters (limit {LIMITS.max_chars:,})")
    deadline = min(self.timeout_s, timeout_s or self.timeout_s)
    request = {"source": source, "strictness": strictness, "device": device}
    died = 0  # processes that died while reading this source
    async with self.slots:
      for _ in range(4):
        proc = await self._take()
        try:
          reply = await asyncio.wait_for(proc.ask(request), deadline)
        except asyncio.TimeoutError:
          await self._drop(proc)
          return too_complex(f"the check took longer than {deadline:.0f} s")
        except StaticWorkerLost as e:
          await self._drop(proc)
          died += e.after_request
          if died == 2:
            return too_complex(f"the check's process died on it twice ({e})")
          continue
        self._give_back(proc)
        return verdict_from_dict(reply)
    raise StaticWorkerLost("no static-check process could take the request")

  async def _take(self) -> StaticProcess:
    while self.idle:
      p = self.idle.pop()
      if p.usable and p.proc.returncode is None:
        return p
      await self._drop(p)
    p = await StaticProcess.start(self.mem_mb)
    self.live.add(p)
    return p

  def _give_back(self, proc: StaticProcess) -> None:
    if proc.usable:
      self.idle.append(proc)
    else:
      asyncio.ensure_future(self._drop(proc))

  async def _drop(self, proc: StaticProcess) -> None:
    self.live.discard(proc)
    await proc.close()

  async def close(self) -> None:
    procs, self.idle = list(self.live), []
    self.live.clear()
    await asyncio.gather(*(p.close() for p in procs), return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
  import argparse

  p = argparse.ArgumentParser(description="static-check process (started by the verifier service)")
  p.add_argument("--mem-mb", type=int, default=DEFAULT_MEM_MB)
  a = p.parse_args(argv)
  serve(sys.stdin.buffer, sys.stdout.buffer, a.mem_mb)
  return 0


if __name__ == "__main__":
  sys.exit(main())
