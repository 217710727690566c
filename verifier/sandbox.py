"""Process isolation for builds and candidate runs.

Each candidate runs in a fresh ``python -m verifier.worker_main`` process (own CUDA context, one GPU via
CUDA_VISIBLE_DEVICES), in its own session/process group, with a scrubbed environment, a private scratch
directory (HOME, TMPDIR, cwd) removed afterwards, a wall-clock limit and a memory watchdog that kill the
whole process group. Why: a CUDA error is sticky for the process (reference doc section 4.1), and
in-process candidates can patch torch for whoever runs next. What is enforced is listed in BUILD_NOTES.md.
Child-side limits (rlimits, network namespace) are applied by the worker itself in ``apply_child_limits``
so that no ``preexec_fn`` runs in the threaded server.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import pathlib
import resource
import shutil
import signal
import sys
import tempfile
import time

from verifier.contract import truncate_log

# Variables a build or run needs; everything else (tokens, credentials, proxies, cloud keys) is dropped.
ENV_ALLOW = (
  "PATH",
  "LANG",
  "LC_ALL",
  "LC_CTYPE",
  "CUDA_HOME",
  "CUDA_PATH",
  "CUDA_ROOT",
  "LD_LIBRARY_PATH",
  "CC",
  "CXX",
  "TORCH_CUDA_ARCH_LIST",
  "VIRTUAL_ENV",
  "CONDA_PREFIX",
  # NVLink multicast must stay off on shared hosts (device notes); keep them if the host sets them.
  "NCCL_NVLS_ENABLE",
  "TORCH_SYMM_MEM_DISABLE_MULTICAST",
  "NVSHMEM_DISABLE_NVLS",
)
PACKAGE_ROOT = str(pathlib.Path(__file__).resolve().parents[1])
RESULT_FILE = "result.json"
LOG_FILE = "worker.log"
FILE_SIZE_LIMIT = 4 << 30
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000


def scrubbed_env(
  scratch: str,
  *,
  cuda_visible: str,
  arch_list: str = "",
  max_jobs: int = 2,
  extra: dict[str, str] | None = None,
) -> dict[str, str]:
  env = {k: os.environ[k] for k in ENV_ALLOW if k in os.environ}
  paths = [PACKAGE_ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
  env.update(
    {
      "HOME": scratch,
      "TMPDIR": scratch,
      "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)),
      "PYTHONDONTWRITEBYTECODE": "1",
      "PYTHONUNBUFFERED": "1",
      "PYTHONHASHSEED": "0",
      "CUDA_VISIBLE_DEVICES": cuda_visible,
      "MAX_JOBS": str(max_jobs),
      "TORCH_EXTENSIONS_DIR": os.path.join(scratch, "torch_extensions"),
      "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
    }
  )
  if arch_list:
    env["TORCH_CUDA_ARCH_LIST"] = arch_list
  env.update(extra or {})
  return env


def apply_child_limits(mem_mb: int, isolate_network: bool, limit_address_space: bool) -> list[str]:
  """Called first thing in the worker. Returns notes on what could not be enforced."""
  notes = []
  resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
  # No single file over 4 GiB (runaway logs); builds write objects of tens of MB.
  resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))
  if limit_address_space and mem_mb > 0:
    # Not for CUDA workers: the CUDA driver reserves huge virtual ranges (RSS watchdog covers those).
    resource.setrlimit(resource.RLIMIT_AS, (mem_mb << 20, mem_mb << 20))
  if isolate_network:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
      notes.append(f"network isolation unavailable (unshare: errno {ctypes.get_errno()})")
  return notes


def _group_rss_mb(pgid: int) -> float:
  total = 0
  for d in os.listdir("/proc"):
    if not d.isdigit():
      continue
    try:
      with open(f"/proc/{d}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
      if int(fields[2]) == pgid:  # field 5 (pgrp) after the comm field
        total += int(fields[21]) * resource.getpagesize()  # rss pages
    except (OSError, IndexError, ValueError):
      continue
  return total / (1 << 20)


def kill_group(pid: int) -> None:
  try:
    os.killpg(pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


class WorkerProcess:
  """One sandboxed worker: started ahead of time (torch imported, device ready), runs exactly one job."""

  def __init__(
    self, proc: asyncio.subprocess.Process, scratch: str, role: str, device: str, mem_mb: int
  ):
    self.proc, self.scratch, self.role, self.device, self.mem_mb = (
      proc,
      scratch,
      role,
      device,
      mem_mb,
    )
    self.started = time.monotonic()

  @classmethod
  async def start(
    cls,
    *,
    role: str,
    device: str,
    gpu_index: str,
    scratch_root: str,
    mem_mb: int,
    isolate_network: bool,
    arch_list: str = "",
    max_jobs: int = 2,
  ) -> "WorkerProcess":
    os.makedirs(scratch_root, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=f"{role}-", dir=scratch_root)
    env = scrubbed_env(
      scratch,
      cuda_visible=gpu_index if device == "cuda" and role == "run" else "",
      arch_list=arch_list,
      max_jobs=max_jobs,
    )
    log = open(os.path.join(scratch, LOG_FILE), "wb")
    try:
      proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "verifier.worker_main",
        "--role",
        role,
        "--device",
        device,
        "--mem-mb",
        str(mem_mb),
        "--scratch",
        scratch,
        *(["--isolate-network"] if isolate_network else []),
        stdin=asyncio.subprocess.PIPE,
        stdout=log,
        stderr=asyncio.subprocess.STDOUT,
        cwd=scratch,
        env=env,
        start_new_session=True,
      )
    finally:
      log.close()
    return cls(proc, scratch, role, device, mem_mb)

  def ready(self) -> bool:
    """Start-up done (torch imported, device and profiler initialised): a job would start at once."""
    return os.path.exists(os.path.join(self.scratch, "ready"))

  async def _watch_memory(self) -> str:
    while True:
      await asyncio.sleep(0.25)
      rss = _group_rss_mb(self.pid)
      if self.mem_mb and rss > self.mem_mb:
        kill_group(self.pid)
        return (
          f"host memory {rss:.0f} MiB exceeded the limit of {self.mem_mb} MiB; process group killed"
        )

  async def run(self, job: dict, timeout_s: float) -> tuple[dict | None, str, str]:
    """Send the job and wait. Returns (result or None, outcome, logs); outcome is '', 'timeout',
    'memory: ...' or 'exit: ...' (died without a result)."""
    outcome = ""
    sent_at = time.monotonic()
    watch = asyncio.ensure_future(self._watch_memory())
    try:
      await self._send(job)
      done, _ = await asyncio.wait(
        {asyncio.ensure_future(self.wait_exited()), watch},
        timeout=timeout_s,
        return_when=asyncio.FIRST_COMPLETED,
      )
      if watch in done:
        outcome = "memory: " + watch.result()
      elif not done:
        outcome = f"timeout: wall-clock limit of {timeout_s:.0f} s hit; process group killed"
    except (BrokenPipeError, ConnectionResetError):
      pass  # the worker died before reading its job; reported below
    finally:
      watch.cancel()
      kill_group(self.pid)
      await self.wait_exited()
    result = None
    path = os.path.join(self.scratch, RESULT_FILE)
    if not outcome and os.path.exists(path):
      with open(path) as f:
        result = json.load(f)
      if "worker_ready_at" in result:  # time the job waited for the worker's start-up (torch, CUDA)
        ready_at = float(result.pop("worker_ready_at"))
        result["startup_wait_s"] = max(0.0, ready_at - sent_at)
        result["startup_s"] = ready_at - self.started
    if not outcome and result is None:
      rc = await self._returncode()
      outcome = (
        f"exit: worker killed by {signal.Signals(-rc).name}"
        if rc and rc < 0
        else f"exit: worker exited with status {rc} without a result"
      )
    logs = self.read_log()
    return result, outcome, logs

  # What differs between a spawned worker and a forked one (ForkedWorker).
  @property
  def pid(self) -> int:
    return self.proc.pid

  def alive(self) -> bool:
    return self.proc.returncode is None

  async def _send(self, job: dict) -> None:
    self.proc.stdin.write(json.dumps(job).encode())
    await self.proc.stdin.drain()
    self.proc.stdin.close()

  async def wait_exited(self) -> None:
    await self.proc.wait()

  async def _returncode(self) -> int | None:
    return self.proc.returncode

  def read_log(self) -> str:
    try:
      with open(os.path.join(self.scratch, LOG_FILE), errors="replace") as f:
        return truncate_log(f.read())
    except OSError:
      return ""

  def discard(self) -> None:
    if self.alive():
      kill_group(self.pid)
    shutil.rmtree(self.scratch, ignore_errors=True)


class ForkedWorker(WorkerProcess):
  """A worker forked by the fork server (zygote.py): the same sandbox, scratch and one-job life as a spawned
  worker; the job arrives as ``job.json``, exit is watched through a pidfd, and the exit status is written
  by the fork server, which reaps it."""

  def __init__(self, pid: int, scratch: str, role: str, device: str, mem_mb: int, status_dir: str):
    super().__init__(None, scratch, role, device, mem_mb)
    self._pid = pid
    self._status = os.path.join(status_dir, f"{pid}.status")
    try:
      self._pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
      self._pidfd = -1  # already gone
    self._exit: asyncio.Future | None = (
      None  # resolved when the pidfd turns readable (the process ended)
    )
    self._loop: asyncio.AbstractEventLoop | None = None

  @property
  def pid(self) -> int:
    return self._pid

  def alive(self) -> bool:
    if self._pidfd < 0:
      return False
    import select

    return not select.select([self._pidfd], [], [], 0)[0]

  async def _send(self, job: dict) -> None:
    from verifier.zygote import JOB_FILE

    tmp = os.path.join(self.scratch, JOB_FILE + ".tmp")
    with open(tmp, "w") as f:
      json.dump(job, f)
    os.replace(tmp, os.path.join(self.scratch, JOB_FILE))

  async def wait_exited(self) -> None:
    if self._exit is None:
      self._loop = asyncio.get_running_loop()
      self._exit = self._loop.create_future()
      if self.alive():
        self._loop.add_reader(self._pidfd, self._on_exit)
      else:
        self._exit.set_result(None)
    await asyncio.shield(self._exit)

  def _on_exit(self) -> None:
    self._loop.remove_reader(self._pidfd)
    if not self._exit.done():
      self._exit.set_result(None)

  async def _returncode(self) -> int | None:
    for _ in range(50):  # the fork server writes it when it reaps the child
      if os.path.exists(self._status):
        with open(self._status) as f:
          return json.load(f)["returncode"]
      await asyncio.sleep(0.02)
    return None

  def discard(self) -> None:
    super().discard()
    if self._pidfd >= 0:
      if self._exit is not None and not self._exit.done():
        self._loop.remove_reader(self._pidfd)
        self._exit.set_result(None)
      os.close(self._pidfd)
      self._pidfd = -1
    try:
      os.remove(self._status)
    except OSError:
      pass  # not reaped yet: the fork server's directory goes when it closes


class ForkServer:
  """The fork server process of one pool (``python -m verifier.zygote``), restarted if it dies."""

  def __init__(
    self,
    *,
    role: str,
    device: str,
    gpu_index: str,
    scratch_root: str,
    mem_mb: int,
    isolate_network: bool,
    arch_list: str = "",
    max_jobs: int = 2,
  ):
    self.kw = dict(
      role=role,
      device=device,
      gpu_index=gpu_index,
      scratch_root=scratch_root,
      mem_mb=mem_mb,
      isolate_network=isolate_network,
      arch_list=arch_list,
      max_jobs=max_jobs,
    )
    self.proc: asyncio.subprocess.Process | None = None
    self.home = ""
    self.lock = asyncio.Lock()
    self.failures = 0

  def _env(self, scratch: str) -> dict[str, str]:
    k = self.kw
    return scrubbed_env(
      scratch,
      cuda_visible=k["gpu_index"] if k["device"] == "cuda" and k["role"] == "run" else "",
      arch_list=k["arch_list"],
      max_jobs=k["max_jobs"],
    )

  async def _ensure(self) -> None:
    if self.proc is not None and self.proc.returncode is None:
      return
    k = self.kw
    os.makedirs(k["scratch_root"], exist_ok=True)
    self.home = self.home or tempfile.mkdtemp(prefix="forkserver-", dir=k["scratch_root"])
    log = open(os.path.join(self.home, LOG_FILE), "ab")
    try:
      self.proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "verifier.zygote",
        "--role",
        k["role"],
        "--device",
        k["device"],
        "--mem-mb",
        str(k["mem_mb"]),
        *(["--isolate-network"] if k["isolate_network"] else []),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=log,
        cwd=self.home,
        env=self._env(self.home),
        start_new_session=True,
      )
    finally:
      log.close()

  async def fork(self) -> ForkedWorker | None:
    """A new worker, or None if the fork server cannot fork (the caller spawns one instead)."""
    k = self.kw
    scratch = tempfile.mkdtemp(prefix=f"{k['role']}-", dir=k["scratch_root"])
    async with self.lock:
      try:
        await self._ensure()
        self.proc.stdin.write(
          (json.dumps({"scratch": scratch, "env": self._env(scratch)}) + "\n").encode()
        )
        await self.proc.stdin.drain()
        line = await asyncio.wait_for(self.proc.stdout.readline(), 120)
        reply = json.loads(line or b"{}")
      except (OSError, asyncio.TimeoutError, ValueError) as e:
        reply = {"error": f"{type(e).__name__}: {e}"}
    if "pid" not in reply:
      self.failures += 1
      shutil.rmtree(scratch, ignore_errors=True)
      return None
    return ForkedWorker(int(reply["pid"]), scratch, k["role"], k["device"], k["mem_mb"], self.home)

  async def close(self) -> None:
    if self.proc is not None and self.proc.returncode is None:
      kill_group(self.proc.pid)
      await self.proc.wait()
    if self.home:
      shutil.rmtree(self.home, ignore_errors=True)
