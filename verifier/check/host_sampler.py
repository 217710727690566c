"""Where a process tree's CPU time goes, sampled from outside it (Linux ``perf_event_open``).

The checker attaches this to the candidate's worker before any candidate code runs: one software
``cpu-clock`` event per (thread, CPU), inherited by every thread and process the tree creates later, each
sample the user-space instruction pointer of the thread that was running, stamped on ``CLOCK_MONOTONIC``
(the checker's clock). The kernel also reports every executable mapping the tree makes (``MMAP2``:
address range and file), every fork and exec, so an instruction pointer is attributed to the module that
was mapped there at that moment, from records the candidate cannot write. The candidate's process holds
none of this: it may not call ``perf_event_open`` nor switch off events attached to it
(``PR_TASK_PERF_EVENTS_DISABLE``; both refused by its seccomp filter, ``confine.protect_evidence``), nor
``mremap`` pages (which makes no record); a mapping no loader makes (past its file's end, code from a
segment the loader maps without execute permission, a second base, a mapping over code another file held
there) is taken for the forgery it is (``ModuleTable.forgery_of``).

Kernel-mode time is not sampled (``exclude_kernel``; unprivileged sampling of another process allows
user space only), nor a process outside the tree. ``host_evidence`` judges the samples.
"""

from __future__ import annotations

import array
import bisect
import ctypes
import dataclasses
import mmap
import os
import platform
import resource
import stat
import struct
import threading
import time

# include/uapi/linux/perf_event.h
PERF_TYPE_SOFTWARE = 1
PERF_COUNT_SW_CPU_CLOCK, PERF_COUNT_SW_DUMMY = 0, 9
PERF_SAMPLE_IP, PERF_SAMPLE_TID, PERF_SAMPLE_TIME = 1, 2, 4
PERF_RECORD_MMAP, PERF_RECORD_LOST, PERF_RECORD_COMM, PERF_RECORD_EXIT = 1, 2, 3, 4
PERF_RECORD_THROTTLE, PERF_RECORD_FORK, PERF_RECORD_SAMPLE, PERF_RECORD_MMAP2 = 5, 7, 9, 10
PERF_RECORD_LOST_SAMPLES = 13
PERF_RECORD_MISC_COMM_EXEC = 1 << 13
PERF_FLAG_FD_CLOEXEC = 8
PERF_EVENT_IOC_SET_OUTPUT = 0x2405
PERF_ATTR_SIZE = 112  # PERF_ATTR_SIZE_VER5: every field used here, accepted by kernels >= 4.1
CLOCK_MONOTONIC = 1
# attr flag bits
_DISABLED, _INHERIT, _EXCLUDE_KERNEL, _EXCLUDE_HV, _MMAP, _COMM, _TASK = 0, 1, 5, 6, 8, 9, 13
_SAMPLE_ID_ALL, _MMAP2, _COMM_EXEC, _USE_CLOCKID = 18, 23, 24, 25
SYS_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}

PAGE = mmap.PAGESIZE
# Ring buffer per CPU, in pages, largest first: 1 MiB hold ~2.6 s of one busy CPU's samples, 256 KiB ~0.6 s,
# 64 KiB ~0.15 s (a host's locked-memory limit for perf buffers, perf_event_mlock_kb per CPU and user, may
# allow only the smaller). Drained every DRAIN_FRACTION of that; samples the kernel dropped count against
# the candidate, so the largest buffer the host allows: on a loaded 2-core host the draining thread can
# wait longer than 0.15 s for a CPU.
DATA_PAGES = (256, 64, 16)
DRAIN_FRACTION = 0.1
CUT_MARGIN_NS = 2_000_000  # records stamped this close to a drain may still be in flight
DEFAULT_PERIOD_NS = 100_000  # 10 kHz of CPU time per busy thread
ANON = "[anonymous executable memory]"
UNKNOWN = "[unmapped]"
# Executable mappings one process may make before its code is no longer told apart: every later sample of
# it counts for OVERFLOW, a foreign module (red team 45: 2.4M short-lived executable mappings kept the
# checker busy for minutes; an honest worker makes a few hundred).
MAX_MAPPINGS = 16384
OVERFLOW = "[code of a process past the executable-mapping cap]"
LOST = "[lost samples]"
# every sample once mapping records may have been dropped (a full side-band ring: ``HostSampler.drain``)
BLIND = "[code run after a mapping record was lost]"
# a mapping that reaches past what its file holds (ModuleTable.module_of)
FORGED = "[forged mapping of {}]"

# the longest side-band record (an MMAP2 record of a PATH_MAX name and its trailer: 4,184 bytes), rounded up
SIDE_RECORD_MAX = 8192

