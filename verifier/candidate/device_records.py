"""The device records of a candidate process (GPU): what ran on the device during each request, from
CUPTI (``verifier_cupti.c``), summarised into a ``DeviceRecords`` record for the checker.

The fork server builds and loads the collector (``prepare``) before it forks any worker; a worker starts it
(``Collector.start``) once its CUDA context exists and before any candidate code. It lives in the
candidate's process (CUPTI only records the process it runs in), so the checker never believes it
blindly: every request carries two marker copies of a size the checker drew at random, which must come
back in the records (``device_evidence``), and records that CUPTI dropped make the evidence incomplete.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
import time

from verifier.ipc.records import CopyRun, DeviceRecords, KernelRun

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verifier_cupti.c")
(
  VC_KERNEL,
  VC_MEMCPY,
  VC_MEMSET,
  VC_CONTEXT,
  VC_STREAM,
  VC_GRAPH_LAUNCH,
  VC_MODULE,
  VC_SYMBOL,
  VC_HOST_MEMORY,
) = range(1, 10)
COPY_KINDS = {
  1: "HtoD",
  2: "DtoH",
  3: "HtoA",
  4: "AtoH",
  5: "AtoA",
  6: "AtoD",
  7: "DtoA",
  8: "DtoD",
  9: "HtoH",
  10: "PtoP",
}
MAX_NAME = 512
MAX_RUNS = 2048  # distinct kernel/copy summaries per message; more is reported as truncated
TAKE = 65536
MARKER_WAIT_S = 0.2
# ATen's ``torch.cuda._sleep`` kernel (``at::cuda::(anonymous namespace)::spin_kernel(long)``, or its
# mangled name where demangling failed): the worker's head start (``head_start``)
SPIN_KERNEL = re.compile(r"\bspin_kernel\b|11spin_kernelE")


class Entry(ctypes.Structure):
  """``vc_entry`` (verifier_cupti.c)."""

  _fields_ = [
    ("type", ctypes.c_uint32),
    ("context", ctypes.c_uint32),
    ("stream", ctypes.c_uint32),
    ("copy_kind", ctypes.c_uint32),
    ("start", ctypes.c_uint64),
    ("end", ctypes.c_uint64),
    ("bytes", ctypes.c_uint64),
    ("graph", ctypes.c_uint64),
    ("name", ctypes.c_void_p),
  ]


_LIB: ctypes.CDLL | None = None  # loaded by the fork server, inherited by its workers
_WHY = "the device-record collector was not built"
COLLECTOR: "Collector | None" = None  # this worker's, started by ``start_collector``
SELF_TEST_BYTES = 7


def build(directory: str, cc: str | None = None) -> str:
  """Compile ``verifier_cupti.c`` into ``directory`` (named by its source's hash); returns the path."""
  with open(SOURCE, "rb") as f:
    digest = hashlib.sha256(f.read()).hexdigest()[:16]
  out = os.path.join(directory, f"verifier_cupti_{digest}.so")
  if os.path.exists(out):
    return out
  cc = cc or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"
  tmp = f"{out}.tmp{os.getpid()}"
  cmd = [cc, "-O2", "-shared", "-fPIC", "-o", tmp, SOURCE, "-ldl", "-lpthread"]
  done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
  if done.returncode != 0:
    raise RuntimeError(f"{' '.join(cmd)}: {done.stderr[-1000:]}")
  os.replace(tmp, out)
  return out


def load(path: str) -> ctypes.CDLL:
  lib = ctypes.CDLL(path)
  lib.vc_start.argtypes = [ctypes.c_char_p]
  lib.vc_start.restype = ctypes.c_int
  lib.vc_error.restype = ctypes.c_char_p
  lib.vc_flush.restype = ctypes.c_long
  lib.vc_take.argtypes = [ctypes.POINTER(Entry), ctypes.c_long]
  lib.vc_take.restype = ctypes.c_long
  lib.vc_lost.restype = ctypes.c_uint64
  lib.vc_version.restype = ctypes.c_uint32
  lib.vc_entry_size.restype = ctypes.c_size_t
  lib.vc_record_entry.argtypes = [ctypes.c_void_p, ctypes.POINTER(Entry)]
  lib.vc_record_entry.restype = ctypes.c_int
  lib.vc_stop.restype = ctypes.c_int
  lib.vc_api_entry.argtypes = [
    ctypes.c_int,
    ctypes.c_uint32,
    ctypes.c_void_p,
    ctypes.POINTER(Entry),
  ]
  lib.vc_api_entry.restype = ctypes.c_int
  lib.vc_cubin_functions.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint64]
  lib.vc_cubin_functions.restype = ctypes.c_long
  if lib.vc_entry_size() != ctypes.sizeof(Entry):
    raise RuntimeError("verifier_cupti entry size does not match device_records.Entry")
  return lib


