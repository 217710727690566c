"""The parent side of the process isolation: fork servers, workers and checkers as the service sees them.

Workers (one candidate or one build each) are forked by a per-pool fork server (``zygote.py``) and confined
there (``confine.py``: own PID, mount, user and network namespaces, Landlock, no capabilities). This module
starts fork servers and checkers, hands channel sockets around, watches workers (exit through a pidfd;
host memory of the whole PID namespace, shared memory and memfds included, and its number of processes)
and kills a worker by killing PID 1 of its namespace, which takes every descendant with it. Logs are read
head and tail, never whole. Environments are rebuilt from an allow-list. What is enforced is listed in
docs/verifier-security.md ("What is enforced (isolation)", "Limits that follow the request").
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib.util
import os
import shutil
import signal
import socket
import stat
import sys
import tempfile
import time

from verifier.api.contract import truncate_log
from verifier.ipc.channel import AsyncChannel, ChannelClosed, ProtocolError
from verifier.ipc.records import Exited, Forked, ForkFailed, ForkRequest, WorkerReady
from verifier.sandbox.import_path import child_pythonpath

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
LOG_FILE = "worker.log"


def _is_elf(path: str) -> bool:
  try:
    with open(path, "rb") as f:
      return f.read(4) == b"\x7fELF"
  except OSError:
    return False


@functools.lru_cache(maxsize=8)
def native_ninja_first(path: str) -> str:
  """``path`` with a native ``ninja`` first where the first ``ninja`` on it is a script: older ninja wheels
  install a Python entry point, whose interpreter needs the environment's ``pyvenv.cfg``, which workers
  cannot read (``confine.hidden_paths``); the wheel's own binary (``ninja/data/bin``) runs without it."""
  first = shutil.which("ninja", path=path)
  if first is None or _is_elf(first):
    return path
  spec = importlib.util.find_spec("ninja")
  if spec is None or not spec.origin:
    return path
  bin_dir = os.path.join(os.path.dirname(spec.origin), "data", "bin")
  if not _is_elf(os.path.join(bin_dir, "ninja")):
    return path
  return os.pathsep.join([bin_dir, *(p for p in path.split(os.pathsep) if p)])


