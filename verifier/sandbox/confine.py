"""Confinement applied inside a worker before any candidate code runs (Linux; ctypes, no dependencies).

Layers, each degrading to a recorded note where the kernel refuses it (docs/verifier-security.md, "What is enforced (isolation)", says what is
enforced where):

1. rlimits (no core dumps, file size cap, optionally address space);
2. a user and network namespace (no interfaces, not even loopback) - applied once in the fork server or
   the spawned worker;
3. a PID namespace per worker: ``enter_pid_namespace`` forks, the child is PID 1 of a fresh namespace and
   the parent stays behind as a tiny waiter; when that PID 1 exits the kernel kills everything left in
   the namespace, so ``setsid``/double-fork escapes die with the check;
4. a mount namespace: a fresh ``/proc`` for that PID namespace (other processes' ``/proc/<pid>`` entries,
   environments and memory are not reachable) and every mount read-only except the scratch directory
   (and the build cache for build workers); the scratch directory on a private tmpfs of ``scratch_mb``
   (its quota); a private IPC namespace without SysV shared memory;
5. Landlock: reads only beneath the toolchain (Python, torch, CUDA, compilers, the build cache; not this
   repository: the fork server imported the worker code before), writes only beneath the writable
   directories, TCP bind/connect denied, no signals and no abstract Unix sockets outside the sandbox;
6. no capabilities and ``no_new_privs``; every inherited descriptor other than stdio and the channel closed;
7. no new sockets (``block_sockets``, seccomp): ``socket``, ``socketpair`` and ``connect`` fail with EPERM,
   so a worker cannot reach a path-based Unix socket (Landlock up to ABI 7 does not cover ``connect``); the
   worker's channel, created before, keeps working.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import re
import resource
import signal
import struct
import sys

from verifier.sandbox.import_path import IMPORT_ROOT

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MS_BIND, MS_REC, MS_PRIVATE = 4096, 0x4000, 1 << 18
MNT_DETACH = 2
MOUNT_ATTR_RDONLY = 1
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
SYS_MOUNT_SETATTR = 442
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
FILE_SIZE_LIMIT = 4 << 30

# Landlock access rights (include/uapi/linux/landlock.h).
LL_EXECUTE, LL_WRITE_FILE, LL_READ_FILE, LL_READ_DIR = 1, 2, 4, 8
LL_DIR_ONLY = sum(1 << i for i in range(4, 14))  # remove/make entries, refer (ABI 2)
LL_TRUNCATE, LL_IOCTL_DEV = 1 << 14, 1 << 15
LL_NET_BIND_TCP, LL_NET_CONNECT_TCP = 1, 2
LL_SCOPE_ABSTRACT_UNIX_SOCKET, LL_SCOPE_SIGNAL = 1, 2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.mount.argtypes = [
  ctypes.c_char_p,
  ctypes.c_char_p,
  ctypes.c_char_p,
  ctypes.c_ulong,
  ctypes.c_void_p,
]


def _errno_text(what: str) -> str:
  e = ctypes.get_errno()
  return f"{what}: {os.strerror(e)} (errno {e})"


@dataclasses.dataclass(frozen=True)
class SandboxSpec:
  """What a worker may touch. ``writable``: directories it may write beneath (its scratch, a build
  cache); ``readable``: extra directories it may read (the build cache for run workers)."""

  writable: tuple[str, ...]
  readable: tuple[str, ...] = ()
  mount_namespace: bool = True
  landlock: bool = True
  scratch: str = ""  # the worker's scratch directory (one of ``writable``)
  scratch_mb: int = 0  # its quota: a tmpfs of this size over it (0: none)
  max_tasks: int = 0  # its PID namespace's cap (cap_pid_namespace; 0: none)


def apply_limits(mem_mb: int, limit_address_space: bool) -> None:
  resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
  resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))
  if limit_address_space and mem_mb > 0:
    # Not for CUDA workers: the driver reserves huge virtual ranges (the RSS watchdog covers those).
    resource.setrlimit(resource.RLIMIT_AS, (mem_mb << 20, mem_mb << 20))


NAMESPACE_ID = 1000  # this process's uid and gid inside its user namespace (not 0: no root there)


def _map_own_ids(uid: int, gid: int) -> list[str]:
  """Map this process's own uid and gid (the only mapping an unprivileged process may write) to
  ``NAMESPACE_ID``, so filesystems mounted in the namespace (the scratch tmpfs) can own files."""
  return _map_ids(NAMESPACE_ID, NAMESPACE_ID, uid, gid)


def _map_ids(uid_inside: int, gid_inside: int, uid: int, gid: int) -> list[str]:
  try:
    with open("/proc/self/setgroups", "w") as f:
      f.write("deny")
    for name, inside, outer in (("uid_map", uid_inside, uid), ("gid_map", gid_inside, gid)):
      with open(f"/proc/self/{name}", "w") as f:
        f.write(f"{inside} {outer} 1")
  except OSError as e:
    return [f"user namespace ids not mapped ({e}): the scratch quota cannot be mounted"]
  return []


def isolate_network() -> list[str]:
  """User + network namespace for this process (and everything it forks). Returns notes on failure."""
  uid, gid = os.geteuid(), os.getegid()
  if _libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
    return ["network isolation unavailable (" + _errno_text("unshare") + ")"]
  return _map_own_ids(uid, gid)


def _outer_uid() -> int:
  """This process's uid in the initial user namespace (through its user namespace's map)."""
  try:
    with open("/proc/self/uid_map") as f:
      inside, outside, _ = f.readline().split()
    return os.geteuid() - int(inside) + int(outside)
  except (OSError, ValueError):
    return os.geteuid()


# Tasks the worker's runtime holds beside what its limit is for (torch, CUDA driver and CUPTI threads)
RUNTIME_TASKS = 64


def own_user_namespace(nproc_limit: int) -> list[str]:
  """A user namespace of this worker's own, with ``RLIMIT_NPROC`` = ``nproc_limit`` + the runtime's
  ``RUNTIME_TASKS``: the kernel counts a user's tasks per user namespace, so a fork or a thread past the
  limit fails (EAGAIN) where it is created, counting only this worker's tasks. Set after the namespace
  exists (the count of the namespace above keeps its creator's limit). The kernel exempts uid 0: a
  service running as root needs the cgroup (``task_limits``) instead."""
  if _outer_uid() == 0:
    return ["RLIMIT_NPROC not applied: the service runs as root, which the kernel exempts"]
  uid, gid = os.geteuid(), os.getegid()
  if _libc.unshare(CLONE_NEWUSER) != 0:
    return ["no user namespace of the worker's own (" + _errno_text("unshare") + "): tasks polled"]
  notes = _map_ids(uid, gid, uid, gid)
  limit = nproc_limit + RUNTIME_TASKS
  resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
  return notes


def _kernel_at_least(major: int, minor: int) -> bool:
  try:
    parts = os.uname().release.split(".")
    return (int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)) >= (major, minor)
  except (ValueError, IndexError):
    return False


PID_NAMESPACE_RESERVED = 300  # the kernel's RESERVED_PIDS: pids wrap to 300 past it


def cap_pid_namespace(max_tasks: int) -> list[str]:
  """At most ``max_tasks`` + 300 tasks in this PID namespace, whoever runs the service: its own
  ``pid_max`` (Linux 6.14+; written through the namespace's fresh /proc; allocation wraps to 300, so the
  cap holds between ``max_tasks`` and ``max_tasks`` + 300 tasks). Only inside a PID namespace of the
  worker's own, only on a kernel that keeps ``pid_max`` per namespace: on an older kernel the file is
  the host's."""
  if max_tasks <= 0:
    return []
  if os.getpid() > 2 or not _kernel_at_least(6, 14):
    return [f"no pid_max of the worker's own on this kernel ({os.uname().release}): tasks polled"]
  try:
    with open("/proc/sys/kernel/pid_max", "w") as f:
      f.write(str(max_tasks + PID_NAMESPACE_RESERVED))
  except OSError as e:
    return [f"pid_max of the worker's namespace not set ({e}): tasks polled"]
  return []


def _wait_status(pid: int) -> int:
  while True:
    try:
      return os.waitpid(pid, 0)[1]
    except InterruptedError:
      continue


def _mirror(code: str) -> None:
  """End this process the way the worker ended: ``"signal N"`` or ``"exit N"``."""
  how, _, n = code.partition(" ")
  if how == "signal" and n.isdigit():
    sig = int(n)
    if sig not in (signal.SIGKILL, signal.SIGSTOP):
      signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
  os._exit(int(n) if how == "exit" and n.isdigit() else 70)


def _describe(status: int) -> str:
  if os.WIFSIGNALED(status):
    return f"signal {os.WTERMSIG(status)}"
  return f"exit {os.WEXITSTATUS(status) if os.WIFEXITED(status) else 70}"


def enter_pid_namespace(report_fd: int = -1, child_only: tuple[int, ...] = ()) -> list[str]:
  """Move the rest of this worker into a fresh PID namespace. Returns only in the worker.

  Three processes: this one stays behind as a waiter in the fork server's namespace; its child is PID 1
  of the new namespace, a tiny init that reaps orphans and waits for the worker; the worker (PID 2) is
  the grandchild, so it gets ordinary signal semantics (PID 1 ignores signals it sends itself, so
  ``abort()`` would turn into SIGSEGV). When the worker ends, the init reports how and exits, which makes
  the kernel kill everything left in the namespace; the waiter then ends the same way as the worker. The
  init's PID as seen from outside (the process to kill to end the sandbox) is written to ``report_fd``.
  ``child_only``: descriptors only the worker keeps. Where the kernel refuses a PID namespace, returns in
  this process with a note (and reports its own PID)."""

  def report(pid: int) -> None:
    if report_fd >= 0:
      os.write(report_fd, f"{pid}\n".encode())
      os.close(report_fd)

  if _libc.unshare(CLONE_NEWPID) != 0:
    report(os.getpid())
    return [
      "PID namespace unavailable ("
      + _errno_text("unshare")
      + "); descendants may outlive the check"
    ]
  status_r, status_w = os.pipe()
  init = os.fork()
  if init == 0:
    os.close(status_r)
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    worker = os.fork()
    if worker == 0:
      os.close(status_w)
      _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
      if report_fd >= 0:
        os.close(report_fd)
      return []
    for fd in (*child_only, report_fd):
      if fd >= 0:
        os.close(fd)
    while True:  # reap orphans until the worker itself ends
      try:
        pid, status = os.waitpid(-1, 0)
      except InterruptedError:
        continue
      except ChildProcessError:
        os._exit(70)
      if pid == worker:
        break
    os.write(status_w, _describe(status).encode())
    os._exit(0)  # the namespace goes with its init
  os.close(status_w)
  report(init)
  for fd in child_only:
    os.close(fd)
  for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, lambda signum, frame: os.kill(init, signal.SIGKILL))
  status = _wait_status(init)
  code = os.read(status_r, 64).decode(errors="replace")
  _mirror(code or _describe(status))
  os._exit(70)


