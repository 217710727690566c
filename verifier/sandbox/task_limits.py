"""Limits on a worker's tasks (processes and threads) that the kernel enforces where they are created,
and the CPU time the kernel charges to them (the service's side; ``confine`` has the worker's side).

A polled limit is outrun: a fork bomb of ~2,000 processes passed the watchdog's 256 between two polls
(issue 37). So, per job:

- **a cgroup** (``CgroupTree``; the cgroup v1 ``pids`` and ``cpuacct`` hierarchies, or cgroup v2), made by
  the service for a worker once it takes it for a job, before the job goes out (no candidate code has run
  in it yet): the worker's processes are moved in, ``pids.max`` refuses the task past the limit (``fork``
  and ``clone`` fail with EAGAIN), ``pids.peak`` is the kernel's high-water mark of the job's tasks
  (threads included; strict mode compares it with the runtime's own), ``pids.events`` counts refusals,
  and the CPU time of every task in it is the candidate's CPU clock on the CPU backend. Needs a writable
  cgroup file system (a root service, or one with a delegated subtree);
- else ``RLIMIT_NPROC`` in the worker's own user namespace (``confine.own_user_namespace``; not for a
  root service: the kernel exempts uid 0);
- and on kernels with a ``pid_max`` per PID namespace (6.14+), every worker's namespace holds at most
  ``max_processes + 300`` tasks whoever runs the service (``confine.cap_pid_namespace``).

Where none applies, the service's poll (``sandbox.watch_resources``) is all there is, and every result
says so.
"""

from __future__ import annotations

import dataclasses
import os
import time

CGROUP_ROOT = "/sys/fs/cgroup"


def _mounts() -> list[tuple[str, str, set[str]]]:
  """(mount point, file system type, options) of every cgroup mount."""
  out = []
  try:
    with open("/proc/self/mountinfo") as f:
      for line in f:
        left, _, right = line.partition(" - ")
        parts, rest = left.split(), right.split()
        if len(parts) >= 5 and rest and rest[0] in ("cgroup", "cgroup2"):
          opts = set(rest[2].split(",")) if len(rest) > 2 else set()
          out.append((parts[4], rest[0], opts))
  except OSError:
    pass
  return out


def _own_cgroups() -> dict[str, str]:
  """This process's cgroup path per v1 controller, and under "" for v2."""
  out = {}
  try:
    with open("/proc/self/cgroup") as f:
      for line in f:
        _, controllers, path = line.rstrip("\n").split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
          out[c] = path
  except (OSError, ValueError):
    pass
  return out


def _write(path: str, text: str) -> None:
  with open(path, "w") as f:
    f.write(text)


def _read(path: str) -> str:
  with open(path) as f:
    return f.read()


@dataclasses.dataclass
class JobCgroup:
  """One job's cgroup: ``pids`` (the task limit, its peak and refusals), ``cpu`` (the CPU time)."""

  pids: str
  cpu: str
  version: int

  def adopt(self, pids) -> None:
    """Move these processes (each with all its threads) in; their later children are born inside."""
    for pid in pids:
      for d in dict.fromkeys((self.pids, self.cpu)):
        try:
          _write(os.path.join(d, "cgroup.procs"), str(pid))
        except ProcessLookupError:
          pass  # it ended meanwhile

  def limit(self, tasks: int) -> None:
    _write(os.path.join(self.pids, "pids.max"), str(tasks) if tasks > 0 else "max")

  def current(self) -> int:
    return int(_read(os.path.join(self.pids, "pids.current")))

  def peak(self) -> int | None:
    """The most tasks it held at once since it was made (the kernel's count; None where this kernel
    keeps none)."""
    try:
      return int(_read(os.path.join(self.pids, "pids.peak")))
    except (OSError, ValueError):
      return None

  def refused(self) -> int:
    """How many task creations ``pids.max`` refused."""
    try:
      for line in _read(os.path.join(self.pids, "pids.events")).splitlines():
        key, _, value = line.partition(" ")
        if key == "max":
          return int(value)
    except (OSError, ValueError):
      pass
    return 0

  def cpu_clock(self) -> str:
    """Where the checker reads the job's CPU time (``verifier.check.cpu_clock``)."""
    if self.version == 1:
      return "cpuacct:" + os.path.join(self.cpu, "cpuacct.usage")
    return "cpu.stat:" + os.path.join(self.cpu, "cpu.stat")

  def close(self) -> bool:
    """Remove it (False while tasks are still leaving)."""
    ok = True
    for d in dict.fromkeys((self.pids, self.cpu)):
      try:
        os.rmdir(d)
      except FileNotFoundError:
        pass
      except OSError:
        ok = False
    return ok


