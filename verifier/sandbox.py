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
ENV_ALLOW = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "CUDA_HOME", "CUDA_PATH", "CUDA_ROOT", "LD_LIBRARY_PATH",
             "CC", "CXX", "TORCH_CUDA_ARCH_LIST", "VIRTUAL_ENV", "CONDA_PREFIX",
             # NVLink multicast must stay off on shared hosts (device notes); keep them if the host sets them.
             "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
PACKAGE_ROOT = str(pathlib.Path(__file__).resolve().parents[1])
RESULT_FILE = "result.json"
LOG_FILE = "worker.log"
FILE_SIZE_LIMIT = 4 << 30
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000


def scrubbed_env(scratch: str, *, cuda_visible: str, arch_list: str = "", max_jobs: int = 2,
                 extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: os.environ[k] for k in ENV_ALLOW if k in os.environ}
    paths = [PACKAGE_ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update({
        "HOME": scratch, "TMPDIR": scratch, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)),
        "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "PYTHONHASHSEED": "0",
        "CUDA_VISIBLE_DEVICES": cuda_visible, "MAX_JOBS": str(max_jobs),
        "TORCH_EXTENSIONS_DIR": os.path.join(scratch, "torch_extensions"),
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
    })
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

    def __init__(self, proc: asyncio.subprocess.Process, scratch: str, role: str, device: str, mem_mb: int):
        self.proc, self.scratch, self.role, self.device, self.mem_mb = proc, scratch, role, device, mem_mb
        self.started = time.monotonic()

    @classmethod
    async def start(cls, *, role: str, device: str, gpu_index: str, scratch_root: str, mem_mb: int,
                    isolate_network: bool, arch_list: str = "", max_jobs: int = 2) -> "WorkerProcess":
        os.makedirs(scratch_root, exist_ok=True)
        scratch = tempfile.mkdtemp(prefix=f"{role}-", dir=scratch_root)
        env = scrubbed_env(scratch, cuda_visible=gpu_index if device == "cuda" and role == "run" else "",
                           arch_list=arch_list, max_jobs=max_jobs)
        log = open(os.path.join(scratch, LOG_FILE), "wb")
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "verifier.worker_main", "--role", role, "--device", device,
                "--mem-mb", str(mem_mb), "--scratch", scratch, *(["--isolate-network"] if isolate_network else []),
                stdin=asyncio.subprocess.PIPE, stdout=log, stderr=asyncio.subprocess.STDOUT, cwd=scratch, env=env,
                start_new_session=True)
        finally:
            log.close()
        return cls(proc, scratch, role, device, mem_mb)

    def ready(self) -> bool:
        """Start-up done (torch imported, device and profiler initialised): a job would start at once."""
        return os.path.exists(os.path.join(self.scratch, "ready"))

    async def _watch_memory(self) -> str:
        while True:
            await asyncio.sleep(0.25)
            rss = _group_rss_mb(self.proc.pid)
            if self.mem_mb and rss > self.mem_mb:
                kill_group(self.proc.pid)
                return f"host memory {rss:.0f} MiB exceeded the limit of {self.mem_mb} MiB; process group killed"

    async def run(self, job: dict, timeout_s: float) -> tuple[dict | None, str, str]:
        """Send the job and wait. Returns (result or None, outcome, logs); outcome is '', 'timeout',
        'memory: ...' or 'exit: ...' (died without a result)."""
        outcome = ""
        sent_at = time.monotonic()
        watch = asyncio.ensure_future(self._watch_memory())
        try:
            self.proc.stdin.write(json.dumps(job).encode())
            await self.proc.stdin.drain()
            self.proc.stdin.close()
            done, _ = await asyncio.wait({asyncio.ensure_future(self.proc.wait()), watch}, timeout=timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if watch in done:
                outcome = "memory: " + watch.result()
            elif not done:
                outcome = f"timeout: wall-clock limit of {timeout_s:.0f} s hit; process group killed"
        except (BrokenPipeError, ConnectionResetError):
            pass  # the worker died before reading its job; reported below
        finally:
            watch.cancel()
            kill_group(self.proc.pid)
            await self.proc.wait()
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
            rc = self.proc.returncode
            outcome = (f"exit: worker killed by {signal.Signals(-rc).name}" if rc and rc < 0
                       else f"exit: worker exited with status {rc} without a result")
        logs = self.read_log()
        return result, outcome, logs

    def read_log(self) -> str:
        try:
            with open(os.path.join(self.scratch, LOG_FILE), errors="replace") as f:
                return truncate_log(f.read())
        except OSError:
            return ""

    def discard(self) -> None:
        if self.proc.returncode is None:
            kill_group(self.proc.pid)
        shutil.rmtree(self.scratch, ignore_errors=True)