def _mount_setattr(path: str, set_bits: int, clear_bits: int) -> int:
  attr = ctypes.create_string_buffer(struct.pack("QQQQ", set_bits, clear_bits, 0, 0))
  return _libc.syscall(
    SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), AT_RECURSIVE, attr, ctypes.c_size_t(32)
  )


def _scratch_quota(scratch: str, scratch_mb: int) -> list[str]:
  """A private tmpfs of ``scratch_mb`` MiB over the scratch directory: writes beyond it fail with ENOSPC,
  and what the worker wrote there goes with its mount namespace. The service's view of the directory
  (the worker's log, opened before) is untouched."""
  opts = f"size={scratch_mb}m,nr_inodes=65536,mode=0700".encode()
  if _libc.mount(b"tmpfs", scratch.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts) != 0:
    return [f"scratch quota refused ({_errno_text('mount tmpfs')}): scratch not size-limited"]
  probe = os.path.join(scratch, ".quota-probe")
  try:  # files need an owner mapped in this user namespace (isolate_network)
    os.close(os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600))
    os.unlink(probe)
  except OSError as e:
    _libc.umount2(scratch.encode(), MNT_DETACH)
    return [f"scratch quota unusable ({e}): scratch not size-limited"]
  return []


def _no_sysv_shared_memory() -> list[str]:
  """A private IPC namespace with no SysV shared memory at all (``shmall`` 0): segments are memory that
  no process maps and that would outlive the worker in a shared namespace."""
  if _libc.unshare(CLONE_NEWIPC) != 0:
    return [
      "IPC namespace unavailable (" + _errno_text("unshare") + "): SysV shared memory unbounded"
    ]
  try:
    with open("/proc/sys/kernel/shmall", "w") as f:
      f.write("0")
  except OSError as e:
    return [f"SysV shared memory not disabled ({e}); its segments die with the worker"]
  return []