_SAMPLE = struct.Struct("<QIIQ")  # ip, pid, tid, time (after the 8-byte header)
_HEADER = struct.Struct("<IHH")


class SamplerUnavailable(RuntimeError):
  """This host refuses to sample another process (``perf_event_paranoid``, no perf support, limits)."""


def event_attr(period_ns: int, side: bool = False) -> bytes:
  """A ``perf_event_attr`` (``PERF_ATTR_SIZE`` bytes), inherited by the task's children, on the checker's
  clock: user-space instruction-pointer samples every ``period_ns`` of a task's CPU time or, ``side``, a
  dummy event that samples nothing and carries the side-band records (executable mappings, forks,
  exits, execs, names) to a ring of their own (``HostSampler``)."""
  flags = 0
  bits = [_INHERIT, _EXCLUDE_KERNEL, _EXCLUDE_HV, _SAMPLE_ID_ALL, _USE_CLOCKID]
  if side:
    bits += [_MMAP, _COMM, _TASK, _MMAP2, _COMM_EXEC]
  for bit in bits:
    flags |= 1 << bit
  attr = bytearray(PERF_ATTR_SIZE)
  struct.pack_into(
    "<IIQQQQQ",
    attr,
    0,
    PERF_TYPE_SOFTWARE,
    PERF_ATTR_SIZE,
    PERF_COUNT_SW_DUMMY if side else PERF_COUNT_SW_CPU_CLOCK,
    1 if side else period_ns,
    PERF_SAMPLE_IP | PERF_SAMPLE_TID | PERF_SAMPLE_TIME,
    0,
    flags,
  )
  struct.pack_into("<i", attr, 92, CLOCK_MONOTONIC)  # clockid
  return bytes(attr)


# ---- records ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Sample:
  time: int
  pid: int
  ip: int


@dataclasses.dataclass(frozen=True)
class Mapping:
  """An executable mapping a process made (``MMAP``/``MMAP2``): ``path`` is the file, or ``ANON``;
  ``pgoff``: the file offset mapped at ``start``."""

  time: int
  pid: int
  start: int
  end: int
  path: str
  pgoff: int = 0


@dataclasses.dataclass(frozen=True)
class Fork:
  """A task created: a process (``pid != parent``) or a thread of ``pid`` (``tid``: the new task)."""

  time: int
  pid: int
  parent: int
  tid: int = 0


@dataclasses.dataclass(frozen=True)
class Exec:
  time: int
  pid: int


@dataclasses.dataclass(frozen=True)
class Exit:
  time: int
  pid: int
  tid: int


@dataclasses.dataclass(frozen=True)
class Lost:
  """Samples the kernel dropped (a full buffer) or throttled (``count`` 0: a throttle mark)."""

  time: int
  count: int


def _trailer_time(rec: bytes) -> int:
  """The sample_id trailer's time (``sample_id_all`` with TID|TIME: pid, tid, time at the end)."""
  return struct.unpack_from("<Q", rec, len(rec) - 8)[0]


def _path(raw: bytes) -> str:
  name = raw.split(b"\0", 1)[0].decode(errors="replace")
  if not name or name.startswith("//anon") or name == "[heap]" or name.startswith("[stack"):
    return ANON
  return name


def parse_record(rec: bytes):
  """One ring-buffer record (header included) as a record object, or None for kinds not used here."""
  kind, misc, size = _HEADER.unpack_from(rec, 0)
  if kind == PERF_RECORD_SAMPLE:
    ip, pid, _tid, t = _SAMPLE.unpack_from(rec, 8)
    return Sample(t, pid, ip)
  if kind == PERF_RECORD_MMAP2:
    pid, _tid, addr, length, pgoff = struct.unpack_from("<IIQQQ", rec, 8)
    return Mapping(_trailer_time(rec), pid, addr, addr + length, _path(rec[72 : size - 16]), pgoff)
  if kind == PERF_RECORD_MMAP:
    pid, _tid, addr, length, pgoff = struct.unpack_from("<IIQQQ", rec, 8)
    return Mapping(_trailer_time(rec), pid, addr, addr + length, _path(rec[40 : size - 16]), pgoff)
  if kind in (PERF_RECORD_FORK, PERF_RECORD_EXIT):
    pid, ppid, tid, _ptid, t = struct.unpack_from("<IIIIQ", rec, 8)
    return Fork(t, pid, ppid, tid) if kind == PERF_RECORD_FORK else Exit(t, pid, tid)
  if kind == PERF_RECORD_COMM and misc & PERF_RECORD_MISC_COMM_EXEC:
    pid = struct.unpack_from("<I", rec, 8)[0]
    return Exec(_trailer_time(rec), pid)
  if kind == PERF_RECORD_LOST:
    return Lost(_trailer_time(rec), struct.unpack_from("<Q", rec, 16)[0])
  if kind == PERF_RECORD_LOST_SAMPLES:
    return Lost(_trailer_time(rec), struct.unpack_from("<Q", rec, 8)[0])
  if kind == PERF_RECORD_THROTTLE:
    return Lost(struct.unpack_from("<Q", rec, 8)[0], 0)
  return None


