"""Fork server for run workers (``--fork-server``, opt-in): torch is imported once, workers are forked from it.

A run worker serves one candidate and then exits, so the service starts one per candidate. On the H200 host a
worker took 16 s from spawn to ready with 14 starting beside 4 running, and that start-up, not the GPU, bounded
the reward-mode rate (BUILD_NOTES, Verifier). This process pays the sandbox set-up (rlimits, network namespace)
and ``import torch`` once; each worker is a ``fork()`` of it that then creates its own CUDA context, so every
candidate still gets a fresh process, its own session and process group, its own scratch directory and
environment, exactly as a spawned worker. Forking is refused (the pool falls back to spawning) if this process
ever has more than one thread, and CUDA is never initialised here.

Protocol: one JSON request per stdin line, ``{"scratch": dir, "env": {...}}``; one JSON reply per stdout line,
``{"pid": n}`` or ``{"error": "..."}``. The child waits for ``<scratch>/job.json`` (written atomically by the
parent), then runs ``worker_main.serve_one`` like a spawned worker. This process reaps its children and writes
each one's exit status to ``<pid>.status`` in its own working directory; the parent watches them through a pidfd.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import time

JOB_FILE = "job.json"


def wait_for_job_file(scratch: str, poll_s: float = 0.005):
  """Block until the parent hands over a job (an empty one discards the worker)."""
  path = os.path.join(scratch, JOB_FILE)

  def read_job() -> dict:
    while not os.path.exists(path):
      time.sleep(poll_s)
    with open(path) as f:
      return json.load(f)

  return read_job


def _child(req: dict, role: str, device: str, mem_mb: int, notes: list[str]) -> None:
  """In the forked child: detach, take the worker's own environment and scratch, then serve one job."""
  from verifier import worker_main

  mark = worker_main.StartupClock()
  os.setsid()
  scratch = req["scratch"]
  log = os.open(os.path.join(scratch, "worker.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
  null = os.open(os.devnull, os.O_RDONLY)
  os.dup2(null, 0)
  os.dup2(log, 1)
  os.dup2(log, 2)
  os.close(null)
  os.close(log)
  import faulthandler

  faulthandler.enable()
  signal.signal(signal.SIGCHLD, signal.SIG_DFL)
  os.environ.clear()
  os.environ.update(req["env"])
  os.chdir(scratch)
  if mem_mb > 0 and not (role == "run" and device == "cuda"):
    resource.setrlimit(resource.RLIMIT_AS, (mem_mb << 20, mem_mb << 20))
  mark("startup_fork")
  worker_main.serve_one(role, device, scratch, notes, mark, wait_for_job_file(scratch))


def threads() -> int:
  return len(os.listdir("/proc/self/task"))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="verifier.zygote")
  p.add_argument("--role", choices=("run", "build"), default="run")
  p.add_argument("--device", choices=("cuda", "cpu"), required=True)
  p.add_argument("--mem-mb", type=int, default=0)
  p.add_argument("--isolate-network", action="store_true")
  args = p.parse_args(argv)

  from verifier.sandbox import apply_child_limits

  # rlimits and the network namespace are inherited by every child; RLIMIT_AS is set per child.
  notes = apply_child_limits(0, args.isolate_network, limit_address_space=False)
  import torch  # noqa: F401 - the point of this process: children start with torch imported
  import torch.utils.cpp_extension  # noqa: F401

  children: dict[int, str] = {}
  early: dict[int, int] = {}  # exited before it was registered

  def write_status(pid: int, rc: int) -> None:
    # In this process's own directory (its cwd), not the worker's scratch, which the parent may be removing.
    try:
      with open(f"{pid}.status.tmp", "w") as f:
        json.dump({"returncode": rc}, f)
      os.replace(f"{pid}.status.tmp", f"{pid}.status")
    except OSError:
      pass

  def reap(signum, frame):
    """Reap exited children and leave each one's exit status in its scratch directory."""
    while True:
      try:
        pid, status = os.waitpid(-1, os.WNOHANG)
      except ChildProcessError:
        return
      if pid == 0:
        return
      rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
      if children.pop(pid, None) is None:
        early[pid] = rc
      else:
        write_status(pid, rc)

  signal.signal(signal.SIGCHLD, reap)
  out = sys.stdout
  for line in sys.stdin:
    if not line.strip():
      continue
    req = json.loads(line)
    n = threads()
    if n != 1:
      out.write(json.dumps({"error": f"fork server has {n} threads; forking is unsafe"}) + "\n")
      out.flush()
      continue
    pid = os.fork()
    if pid == 0:
      try:
        _child(req, args.role, args.device, args.mem_mb, notes)
      finally:
        os._exit(70)
    children[pid] = req["scratch"]
    if pid in early:
      children.pop(pid)
      write_status(pid, early.pop(pid))
    out.write(json.dumps({"pid": pid}) + "\n")
    out.flush()
  return 0


if __name__ == "__main__":
  sys.exit(main())