def prepare(directory: str) -> str:
  """In the fork server, before any fork: build and load the collector. Returns "" or why not."""
  global _LIB, _WHY
  try:
    _LIB = load(build(directory))
    _WHY = ""
  except Exception as e:  # noqa: BLE001 - workers then fall back to the in-process profiler
    _LIB, _WHY = None, f"device-record collector not built: {type(e).__name__}: {str(e)[:500]}"
  return _WHY


def start_collector() -> str:
  """In a GPU worker, once its CUDA context exists and before any candidate code: start recording and
  check that a kernel and a device-to-device copy of the verifier's own come back. Returns "" or why
  not (then the collector is stopped, so the in-process profiler can take CUPTI)."""
  global COLLECTOR
  import torch

  COLLECTOR = Collector()
  why = COLLECTOR.start()
  if why:
    return why
  try:
    x = torch.ones(16, device="cuda")
    y = x + 1
    buf = torch.zeros(2 * SELF_TEST_BYTES, dtype=torch.uint8, device="cuda")
    buf[SELF_TEST_BYTES:].copy_(buf[:SELF_TEST_BYTES])
    torch.cuda.synchronize()
    got = COLLECTOR.take(-2, SELF_TEST_BYTES)
    del x, y, buf
  except Exception as e:  # noqa: BLE001
    got, why = None, f"self-test raised {type(e).__name__}: {e}"
  if got is not None:
    copies = [c for c in got.copies if c.kind == "DtoD" and c.bytes == SELF_TEST_BYTES]
    if not got.kernels or not copies:
      why = (
        f"self-test: {len(got.kernels)} kernel run(s), {len(copies)} marker copy run(s) recorded "
        f"(CUPTI {COLLECTOR.lib.vc_version()})"
      )
  if why:
    COLLECTOR.stop(why)
  return why


def cupti_paths() -> list[str]:
  """Where libcupti may be (torch's CUDA wheels, then the toolkit)."""
  import torch

  lib = os.path.dirname(torch.__file__)
  site = os.path.dirname(lib)
  home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
  found = []
  for d in (
    os.path.join(site, "nvidia", "cu13", "lib"),
    os.path.join(site, "nvidia", "cuda_cupti", "lib"),
    os.path.join(home, "extras", "CUPTI", "lib64"),
    os.path.join(home, "lib64"),
    os.path.join(home, "lib"),
  ):
    for name in ("libcupti.so.13", "libcupti.so"):
      if os.path.exists(os.path.join(d, name)):
        found.append(os.path.join(d, name))
  return found


def demangle(name: str) -> str:
  """A C++ symbol demangled (``__cxa_demangle``), or the name itself. Runs in the candidate's process:
  its names are its own input."""
  if not name.startswith("_Z"):
    return name
  try:
    lib = ctypes.CDLL("libstdc++.so.6")
    fn = lib.__cxa_demangle
  except (OSError, AttributeError):
    return name
  fn.restype = ctypes.c_void_p
  fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
  status = ctypes.c_int(1)
  ptr = fn(name.encode(), None, None, ctypes.byref(status))
  if not ptr or status.value != 0:
    return name
  try:
    return ctypes.string_at(ptr).decode(errors="replace")
  finally:
    ctypes.CDLL(None).free(ctypes.c_void_p(ptr))


