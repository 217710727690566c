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
import stat
import struct
import threading
import time

# include/uapi/linux/perf_event.h
PERF_TYPE_SOFTWARE = 1
PERF_COUNT_SW_CPU_CLOCK = 0
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
# a mapping that reaches past what its file holds (ModuleTable.module_of)
FORGED = "[forged mapping of {}]"

_SAMPLE = struct.Struct("<QIIQ")  # ip, pid, tid, time (after the 8-byte header)
_HEADER = struct.Struct("<IHH")


class SamplerUnavailable(RuntimeError):
  """This host refuses to sample another process (``perf_event_paranoid``, no perf support, limits)."""


def event_attr(period_ns: int) -> bytes:
  """A ``perf_event_attr`` (``PERF_ATTR_SIZE`` bytes) for user-space instruction-pointer samples every
  ``period_ns`` of a task's CPU time, inherited by its children, with mmap/fork/exec records."""
  flags = 0
  for bit in (
    _INHERIT,
    _EXCLUDE_KERNEL,
    _EXCLUDE_HV,
    _MMAP,
    _COMM,
    _TASK,
    _SAMPLE_ID_ALL,
    _MMAP2,
    _COMM_EXEC,
    _USE_CLOCKID,
  ):
    flags |= 1 << bit
  attr = bytearray(PERF_ATTR_SIZE)
  struct.pack_into(
    "<IIQQQQQ",
    attr,
    0,
    PERF_TYPE_SOFTWARE,
    PERF_ATTR_SIZE,
    PERF_COUNT_SW_CPU_CLOCK,
    period_ns,
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
  time: int
  pid: int
  parent: int


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
    return Fork(t, pid, ppid) if kind == PERF_RECORD_FORK else Exit(t, pid, tid)
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


class ModuleTable:
  """Samples attributed to modules as they arrive: per process an ``AddressSpace``, per sample
  (time, module id) in arrival order (each drain's records sorted by time)."""

  def __init__(self):
    self.names: list[str] = []
    self.ids: dict[str, int] = {}
    self.spaces: dict[int, AddressSpace] = {}
    self.times = array.array("q")
    self.modules = array.array("i")
    self.lost = 0
    self.layouts: dict[str, tuple] = {}  # path -> file_layout, read once per path
    self.load_base: dict[tuple[int, str], int] = {}  # (pid, path) -> its loader's base there
    self.file_code: dict[int, CodeHistory] = {}  # pid -> the ranges files' code held there
    self.forged: list[Mapping] = []
    self.forgery: list[str] = []  # why, one per ``forged``
    self.mappings: dict[int, int] = {}  # pid -> executable mappings recorded (``MAX_MAPPINGS``)

  @property
  def extents(self) -> dict[str, int | None]:
    return {path: layout[0] for path, layout in self.layouts.items()}

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
    if segments:
      at = loader_offset(segments, rec.pgoff)
      if at is None:
        return "maps code from a segment its loader maps without execute permission"
      base = self.load_base.setdefault((rec.pid, rec.path), rec.start - at)
      if base != rec.start - at:
        return "a second copy of the file's code at another base"
    history = self.file_code.get(rec.pid)
    other = history.others(rec.start, rec.end, self.ids.get(rec.path, -1)) if history else None
    if other is not None:
      return f"lies over the code of {os.path.basename(self.names[other])}"
    return ""

  def _held_file_code(self, pid: int, start: int, end: int, module: int) -> None:
    if self.names[module].startswith("/"):
      self.file_code.setdefault(pid, CodeHistory()).add(start, end, module)

  def module_id(self, path: str) -> int:
    if path not in self.ids:
      self.ids[path] = len(self.names)
      self.names.append(path)
    return self.ids[path]

  def seed(self, pid: int, maps_text: str) -> None:
    """A process's mappings before the first record (read from /proc before candidate code ran)."""
    space = self.spaces.setdefault(pid, AddressSpace())
    for s, e, path in executable_ranges(maps_text):
      space.add(s, e, self.module_id(path))
      self._held_file_code(pid, s, e, self.module_id(path))

  def apply(self, rec) -> None:
    if isinstance(rec, Sample):
      if self.mappings.get(rec.pid, 0) > MAX_MAPPINGS:
        self._add(rec.time, self.module_id(OVERFLOW))
        return
      space = self.spaces.get(rec.pid)
      m = space.find(rec.ip) if space is not None else -1
      self._add(rec.time, m if m >= 0 else self.module_id(UNKNOWN))
    elif isinstance(rec, Mapping):
      self.mappings[rec.pid] = n = self.mappings.get(rec.pid, 0) + 1
      if n > MAX_MAPPINGS:
        if n == MAX_MAPPINGS + 1:
          self.forged.append(rec)
          self.forgery.append(f"more than {MAX_MAPPINGS} executable mappings in one process")
        return
      module = self.module_id(self.module_of(rec))
      self.spaces.setdefault(rec.pid, AddressSpace()).add(rec.start, rec.end, module)
      self._held_file_code(rec.pid, rec.start, rec.end, module)
    elif isinstance(rec, Fork):
      if rec.pid != rec.parent and rec.parent in self.spaces:
        self.spaces[rec.pid] = self.spaces[rec.parent].copy()
        for (pid, path), base in list(self.load_base.items()):
          if pid == rec.parent:
            self.load_base[(rec.pid, path)] = base
        if rec.parent in self.file_code:
          self.file_code[rec.pid] = self.file_code[rec.parent].copy()
        self.mappings[rec.pid] = self.mappings.get(rec.parent, 0)
    elif isinstance(rec, Exec):
      self.spaces[rec.pid] = AddressSpace()
      for key in [k for k in self.load_base if k[0] == rec.pid]:
        del self.load_base[key]
      self.file_code.pop(rec.pid, None)
    elif isinstance(rec, Lost) and rec.count:
      self.lost += rec.count
      lost = self.module_id(LOST)
      for _ in range(min(rec.count, 1 << 20)):
        self._add(rec.time, lost)

  def _add(self, t: int, module: int) -> None:
    if self.times and t < self.times[-1]:  # out of order across drains: keep the list sorted
      i = bisect.bisect_right(self.times, t)
      self.times.insert(i, t)
      self.modules.insert(i, module)
    else:
      self.times.append(t)
      self.modules.append(module)

  def count(self, t0: int, t1: int) -> dict[str, int]:
    """Samples per module name stamped in [t0, t1]."""
    lo, hi = bisect.bisect_left(self.times, t0), bisect.bisect_right(self.times, t1)
    out: dict[str, int] = {}
    for m in self.modules[lo:hi]:
      name = self.names[m]
      out[name] = out.get(name, 0) + 1
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


class _Ring:
  """One CPU's ring buffer (its first event's mmap; the others on that CPU write into it)."""

  def __init__(self, fd: int):
    self.fd = fd
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

  def read(self) -> bytes:
    head = struct.unpack_from("<Q", self.map, 1024)[0]
    tail = struct.unpack_from("<Q", self.map, 1032)[0]
    if head == tail:
      return b""
    n = min(head - tail, self.size)
    start = PAGE + tail % self.size
    first = min(n, PAGE + self.size - start)
    data = self.map[start : start + first] + self.map[PAGE : PAGE + n - first]
    struct.pack_into("<Q", self.map, 1032, head)
    return data

  def close(self) -> None:
    self.map.close()


class HostSampler:
  """Samples of a process tree's user-space instruction pointers, attributed to modules.

  ``attach(root)`` opens the events (raises ``SamplerUnavailable`` where the host refuses) and starts a
  thread that drains the ring buffers often enough (``DRAIN_FRACTION`` of their time to fill); ``count(t0, t1)`` gives samples per module in a
  window of ``time.monotonic_ns()``; ``close()`` stops everything."""

  def __init__(self, period_ns: int):
    self.period_ns = period_ns
    self.table = ModuleTable()
    self.fds: list[int] = []
    self.rings: list[_Ring] = []
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

  def _open(self, root: int) -> None:
    attr = event_attr(self.period_ns)
    cpus = online_cpus()
    owner: dict[int, int] = {}  # cpu -> the fd holding its ring buffer
    seen: set[int] = set()
    for _ in range(4):  # until no thread appeared meanwhile (the tree runs only our code now)
      tasks = tree_tasks(root)
      new = [(pid, tid) for pid, tids in tasks.items() for tid in tids if tid not in seen]
      if not new:
        break
      for pid, tid in new:
        for cpu in cpus:
          try:
            fd = _perf_event_open(attr, tid, cpu)
          except OSError as e:
            if e.errno == 3 or e.errno == 2:  # ESRCH/ENOENT: the thread ended meanwhile
              break
            raise SamplerUnavailable(f"perf_event_open: {e.strerror} (errno {e.errno})") from None
          self.fds.append(fd)
          if cpu in owner:
            if _libc.ioctl(fd, PERF_EVENT_IOC_SET_OUTPUT, owner[cpu]) != 0:
              e = ctypes.get_errno()
              raise SamplerUnavailable(f"PERF_EVENT_IOC_SET_OUTPUT: {os.strerror(e)}")
          else:
            try:
              self.rings.append(_Ring(fd))
            except OSError as e:
              raise SamplerUnavailable(f"mapping a perf ring buffer: {e}") from None
            owner[cpu] = fd
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
    fill_s = min(r.size for r in self.rings) / 40 * self.period_ns / 1e9
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
        for raw in split_records(ring.read()):
          rec = parse_record(raw)
          if rec is not None:
            self.pending.append(rec)
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