def scrubbed_env(
  scratch: str,
  *,
  cuda_visible: str,
  arch_list: str = "",
  max_jobs: int = 2,
  extra: dict[str, str] | None = None,
) -> dict[str, str]:
  env = {k: os.environ[k] for k in ENV_ALLOW if k in os.environ}
  env["PATH"] = native_ninja_first(env.get("PATH", os.defpath))
  env.update(
    {
      "HOME": scratch,
      "TMPDIR": scratch,
      "USER": "verifier",
      "LOGNAME": "verifier",
      "PYTHONPATH": child_pythonpath(),
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


LOG_READ_LIMIT = 64 << 10  # bytes of a worker's log the service reads at most (head + tail)


def read_log_capped(path: str, limit: int = LOG_READ_LIMIT) -> str:
  """Head and tail of a log file, never more than ``limit`` bytes read whatever its size. Only a regular
  file is read (no symlink, FIFO or device a candidate put in its place)."""
  try:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
  except OSError:
    return ""
  with os.fdopen(fd, "rb") as f:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
      return ""
    if st.st_size <= limit:
      return f.read(limit).decode(errors="replace")
    half = limit // 2
    head = f.read(half)
    f.seek(st.st_size - half)
    tail = f.read(half)
  cut = f"\n... [{st.st_size - 2 * half} bytes not read] ...\n"
  return head.decode(errors="replace") + cut + tail.decode(errors="replace")


def _process_tree(root: int) -> list[int]:
  """``root`` and all its descendants (a worker's PID namespace: orphans there are re-parented to its
  PID 1, so the tree is the namespace)."""
  children: dict[int, list[int]] = {}
  for d in os.listdir("/proc"):
    if not d.isdigit():
      continue
    try:
      with open(f"/proc/{d}/stat") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
      continue
    children.setdefault(ppid, []).append(int(d))
  tree, stack = [], [root]
  while stack:
    pid = stack.pop()
    tree.append(pid)
    stack += children.get(pid, [])
  return tree


def _status_kb(pid: int, keys: tuple[str, ...]) -> dict[str, int]:
  out = {}
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        name, _, value = line.partition(":")
        if name in keys:
          out[name] = int(value.split()[0])
  except (OSError, ValueError, IndexError):
    pass
  return out


def _is_shared_memory(link: str, st: os.stat_result) -> bool:
  """A file that lives in memory and outlives no process: a memfd, an unlinked file, /dev/shm, SysV."""
  return stat.S_ISREG(st.st_mode) and (
    st.st_nlink == 0 or link.startswith(("/dev/shm/", "/SYSV", "/memfd:"))
  )


def _add_if_shared(path: str, objects: dict) -> bool:
  """Add the file behind ``path`` (a /proc link) if it is shared memory; False if not permitted."""
  try:
    link = os.readlink(path)
    if link.startswith("/"):
      st = os.stat(path)
      if _is_shared_memory(link, st):
        objects[(st.st_dev, st.st_ino)] = st.st_blocks * 512
  except PermissionError:
    return False
  except OSError:
    pass  # closed or unmapped meanwhile
  return True


def _held_objects(pid: int, objects: dict) -> bool:
  """Add the shared-memory files ``pid`` holds open to ``objects`` ((dev, inode) -> allocated bytes).
  False where its descriptors cannot be listed although it exists (it made itself undumpable)."""
  try:
    names = os.listdir(f"/proc/{pid}/fd")
  except FileNotFoundError:
    return True  # it ended
  except OSError:
    return False
  return all([_add_if_shared(f"/proc/{pid}/fd/{name}", objects) for name in names])


def _mapped_objects(pid: int, objects: dict) -> bool:
  """Add the shared-memory files ``pid`` maps shared (a memfd whose descriptor was closed) to
  ``objects``. False where ``map_files`` is not readable (needs CAP_SYS_ADMIN)."""
  try:
    with open(f"/proc/{pid}/maps") as f:
      ranges = [line.split(None, 1)[0] for line in f if line.split(None, 2)[1:2][0][3:4] == "s"]
  except (OSError, IndexError):
    return True
  return all(_add_if_shared(f"/proc/{pid}/map_files/{r}", objects) for r in ranges)


@dataclasses.dataclass(frozen=True)
class TreeUsage:
  """What a worker's process tree holds: memory (private resident pages plus every shared-memory
  object it holds or maps, counted once, whether mapped or not), its number of processes, and how
  many of them hide their descriptors from the service."""

  memory_mb: float
  processes: int
  hidden: int = 0


def process_tree_usage(root: int) -> TreeUsage:
  tree = _process_tree(root)
  private_kb, objects, hidden = 0, {}, 0
  for pid in tree:
    kb = _status_kb(pid, ("RssAnon", "RssFile", "RssShmem"))
    private_kb += kb.get("RssAnon", 0) + kb.get("RssFile", 0)
    hidden += not _held_objects(pid, objects)
    if not _mapped_objects(pid, objects):
      private_kb += kb.get("RssShmem", 0)  # mapped shared memory seen only as resident pages
  total = private_kb * 1024 + sum(objects.values())
  return TreeUsage(total / (1 << 20), len(tree), hidden)


def process_tree_rss_mb(root: int) -> float:
  """Host memory of ``root``'s process tree (``process_tree_usage``)."""
  return process_tree_usage(root).memory_mb


@dataclasses.dataclass(frozen=True)
class Limits:
  """What the service enforces on a worker from outside (0: no limit)."""

  mem_mb: int = 0
  max_processes: int = 0


WATCH_POLL_S = 0.25
# How the limits are enforced, on every result (docs/verifier-security.md, "Limits that follow the request": not a cgroup).
ACCOUNTING_NOTE = (
  f"memory (shared memory and memfds included) and process count polled every {WATCH_POLL_S} s "
  "from outside; tasks also capped by the kernel (the tasks note says how)"
)


async def watch_resources(worker: "Worker", limits: Limits) -> str:
  """Poll the worker's tree until it breaks a limit; then kill it (``killed_by`` "memory" or
  "processes") and return why."""
  while True:
    await asyncio.sleep(WATCH_POLL_S)
    usage = await asyncio.to_thread(worker.usage)
    if usage.hidden:
      worker.kill("processes")
      return f"{usage.hidden} of its processes hid their descriptors from the service; killed"
    # processes first: forked copies of one process each count its shared pages as resident
    if limits.max_processes and usage.processes > limits.max_processes:
      worker.kill("processes")
      return (
        f"{usage.processes} processes exceeded the limit of {limits.max_processes}; "
        "the worker was killed"
      )
    if limits.mem_mb and usage.memory_mb > limits.mem_mb:
      worker.kill("memory")
      return (
        f"host memory {usage.memory_mb:.0f} MiB (resident and shared memory) exceeded the limit of "
        f"{limits.mem_mb} MiB; the worker was killed"
      )


def describe_exit(rc: int | None) -> str:
  if rc is None:
    return "exit status unknown"
  if rc < 0:
    try:
      return f"killed by {signal.Signals(-rc).name}"
    except ValueError:
      return f"killed by signal {-rc}"
  return f"exit status {rc}"


def _pidfd(pid: int) -> int:
  try:
    return os.pidfd_open(pid)
  except (ProcessLookupError, OSError):
    return -1


def _signal_pidfd(fd: int, sig=signal.SIGKILL) -> None:
  if fd >= 0:
    try:
      signal.pidfd_send_signal(fd, sig)
    except (ProcessLookupError, OSError):
      pass


async def _wait_pidfd(fd: int) -> None:
  if fd < 0 or _exited(fd):
    return
  loop = asyncio.get_running_loop()
  done = loop.create_future()
  loop.add_reader(fd, lambda: done.done() or done.set_result(None))
  try:
    await done
  finally:
    loop.remove_reader(fd)


def _exited(fd: int) -> bool:
  if fd < 0:
    return True
  import select

  return bool(select.select([fd], [], [], 0)[0])


class Worker:
  """One forked worker: ``pid`` is its waiter in the fork server's namespace (its exit status mirrors the
  worker's), ``sandbox_pid`` the worker itself, PID 1 of its own namespace."""

  def __init__(self, forked: Forked, scratch: str, chan: AsyncChannel, server: "ForkServerClient"):
    self.pid, self.sandbox_pid, self.scratch, self.chan = (
      forked.pid,
      forked.sandbox_pid,
      scratch,
      chan,
    )
    self.server = server
    self.pidfd = _pidfd(self.pid)
    self.sandbox_pidfd = _pidfd(self.sandbox_pid)
    self.started = time.monotonic()
    self.ready_msg: WorkerReady | None = None
    self.ready_task: asyncio.Task | None = None
    self.killed_by = ""  # why the service killed it ("" if it was not killed)

  # ---- readiness ----------------------------------------------------------------------------------
  def watch_ready(self) -> None:
    async def read():
      self.ready_msg = await self.chan.recv(WorkerReady)
      return self.ready_msg

    self.ready_task = asyncio.ensure_future(read())
    self.ready_task.add_done_callback(lambda t: t.cancelled() or t.exception())

  def ready(self) -> bool:
    return self.ready_task is not None and self.ready_task.done() and self.ready_msg is not None

  async def wait_ready(self, timeout_s: float) -> WorkerReady:
    """The worker's ``WorkerReady`` (it finished its start-up), or an error if it died or hung."""
    try:
      return await asyncio.wait_for(asyncio.shield(self.ready_task), timeout_s)
    except (ChannelClosed, ProtocolError, asyncio.TimeoutError) as e:
      raise WorkerStartError(
        f"worker {self.pid} did not become ready: {type(e).__name__} {e}"
      ) from None

  # ---- life -------------------------------------------------------------------------------------
  def alive(self) -> bool:
    return not _exited(self.pidfd)

  async def wait_exited(self) -> None:
    """Until the waiter and PID 1 of the worker's namespace have both exited. PID 1 exits only once
    every other process of the namespace has (the kernel reaps them first), so nothing the candidate
    started still runs, on the CPU or the GPU (its contexts go with its processes), after this."""
    for fd in (self.pidfd, self.sandbox_pidfd):
      await _wait_pidfd(fd)

  async def returncode(self, timeout_s: float = 2.0) -> int | None:
    return await self.server.returncode(self.pid, timeout_s)

  async def ended(self, grace_s: float) -> int | None:
    """How the worker ended: give it ``grace_s`` to finish on its own (a crash still unwinding), then kill
    it; returns its exit status (negative: the signal)."""
    try:
      await asyncio.wait_for(self.wait_exited(), grace_s)
    except asyncio.TimeoutError:
      self.kill()
      await self.wait_exited()
    return await self.returncode()

  def kill(self, why: str = "") -> None:
    """Kill the worker's PID namespace (and its waiter)."""
    if why and not self.killed_by:
      self.killed_by = why
    _signal_pidfd(self.sandbox_pidfd)
    _signal_pidfd(self.pidfd)

  def tree_pids(self) -> list[int]:
    """The worker's processes as the service sees them: its waiter and its namespace's tree."""
    return [self.pid, *_process_tree(self.sandbox_pid)]

  def signal_tree(self, sig: int) -> None:
    """``sig`` to every process of the worker (twice for a stop: a fork in flight the first time)."""
    for _ in range(2 if sig == signal.SIGSTOP else 1):
      for pid in self.tree_pids():
        try:
          os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
          pass

  def rss_mb(self) -> float:
    return process_tree_rss_mb(self.sandbox_pid)

  def usage(self) -> TreeUsage:
    return process_tree_usage(self.sandbox_pid)

  def read_log(self) -> str:
    return truncate_log(read_log_capped(os.path.join(self.scratch, LOG_FILE)))

  def discard(self) -> None:
    self.kill()
    if self.ready_task is not None and not self.ready_task.done():
      self.ready_task.cancel()
    self.chan.close()
    for fd in (self.pidfd, self.sandbox_pidfd):
      if fd >= 0:
        os.close(fd)
    self.pidfd = self.sandbox_pidfd = -1
    shutil.rmtree(self.scratch, ignore_errors=True)
    self.server.forget(self.pid)


class WorkerStartError(RuntimeError):
  pass


class ForkServerClient:
  """The fork server of one pool (``python -m verifier.candidate.zygote``), restarted if it dies."""

  def __init__(
    self,
    *,
    device: str,
    gpu_index: str,
    scratch_root: str,
    isolate_network: bool,
    arch_list: str = "",
    max_jobs: int = 2,
  ):
    self.device, self.gpu_index, self.scratch_root = device, gpu_index, scratch_root
    self.isolate_network, self.arch_list, self.max_jobs = isolate_network, arch_list, max_jobs
    self.proc: asyncio.subprocess.Process | None = None
    self.chan: AsyncChannel | None = None
    self.home = ""
    self.lock = asyncio.Lock()
    self.reply: asyncio.Future | None = None
    self.exits: dict[int, asyncio.Future] = {}
    self.reader: asyncio.Task | None = None
    self.failures = 0

  def env(self, scratch: str, role: str) -> dict[str, str]:
    return scrubbed_env(
      scratch,
      cuda_visible=self.gpu_index if self.device == "cuda" and role == "candidate" else "",
      arch_list=self.arch_list,
      max_jobs=self.max_jobs,
    )

  async def _ensure(self) -> None:
    if self.proc is not None and self.proc.returncode is None:
      return
    os.makedirs(self.scratch_root, exist_ok=True)
    self.home = self.home or tempfile.mkdtemp(prefix="forkserver-", dir=self.scratch_root)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    log = open(os.path.join(self.home, LOG_FILE), "ab")
    try:
      self.proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "verifier.candidate.zygote",
        "--device",
        self.device,
        "--fd",
        str(theirs.fileno()),
        *(["--isolate-network"] if self.isolate_network else []),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        cwd=self.home,
        env=self.env(self.home, "candidate"),
        start_new_session=True,
        pass_fds=(theirs.fileno(),),
      )
    finally:
      log.close()
      theirs.close()
    self.chan = AsyncChannel(ours)
    self.reader = asyncio.ensure_future(self._read())

  async def _read(self) -> None:
    chan = self.chan
    try:
      while True:
        msg = await chan.recv(Forked, ForkFailed, Exited)
        if isinstance(msg, Exited):
          fut = self.exits.setdefault(msg.pid, asyncio.get_running_loop().create_future())
          if not fut.done():
            fut.set_result(msg.returncode)
        elif self.reply is not None and not self.reply.done():
          self.reply.set_result(msg)
    except (ChannelClosed, ProtocolError, OSError) as e:
      if self.reply is not None and not self.reply.done():
        self.reply.set_result(ForkFailed(f"fork server gone: {e}"))

  async def fork(
    self,
    role: str,
    *,
    writable=(),
    readable=(),
    mem_mb=0,
    warm_profiler=True,
    mount_namespace=True,
    landlock=True,
    block_sockets=True,
    scratch_mb=0,
    max_tasks=0,
    nproc_limit=0,
  ) -> Worker:
    """A new worker (its start-up still running; see ``Worker.wait_ready``)."""
    os.makedirs(self.scratch_root, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=f"{role}-", dir=self.scratch_root)
    req = ForkRequest(
      role=role,
      scratch=scratch,
      env=self.env(scratch, role),
      writable=(scratch, *writable),
      readable=tuple(readable),
      mem_mb=mem_mb,
      warm_profiler=warm_profiler,
      mount_namespace=mount_namespace,
      landlock=landlock,
      block_sockets=block_sockets,
      scratch_mb=scratch_mb,
      max_tasks=max_tasks,
      nproc_limit=nproc_limit,
    )
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
      async with self.lock:
        await self._ensure()
        self.reply = asyncio.get_running_loop().create_future()
        try:
          await self.chan.send(req, fds=[theirs.fileno()])
          reply = await asyncio.wait_for(self.reply, 120)
        except (ChannelClosed, OSError, asyncio.TimeoutError) as e:
          reply = ForkFailed(f"{type(e).__name__}: {e}")
    finally:
      theirs.close()
    if isinstance(reply, ForkFailed):
      self.failures += 1
      ours.close()
      shutil.rmtree(scratch, ignore_errors=True)
      if self.proc is not None and self.proc.returncode is None and "gone" in reply.reason:
        self.proc.kill()
      raise WorkerStartError(f"fork server could not fork a {role} worker: {reply.reason}")
    worker = Worker(reply, scratch, AsyncChannel(ours), self)
    worker.watch_ready()
    return worker

  async def returncode(self, pid: int, timeout_s: float) -> int | None:
    fut = self.exits.setdefault(pid, asyncio.get_running_loop().create_future())
    try:
      return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
    except asyncio.TimeoutError:
      return None

  def forget(self, pid: int) -> None:
    fut = self.exits.get(pid)
    if fut is not None and fut.done():
      del self.exits[pid]

  async def close(self) -> None:
    if self.chan is not None:
      self.chan.close()
    if self.reader is not None:
      self.reader.cancel()
      await asyncio.gather(self.reader, return_exceptions=True)
    if self.proc is not None and self.proc.returncode is None:
      try:
        os.killpg(self.proc.pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass
      await self.proc.wait()
    if self.home:
      shutil.rmtree(self.home, ignore_errors=True)


class CheckerClient:
  """One long-lived checker process (``python -m verifier.check.checker_main``) and its channel. It runs no
  candidate code, so it is started directly (not forked from the fork server) and kept across jobs."""

  def __init__(
    self,
    *,
    device: str,
    gpu_index: str,
    scratch_root: str,
    cache_mb: int = 2048,
    max_jobs: int = 0,
  ):
    self.device, self.gpu_index, self.scratch_root = device, gpu_index, scratch_root
    self.cache_mb, self.max_jobs = cache_mb, max_jobs
    self.proc: asyncio.subprocess.Process | None = None
    self.chan: AsyncChannel | None = None
    self.home = ""
    self.recent: list[str] = []  # reference keys it served lately (it probably still holds them)
    self.jobs = 0

  async def start(self, timeout_s: float = 300.0) -> None:
    os.makedirs(self.scratch_root, exist_ok=True)
    self.home = tempfile.mkdtemp(prefix="checker-", dir=self.scratch_root)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    log = open(os.path.join(self.home, LOG_FILE), "ab")
    try:
      self.proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "verifier.check.checker_main",
        "--device",
        self.device,
        "--fd",
        str(theirs.fileno()),
        "--max-jobs",
        str(self.max_jobs),
        "--cache-mb",
        str(self.cache_mb),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        cwd=self.home,
        env=scrubbed_env(self.home, cuda_visible=self.gpu_index if self.device == "cuda" else ""),
        start_new_session=True,
        pass_fds=(theirs.fileno(),),
      )
    finally:
      log.close()
      theirs.close()
    self.chan = AsyncChannel(ours)
    try:
      await asyncio.wait_for(self.chan.recv(WorkerReady), timeout_s)
    except (ChannelClosed, ProtocolError, asyncio.TimeoutError) as e:
      tail = self.read_log()[-2000:]
      await self.close()
      raise WorkerStartError(f"checker did not start ({type(e).__name__}): {tail}") from None

  def alive(self) -> bool:
    return self.proc is not None and self.proc.returncode is None

  async def check(self, job, candidate: socket.socket, on_stage) -> "object":
    """Send ``job`` with the candidate's socket; returns the ``CheckReport``. Stage messages go to
    ``on_stage(name)``. Raises ChannelClosed if the checker died."""
    from verifier.ipc.records import CheckReport, Stage

    try:
      await self.chan.send(job, fds=[candidate.fileno()])
    finally:
      candidate.close()
    self.jobs += 1
    while True:
      msg = await self.chan.recv(Stage, CheckReport)
      if isinstance(msg, Stage):
        on_stage(msg.name)
      else:
        return msg

  def read_log(self) -> str:
    return truncate_log(read_log_capped(os.path.join(self.home, LOG_FILE)))

  def kill(self) -> None:
    """Close the channel and kill the process group now (no await: also when its job is abandoned
    with no loop left to run on); ``close`` reaps it."""
    if self.chan is not None:
      self.chan.close()
      self.chan = None
    if self.proc is not None and self.proc.returncode is None:
      try:
        os.killpg(self.proc.pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass

  async def close(self) -> None:
    self.kill()
    if self.proc is not None:
      await self.proc.wait()
    if self.home:
      shutil.rmtree(self.home, ignore_errors=True)