class Collector:
  """The running collector of this process: ``start`` once, then ``take(call)`` after each request."""

  def __init__(self):
    self.lib = _LIB
    self.error = _WHY
    self.names: dict[int, tuple[str, str]] = {}  # CUPTI's name pointer -> (as recorded, demangled)
    self.defined: dict[str, set[int]] = {}  # a function name -> the loaded modules that define it
    self.buf = (Entry * TAKE)()
    self.lost_seen = 0

  def start(self) -> str:
    """Start recording; returns "" or why not (then the worker uses the in-process profiler)."""
    if self.lib is None:
      return self.error
    paths = cupti_paths()
    rc = self.lib.vc_start((paths[0] if paths else "").encode())
    if rc != 0:
      self.error = self.lib.vc_error().decode(errors="replace")
      self.lib = None
    return self.error

  def stop(self, why: str) -> None:
    if self.lib is not None:
      self.lib.vc_stop()
    self.lib, self.error = None, why

  @property
  def active(self) -> bool:
    return self.lib is not None

  def entries(self) -> list[Entry]:
    """Everything recorded since the last call (a forced flush first)."""
    out: list[Entry] = []
    if self.lib.vc_flush() < 0:
      raise RuntimeError(self.lib.vc_error().decode(errors="replace"))
    while True:
      n = self.lib.vc_take(self.buf, TAKE)
      out += [Entry.from_buffer_copy(self.buf[i]) for i in range(n)]
      if n < TAKE:
        return out

  def take(
    self,
    call: int,
    marker: int = 0,
    span_markers: tuple[int, ...] = (),
    forwards: int = 0,
    head: bool = False,
  ) -> DeviceRecords:
    """Everything recorded since the last ``take``; with ``marker``, flushed again (for up to
    ``MARKER_WAIT_S``) until both marker copies of that size are in (CUPTI may still be writing the
    records of finished work), and with ``span_markers`` (pre, post) one of each per forward, whose
    spans come back as ``forward_ns`` (``forward_spans``). ``head``: each pre marker follows the
    worker's head start (``head_starts``), which is left out of the summary (the verifier's own work,
    not a kernel of the candidate's) and opens its forward's window; a head start not found there
    gives no spans."""
    entries = self.entries()
    deadline = time.monotonic() + MARKER_WAIT_S

    def short() -> bool:
      return (
        _markers(entries, marker) < 2
        or any(_markers(entries, n) < forwards for n in span_markers)
        or (head and self._spins(entries) < forwards)
      )

    while marker and short() and time.monotonic() < deadline:
      time.sleep(0.001)
      entries += self.entries()
    for e in entries:
      if e.type == VC_SYMBOL and e.name:
        name = ctypes.string_at(e.name).decode(errors="replace")
        self.defined.setdefault(name, set()).add(int(e.graph))
    lost = int(self.lib.vc_lost())
    heads = ()
    if head and len(span_markers) == 2:
      heads = head_starts(entries, *span_markers, self._name)
    verifiers = {id(h) for h in heads if h is not None}
    judged = [e for e in entries if id(e) not in verifiers]
    records = summarise(judged, call, self._name, lost - self.lost_seen, self._modules)
    self.lost_seen = lost
    if verifiers:
      ns = sum(max(int(h.end) - int(h.start), 0) for h in heads if h is not None)
      records = dataclasses.replace(records, head_ns=ns)
    if len(span_markers) == 2:
      spans = () if head and None in heads else forward_spans(entries, *span_markers, heads or None)
      lead, tail = span_edges(entries, *span_markers) if spans else (0, 0)
      records = dataclasses.replace(records, forward_ns=spans, lead_ns=lead, tail_ns=tail)
    return records

  def _names(self, ptr: int) -> tuple[str, str]:
    if ptr not in self.names:
      raw = ctypes.string_at(ptr).decode(errors="replace") if ptr else "?"
      self.names[ptr] = (raw, demangle(raw[: 4 * MAX_NAME])[:MAX_NAME])
    return self.names[ptr]

  def _name(self, ptr: int) -> str:
    return self._names(ptr)[1]

  def _spins(self, entries) -> int:
    """How many of ``entries`` are ATen's spin kernel (the head starts among them)."""
    return sum(1 for e in entries if e.type == VC_KERNEL and SPIN_KERNEL.search(self._name(e.name)))

  def _modules(self, ptr: int) -> int:
    """How many loaded modules define the kernel CUPTI named at ``ptr``."""
    return len(self.defined.get(self._names(ptr)[0], ()))