def read_only_filesystem(
  writable: tuple[str, ...], scratch: str = "", scratch_mb: int = 0, max_tasks: int = 0
) -> list[str]:
  """New mount namespace: fresh /proc (and through it the PID namespace's cap of ``max_tasks``),
  everything read-only except ``writable``; ``scratch`` on a tmpfs of ``scratch_mb`` MiB when asked."""
  if _libc.unshare(CLONE_NEWNS) != 0:
    return ["mount namespace unavailable (" + _errno_text("unshare") + "): filesystem writable"]
  notes = _no_sysv_shared_memory()
  if _libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
    return notes + ["mounts not private (" + _errno_text("mount") + "): filesystem writable"]
  if _libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None) != 0:
    notes.append("fresh /proc refused (" + _errno_text("mount proc") + "): host /proc visible")
  else:
    notes += cap_pid_namespace(max_tasks)
  for path in writable:
    if path == scratch and scratch_mb > 0:
      quota = _scratch_quota(scratch, scratch_mb)
      if not quota:
        continue
      notes += quota
    if _libc.mount(path.encode(), path.encode(), None, MS_BIND | MS_REC, None) != 0:
      return notes + [f"bind of {path} refused (" + _errno_text("mount") + "): filesystem writable"]
  if _mount_setattr("/", MOUNT_ATTR_RDONLY, 0) != 0:
    return notes + ["read-only remount refused (" + _errno_text("mount_setattr") + ")"]
  # The fresh /proc (this PID namespace's own processes) stays writable: the CUDA driver writes under
  # /proc at cuInit, and fails with cudaErrorOperatingSystem (304) on a read-only /proc (H200 host,
  # driver 580, 2026-11-30; /dev, /dev/shm and /sys may stay read-only).
  if _mount_setattr("/proc", 0, MOUNT_ATTR_RDONLY) != 0:
    notes.append("/proc stays read-only (" + _errno_text("mount_setattr") + "): CUDA cannot start")
  for path in writable:
    if _mount_setattr(path, 0, MOUNT_ATTR_RDONLY) != 0:
      notes.append(f"{path} stays read-only (" + _errno_text("mount_setattr") + ")")
  return notes


