"""Who did the work on the GPU, judged per round trip from the device records (``DeviceRecords``: every
kernel, copy and memset CUPTI recorded in the candidate's process, every context and stream created and
graph launched there). Pure functions; the checker collects a ``DeviceWindow`` per round trip.

Rules, in this order (the first that fails decides):
1. EVIDENCE_MISSING: a round trip without records, with records CUPTI dropped, or without the two marker
   copies (device to device, of a size the checker drew for that request) the worker makes before and
   after the forwards: the collector was switched off or its records altered.
2. THREAD_OR_STREAM (when the strictness forbids threads and streams): a CUDA context created after the
   candidate's code started, work in another context than the markers', a CUDA graph launched or work
   from one, work on another stream than the markers'.
3. KERNEL_NOT_LAUNCHED: a round trip whose forwards ran fewer of the candidate's own kernels than there
   were forwards.
4. FOREIGN_KERNELS: in any judged round trip (every one but the first trial, which may pay for lazy
   initialisation, unless it is the only one), device time in kernels not built from the candidate and not allocation/copy/fill
   kernels above ``max_foreign_fraction`` of the kernels' time (copies and memsets do not count): the
   profiler-based rule applied to every call instead of the last trial alone.
5. HOST_COMPUTE (device-buffer transport only): a round trip copying at least ``host_bytes_allowed`` of
   its forwards' inputs from the device to the host, or the load or a round trip allocating or
   registering more than ``host_memory_allowed`` of host memory a kernel can reach (pinned, mapped,
   managed): the inputs went (or could go, with no copy record, through the candidate's own kernels) to
   the host to be computed on there. The copy bound is ``HOST_COPY_FRACTION`` of the inputs, and at least
   the smaller of ``HOST_COPY_BYTES`` and ``HOST_SMALL_SHARE`` of them: most of DICE's RL tasks take under
   64 KiB of inputs (2,263 of its 4,000 end-to-end tasks; 1,148 under 4 KiB), so a fixed 64 KiB let a
   candidate copy every input of those to the host.
The worker's head starts (ATen's spin right before each forward's pre marker, ``head_start``) are the
verifier's own work: the collector leaves them out of ``kernels`` (``device_records.head_starts``: by
place and name; a spin the candidate launches itself is judged like any kernel).
A kernel is the candidate's own when its name names one of the ``__global__`` kernels of its source
(``kernel_names``, as the profiler-based rule did) and no more than one loaded module defines its
(mangled) name: a kernel of the candidate's named exactly like a library's does not make the library's
kernel its own.
"""

from __future__ import annotations

import dataclasses
import re

from verifier.api.contract import FailureKind
from verifier.check.runtime_check import ALLOWED_KERNEL, RuntimeVerdict
from verifier.ipc.records import DeviceRecords

HOST_COPY_BYTES = 64 << 10
HOST_COPY_FRACTION = 0.05
HOST_SMALL_SHARE = 0.5
# Host memory a kernel can reach: at most 1 % of the inputs and 256 bytes (torch's nonzero, under boolean
# indexing and masked_select too, pins a count buffer of a few bytes on first use). More is a channel to
# the host with no copy record: a buffer of 1 % of the inputs takes a hundred kernel-and-sync trips a
# forward to move them, milliseconds of host time, what the host samples see.
HOST_MEMORY_BYTES = 256
HOST_MEMORY_FRACTION = 0.01


def host_bytes_allowed(input_bytes: int) -> float:
  """Bytes a round trip whose forwards take ``input_bytes`` of tensor inputs may copy to the host, or
  allocate there for kernels to reach, before it is HOST_COMPUTE: 5 % of the inputs, and at least the
  smaller of 64 KiB and half of them (a scalar read back, ``.item()``, stays far under it; every input
  of a small task does not)."""
  return max(min(HOST_COPY_BYTES, HOST_SMALL_SHARE * input_bytes), HOST_COPY_FRACTION * input_bytes)