# A service's cgroup is named SERVICE_PREFIX + its pid + "-" + more (``service_name``): those of services
# that died without closing theirs (SIGKILL) are removed by the next one to start (``sweep_dead``).
SERVICE_PREFIX = "dice-verifier-"


def service_name(pid: int, suffix: str) -> str:
  return f"{SERVICE_PREFIX}{pid}-{suffix}"


def sweep_dead(parent: str) -> list[str]:
  """Remove the empty cgroups (and their empty job cgroups) that services no longer running left in
  ``parent``; returns what was removed. A cgroup that still holds tasks refuses (left as it is)."""
  removed = []
  try:
    names = os.listdir(parent)
  except OSError:
    return removed
  for name in names:
    pid = name[len(SERVICE_PREFIX) :].partition("-")[0]
    if not name.startswith(SERVICE_PREFIX) or not pid.isdigit() or os.path.exists(f"/proc/{pid}"):
      continue
    top = os.path.join(parent, name)
    try:
      jobs = [os.path.join(top, d) for d in os.listdir(top) if d.startswith("job-")]
    except OSError:
      continue
    _remove(*jobs, top)
    if not os.path.exists(top):
      removed.append(top)
  return removed


class CgroupTree:
  """A cgroup of the service's own under which each job gets one (``job``). ``create`` returns None
  with the reason in ``CgroupTree.why`` where no cgroup file system is writable here; it first removes
  what services that died left (``sweep_dead``)."""

  why = ""

  def __init__(self, pids: str, cpu: str, version: int):
    self.pids, self.cpu, self.version = pids, cpu, version
    self.count = 0
    self.leftover: list[JobCgroup] = []

  @classmethod
  def create(cls, name: str) -> "CgroupTree | None":
    mounts = _mounts()
    own = _own_cgroups()
    v1 = {c: m for m, fs, opts in mounts if fs == "cgroup" for c in opts & {"pids", "cpuacct"}}
    errors = []
    if "pids" in v1:
      pids = os.path.join(v1["pids"], own.get("pids", "/").lstrip("/"), name)
      cpu_mount = v1.get("cpuacct")
      cpu = os.path.join(cpu_mount, own.get("cpuacct", "/").lstrip("/"), name) if cpu_mount else ""
      for parent in dict.fromkeys(os.path.dirname(d) for d in (pids, cpu) if d):
        sweep_dead(parent)
      try:
        os.makedirs(pids)
        if cpu and cpu != pids:
          os.makedirs(cpu)
        return cls(pids, cpu or pids, 1)
      except OSError as e:
        _remove(pids, cpu)
        errors.append(f"cgroup v1 pids: {e}")
    v2 = [m for m, fs, _ in mounts if fs == "cgroup2"]
    if v2:
      tree = cls._create_v2(v2[0], own.get("", "/"), name, errors)
      if tree is not None:
        return tree
    cls.why = "; ".join(errors) or "no cgroup file system with the pids controller is mounted"
    return None

  @classmethod
  def _create_v2(cls, mount: str, own: str, name: str, errors: list) -> "CgroupTree | None":
    """Under this process's own v2 cgroup: enabling the pids controller below it needs that cgroup to
    hold no process itself (the root cgroup excepted), which a delegated service arranges."""
    base = os.path.join(mount, own.lstrip("/"))
    top = os.path.join(base, name)
    try:
      if "pids" not in _read(os.path.join(base, "cgroup.controllers")).split():
        errors.append("cgroup v2: the pids controller is not available to this service's cgroup")
        return None
      _write(os.path.join(base, "cgroup.subtree_control"), "+pids")
      sweep_dead(base)
      os.makedirs(top)
      _write(os.path.join(top, "cgroup.subtree_control"), "+pids")
      return cls(top, top, 2)
    except OSError as e:
      _remove(top)
      errors.append(f"cgroup v2 at {base}: {e}")
      return None

  def job(self) -> JobCgroup:
    """A fresh, empty cgroup for one job."""
    self.count += 1
    leaf = f"job-{self.count}"
    pids = os.path.join(self.pids, leaf)
    cpu = os.path.join(self.cpu, leaf)
    os.makedirs(pids)
    if cpu != pids:
      os.makedirs(cpu)
    self._sweep()
    return JobCgroup(pids, cpu, self.version)

  def release(self, job: JobCgroup) -> None:
    """Remove a job's cgroup once its tasks are gone (retried at the next ``job`` if some linger)."""
    if not job.close():
      self.leftover.append(job)

  def _sweep(self) -> None:
    self.leftover = [j for j in self.leftover if not j.close()]

  def close(self, wait_s: float = 5.0) -> None:
    """Remove every job's cgroup and the service's (waiting up to ``wait_s`` for killed tasks to go)."""
    deadline = time.monotonic() + wait_s
    self._sweep()
    while self.leftover and time.monotonic() < deadline:
      time.sleep(0.05)
      self._sweep()
    _remove(self.pids, self.cpu)