def landlock_abi() -> int:
  return max(
    0, _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
  )


LOADER_FILES = (
  "/etc/ld.so.cache",
  "/etc/ld.so.conf",
  "/etc/ld.so.conf.d",
  "/etc/ld.so.preload",
  "/etc/alternatives",
  "/etc/localtime",
  "/etc/nsswitch.conf",
  "/etc/nvidia",
)
SYSTEM_DIRS = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/opt")


def beneath(path: str, root: str) -> bool:
  return path == root or path.startswith(root.rstrip("/") + "/")


def _repository() -> str:
  """The checkout the service runs from (where ``verifier`` is imported from)."""
  return os.path.realpath(IMPORT_ROOT)


def toolchain_paths() -> list[str]:
  """Paths a worker reads: this Python and its packages (``sys.path``), CUDA and the compilers (system
  directories, ``PATH``, ``LD_LIBRARY_PATH``, ``CUDA_HOME``) and the loader's configuration. Not this
  repository (workers import the verifier's modules before they are confined: ``zygote``), nor a
  directory that contains it, nor /home, /root, /tmp, /var or the rest of /etc. The interpreter's own
  installation stays readable even inside the checkout (a virtual environment in ``.venv``)."""
  import sysconfig

  always = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
  always += list(SYSTEM_DIRS) + list(LOADER_FILES)
  others = [os.path.dirname(os.path.realpath(sys.executable))]
  others += [sysconfig.get_path(n) or "" for n in ("stdlib", "platstdlib", "purelib", "platlib")]
  others += sys.path
  for var in ("PATH", "LD_LIBRARY_PATH"):
    others += os.environ.get(var, "").split(os.pathsep)
  others += [os.environ.get(v, "") for v in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT", "VIRTUAL_ENV")]
  repo = _repository()
  kept = [os.path.realpath(p) for p in always if p]

  def allowed(q: str) -> bool:
    if any(beneath(q, k) for k in kept):
      return True
    return not (beneath(q, repo) or beneath(repo, q))

  out = []
  for p in always + others:
    if p and os.path.isabs(p) and os.path.exists(p):
      out += [q for q in (os.path.normpath(p), os.path.realpath(p)) if allowed(q)]
  hidden = hidden_paths(list(dict.fromkeys(out)))
  return list(dict.fromkeys(q for p in dict.fromkeys(out) for q in without(p, hidden)))


def hidden_paths(roots: list[str]) -> list[str]:
  """What a worker never reads although it lies beneath a toolchain directory: this verifier's own
  source and the learner's, where they are installed into site-packages (the repository itself is not
  readable at all), and the configuration of a virtual environment (``pyvenv.cfg``: the host's paths and
  how it was made). Compile workers too: their compilers read whatever a candidate's source names
  (``#include``, ``.incbin``; red team 43d quoted it line by line in a COMPILE_ERROR). Workers are forked
  from a started interpreter (``zygote``) and run no Python of the environment afterwards; ninja is a
  native binary (``sandbox.native_ninja_first``)."""
  package = os.path.dirname(os.path.abspath(__file__))  # .../verifier/sandbox
  verifier = os.path.dirname(package)
  site = os.path.dirname(verifier)
  out = [verifier, os.path.join(site, "dice_jax")]
  out += [os.path.join(r, "pyvenv.cfg") for r in roots]
  # this project's installation record: its README (METADATA), the checkout's path and layout (an
  # editable install's finder and .pth; red team 44 read them with .incbin)
  for d in [q for r in roots for q in (r, os.path.join(r, "__pycache__"))]:
    out += [os.path.join(d, n) for n in _listdir(d) if _PROJECT_RECORD.match(n)]
  out += [os.path.join(p, "pyvenv.cfg") for p in (sys.prefix, sys.exec_prefix)]
  found = [q for p in out if os.path.exists(p) for q in (p, os.path.realpath(p))]
  return list(dict.fromkeys(found))


_PROJECT_RECORD = re.compile(
  r"dice_jax-[^/]*\.dist-info|__editable__[._]+dice_jax[^/]*|dice[_-]jax\.egg-link"
)


def _listdir(path: str) -> list[str]:
  try:
    return sorted(os.listdir(path)) if os.path.isdir(path) else []
  except OSError:
    return []


def without(root: str, hidden: list[str]) -> list[str]:
  """Paths whose union is everything beneath ``root`` except ``hidden`` (Landlock only allows): ``root``
  itself where nothing hidden lies beneath it, else its entries, expanded the same way. A link is judged by
  where it leads (a rule holds its target: the venv's ``lib64 -> lib`` gave all of ``lib`` back, red team
  44); one leading to a directory above it is left out."""
  real = os.path.realpath(root)
  inside = [h for h in hidden if beneath(h, root) or beneath(h, real)]
  if not inside:
    return [root]
  if root in inside or real in inside or not os.path.isdir(real):
    return []
  if real != os.path.normpath(root):
    return [] if beneath(root, real) else without(real, inside)
  return [q for n in _listdir(root) for q in without(os.path.join(root, n), inside)]


def repository_exposed(paths: list[str]) -> list[str]:
  """A note when the repository lies beneath a directory workers must read (e.g. under /usr)."""
  repo = _repository()
  under = [p for p in paths if beneath(repo, os.path.realpath(p))]
  return [f"the repository {repo} lies beneath {under[0]}: workers can read it"] if under else []


def landlock(spec: SandboxSpec) -> list[str]:
  abi = landlock_abi()
  if abi < 1:
    return ["Landlock unavailable: reads and writes are limited by the mount namespace only"]
  fs = (1 << 13) - 1
  if abi >= 2:
    fs |= 1 << 13
  if abi >= 3:
    fs |= LL_TRUNCATE
  if abi >= 5:
    fs |= LL_IOCTL_DEV
  net = (LL_NET_BIND_TCP | LL_NET_CONNECT_TCP) if abi >= 4 else 0
  scoped = (LL_SCOPE_ABSTRACT_UNIX_SOCKET | LL_SCOPE_SIGNAL) if abi >= 6 else 0
  size = 8 if abi < 4 else (16 if abi < 6 else 24)
  attr = ctypes.create_string_buffer(struct.pack("QQQ", fs, net, scoped)[:size])
  ruleset = _libc.syscall(
    SYS_LANDLOCK_CREATE_RULESET, attr, ctypes.c_size_t(size), ctypes.c_uint32(0)
  )
  if ruleset < 0:
    return ["Landlock refused (" + _errno_text("landlock_create_ruleset") + ")"]
  notes = []
  read = LL_EXECUTE | LL_READ_FILE | LL_READ_DIR
  device = LL_READ_FILE | LL_WRITE_FILE | LL_READ_DIR | (LL_IOCTL_DEV if abi >= 5 else 0)
  # CUDA writes under /proc. On the H200 host (session 13, experiments/gpu/landlock_cuda_probe.py)
  # cuInit failed with error 304 under read + write there and succeeded with every right. Every right
  # but execute, then: procfs itself refuses creating, removing and linking, so what this adds is
  # truncation (fopen(..., "w") opens with O_TRUNC) and the errors procfs gives for the rest; execute
  # stays denied (executing /proc/self/fd/N would run a memfd's contents).
  proc = fs & ~LL_EXECUTE
  # The build cache is readable file by file (a worker opens the entries its own sources name) but not
  # listable, so a candidate cannot find and load another candidate's extension.
  toolchain = toolchain_paths()
  notes += repository_exposed(toolchain)
  rules = [(p, read) for p in toolchain]
  rules += [(p, LL_EXECUTE | LL_READ_FILE) for p in spec.readable]
  rules += [
    ("/dev", device),
    ("/proc", proc),
    ("/sys", LL_READ_FILE | LL_READ_DIR),
  ]
  rules += [(p, fs) for p in spec.writable]
  try:
    for path, access in rules:
      try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
      except OSError:
        continue  # absent on this host
      try:
        if not os.path.isdir(path):
          access &= LL_EXECUTE | LL_READ_FILE | LL_WRITE_FILE | LL_TRUNCATE | LL_IOCTL_DEV
        rule = ctypes.create_string_buffer(struct.pack("=Qi", access & fs, fd))
        if _libc.syscall(SYS_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), 1, rule, ctypes.c_uint32(0)):
          notes.append(
            f"Landlock rule for {path} refused (" + _errno_text("landlock_add_rule") + ")"
          )
      finally:
        os.close(fd)
    _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if _libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)):
      return notes + ["Landlock refused (" + _errno_text("landlock_restrict_self") + ")"]
  finally:
    os.close(ruleset)
  return notes