def split_records(data: bytes) -> list[bytes]:
  """Ring-buffer bytes (whole records) cut into records; a malformed size ends the list."""
  out, pos = [], 0
  while pos + 8 <= len(data):
    size = _HEADER.unpack_from(data, pos)[2]
    if size < 8 or pos + size > len(data):
      break
    out.append(data[pos : pos + size])
    pos += size
  return out


# ---- address spaces -----------------------------------------------------------------------------------
class AddressSpace:
  """The executable mappings of one process: sorted, non-overlapping (start, end, module id); a new
  mapping replaces whatever it overlaps (as ``mmap(MAP_FIXED)`` does)."""

  def __init__(self, ranges=()):
    self.starts: list[int] = []
    self.ranges: list[tuple[int, int, int]] = []
    for r in ranges:
      self.add(*r)

  def copy(self) -> "AddressSpace":
    new = AddressSpace()
    new.starts, new.ranges = list(self.starts), list(self.ranges)
    return new

  def add(self, start: int, end: int, module: int) -> None:
    if end <= start:
      return
    i = bisect.bisect_right(self.starts, start) - 1
    i = max(i, 0)
    kept: list[tuple[int, int, int]] = []
    j = i
    while j < len(self.ranges) and self.ranges[j][0] < end:
      s, e, m = self.ranges[j]
      if e <= start:
        kept.append((s, e, m))
      else:
        if s < start:
          kept.append((s, start, m))
        if e > end:
          kept.append((end, e, m))
      j += 1
    kept.append((start, end, module))
    kept.sort()
    self.ranges[i:j] = kept
    self.starts[i:j] = [r[0] for r in kept]  # not rebuilt whole: red team 45 made 2.4M mappings

  def find(self, ip: int) -> int:
    """The module id mapped at ``ip``, or -1."""
    i = bisect.bisect_right(self.starts, ip) - 1
    if i >= 0:
      s, e, m = self.ranges[i]
      if s <= ip < e:
        return m
    return -1


class CodeHistory:
  """Every range a file's code held in one process, overlays notwithstanding: sorted, disjoint segments
  (start, end, the module ids whose code was there). A query and an insert touch only the segments they
  overlap (a candidate that maps pages in a loop cannot make each record cost the whole history)."""

  def __init__(self):
    self.starts: list[int] = []
    self.segs: list[tuple[int, int, frozenset]] = []

  def copy(self) -> "CodeHistory":
    new = CodeHistory()
    new.starts, new.segs = list(self.starts), list(self.segs)
    return new

  def _first(self, start: int) -> int:
    i = max(bisect.bisect_right(self.starts, start) - 1, 0)
    return i + 1 if i < len(self.segs) and self.segs[i][1] <= start else i

  def others(self, start: int, end: int, module: int) -> int | None:
    """A module other than ``module`` whose code held part of [start, end), or None."""
    j = self._first(start)
    while j < len(self.segs) and self.segs[j][0] < end:
      for m in self.segs[j][2]:
        if m != module:
          return m
      j += 1
    return None

  def add(self, start: int, end: int, module: int) -> None:
    if end <= start:
      return
    i = j = self._first(start)
    pieces, at = [], start
    while j < len(self.segs) and self.segs[j][0] < end:
      s, e, ms = self.segs[j]
      if s < start:
        pieces.append((s, start, ms))
      if at < s:
        pieces.append((at, s, frozenset((module,))))
      pieces.append((max(s, start), min(e, end), ms | {module}))
      if e > end:
        pieces.append((end, e, ms))
      at = e
      j += 1
    if at < end:
      pieces.append((at, end, frozenset((module,))))
    self.segs[i:j] = pieces
    self.starts[i:j] = [p[0] for p in pieces]


