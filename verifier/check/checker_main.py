"""The checker process (``python -m verifier.check.checker_main --device cuda|cpu --fd N``): owns references,
inputs, golden outputs, comparisons, the anti-cheat verdicts and the result, and never executes candidate
code.

Long-lived (one per GPU slot): it keeps recent tasks (``reference.TaskCache``) and serves one job at a
time. The job (``RunJob``) arrives on its channel to the service with the socket of a freshly forked
candidate process attached; the verdict (``CheckReport``) goes back on the same channel, which only this
process and the service hold. It is not dumpable (no ptrace or /proc/<pid>/mem from same-user processes),
and a candidate cannot see it at all (own PID namespace). Global torch settings a reference may change are
restored before every job; after an infrastructure failure (its own device context broke) it exits and the
pool starts a fresh one.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import secrets
import socket
import sys
import time
import traceback

from verifier.api.contract import FailureKind
from verifier.ipc import tensors
from verifier.ipc.channel import Channel, ChannelClosed
from verifier.ipc.records import CheckReport, RunJob, Stage, WorkerReady
from verifier.sandbox import confine


class TorchState:
  """Process-wide torch settings a reference can change (restored before each job)."""

  def __init__(self):
    import torch

    self.values = {
      "dtype": torch.get_default_dtype(),
      "grad": torch.is_grad_enabled(),
      "deterministic": torch.are_deterministic_algorithms_enabled(),
      "cudnn_benchmark": torch.backends.cudnn.benchmark,
      "cudnn_deterministic": torch.backends.cudnn.deterministic,
      "cudnn_tf32": torch.backends.cudnn.allow_tf32,
      "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
      "matmul_precision": torch.get_float32_matmul_precision(),
      "threads": torch.get_num_threads(),
    }

  def restore(self) -> None:
    """Put back what changed (setting some of these is slow the first time, e.g. deterministic mode)."""
    import torch

    now = TorchState().values
    v = self.values
    if now["dtype"] != v["dtype"]:
      torch.set_default_dtype(v["dtype"])
    if now["grad"] != v["grad"]:
      torch.set_grad_enabled(v["grad"])
    if now["deterministic"] != v["deterministic"]:
      torch.use_deterministic_algorithms(v["deterministic"])
    torch.backends.cudnn.benchmark = v["cudnn_benchmark"]
    torch.backends.cudnn.deterministic = v["cudnn_deterministic"]
    torch.backends.cudnn.allow_tf32 = v["cudnn_tf32"]
    torch.backends.cuda.matmul.allow_tf32 = v["matmul_tf32"]
    if now["matmul_precision"] != v["matmul_precision"]:
      torch.set_float32_matmul_precision(v["matmul_precision"])
    if now["threads"] != v["threads"]:
      torch.set_num_threads(v["threads"])


class CheckerProcess:
  def __init__(self, chan: Channel, device: str, cache_bytes: int, cache_tasks: int):
    import torch

    from verifier.check.reference import TaskCache

    self.chan = chan
    self.device = torch.device("cuda:0" if device == "cuda" else "cpu")
    self.cache = TaskCache(cache_tasks, cache_bytes)
    self.state = TorchState()
    # the secret the trials' input seeds come from (reference.trial_seeds): a candidate knows the request
    # seed, never this, so it cannot draw its trials' inputs ahead of them
    self.input_key = secrets.token_bytes(32)

  def serve(self, max_jobs: int) -> int:
    done = 0
    while max_jobs <= 0 or done < max_jobs:
      try:
        job, fds = self.chan.recv(RunJob, max_fds=1)
      except ChannelClosed:
        return 0
      if len(fds) != 1:
        for fd in fds:
          os.close(fd)
        self.chan.send(
          CheckReport(job.job_id, FailureKind.INTERNAL_ERROR, "job came without a candidate")
        )
        continue
      cand = Channel.from_fd(fds[0])
      try:
        report = self.job(job, cand)
      finally:
        cand.close()
      self.chan.send(report)
      done += 1
      if report.infrastructure:
        return 3  # this process's device state is suspect: the pool starts a fresh checker
    return 0

  def job(self, job: RunJob, cand: Channel) -> CheckReport:
    import torch

    from verifier.check import checker
    from verifier.check.reference import ReferenceFailure, ReferenceTask, is_out_of_memory, task_key

    self.state.restore()
    if self.device.type == "cuda":
      torch.cuda.reset_peak_memory_stats()
    o = job.options

    def stage(name: str) -> None:
      if name:
        self.chan.send(Stage(job.job_id, name))

    trials = checker.correctness_trials(o)
    key = task_key(job.reference_source, o.seed, trials, self.device.type, o.atol, o.rtol)
    task = self.cache.get(key)
    reference_s = 0.0
    try:
      if task is None:
        stage("reference")
        t0 = time.monotonic()
        try:
          task = ReferenceTask.load(
            job.reference_source, o.seed, trials, self.device, o.atol, o.rtol, self.input_key
          )
        except ReferenceFailure as e:
          return CheckReport(
            job.job_id,
            FailureKind.REFERENCE_ERROR,
            str(e),
            stage="reference",
            device_oom=e.out_of_memory,
          )
        reference_s = time.monotonic() - t0
      report = checker.check(
        job, task, cand, stage, use_device_buffers=True, keep_bytes=self.cache.max_bytes
      )
      phases = dict(report.phases, reference=reference_s)
      peak = int(torch.cuda.max_memory_allocated()) if self.device.type == "cuda" else 0
      return dataclasses.replace(report, phases=phases, ref_peak_bytes=peak)
    except BaseException as e:  # noqa: BLE001 - this process's own failure, never the candidate's
      if is_out_of_memory(e):
        self.cache.clear()
        return CheckReport(
          job.job_id,
          FailureKind.OUT_OF_MEMORY,
          f"the checker ran out of device memory: {str(e)[:500]}",
          stage="checker",
          device_oom=True,
        )
      return CheckReport(
        job.job_id,
        FailureKind.INTERNAL_ERROR,
        f"checker failed: {type(e).__name__}: {str(e)[:2000]}\n{traceback.format_exc()[-2000:]}",
        stage="checker",
        infrastructure=True,
      )
    finally:
      if task is not None:
        self.cache.put(task)  # after the job: its kept trials count against the budget
      task = None
      gc.collect()
      tensors.empty_caches(self.device)
      if self.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="verifier.check.checker_main")
  p.add_argument("--device", choices=("cuda", "cpu"), required=True)
  p.add_argument("--fd", type=int, required=True)
  p.add_argument("--max-jobs", type=int, default=0, help="exit after this many jobs (0: never)")
  p.add_argument("--cache-mb", type=int, default=2048, help="tasks kept (inputs + golden outputs)")
  p.add_argument("--cache-tasks", type=int, default=2)
  args = p.parse_args(argv)
  confine.set_undumpable()
  t0 = time.monotonic()
  import torch

  if args.device == "cuda":
    torch.cuda.init()
    torch.ones(1, device="cuda").sum().item()
  chan = Channel(socket.socket(fileno=args.fd))
  chan.send(WorkerReady(os.getpid(), {"startup": time.monotonic() - t0}, (), time.monotonic()))
  code = CheckerProcess(chan, args.device, args.cache_mb << 20, args.cache_tasks).serve(
    args.max_jobs
  )
  sys.stdout.flush()
  os._exit(code)


if __name__ == "__main__":
  sys.exit(main())