class _CapHeader(ctypes.Structure):
  _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
  _fields_ = [
    ("effective", ctypes.c_uint32),
    ("permitted", ctypes.c_uint32),
    ("inheritable", ctypes.c_uint32),
  ]


def drop_capabilities() -> list[str]:
  _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
  header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
  data = (_CapData * 2)()
  if _libc.capset(ctypes.byref(header), data) != 0:
    return ["capabilities not dropped (" + _errno_text("capset") + ")"]
  return []


# seccomp (include/uapi/linux/seccomp.h, filter.h, audit.h)
_BPF_LD_W_ABS, _BPF_JEQ_K, _BPF_JGE_K, _BPF_RET_K = 0x20, 0x15, 0x35, 0x06
_SECCOMP_RET_ALLOW, _SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
_SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_TSYNC = 1, 1
_X32_SYSCALL_BIT = 0x40000000
# arch -> (AUDIT_ARCH value, SYS_seccomp, (socket, connect, socketpair))
_SOCKET_SYSCALLS = {
  "x86_64": (0xC000003E, 317, (41, 42, 53)),
  "aarch64": (0xC00000B7, 277, (198, 203, 199)),
}


class _SockFilter(ctypes.Structure):
  _fields_ = [
    ("code", ctypes.c_ushort),
    ("jt", ctypes.c_ubyte),
    ("jf", ctypes.c_ubyte),
    ("k", ctypes.c_uint),
  ]


