"""What runs inside a worker once the fork server (``zygote.py``) has forked it: take the worker's own
session, environment, scratch directory and log, confine it (``confine.py``), pay the device start-up,
say ``WorkerReady`` on its channel, then serve one job in its role (``candidate_main`` or ``build_main``)
and exit. Imports nothing of the parent side (``sandbox``, ``pool``, ``service``).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import sys
import time

from verifier.ipc.channel import Channel, ChannelClosed
from verifier.ipc.records import INTERNAL_EXIT, ForkRequest, WorkerReady
from verifier.sandbox import confine
from verifier.sandbox.import_path import IMPORT_ROOT

LOG_FILE = "worker.log"
# Build and compile workers (and the compilers they start) run at the lowest CPU priority. A timed run
# measures a candidate on the checker's clock around a round trip through two processes that block on
# a socket; waking one of them behind busy compilers at the same priority took up to 3 ms on the H200
# host (16 busy processes at nice 0), behind nice-19 ones 0.01-0.02 ms, the same as an idle host
# (``experiments/gpu/exchange_floor.py``, docs/performance.md). The compilers still get every idle core.
BACKGROUND_NICE = 19


class StartupClock:
  """Where a worker's start-up goes (reported in ``WorkerReady``; docs/log.md, "Verifier: session 3")."""

  def __init__(self, t0: float | None = None):
    self.last = time.monotonic() if t0 is None else t0
    self.phases: dict[str, float] = {}

  def __call__(self, name: str) -> None:
    now = time.monotonic()
    self.phases[name], self.last = now - self.last, now


def warm_device(device: str, profiler: bool, mark: StartupClock) -> list[str]:
  """Create the CUDA context and start the device records (CUPTI, ``device_records``) before the job
  arrives; where those cannot run, start the in-process profiler instead (which then takes CUPTI).
  Returns notes."""
  import torch
  from torch.profiler import ProfilerActivity, profile

  activities = [ProfilerActivity.CPU]
  x = torch.ones(16)
  notes = []
  if device == "cuda":
    from verifier.candidate import device_records

    torch.cuda.init()
    # before the first module loads, so that every module's kernel names are seen (device_evidence)
    why = device_records.start_collector()
    mark("startup_device_records")
    x = x.cuda()
    (torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")).sum().item()  # loads cuBLAS
    torch.cuda.synchronize()
    activities.append(ProfilerActivity.CUDA)
    mark("startup_device_context")
    if not why:
      return notes  # torch's profiler would compete for CUPTI: never started here
    notes.append(f"device records unavailable: {why[:300]}")
  if profiler:
    with profile(activities=activities) as prof:
      (x + 1).sum().item()
    prof.events()
    mark("startup_profiler")
  return notes


def _redirect_output(scratch: str) -> None:
  log = os.open(os.path.join(scratch, LOG_FILE), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
  null = os.open(os.devnull, os.O_RDONLY)
  os.dup2(null, 0)
  os.dup2(log, 1)
  os.dup2(log, 2)
  os.close(null)
  os.close(log)


def _forget_the_repository() -> None:
  """In a worker that runs candidate code, nothing of Python's state names where the verifier's source
  lives (its modules are imported; its files are unreadable once confined): no ``PYTHONPATH``, no
  ``sys.path`` entry for the checkout (an installation's site-packages stays: torch imports lazily),
  ``sys.argv`` just the role."""
  root = os.path.realpath(IMPORT_ROOT)
  checkout = {root, os.path.join(root, "verifier")}
  prefixes = [os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)]

  def names_checkout(p: str) -> bool:
    q = os.path.realpath(p or ".")
    return q in checkout and not any(confine.beneath(q, x) for x in prefixes)

  os.environ.pop("PYTHONPATH", None)
  sys.path[:] = [p for p in sys.path if not names_checkout(p)]
  sys.argv[:] = ["worker"]


def run_forked(req: ForkRequest, chan_fd: int, device: str, base_notes: list[str], report_fd: int):
  """In the child the fork server just forked. Never returns."""
  mark = StartupClock()
  code = 0
  try:
    os.setsid()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    _redirect_output(req.scratch)
    confine.close_inherited_fds(keep=(chan_fd, report_fd))
    confine.die_with_parent()
    # the fork server's command line, as /proc/<pid>/cmdline shows it here and in the namespace's init
    confine.blank_process_strings(environment=False)
    notes = list(base_notes)
    if req.nproc_limit > 0:
      notes += confine.own_user_namespace(req.nproc_limit)
    notes += confine.enter_pid_namespace(report_fd, child_only=(chan_fd,))
    faulthandler.enable()
    os.environ.clear()
    os.environ.update(req.env)
    if req.role != "compile":
      _forget_the_repository()
    confine.blank_process_strings(arguments=False)  # /proc/self/environ: the fork server's, once
    if req.role != "candidate":
      os.setpriority(os.PRIO_PROCESS, 0, BACKGROUND_NICE)
    if req.mem_mb > 0 and not (req.role == "candidate" and device == "cuda"):
      confine.apply_limits(req.mem_mb, limit_address_space=True)
    spec = confine.SandboxSpec(
      writable=req.writable,
      readable=req.readable,
      mount_namespace=req.mount_namespace,
      landlock=req.landlock,
      scratch=req.scratch,
      scratch_mb=req.scratch_mb,
      max_tasks=req.max_tasks,
    )
    notes += confine.confine(spec)
    os.chdir(req.scratch)  # after the remount: the writable bind, not the read-only original
    mark("startup_fork")
    chan = Channel(socket.socket(fileno=chan_fd))
    if req.role == "candidate":
      notes += warm_device(device, req.warm_profiler, mark)
      from verifier.candidate import candidate_main

      candidate_main.start_mapper()  # the runtime's threads all exist before the job (task_limits)
    if req.block_sockets:  # after the CUDA context: the driver may open sockets while it starts
      notes += confine.block_sockets()
    if req.role == "candidate":  # the checker's samplers stay on (host_sampler)
      notes += confine.protect_evidence()
    chan.send(WorkerReady(os.getpid(), dict(mark.phases), tuple(notes), time.monotonic()))
    if req.role == "candidate":
      from verifier.candidate import candidate_main

      candidate_main.run(chan, device, req.scratch)
    else:
      from verifier.build import build_main

      build_main.run(chan)
  except ChannelClosed:
    pass  # the service discarded this worker
  except BaseException:  # noqa: BLE001 - our own failure: the log says why, the exit status shows it
    import traceback

    traceback.print_exc()
    code = INTERNAL_EXIT
  finally:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip destructors of candidate extensions