def _remove(*dirs: str) -> None:
  for d in dict.fromkeys(d for d in dirs if d):
    try:
      os.rmdir(d)
    except OSError:
      pass


def tree_tasks(pids) -> int:
  """Tasks (threads) of these processes, counted in /proc (where no cgroup counts them)."""
  n = 0
  for pid in pids:
    try:
      n += len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
      pass
  return n


# Tasks the candidate process's own runtime may start during a job beyond those it held when the job
# started (the kernel's peak and the count at the end are compared with that count plus these). CPU:
# none (the exchange's mapping thread is started before the worker says it is ready). GPU: the CUPTI
# collector starts before the job (``worker_main.warm_device``); where it cannot, torch's profiler of the
# last trial may start CUPTI's threads then. To be confirmed on the H200: experiments/gpu/evidence_h200.sh
# prints DICE's jobs by their tasks beyond the start (``Metrics.tasks_beyond_baseline``).
RUNTIME_TRANSIENT_TASKS = {"cpu": 0, "cuda": 2}


@dataclasses.dataclass
class JobTasks:
  """One job's tasks as the kernel counted them: ``baseline`` when the job started (the runtime's own),
  then ``cgroup``'s peak, refusals and count at the end, or, without a cgroup, the threads of the
  worker's processes at the end (``tree``)."""

  cgroup: JobCgroup | None
  baseline: int
  limit: int
  tree: tuple[int, ...] = ()

  @classmethod
  def open(cls, tree: CgroupTree | None, pids: list[int], limit: int) -> "JobTasks":
    """Move the worker's processes into a fresh cgroup of ``tree`` and cap its tasks at what they hold
    now plus ``limit`` (no cap where there is no tree)."""
    if tree is None:
      return cls(None, tree_tasks(pids), limit, tuple(pids))
    try:
      cg = tree.job()
    except OSError:
      return cls(None, tree_tasks(pids), limit, tuple(pids))
    try:
      cg.adopt(pids)
      base = cg.current()
      cg.limit(base + limit if limit > 0 else 0)
    except OSError:
      cg.close()
      return cls(None, tree_tasks(pids), limit, tuple(pids))
    return cls(cg, base, limit, tuple(pids))

  def polled(self, limits):
    """The limits the service's poll keeps (``sandbox.Limits``): not the process count where a cgroup
    caps the tasks (its refusals give the verdict, not a poll that may or may not see them)."""
    return dataclasses.replace(limits, max_processes=0) if self.cgroup is not None else limits

  def counts(self) -> dict:
    """The job's task counts now (before the worker is killed)."""
    if self.cgroup is None:
      return {"baseline": self.baseline, "end": tree_tasks(self.tree)}
    try:
      peak = self.cgroup.peak()
      return {
        "baseline": self.baseline,
        "end": self.cgroup.current(),
        "refused": self.cgroup.refused(),
        **({"peak": peak} if peak is not None else {}),
      }
    except (OSError, ValueError):
      return {"baseline": self.baseline}

  def close(self, tree: CgroupTree | None) -> None:
    if self.cgroup is not None and tree is not None:
      tree.release(self.cgroup)


def tasks_beyond_baseline(counts: dict) -> int:
  """How many more tasks the job held at its peak (or at its end, where no peak is counted) than its
  runtime held when it began."""
  base = counts.get("baseline", 0)
  return max(counts.get("end", base), counts.get("peak", base)) - base


def tasks_verdict(counts: dict, forbid_threads: bool, device: str):
  """(kind name, reason) for a job whose tasks broke a rule, else None: task creations refused at the
  limit (RESOURCE_LIMIT, any strictness: a fork bomb that shrugs off EAGAIN is still one); under a
  preset that forbids threads, more tasks at once than the runtime's own (THREAD_OR_STREAM, however they
  were created: ``pthread_create`` found by ``dlsym``, ``clone``, ``fork``)."""
  base = counts.get("baseline", 0)
  if counts.get("refused", 0) > 0:
    return (
      "RESOURCE_LIMIT",
      f"the candidate's process tried to start more than its limit of tasks (processes and threads); "
      f"the kernel refused {counts['refused']} of them",
    )
  if not forbid_threads:
    return None
  extra = tasks_beyond_baseline(counts)
  if extra > RUNTIME_TRANSIENT_TASKS.get(device, 0):
    return (
      "THREAD_OR_STREAM",
      f"the candidate started threads or processes: {extra} beyond the {base} tasks its process's "
      "runtime held when the job began (the kernel's count)",
    )
  return None