class _SockFprog(ctypes.Structure):
  _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def socket_filter_program(
  audit_arch: int, numbers: tuple[int, ...]
) -> list[tuple[int, int, int, int]]:
  """A classic-BPF seccomp program: on `audit_arch`, the syscalls `numbers` and any x32 syscall return
  EPERM and everything else is allowed; every syscall of another architecture (e.g. i386 through
  ``int 0x80``, which has its own socket numbers) returns EPERM."""
  deny = _SECCOMP_RET_ERRNO | 1  # EPERM
  n = len(numbers)
  prog = [(_BPF_LD_W_ABS, 0, 0, 4)]  # seccomp_data.arch
  prog.append((_BPF_JEQ_K, 0, n + 3, audit_arch))  # another arch: jump to deny
  prog.append((_BPF_LD_W_ABS, 0, 0, 0))  # seccomp_data.nr
  prog.append((_BPF_JGE_K, n + 1, 0, _X32_SYSCALL_BIT))  # x32 ABI: deny
  for i, nr in enumerate(numbers):
    prog.append((_BPF_JEQ_K, n - i, 0, nr))  # jump to deny
  prog.append((_BPF_RET_K, 0, 0, _SECCOMP_RET_ALLOW))
  prog.append((_BPF_RET_K, 0, 0, deny))
  return prog


def block_sockets() -> list[str]:
  """Layer 7 for every thread of this process (needs ``no_new_privs``, set by ``drop_capabilities``)."""
  import platform

  arch = platform.machine()
  if arch not in _SOCKET_SYSCALLS:
    return [f"new sockets not blocked: no seccomp filter for {arch}"]
  audit_arch, sys_seccomp, numbers = _SOCKET_SYSCALLS[arch]
  prog = socket_filter_program(audit_arch, numbers)
  return _install_filter(prog, sys_seccomp, "new sockets not blocked")


def _stat_fields() -> list[str]:
  with open("/proc/self/stat") as f:
    return f.read().rsplit(")", 1)[1].split()


def blank_process_strings(arguments: bool = True, environment: bool = True) -> None:
  """Zero the memory the kernel shows as ``/proc/<pid>/cmdline`` and ``/proc/<pid>/environ`` (the
  strings this process was started with: the fork server's command line, its environment), so a
  candidate that reads them finds nothing. Python keeps its own copies (``sys.argv``, ``os.environ``);
  blank the environment only once ``os.environ`` was rebuilt (glibc's ``environ`` then points at the
  heap, not at these strings)."""
  f = _stat_fields()  # from field 3 on: arg_start is field 48
  spans = []
  if arguments:
    spans.append((int(f[45]), int(f[46])))
  if environment:
    spans.append((int(f[47]), int(f[48])))
  for start, end in spans:
    if 0 < start < end:
      ctypes.memset(start, 0, end - start)