def _is_marker(e, nbytes: int) -> bool:
  return e.type == VC_MEMCPY and e.copy_kind == 8 and e.bytes == nbytes


def _markers(entries, nbytes: int) -> int:
  return sum(1 for e in entries if _is_marker(e, nbytes))


def head_starts(entries, pre: int, post: int, name_of) -> tuple:
  """The worker's head start before each forward's pre marker (``head_start``), in order: the kernel
  on the pre marker's context and stream that ends last at or before the marker's start and starts after
  the previous forward's post marker ended, where it is ATen's spin (``SPIN_KERNEL``, named by
  ``name_of``); None for a forward where that kernel is anything else or there is none. Position and
  name both: a spin the candidate launches itself runs inside its forward (before the post marker),
  never right before the next pre marker, so it stays a kernel of the candidate's round trip."""
  pres = sorted((e for e in entries if _is_marker(e, pre)), key=lambda e: int(e.start))
  posts = sorted((e for e in entries if _is_marker(e, post)), key=lambda e: int(e.start))
  kernels = [e for e in entries if e.type == VC_KERNEL]
  heads = []
  for i, m in enumerate(pres):
    after = int(posts[i - 1].end) if 0 < i <= len(posts) else None
    before = [
      e
      for e in kernels
      if (e.context, e.stream) == (m.context, m.stream)
      and int(e.end) <= int(m.start)
      and (after is None or int(e.start) >= after)
    ]
    last = max(before, key=lambda e: int(e.end), default=None)
    heads.append(last if last is not None and SPIN_KERNEL.search(name_of(last.name)) else None)
  return tuple(heads)


def _start(e) -> int:
  return int(e.start)


def _marker_pairs(entries, pre: int, post: int) -> list | None:
  """Each forward's (pre, post) marker copies, in order of start; None unless there are as many of each."""
  befores = sorted((e for e in entries if _is_marker(e, pre)), key=_start)
  afters = sorted((e for e in entries if _is_marker(e, post)), key=_start)
  return list(zip(befores, afters)) if len(befores) == len(afters) else None


def forward_spans(entries, pre: int, post: int, heads=None) -> tuple[int, ...]:
  """Each forward's span on the device clock (ns), in order: from the end of its pre marker copy (a
  device-to-device copy of ``pre`` bytes, made on an idle device, or behind the worker's head start) to
  the start of its post marker (``post`` bytes, enqueued on the same stream right after the call), what
  CUDA events recorded in their places would measure (KernelBench, ``timing.time_calls``); widened by
  the work on any other stream or context that started in the forward's window: from its head start's
  start (``heads``, one per forward, from ``head_starts``; without, its pre marker's start) to the
  next forward's. Such work that started before the pre marker ended (launched while the device spun)
  moves the span's start back to its own start, and such work that ended after the post marker started
  moves its end to that end. () unless the copies pair up: as many of each (and of ``heads``), sorted
  by start, every span inside its pair (pre ends before post starts) and before the next window."""
  pairs = _marker_pairs(entries, pre, post)
  if pairs is None or (heads is not None and len(heads) != len(pairs)):
    return ()
  if heads is not None and any(h is None for h in heads):
    return ()
  opens = [int(h.start) for h in heads] if heads is not None else [int(m.start) for m, _ in pairs]
  work = [e for e in entries if e.type in (VC_KERNEL, VC_MEMCPY, VC_MEMSET)]
  spans = []
  for i, (m, closing) in enumerate(pairs):
    s0, t0, t1 = int(m.start), int(m.end), int(closing.start)
    following = opens[i + 1] if i + 1 < len(pairs) else None
    if t1 < t0 or opens[i] > s0 or (following is not None and following < t1):
      return ()
    home = (m.context, m.stream)
    side = [
      (int(e.start), int(e.end))
      for e in work
      if (e.context, e.stream) != home
      and opens[i] <= int(e.start)
      and (following is None or int(e.start) < following)
    ]
    begin = min([t0, *(a for a, _ in side)])
    spans.append(max([t1, *(b for _, b in side)]) - begin)
  return tuple(spans)