def host_memory_allowed(input_bytes: int) -> float:
  """Bytes of host memory a kernel can reach (pinned, mapped, managed) that a window whose forwards take
  ``input_bytes`` may allocate or register before it is HOST_COMPUTE."""
  return min(HOST_MEMORY_BYTES, HOST_MEMORY_FRACTION * input_bytes)


def _host_compute(r: DeviceRecords, label: str, input_bytes: int, copies: bool = True) -> str:
  """Why ``r`` (of forwards taking ``input_bytes``) sent the work to the host ("" when it did not);
  ``copies``: whether its copies to the host count (not in the load: no forward's inputs exist yet)."""
  allowed = host_bytes_allowed(input_bytes)
  to_host = sum(c.bytes * c.count for c in r.copies if c.kind in TO_HOST) if copies else 0
  if to_host and to_host >= allowed:
    return (
      f"{label}: {to_host} bytes copied from the device to the host during the forward (its inputs "
      f"are {input_bytes} bytes): the work went to the host"
    )
  if r.host_memory_calls and r.host_memory_bytes > host_memory_allowed(input_bytes):
    return (
      f"{label}: {r.host_memory_bytes} bytes of host memory a kernel can reach allocated or "
      f"registered ({r.host_memory_calls} call(s): pinned, mapped or managed; the forwards' inputs are "
      f"{input_bytes} bytes): the work can go to the host without a copy"
    )
  return ""


TO_HOST = ("DtoH", "AtoH")


@dataclasses.dataclass(frozen=True)
class DeviceWindow:
  """One round trip's records (None: none came back) with what the checker knows of it."""

  records: DeviceRecords | None
  label: str  # "trial 1", "timed call 12", ...
  forwards: int  # candidate forwards in it (0: a round trip with no model)
  marker: int  # bytes of its marker copies
  input_bytes: int = 0  # its forwards' tensor inputs
  fraction: bool = True  # counts towards the foreign fraction


def own_patterns(kernel_names) -> list[re.Pattern]:
  return [re.compile(rf"\b{re.escape(k)}\b") for k in kernel_names]


def _missing(w: DeviceWindow) -> str:
  r = w.records
  if r is None:
    return f"{w.label}: no device records came back"
  if r.error:
    return f"{w.label}: the device-record collector failed ({r.error[:200]})"
  if r.lost:
    return f"{w.label}: {r.lost} device records were dropped"
  if r.truncated:
    return f"{w.label}: more distinct kernels and copies than one record carries"
  markers = [c for c in r.copies if c.kind == "DtoD" and c.bytes == w.marker]
  if sum(c.count for c in markers) < 2:
    return (
      f"{w.label}: the marker copies of {w.marker} bytes are missing from the device records (the "
      "collector was switched off or its records altered)"
    )
  return ""


def _home(w: DeviceWindow) -> tuple[int, int]:
  """The context and stream of the window's first marker copy (the verifier's own)."""
  m = next(c for c in w.records.copies if c.kind == "DtoD" and c.bytes == w.marker)
  return m.context, m.stream


def _placement(r: DeviceRecords, label: str, home: tuple[int, int] | None, streams: bool) -> str:
  """Why ``r`` breaks the contexts/streams/graphs rules ("" when it does not)."""
  if r.contexts_created:
    return f"{label}: {r.contexts_created} CUDA context(s) created"
  if r.graph_launches:
    return f"{label}: a CUDA graph was launched"
  for run in (*r.kernels, *r.copies):
    name = getattr(run, "name", "") or f"{run.kind} of {run.bytes} bytes"
    if run.graph:
      return f"{label}: {name[:200]} ran from a CUDA graph"
    if home is None:
      continue
    if run.context != home[0]:
      return f"{label}: {name[:200]} ran in another CUDA context"
    if streams and run.stream != home[1]:
      return (
        f"{label}: {name[:200]} ran on another stream ({run.stream}, the forward's is {home[1]})"
      )
  return ""