# Switching off the verifier's view of a process: arch -> (perf_event_open, prctl). ``prctl`` options
# PR_TASK_PERF_EVENTS_DISABLE/ENABLE (31, 32) act on every perf event attached to the caller, including
# the checker's samplers (host_sampler).
_EVIDENCE_SYSCALLS = {"x86_64": (298, 157), "aarch64": (241, 167)}
PR_TASK_PERF_EVENTS_DISABLE, PR_TASK_PERF_EVENTS_ENABLE = 31, 32
# Relabelling the candidate's mappings (red team 42, hole B1): ``mremap`` moves pages without a perf
# record, so with MREMAP_FIXED a candidate moved torch's text away, mapped its own build (a record:
# "own") over the hole and moved torch's pages back on top, and every sample in torch counted as its own.
# MREMAP_MAYMOVE alone does it too: the kernel puts the pages in the highest hole that fits, and a
# ``munmap`` (no record either) of a range labelled "own" makes that hole. So ``mremap`` is refused with
# any of MREMAP_MAYMOVE, MREMAP_FIXED, MREMAP_DONTUNMAP in its flags (4th argument): no mapping moves.
# Growing or shrinking in place stays allowed; glibc's realloc of an mmapped chunk, refused its
# MREMAP_MAYMOVE, falls back to malloc, copy and free. AUDIT_ARCH -> ``mremap``.
_MREMAP_SYSCALL = {0xC000003E: 25, 0xC00000B7: 216}
MREMAP_MAYMOVE, MREMAP_FIXED, MREMAP_DONTUNMAP = 1, 2, 4
# The kernel's key retention service (red team 42, round 2): keys are not files, so neither the read-only
# mounts, Landlock nor the namespaces cover them, and in a service run as root every worker shares one user
# keyring: a candidate stored each forward's trial seed there (``add_key``) and a later request of the same
# task read them back in ``__init__`` (``keyctl``), drew its trials' inputs and looked the answers up.
# AUDIT_ARCH -> (add_key, request_key, keyctl), all refused.
_KEYRING_SYSCALLS = {0xC000003E: (248, 249, 250), 0xC00000B7: (217, 218, 219)}
# io_uring (red team 43b): its requests run in kernel threads and kernel mode, which the host sampler does
# not see; what it offers today only copies data, but nothing a kernel runs for the candidate should be
# out of sight, and torch does not use it. (io_uring_setup, _enter, _register: one numbering on both.)
_IO_URING_SYSCALLS = (425, 426, 427)
# A process sharing the candidate's memory (red team 46): the sampler gives a new process a copy of its
# parent's address space at the FORK record, and FORK records carry no clone flags, so a ``clone(CLONE_VM)``
# child kept a stale copy while its parent loaded a library over its own code, and computed there as
# "own". ``clone`` with CLONE_VM is refused unless CLONE_THREAD (a thread: one space) or CLONE_VFORK (the
# parent waits until the child execs or exits) is set; ``clone3`` (flags behind a pointer, out of a
# filter's reach) answers ENOSYS, so glibc falls back to ``clone``. AUDIT_ARCH -> (clone, clone3).
_CLONE_SYSCALLS = {0xC000003E: (56, 435), 0xC00000B7: (220, 435)}
CLONE_VM, CLONE_VFORK, CLONE_THREAD = 0x100, 0x4000, 0x10000
_ENOSYS = 38
_BPF_JSET_K = 0x45