def executable_ranges(maps_text: str) -> list[tuple[int, int, str]]:
  """(start, end, path) of each executable mapping in a ``/proc/<pid>/maps`` text."""
  out = []
  for line in maps_text.splitlines():
    parts = line.split(None, 5)
    if len(parts) < 5 or "x" not in parts[1]:
      continue
    lo, _, hi = parts[0].partition("-")
    path = parts[5].strip() if len(parts) > 5 else ""
    if path.endswith(" (deleted)"):
      path = path[: -len(" (deleted)")]
    if not path.startswith("/") and path not in ("[vdso]", "[vsyscall]"):
      path = ANON
    out.append((int(lo, 16), int(hi, 16), path))
  return out


def _pages(n: int) -> int:
  return -(-n // PAGE) * PAGE


@dataclasses.dataclass(frozen=True)
class Segment:
  """A ``PT_LOAD`` program header: file ``offset``, ``vaddr``, ``filesz``, ``memsz``, executable or not."""

  offset: int
  vaddr: int
  filesz: int
  memsz: int
  executable: bool


def file_layout(path: str) -> tuple[int | None, tuple[Segment, ...] | None]:
  """(extent, segments) of the file at ``path``. ``extent``: how far into the file an honest mapping of it
  reaches at most (``pgoff + len``, bytes): its size in whole pages or, for a 64-bit ELF file, the image its
  loader maps in one piece from the first segment's offset (every ``PT_LOAD``, gaps and bss included: glibc
  maps that with the first segment's protection, executable where the linker put code there), whichever is
  larger; None where this process finds no regular file there. ``segments``: its ``PT_LOAD`` headers, None
  for anything but a readable 64-bit little-endian ELF file."""
  try:
    if not stat.S_ISREG(os.stat(path).st_mode):
      return None, None
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
  except OSError:
    return None, None
  try:
    extent = _pages(os.fstat(fd).st_size)
    head = os.pread(fd, 64, 0)
    if len(head) < 64 or head[:6] != b"\x7fELF\x02\x01":  # 64-bit little-endian ELF
      return extent, None
    phoff = struct.unpack_from("<Q", head, 32)[0]
    phentsize, phnum = struct.unpack_from("<HH", head, 54)
    if phentsize != 56:  # Elf64_Phdr
      return extent, None
    table = os.pread(fd, phentsize * phnum, phoff)
    loads = []
    for i in range(len(table) // phentsize):
      kind, flags, offset, vaddr, _, filesz, memsz = struct.unpack_from(
        "<IIQQQQQ", table, i * phentsize
      )
      if kind == 1:  # PT_LOAD
        loads.append(Segment(offset, vaddr, filesz, memsz, bool(flags & 1)))  # PF_X
    if loads:
      first = min(loads, key=lambda g: g.vaddr)
      top = max(g.vaddr + g.memsz for g in loads)
      extent = max(extent, first.offset // PAGE * PAGE + _pages(top - first.vaddr // PAGE * PAGE))
    return extent, tuple(loads)
  # OverflowError: e_phoff >= 2**63 overflows pread's offset (red team 45), no loader's file
  except (OSError, OverflowError):
    return extent, None
  finally:
    os.close(fd)


def file_extent(path: str) -> int | None:
  """``file_layout``'s extent."""
  return file_layout(path)[0]


def loader_offset(segments: tuple[Segment, ...], pgoff: int) -> int | None:
  """Where, from its load base, a loader puts the file offset ``pgoff`` when it maps code: inside an
  executable ``PT_LOAD`` (mapped at ``base + vaddr`` rounded down to a page, from its offset rounded down),
  or None where no executable segment holds that offset (a loader maps it without execute permission)."""
  for g in segments:
    lo = g.offset // PAGE * PAGE
    if g.executable and lo <= pgoff < g.offset + max(g.filesz, 1):
      return g.vaddr // PAGE * PAGE + (pgoff - lo)
  return None


@dataclasses.dataclass
class Process:
  """What one address space holds, for every process that shares it: the executable mappings (``space``),
  each file's loader base (``load_base``), every range a file's code held (``file_code``) and how many
  executable mappings were recorded (``mappings``, capped at ``MAX_MAPPINGS``)."""

  space: AddressSpace = dataclasses.field(default_factory=AddressSpace)
  load_base: dict[str, int] = dataclasses.field(default_factory=dict)
  file_code: CodeHistory = dataclasses.field(default_factory=CodeHistory)
  mappings: int = 0


class ModuleTable:
  """Samples attributed to modules as they arrive: per process a ``Process`` (its address space), per
  sample (time, module id) in arrival order (each drain's records sorted by time).

  A child shares its parent's ``Process`` until it execs: a fork record carries no clone flags, and a
  child made with ``CLONE_VM`` (or ``vfork``) maps into its parent's memory, so each one's mappings are
  the other's (red team 46, A1: a CLONE_VM child kept a stale copy of its parent's space, and OpenBLAS
  loaded over the parent's own code counted as own in the child). For a plain fork this merges two
  spaces that may diverge, which errs against the candidate only: a mapping over code the other held
  there is a forgery. Under ``strict``, the only preset sampled, a candidate starts no process anyway.
  A process's tables go when it exits (red team 46, D3: every fork copied them, and a scan of every
  process's load bases per fork, with nothing freed, kept two checkers busy for minutes).

  ``blind``: from then on the mappings are not known (mapping records may have been dropped): every
  sample stamped since counts for ``BLIND`` (red team 46, L1). ``tasks_peak``: the most tasks (threads and
  processes) created since the attach alive at once (red team 46, T1: the pids cgroup counts tasks alive,
  so a candidate that ended one of its runtime's threads could start one of its own unseen)."""

  def __init__(self):
    self.names: list[str] = []
    self.ids: dict[str, int] = {}
    self.procs: dict[int, Process] = {}
    self.times = array.array("q")
    self.modules = array.array("i")
    self.lost_times = array.array("q")  # one entry per Lost record (``count``: how many it dropped)
    self.lost_counts = array.array("q")
    self.lost = 0
    self.blind_from: int | None = None
    self.created: set[int] = set()  # tids created since the attach, alive
    self.tasks_created = 0
    self.tasks_peak = 0
    self.execs = 0  # programs the tree ran since the attach (``Exec`` records)
    self.layouts: dict[str, tuple] = {}  # path -> file_layout, read once per path
    self.forged: list[Mapping] = []
    self.forgery: list[str] = []  # why, one per ``forged``

  @property
  def extents(self) -> dict[str, int | None]:
    return {path: layout[0] for path, layout in self.layouts.items()}

  def _proc(self, pid: int) -> Process:
    if pid not in self.procs:
      self.procs[pid] = Process()
    return self.procs[pid]

  def module_of(self, rec: Mapping) -> str:
    """The module a mapping's samples count for: its file, unless the mapping is one no loader makes and
    only a forgery wants (``forgery``): then a foreign module named after the forgery, so whatever runs in
    that range counts against the candidate. Paths this process cannot stat (another mount namespace's
    scratch file) are judged by where they are mapped alone."""
    if not rec.path.startswith("/"):
      return rec.path
    why = self.forgery_of(rec)
    if why:
      self.forged.append(rec)
      self.forgery.append(why)
      return FORGED.format(os.path.basename(rec.path))
    return rec.path

  def forgery_of(self, rec: Mapping) -> str:
    """Why an executable mapping of a file is not its loader's, or "". A loader maps a file's code once per
    process, at one base, from its executable segments of an ELF file, into address space no other file's
    code held. Red team 42 (hole B1): the candidate's own build mapped over torch's text and torch's pages
    moved back on top with ``mremap`` (a mapping past the file's end). Red team 43: the own build carried a
    byte copy of libtorch_cpu's text (``.incbin``) and mapped that part of itself, within the file, over
    libtorch's text: same bytes, so torch ran on, and every sample in it counted as the candidate's (over
    code another file held there, also after anonymous memory was mapped over it first, and also when a
    page of the same file mapped into a free gap first had set its base: round 43b). An honest mapping over
    another file's code needs that file unloaded (``dlclose``) and its range reused, which the worker's
    libraries do not do while it runs candidates."""
    if rec.path not in self.layouts:
      self.layouts[rec.path] = file_layout(rec.path)
    extent, segments = self.layouts[rec.path]
    if extent is not None and rec.pgoff + (rec.end - rec.start) > extent:
      return "reaches past the file's end"
    if extent is not None and segments is None:
      return "maps a file no loader loads (not a 64-bit ELF file) as code"
    proc = self._proc(rec.pid)
    if segments:
      at = loader_offset(segments, rec.pgoff)
      if at is None:
        return "maps code from a segment its loader maps without execute permission"
      base = proc.load_base.setdefault(rec.path, rec.start - at)
      if base != rec.start - at:
        return "a second copy of the file's code at another base"
    other = proc.file_code.others(rec.start, rec.end, self.ids.get(rec.path, -1))
    if other is not None:
      return f"lies over the code of {os.path.basename(self.names[other])}"
    return ""

  def _held_file_code(self, proc: Process, start: int, end: int, module: int) -> None:
    if self.names[module].startswith("/"):
      proc.file_code.add(start, end, module)

  def module_id(self, path: str) -> int:
    if path not in self.ids:
      self.ids[path] = len(self.names)
      self.names.append(path)
    return self.ids[path]

  def seed(self, pid: int, maps_text: str) -> None:
    """A process's mappings before the first record (read from /proc before candidate code ran)."""
    proc = self._proc(pid)
    for s, e, path in executable_ranges(maps_text):
      proc.space.add(s, e, self.module_id(path))
      self._held_file_code(proc, s, e, self.module_id(path))

  def blind(self, t: int) -> None:
    """Mapping records stamped from ``t`` on may have been dropped: every sample since counts for
    ``BLIND``, those already attributed too."""
    if self.blind_from is not None and self.blind_from <= t:
      return
    self.blind_from = t
    blind = self.module_id(BLIND)
    for i in range(bisect.bisect_left(self.times, t), len(self.times)):
      self.modules[i] = blind

  def apply(self, rec) -> None:
    if isinstance(rec, Sample):
      proc = self.procs.get(rec.pid)
      if self.blind_from is not None and rec.time >= self.blind_from:
        m = self.module_id(BLIND)
      elif proc is not None and proc.mappings > MAX_MAPPINGS:
        m = self.module_id(OVERFLOW)
      else:
        m = proc.space.find(rec.ip) if proc is not None else -1
      self._add(rec.time, m if m >= 0 else self.module_id(UNKNOWN))
    elif isinstance(rec, Mapping):
      proc = self._proc(rec.pid)
      proc.mappings += 1
      if proc.mappings > MAX_MAPPINGS:
        if proc.mappings == MAX_MAPPINGS + 1:
          self.forged.append(rec)
          self.forgery.append(f"more than {MAX_MAPPINGS} executable mappings in one process")
        return
      module = self.module_id(self.module_of(rec))
      proc.space.add(rec.start, rec.end, module)
      self._held_file_code(proc, rec.start, rec.end, module)
    elif isinstance(rec, Fork):
      self.tasks_created += 1
      self.created.add(rec.tid or rec.pid)
      self.tasks_peak = max(self.tasks_peak, len(self.created))
      if rec.pid != rec.parent and rec.parent in self.procs:
        self.procs[rec.pid] = self.procs[rec.parent]  # shared until it execs (class docstring)
    elif isinstance(rec, Exec):
      self.execs += 1
      self.procs[rec.pid] = Process()
    elif isinstance(rec, Exit):
      self.created.discard(rec.tid)
      if rec.tid == rec.pid:
        self.procs.pop(rec.pid, None)
    elif isinstance(rec, Lost) and rec.count:
      self.lost += rec.count
      i = bisect.bisect_right(self.lost_times, rec.time)
      self.lost_times.insert(i, rec.time)
      self.lost_counts.insert(i, rec.count)

  def _add(self, t: int, module: int) -> None:
    if self.times and t < self.times[-1]:  # out of order across drains: keep the list sorted
      i = bisect.bisect_right(self.times, t)
      self.times.insert(i, t)
      self.modules.insert(i, module)
    else:
      self.times.append(t)
      self.modules.append(module)

  def count(self, t0: int, t1: int) -> dict[str, int]:
    """Samples per module name stamped in [t0, t1], lost ones (``LOST``) included."""
    lo, hi = bisect.bisect_left(self.times, t0), bisect.bisect_right(self.times, t1)
    out: dict[str, int] = {}
    for m in self.modules[lo:hi]:
      name = self.names[m]
      out[name] = out.get(name, 0) + 1
    lo, hi = bisect.bisect_left(self.lost_times, t0), bisect.bisect_right(self.lost_times, t1)
    lost = sum(self.lost_counts[lo:hi])
    if lost:
      out[LOST] = out.get(LOST, 0) + lost
    return out


# ---- the perf events ----------------------------------------------------------------------------------
def online_cpus(text: str | None = None) -> list[int]:
  """CPU numbers from ``/sys/devices/system/cpu/online`` ("0-3,6")."""
  if text is None:
    with open("/sys/devices/system/cpu/online") as f:
      text = f.read()
  cpus = []
  for part in text.strip().split(","):
    if not part:
      continue
    lo, _, hi = part.partition("-")
    cpus += range(int(lo), int(hi or lo) + 1)
  return cpus


def tree_tasks(root: int) -> dict[int, list[int]]:
  """pid -> its thread ids, for ``root`` and its descendants (a worker's PID namespace)."""
  from verifier.sandbox.sandbox import _process_tree

  out = {}
  for pid in _process_tree(root):
    try:
      out[pid] = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
      pass
  return out


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _perf_event_open(attr: bytes, tid: int, cpu: int) -> int:
  nr = SYS_PERF_EVENT_OPEN.get(platform.machine())
  if nr is None:
    raise SamplerUnavailable(f"no perf_event_open number for {platform.machine()}")
  buf = ctypes.create_string_buffer(attr, len(attr))
  fd = _libc.syscall(nr, buf, tid, cpu, -1, PERF_FLAG_FD_CLOEXEC)
  if fd < 0:
    e = ctypes.get_errno()
    raise OSError(e, os.strerror(e))
  return int(fd)


def _room_for_fds(n: int) -> None:
  """Raise this process's soft open-file limit to hold ``n`` descriptors more than it has, where the hard
  limit allows
  (two events per thread and CPU: a 128-CPU host's worker of ten threads needs 2,560, over the usual
  soft limit of 1,024, and an EMFILE would leave the request without host evidence)."""
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  want = len(os.listdir("/proc/self/fd")) + n + 64
  if soft != resource.RLIM_INFINITY and soft < want:
    top = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if top > soft:
      resource.setrlimit(resource.RLIMIT_NOFILE, (top, hard))


class _Ring:
  """One CPU's ring buffer (its first event's mmap; the others on that CPU write into it). ``side``: it
  holds side-band records, so a loss there blinds the table (``HostSampler.drain``); ``samples``: it
  holds samples (a side-band ring shares the samples' where the host allows no second one);
  ``read_ns``: when it was last emptied."""

  def __init__(self, fd: int, side: bool):
    self.fd, self.side, self.samples = fd, side, not side
    self.read_ns = time.monotonic_ns()
    for pages in DATA_PAGES:
      self.size = pages * PAGE
      try:
        self.map = mmap.mmap(
          fd, PAGE + self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
        )
        return
      except OSError:
        if pages == DATA_PAGES[-1]:
          raise

  def read(self) -> tuple[bytes, bool]:
    """The records written since the last read, and whether the ring came close enough to full since
    then that a record may have been dropped (the kernel drops a record that does not fit, and nothing
    frees space between two reads: the fill seen now is the most there was)."""
    head = struct.unpack_from("<Q", self.map, 1024)[0]
    tail = struct.unpack_from("<Q", self.map, 1032)[0]
    if head == tail:
      return b"", False
    n = min(head - tail, self.size)
    start = PAGE + tail % self.size
    first = min(n, PAGE + self.size - start)
    data = self.map[start : start + first] + self.map[PAGE : PAGE + n - first]
    struct.pack_into("<Q", self.map, 1032, head)
    return data, n > self.size - 2 * SIDE_RECORD_MAX

  def close(self) -> None:
    self.map.close()


class HostSampler:
  """Samples of a process tree's user-space instruction pointers, attributed to modules.

  ``attach(root)`` opens the events (raises ``SamplerUnavailable`` where the host refuses) and starts a
  thread that drains the ring buffers often enough (``DRAIN_FRACTION`` of their time to fill); ``count(t0,
  t1)`` gives samples per module in a window of ``time.monotonic_ns()``; ``close()`` stops everything.

  Two events per (thread, CPU), each CPU's of a kind sharing one ring: samples, and the side-band records
  (mappings, forks, exits, execs) on a dummy event. Samples may overflow their ring on a loaded host (what
  is lost counts against the candidate, ``LOST``), but a dropped mapping record would leave the table
  trusting a stale address map: red team 46 (L1) flooded the one shared ring with name records
  (``prctl(PR_SET_NAME)``), so OpenBLAS's mapping record was dropped and its code counted as the
  candidate's own. Only the candidate's own mappings, tasks and names fill the side-band ring (a few
  hundred records for an honest worker, drained every fraction of a second), and a side-band ring seen
  near full blinds the table from the read before (``ModuleTable.blind``). Where the host allows no second
  ring, the side-band records share the samples' ring, and a loss there blinds."""

  def __init__(self, period_ns: int):
    self.period_ns = period_ns
    self.table = ModuleTable()
    self.fds: list[int] = []
    self.rings: list[_Ring] = []
    self.sample_owner: dict[int, int] = {}  # cpu -> the fd holding its samples' ring
    self.pending: list = []
    self.lock = threading.Lock()
    self.stop = threading.Event()
    self.thread: threading.Thread | None = None
    self.error = ""

  @classmethod
  def attach(cls, root: int, period_ns: int = DEFAULT_PERIOD_NS) -> "HostSampler":
    sampler = cls(period_ns)
    try:
      sampler._open(root)
    except BaseException:
      sampler.close()
      raise
    sampler.thread = threading.Thread(target=sampler._run, name="host-sampler", daemon=True)
    sampler.thread.start()
    return sampler

  def _event(self, attr: bytes, tid: int, cpu: int, owner: dict, side: bool) -> bool:
    """Open one event on (``tid``, ``cpu``) writing into ``owner[cpu]``'s ring (its own ring where there is
    none yet); False where the thread ended meanwhile."""
    try:
      fd = _perf_event_open(attr, tid, cpu)
    except OSError as e:
      if e.errno == 3 or e.errno == 2:  # ESRCH/ENOENT: the thread ended meanwhile
        return False
      raise SamplerUnavailable(f"perf_event_open: {e.strerror} (errno {e.errno})") from None
    self.fds.append(fd)
    if cpu not in owner:
      try:
        ring = _Ring(fd, side)
      except OSError as e:
        if not side:
          raise SamplerUnavailable(f"mapping a perf ring buffer: {e}") from None
        owner[cpu] = self.sample_owner[
          cpu
        ]  # no room for a second ring: share the samples' (docstring)
        next(r for r in self.rings if r.fd == owner[cpu]).side = True
      else:
        self.rings.append(ring)
        owner[cpu] = fd
        return True
    if _libc.ioctl(fd, PERF_EVENT_IOC_SET_OUTPUT, owner[cpu]) != 0:
      e = ctypes.get_errno()
      raise SamplerUnavailable(f"PERF_EVENT_IOC_SET_OUTPUT: {os.strerror(e)}")
    return True

  def _open(self, root: int) -> None:
    attrs = (event_attr(self.period_ns), event_attr(self.period_ns, side=True))
    cpus = online_cpus()
    side_owner: dict[int, int] = {}
    seen: set[int] = set()
    for _ in range(4):  # until no thread appeared meanwhile (the tree runs only our code now)
      tasks = tree_tasks(root)
      new = [(pid, tid) for pid, tids in tasks.items() for tid in tids if tid not in seen]
      if not new:
        break
      _room_for_fds(2 * len(cpus) * len(new))
      for pid, tid in new:
        for cpu in cpus:
          if not (
            self._event(attrs[0], tid, cpu, self.sample_owner, False)
            and self._event(attrs[1], tid, cpu, side_owner, True)
          ):
            break
        seen.add(tid)
    if not seen:
      raise SamplerUnavailable(f"no process {root} to sample")
    for pid in tree_tasks(root):  # mappings made before the events existed
      try:
        with open(f"/proc/{pid}/maps") as f:
          self.table.seed(pid, f.read())
      except OSError:
        pass

  def _run(self) -> None:
    # the smallest buffer's time to fill at 1 sample (~40 bytes) per period of one busy thread
    fill_s = min(r.size for r in self.rings if r.samples) / 40
    fill_s *= self.period_ns / 1e9
    while not self.stop.wait(DRAIN_FRACTION * fill_s):
      try:
        self.drain()
      except Exception as e:  # noqa: BLE001 - reported with the evidence, never raised into the check
        self.error = f"{type(e).__name__}: {e}"
        return

  def drain(self, final: bool = False) -> None:
    """Read every ring buffer; apply, in time order, the records stamped before a cut a little in the
    past (later ones may still be in flight on another CPU), or all of them when ``final``."""
    with self.lock:
      cut = time.monotonic_ns() - (0 if final else CUT_MARGIN_NS)
      for ring in self.rings:
        now = time.monotonic_ns()
        data, full = ring.read()
        recs = [r for r in map(parse_record, split_records(data)) if r is not None]
        if ring.side and (full or any(isinstance(r, Lost) and r.count for r in recs)):
          # a mapping record may have been dropped since the last read (class docstring)
          self.table.blind(ring.read_ns - CUT_MARGIN_NS)
        if ring.side and not ring.samples:
          recs = [r for r in recs if not isinstance(r, Lost)]  # side-band records are no samples
        ring.read_ns = now
        self.pending += recs
      self.pending.sort(key=lambda r: r.time)
      k = bisect.bisect_right([r.time for r in self.pending], cut)
      ready, self.pending = self.pending[:k], self.pending[k:]
      for rec in ready:
        self.table.apply(rec)

  def count(self, t0: int, t1: int) -> dict[str, int]:
    """Samples per module in [t0, t1] (``time.monotonic_ns()``); waits for records still in flight."""
    wait = t1 + CUT_MARGIN_NS - time.monotonic_ns()
    if wait > 0:
      time.sleep(wait / 1e9)
    self.drain()
    with self.lock:
      return self.table.count(t0, t1)

  def close(self) -> None:
    self.stop.set()
    if self.thread is not None and self.thread is not threading.current_thread():
      self.thread.join(1.0)
    for ring in self.rings:
      ring.close()
    for fd in self.fds:
      try:
        os.close(fd)
      except OSError:
        pass
    self.rings, self.fds = [], []
