"""The fork server of a pool (``python -m verifier.candidate.zygote --device cuda|cpu --fd N``): imports torch once
and forks every worker of the pool from itself.

A worker serves one candidate (or one build) and exits, so the service needs a new process per candidate;
spawning one cost the torch import each time (13.5 s per worker on the H200 host under load, docs/log.md).
This process applies what all its workers share (rlimits, the user and network namespace) and imports
torch, never initialising CUDA; each fork then gets its own PID namespace, session, environment, scratch,
mounts and Landlock domain (``worker_main.run_forked``) and creates its own CUDA context. It never runs
candidate code. Forking is refused if this process ever has a second thread.

Channel (``records``): ``ForkRequest`` with the worker's channel socket attached -> ``Forked`` or
``ForkFailed``; ``Exited`` whenever a worker's waiter is reaped. The service watches each worker through a
pidfd and kills it (its PID namespace) on a limit.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import select
import signal
import socket
import sys

from verifier.ipc.channel import Channel, ChannelClosed
from verifier.ipc.records import Exited, Forked, ForkFailed, ForkRequest
from verifier.sandbox import confine

# What a worker imports after it is confined, from a repository it can no longer read (confine).
WORKER_MODULES = (
  "verifier.candidate.worker_main",
  "verifier.candidate.candidate_main",
  "verifier.build.build_main",
  "verifier.ipc.cuda_driver",  # imported lazily by exchange on a GPU
  "verifier.build.pch",
  "verifier.build.split_build",
  "verifier.candidate.device_records",
)


def thread_names() -> list[str]:
  names = []
  for tid in sorted(os.listdir("/proc/self/task")):
    try:
      with open(f"/proc/self/task/{tid}/comm") as f:
        names.append(f.read().strip())
    except OSError:  # the thread ended meanwhile
      pass
  return names


def threads() -> int:
  return len(os.listdir("/proc/self/task"))


@contextlib.contextmanager
def no_cuda_probe():
  """Keeps `torch.cuda.is_available()` from initialising the CUDA driver while modules import.

  torch >= 2.11's `torch.utils.cpp_extension` calls `torch.cuda.is_available()` at import (only to
  decide whether to print a warning about CUDA_HOME); that runs cuInit, which starts a driver thread
  and makes every later fork unable to use CUDA. Seen on the H200 host (torch 2.11.0+cu130,
  2026-11-30): one `cuda...` thread after the import. Inside this block the probe answers True
  without touching the driver; it is restored on exit, before any worker is forked.
  """
  import torch

  real = torch.cuda.is_available
  torch.cuda.is_available = lambda: True
  try:
    yield
  finally:
    torch.cuda.is_available = real


class ForkServer:
  def __init__(self, chan: Channel, device: str, notes: list[str]):
    self.chan, self.device, self.notes = chan, device, notes
    self.children: set[int] = set()
    self.wake_r, self.wake_w = os.pipe()
    os.set_blocking(self.wake_w, False)
    os.set_blocking(self.wake_r, False)

  def fork(self, req: ForkRequest, chan_fd: int):
    names = thread_names()
    if len(names) != 1:
      return ForkFailed(
        f"fork server has {len(names)} threads ({', '.join(names)}); forking is unsafe"
      )
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
      os.close(r)
      from verifier.candidate import worker_main

      worker_main.run_forked(req, chan_fd, self.device, self.notes, w)  # never returns
    os.close(w)
    os.close(chan_fd)
    self.children.add(pid)
    line = b""
    while not line.endswith(b"\n"):
      chunk = os.read(r, 64)
      if not chunk:
        break
      line += chunk
    os.close(r)
    if not line.strip().isdigit():
      return ForkFailed(f"worker {pid} did not start its sandbox")
    return Forked(pid, int(line))

  def reap(self) -> None:
    while True:
      try:
        pid, status = os.waitpid(-1, os.WNOHANG)
      except ChildProcessError:
        return
      if pid == 0:
        return
      self.children.discard(pid)
      rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
      self.chan.send(Exited(pid, rc))

  def serve(self) -> None:
    signal.set_wakeup_fd(self.wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
      ready, _, _ = select.select([self.chan.fileno(), self.wake_r], [], [])
      if self.wake_r in ready:
        try:
          while os.read(self.wake_r, 512):
            pass
        except BlockingIOError:
          pass
        self.reap()
      if self.chan.fileno() in ready:
        try:
          req, fds = self.chan.recv(ForkRequest, max_fds=1)
        except ChannelClosed:
          return
        if len(fds) != 1:
          for fd in fds:
            os.close(fd)
          self.chan.send(ForkFailed("a fork request needs the worker's channel socket"))
          continue
        self.chan.send(self.fork(req, fds[0]))
        self.reap()


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="verifier.candidate.zygote")
  p.add_argument("--device", choices=("cuda", "cpu"), required=True)
  p.add_argument("--fd", type=int, required=True, help="this process's channel to the service")
  p.add_argument("--isolate-network", action="store_true")
  p.add_argument(
    "--no-preimport",
    action="store_true",
    help="do not import the profiler's dependencies here (set when they started a thread)",
  )
  args = p.parse_args(argv)

  confine.apply_limits(0, limit_address_space=False)  # RLIMIT_AS is set per worker
  notes = confine.isolate_network() if args.isolate_network else []
  import torch  # noqa: F401 - the point of this process: workers start with torch imported

  with no_cuda_probe():
    import torch.utils.cpp_extension  # noqa: F401 - slow first import (setuptools)

    # And with every module of the worker code imported: confined workers cannot read this repository.
    for module in WORKER_MODULES:
      importlib.import_module(module)

  if not args.no_preimport:
    # The first profiled forward imports torch._dynamo (about 5 s); import it once here. If that
    # started a thread, forking would be unsafe: start over without it.
    with no_cuda_probe():
      import torch._dynamo  # noqa: F401
      import torch.profiler  # noqa: F401

    if threads() != 1:
      print(
        f"profiler imports started threads ({', '.join(thread_names())}); restarting without them",
        file=sys.stderr,
        flush=True,
      )
      os.execv(
        sys.executable,
        [
          sys.executable,
          "-m",
          "verifier.candidate.zygote",
          *(argv or sys.argv[1:]),
          "--no-preimport",
        ],
      )

  if threads() != 1:  # the worker code's imports started one: no fork could use CUDA safely
    print(
      f"fork server: imports started threads ({', '.join(thread_names())}); forking is unsafe",
      file=sys.stderr,
      flush=True,
    )
  if (
    args.device == "cuda"
  ):  # built and loaded here: confined workers can read neither the source nor it
    from verifier.candidate import device_records

    why = device_records.prepare(os.getcwd())
    if why:
      print(why, file=sys.stderr, flush=True)
      notes.append(why[:300])
  chan = Channel(socket.socket(fileno=args.fd))
  ForkServer(chan, args.device, notes).serve()
  return 0


if __name__ == "__main__":
  sys.exit(main())