def judge_device(
  windows: list[DeviceWindow],
  load: DeviceRecords | None,
  kernel_names,
  max_foreign_fraction: float,
  forbid_threads_streams: bool,
  device_buffers: bool,
) -> RuntimeVerdict:
  """The device verdict over every round trip since the candidate loaded (rules in the module
  docstring); ``load``: the records of its import and ``__init__`` (only contexts and graphs judged)."""
  for w in windows:
    why = _missing(w)
    if why:
      return RuntimeVerdict(FailureKind.EVIDENCE_MISSING, why)
  if forbid_threads_streams:
    if load is not None:
      why = _placement(load, "the candidate's load", None, False)
      if why:
        return RuntimeVerdict(FailureKind.THREAD_OR_STREAM, why)
    for w in windows:
      home = _home(w)
      if w.forwards and _home_streams(w) > 1:
        return RuntimeVerdict(
          FailureKind.THREAD_OR_STREAM, f"{w.label}: the forward left the current stream changed"
        )
      why = _placement(w.records, w.label, home, True)
      if why:
        return RuntimeVerdict(FailureKind.THREAD_OR_STREAM, why)
  patterns = own_patterns(kernel_names)
  if not any(w.fraction for w in windows if w.forwards):  # a single call: judged all the same
    windows = [dataclasses.replace(w, fraction=True) for w in windows]
  own_total = foreign_total = 0
  worst: tuple[float, str, int, int, dict] | None = None
  for w in windows:
    if not w.forwards:
      continue
    own_count = own_ns = foreign_ns = 0
    foreign_by: dict[str, int] = {}
    for k in w.records.kernels:
      if k.modules <= 1 and any(p.search(k.name) for p in patterns):
        own_count += k.count
        own_ns += k.ns
      elif not ALLOWED_KERNEL.search(k.name):
        foreign_ns += k.ns
        foreign_by[k.name] = foreign_by.get(k.name, 0) + k.ns
    if own_count < w.forwards:
      names = ", ".join(kernel_names) or "none found"
      return RuntimeVerdict(
        FailureKind.KERNEL_NOT_LAUNCHED,
        f"{w.label}: {own_count} launch(es) of the candidate's kernels ({names}) for {w.forwards} "
        "forward(s)",
      )
    if not w.fraction:
      continue
    own_total += own_ns
    foreign_total += foreign_ns
    share = foreign_ns / max(own_ns + foreign_ns, 1)
    if worst is None or share > worst[0]:
      worst = (share, w.label, own_ns, foreign_ns, foreign_by)
  if worst is not None and worst[0] > max_foreign_fraction:
    share, label, own_ns, foreign_ns, foreign_by = worst
    top = sorted(foreign_by.items(), key=lambda kv: -kv[1])[:3]
    return RuntimeVerdict(
      FailureKind.FOREIGN_KERNELS,
      f"{label}: {100 * share:.0f}% of GPU time in kernels not built from the candidate "
      f"(allowed {100 * max_foreign_fraction:.0f}% in every call); most: "
      + "; ".join(f"{n[:160]} {t / 1e6:.2f} ms" for n, t in top),
      own_ns / 1e3,
      foreign_ns / 1e3,
    )
  own_ns, foreign_ns = own_total, foreign_total
  if device_buffers:
    per_forward = next((w.input_bytes // w.forwards for w in windows if w.forwards), 0)
    judged = [(load, "the candidate's load", per_forward, False)] if load is not None else []
    judged += [(w.records, w.label, w.input_bytes, True) for w in windows if w.forwards]
    for records, label, input_bytes, copies in judged:
      why = _host_compute(records, label, input_bytes, copies)
      if why:
        return RuntimeVerdict(FailureKind.HOST_COMPUTE, why, own_ns / 1e3, foreign_ns / 1e3)
  return RuntimeVerdict(FailureKind.OK, "", own_ns / 1e3, foreign_ns / 1e3)


def _home_streams(w: DeviceWindow) -> int:
  """How many streams the window's marker copies ran on (two: the forward changed the stream)."""
  return len({c.stream for c in w.records.copies if c.kind == "DtoD" and c.bytes == w.marker})