def span_edges(entries, pre: int, post: int) -> tuple[int, int]:
  """A diagnostic of the device clock: over the forwards, the device's idle time at each span's edges on
  the forward's own stream (ns, summed): from the end of its pre marker to the start of the first work
  after it (``lead``: the host's path to the launch, where the head start did not cover it), and from
  the end of the last work to the start of its post marker (``tail``). A forward with no work between
  its markers adds nothing; markers that do not pair up give (0, 0). What a span holds beside its
  kernels' own time (``timing_device_kernel_ms``) is these edges plus the gaps between its kernels."""
  pairs = _marker_pairs(entries, pre, post)
  if pairs is None:
    return 0, 0
  work = [
    e
    for e in entries
    if e.type in (VC_KERNEL, VC_MEMCPY, VC_MEMSET)
    and not (_is_marker(e, pre) or _is_marker(e, post))
  ]
  lead = tail = 0
  for b, a in pairs:
    t0, t1 = int(b.end), int(a.start)
    inside = [
      e
      for e in work
      if (e.context, e.stream) == (b.context, b.stream) and t0 <= int(e.start) and int(e.end) <= t1
    ]
    if inside:
      lead += min(int(e.start) for e in inside) - t0
      tail += t1 - max(int(e.end) for e in inside)
  return lead, tail


def summarise(
  entries, call: int, name_of, lost: int = 0, modules_of=lambda ptr: 0
) -> DeviceRecords:
  """Entries folded into runs: kernels by (name, context, stream, from a graph, how many loaded modules
  define that name), copies and memsets by (kind, bytes, context, stream, from a graph), with counts and
  device nanoseconds; host memory calls counted with the bytes they asked for."""
  kernels: dict[tuple, list[int]] = {}
  copies: dict[tuple, list[int]] = {}
  counts = {VC_CONTEXT: 0, VC_STREAM: 0, VC_GRAPH_LAUNCH: 0, VC_MODULE: 0, VC_HOST_MEMORY: 0}
  host_bytes = 0
  for e in entries:
    ns = max(int(e.end) - int(e.start), 0)
    if e.type == VC_HOST_MEMORY:
      host_bytes += int(e.bytes)
    if e.type == VC_KERNEL:
      key = (name_of(e.name), e.context, e.stream, bool(e.graph), modules_of(e.name))
      run = kernels.setdefault(key, [0, 0])
    elif e.type in (VC_MEMCPY, VC_MEMSET):
      kind = "memset" if e.type == VC_MEMSET else COPY_KINDS.get(e.copy_kind, f"copy{e.copy_kind}")
      run = copies.setdefault((kind, int(e.bytes), e.context, e.stream, bool(e.graph)), [0, 0])
    elif e.type == VC_SYMBOL:
      continue
    else:
      counts[e.type] = counts.get(e.type, 0) + 1
      continue
    run[0] += 1
    run[1] += ns
  truncated = len(kernels) > MAX_RUNS or len(copies) > MAX_RUNS
  return DeviceRecords(
    call=call,
    kernels=tuple(
      KernelRun(n, c, s, g, k, t, m) for (n, c, s, g, m), (k, t) in list(kernels.items())[:MAX_RUNS]
    ),
    copies=tuple(
      CopyRun(kind, b, c, s, g, k, t)
      for (kind, b, c, s, g), (k, t) in list(copies.items())[:MAX_RUNS]
    ),
    contexts_created=counts[VC_CONTEXT],
    streams_created=counts[VC_STREAM],
    graph_launches=counts[VC_GRAPH_LAUNCH],
    modules_loaded=counts[VC_MODULE],
    host_memory_calls=counts[VC_HOST_MEMORY],
    host_memory_bytes=host_bytes,
    lost=lost,
    truncated=truncated,
  )