def evidence_filter_program(
  audit_arch: int, perf_event_open: int, prctl: int, mremap: int | None = None
) -> list[tuple[int, int, int, int]]:
  """A classic-BPF seccomp program: ``perf_event_open``, the keyring calls (``add_key``, ``request_key``,
  ``keyctl``), io_uring's three, ``clone`` of a process sharing the caller's memory (CLONE_VM without
  CLONE_THREAD or CLONE_VFORK; ``clone3``: ENOSYS), ``prctl(PR_TASK_PERF_EVENTS_DISABLE or _ENABLE)``, ``mremap`` that may move the mapping
  (MREMAP_MAYMOVE, _FIXED or _DONTUNMAP), any x32 syscall and any syscall of another architecture return
  EPERM; everything else (other ``prctl`` options, ``mremap`` in place) is allowed. ``mremap``: its
  number (default: the one of ``audit_arch``)."""
  mremap = _MREMAP_SYSCALL[audit_arch] if mremap is None else mremap
  refused = (perf_event_open, *_KEYRING_SYSCALLS.get(audit_arch, ()), *_IO_URING_SYSCALLS)
  clone, clone3 = _CLONE_SYSCALLS.get(audit_arch, (0xFFFFFFFF, 0xFFFFFFFF))
  # (op, jump-true label, jump-false label, k): labels resolved to offsets below
  body = [
    (_BPF_LD_W_ABS, None, None, 4),  # seccomp_data.arch
    (_BPF_JEQ_K, None, "deny", audit_arch),  # another arch -> deny
    (_BPF_LD_W_ABS, None, None, 0),  # seccomp_data.nr
    (_BPF_JGE_K, "deny", None, _X32_SYSCALL_BIT),  # x32 -> deny
    *((_BPF_JEQ_K, "deny", None, nr) for nr in refused),
    (_BPF_JEQ_K, "prctl", None, prctl),
    (_BPF_JEQ_K, "mremap", None, mremap),
    (_BPF_JEQ_K, "clone", None, clone),
    (_BPF_JEQ_K, "nosys", None, clone3),
    (_BPF_RET_K, None, None, _SECCOMP_RET_ALLOW),
    ("clone", _BPF_LD_W_ABS, None, None, 16),  # args[0] (flags), low 32 bits
    (_BPF_JSET_K, None, "allow", CLONE_VM),
    (_BPF_JSET_K, "allow", "deny", CLONE_THREAD | CLONE_VFORK),
    ("nosys", _BPF_RET_K, None, None, _SECCOMP_RET_ERRNO | _ENOSYS),
    ("prctl", _BPF_LD_W_ABS, None, None, 16),  # args[0], low 32 bits (little-endian)
    (_BPF_JEQ_K, "deny", None, PR_TASK_PERF_EVENTS_DISABLE),
    (_BPF_JEQ_K, "deny", None, PR_TASK_PERF_EVENTS_ENABLE),
    (_BPF_RET_K, None, None, _SECCOMP_RET_ALLOW),
    ("mremap", _BPF_LD_W_ABS, None, None, 40),  # args[3] (flags), low 32 bits
    (_BPF_JSET_K, "deny", None, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP),
    ("allow", _BPF_RET_K, None, None, _SECCOMP_RET_ALLOW),
    ("deny", _BPF_RET_K, None, None, _SECCOMP_RET_ERRNO | 1),  # EPERM
  ]
  labels = {ins[0]: i for i, ins in enumerate(body) if isinstance(ins[0], str)}
  prog = []
  for i, ins in enumerate(body):
    op, jt, jf, k = ins[1:] if isinstance(ins[0], str) else ins
    off = lambda label: 0 if label is None else labels[label] - i - 1  # noqa: E731
    prog.append((op, off(jt), off(jf), k))
  return prog


def _install_filter(
  prog: list[tuple[int, int, int, int]], sys_seccomp: int, what: str
) -> list[str]:
  filters = (_SockFilter * len(prog))(*[_SockFilter(*ins) for ins in prog])
  fprog = _SockFprog(len(prog), filters)
  _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
  rc = _libc.syscall(
    sys_seccomp, _SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_TSYNC, ctypes.byref(fprog)
  )
  if rc != 0:
    return [f"{what} (" + _errno_text("seccomp") + ")"]
  return []


def protect_evidence() -> list[str]:
  """For every thread of this process: no ``perf_event_open``, no switching off the perf events attached
  to it (the checker's host sampler), no ``mremap`` that moves a mapping (which would move code under
  a mapping the sampler attributes to another file) and no kernel keyring (which outlives the
  worker). Candidate workers, before any candidate code."""
  import platform

  arch = platform.machine()
  if arch not in _EVIDENCE_SYSCALLS:
    return [f"host evidence not protected: no seccomp filter for {arch}"]
  audit_arch, sys_seccomp, _ = _SOCKET_SYSCALLS[arch]
  prog = evidence_filter_program(audit_arch, *_EVIDENCE_SYSCALLS[arch])
  return _install_filter(prog, sys_seccomp, "host evidence not protected")


def close_inherited_fds(keep: tuple[int, ...]) -> None:
  """Close every descriptor but stdio and ``keep`` (no channel of the service leaks into a worker)."""
  fds = sorted(int(f) for f in os.listdir("/proc/self/fd") if f.isdigit())
  for fd in fds:
    if fd > 2 and fd not in keep:
      try:
        os.close(fd)
      except OSError:
        pass


def confine(spec: SandboxSpec) -> list[str]:
  """Layers 4-6 for the current process (already PID 1 of its namespace). Returns notes on what the
  kernel refused."""
  notes = []
  if spec.mount_namespace:
    notes += read_only_filesystem(spec.writable, spec.scratch, spec.scratch_mb, spec.max_tasks)
  elif spec.scratch_mb > 0:
    notes.append("no mount namespace: scratch not size-limited (file size limit only)")
  if spec.landlock:
    notes += landlock(spec)
  notes += drop_capabilities()
  return notes


def die_with_parent() -> None:
  _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def set_undumpable() -> None:
  """No ptrace attach and no /proc/<pid>/mem for same-user processes without CAP_SYS_PTRACE."""
  _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


def is_pid_namespace_init() -> bool:
  return os.getpid() == 1


__all__ = [
  "SandboxSpec",
  "apply_limits",
  "isolate_network",
  "enter_pid_namespace",
  "confine",
  "close_inherited_fds",
  "set_undumpable",
  "landlock_abi",
  "block_sockets",
  "blank_process_strings",
]
