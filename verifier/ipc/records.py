"""Typed records exchanged between the service, the pools, the checker and the workers.

Every message on a channel (``channel.py``) is one of the frozen dataclasses below, encoded as JSON with its
type name. Decoding is strict: an unknown type or field, a missing field or a value of the wrong type is a
``RecordError`` naming it. Messages from a candidate process are untrusted input, so nothing here executes
or unpickles anything.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from typing import Any

from verifier.api.contract import FailureKind, Runtime, VerifyOptions

# Exit status of a worker whose own code (not the candidate's) failed: the service retries the job.
INTERNAL_EXIT = 70

# Kinds a candidate may report about itself (anything else it sends is a protocol violation).
SELF_REPORTED_KINDS = frozenset(
  {
    FailureKind.COMPILE_ERROR,
    FailureKind.IMPORT_ERROR,
    FailureKind.MISSING_MODEL_NEW,
    FailureKind.INIT_ERROR,
    FailureKind.RUNTIME_ERROR,
    FailureKind.CUDA_ERROR,
    FailureKind.OUT_OF_MEMORY,
  }
)


class RecordError(ValueError):
  """A message that is not a valid record (names the record and the field)."""


_REGISTRY: dict[str, type] = {}


def record(cls):
  """Register a frozen dataclass as a wire record (its class name is its type tag)."""
  cls = dataclasses.dataclass(frozen=True)(cls)
  _REGISTRY[cls.__name__] = cls
  return cls


def _encode(value: Any) -> Any:
  if dataclasses.is_dataclass(value):
    return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
  if isinstance(value, enum.Enum):
    return value.value
  if isinstance(value, (list, tuple)):
    return [_encode(v) for v in value]
  if isinstance(value, dict):
    return {str(k): _encode(v) for k, v in value.items()}
  return value


def to_wire(rec: Any) -> dict:
  """``{"type": <record name>, "body": {...}}`` for a registered record."""
  name = type(rec).__name__
  if _REGISTRY.get(name) is not type(rec):
    raise RecordError(f"{name} is not a registered record")
  return {"type": name, "body": _encode(rec)}


class _Where:
  """Where a value sits in a record, formatted only when a check fails (building the path of every
  list item eagerly was most of a burst request's decode)."""

  __slots__ = ("parent", "key")

  def __init__(self, parent, key):
    self.parent, self.key = parent, key

  def __str__(self) -> str:
    if isinstance(self.key, int):
      return f"{self.parent}[{self.key}]"
    return f"{self.parent}.{self.key}" if self.parent is not None else str(self.key)

  __format__ = lambda self, spec: format(str(self), spec)  # noqa: E731


@functools.cache
def _shape(hint: Any) -> tuple[Any, tuple]:
  return typing.get_origin(hint), typing.get_args(hint)


def _check(value: Any, hint: Any, where) -> Any:
  if hint is Any:
    return value
  if hint is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise RecordError(f"{where}: expected an integer, got {type(value).__name__}")
    return value
  if hint is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise RecordError(f"{where}: expected a number, got {type(value).__name__}")
    return float(value)
  if hint is str or hint is bool:
    if not isinstance(value, hint):
      raise RecordError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
    return value
  origin, args = _shape(hint)
  if origin in (typing.Union, types.UnionType):
    if value is None and type(None) in args:
      return None
    for option in args:
      try:
        return _check(value, option, where)
      except RecordError:
        pass
    raise RecordError(f"{where}: {value!r:.80} matches none of {hint}")
  if hint is type(None):
    if value is not None:
      raise RecordError(f"{where}: expected null, got {type(value).__name__}")
    return None
  if dataclasses.is_dataclass(hint):
    return _decode_fields(hint, value, where)
  if isinstance(hint, type) and issubclass(hint, enum.Enum):
    try:
      return hint(value)
    except ValueError:
      raise RecordError(f"{where}: {value!r:.80} is not a {hint.__name__}") from None
  if origin in (tuple, list):
    if not isinstance(value, list):
      raise RecordError(f"{where}: expected a list, got {type(value).__name__}")
    item = args[0] if args else Any
    items = [_check(v, item, _Where(where, i)) for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items
  if origin is dict:
    if not isinstance(value, dict):
      raise RecordError(f"{where}: expected an object, got {type(value).__name__}")
    _, vt = args or (str, Any)
    return {str(k): _check(v, vt, _Where(where, str(k))) for k, v in value.items()}
  raise RecordError(f"{where}: unsupported field type {hint}")


@functools.cache
def _schema(cls: type) -> tuple[tuple[dataclasses.Field, ...], dict[str, Any], frozenset[str]]:
  """A record class's fields, resolved type hints and field names, worked out once per class (resolving
  the string annotations took most of a decode: 0.6 ms for a ``ForwardRequest``, inside every timed
  call's round trip)."""
  fields = dataclasses.fields(cls)
  return fields, typing.get_type_hints(cls), frozenset(f.name for f in fields)


def _decode_fields(cls: type, body: Any, where: str):
  if not isinstance(body, dict):
    raise RecordError(f"{where}: expected an object for {cls.__name__}")
  fields, hints, names = _schema(cls)
  unknown = set(body) - names
  if unknown:
    raise RecordError(f"{where}: unknown field(s) {sorted(unknown)} for {cls.__name__}")
  kw = {}
  for f in fields:
    if f.name in body:
      kw[f.name] = _check(body[f.name], hints[f.name], _Where(where, f.name))
    elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
      raise RecordError(f"{where}: {cls.__name__} needs field {f.name!r}")
  try:
    return cls(**kw)
  except (TypeError, ValueError) as e:
    raise RecordError(f"{where}: invalid {cls.__name__}: {e}") from None


def from_wire(msg: Any, *expected: type):
  """Decode ``{"type", "body"}``; with ``expected``, the record must be one of those types."""
  if not isinstance(msg, dict) or set(msg) != {"type", "body"}:
    raise RecordError("a message must be an object with exactly 'type' and 'body'")
  cls = _REGISTRY.get(msg["type"]) if isinstance(msg["type"], str) else None
  if cls is None:
    raise RecordError(f"unknown record type {msg['type']!r:.80}")
  if expected and cls not in expected:
    raise RecordError(f"expected {' or '.join(c.__name__ for c in expected)}, got {cls.__name__}")
  return _decode_fields(cls, msg["body"], cls.__name__)


# ---- values crossing to the candidate ------------------------------------------------------------
@record
class TensorRef:
  """A tensor living in a shared buffer: ``buffer`` id, element type, shape and strides (elements)."""

  buffer: int
  dtype: str
  shape: tuple[int, ...]
  stride: tuple[int, ...]
  offset: int = 0  # in elements


@record
class BufferRef:
  """A shared buffer the receiver maps once (its file descriptor travels with the message)."""

  buffer: int
  nbytes: int
  kind: str  # "memfd" (host shared memory) or "cuda_vmm" (device memory, POSIX fd handle)
  map_bytes: int = 0  # device mappings are whole granules


@record
class Value:
  """One argument or output leaf: a tensor (``tensor``), or plain data (``data``, JSON)."""

  tensor: TensorRef | None = None
  data: Any = None
  kind: str = "data"  # "tensor" | "data" | "list" | "tuple" | "dtype"
  items: tuple[Value, ...] = ()


@record
class OutputSpec:
  """What a forward returned, leaf by leaf, as reported by the candidate process."""

  kind: str  # "tensor" | "data" | "other"
  type_name: str = ""
  dtype: str = ""
  shape: tuple[int, ...] = ()
  device: str = ""
  plain: bool = True  # exactly torch.Tensor (no subclass)
  data: Any = None
  copied: bool = False  # written into the checker's output buffer


# ---- service <-> candidate worker (start-up) ------------------------------------------------------
@record
class WorkerReady:
  """First message of every worker, sent before any job (and any candidate code)."""

  pid: int
  startup_phases: dict[str, float]
  sandbox_notes: tuple[str, ...] = ()
  ready_at: float = 0.0  # CLOCK_MONOTONIC


# ---- checker -> candidate ------------------------------------------------------------------------
@record
class CandidateJob:
  candidate_source: str
  build_root: str
  device: str
  seed: int
  init_args: tuple[Value, ...]
  buffers: tuple[BufferRef, ...]  # buffers for tensor init args (fds attached)
  kernel_names: tuple[str, ...] = ()
  # the first forward's buffers (fds attached after ``buffers``'), mapped while the candidate loads
  prefetch: tuple[BufferRef, ...] = ()
  split_build: bool = True
  use_pch: bool = True
  gpu_memory_fraction: float = 0.0


@record
class ProbeRequest:
  """Before any candidate code runs: map ``probe`` (fd attached) and read ``tensor`` from it."""

  probe: BufferRef
  tensor: TensorRef


@record
class CalibrationModel:
  """Before any candidate code runs: build the task's reference model here (its source, built under
  ``seed`` from ``init_args``; fds for new buffers attached), the workload that calibrated round trips
  (``ForwardRequest.calibrate``) run, so the exchange's cost is measured on the task's own forward."""

  reference_source: str
  seed: int
  init_args: tuple[Value, ...]
  buffers: tuple[BufferRef, ...] = ()


@record
class BurstCall:
  """One more forward of a timed burst (``ForwardRequest.burst``): like the request's own."""

  call: int
  seed: int
  args: tuple[Value, ...]
  outputs: tuple[TensorRef | None, ...]


@record
class ForwardRequest:
  """Run one forward on ``args`` (buffers already filled by the checker) and copy the outputs into ``outputs``;
  then those of ``burst`` in order, back to back, with one answer for all (a timed burst: the checker's clock
  spans them)."""

  call: int  # index of this forward in the candidate's life (lock-step with the reference)
  seed: int
  args: tuple[Value, ...]
  outputs: tuple[TensorRef | None, ...]  # one per expected output leaf (None: not a tensor)
  new_buffers: tuple[BufferRef, ...] = ()  # fds attached, in this order
  profile: bool = False  # collect runtime-check evidence during this forward
  # before the load only: the exchange with the calibration model (``CalibrationModel``), or with none
  # (outputs allocated like a forward's): the checker's measure of what a round trip costs beside the
  # forward itself
  calibrate: bool = False
  null: bool = False  # with ``calibrate``: no model, even when a calibration model is built
  burst: tuple[BurstCall, ...] = ()
  # device records on (GPU): bytes of the two marker copies the worker makes before and after the
  # forwards, drawn by the checker; they must come back in this request's ``DeviceRecords``
  marker: int = 0
  # device records on (GPU): bytes of the marker copies the worker makes right before and right after
  # each forward (pre, post; drawn by the checker, distinct from ``marker``): the device clock's
  # bounds of that forward (``DeviceRecords.forward_ns``)
  span_markers: tuple[int, ...] = ()
  # NaN the outputs after they are copied out (``tensors.poison``), so one the candidate returns again
  # shows NaN: the trials, the re-check and the profiled call. Timed and calibration round trips leave
  # them: their inputs are fresh every call, so a stale output is wrong there anyway, and a level-1
  # task's 4 GB output cost a 4 GB fill a call (a third of its publishing)
  poison: bool = True


@record
class RecordsQuery:
  """Before any candidate code: are device records collected in this process (``RecordsStatus``)?"""


@record
class Shutdown:
  pass


# ---- candidate -> checker ------------------------------------------------------------------------
@record
class ProbeReply:
  value: float
  transport: str  # the transport the candidate could use ("cuda_vmm", "memfd")
  error: str = ""


@record
class RecordsStatus:
  error: str = ""  # why no device records are collected here ("" when they are)
  # the spin before each forward's pre marker (``head_start``), calibrated here before any candidate
  # code: its target in us (0: none) and why there is none
  head_start_us: float = 0.0
  head_start_error: str = ""


@record
class KernelRun:
  """Kernels of one name that ran in one context and stream (from a CUDA graph or not): how many and
  their device nanoseconds (``DeviceRecords``); ``modules``: how many modules loaded since the collector
  started define that (mangled) name (0: none seen, e.g. one loaded before)."""

  name: str
  context: int
  stream: int
  graph: bool
  count: int
  ns: int
  modules: int = 0


@record
class CopyRun:
  """Copies (``kind`` "HtoD", "DtoH", "DtoD", ...) or memsets ("memset") of ``bytes`` each."""

  kind: str
  bytes: int
  context: int
  stream: int
  graph: bool
  count: int
  ns: int


@record
class DeviceRecords:
  """What CUPTI recorded in the candidate's process since the previous ``DeviceRecords``: sent after every
  ``ForwardDone`` (``call``) and after ``Loaded`` (``call`` -1: the load's and ``__init__``'s work).
  Judged by ``device_evidence``; made in the candidate's process, so only what its markers vouch for."""

  call: int
  kernels: tuple[KernelRun, ...] = ()
  copies: tuple[CopyRun, ...] = ()
  contexts_created: int = 0
  streams_created: int = 0
  graph_launches: int = 0
  modules_loaded: int = 0
  # calls that allocated or registered host memory a kernel can read and write (pinned, mapped,
  # registered, managed: cudaHostAlloc, cudaMallocHost, cudaHostRegister, cudaMallocManaged and their
  # driver calls), and the bytes they asked for: where a candidate's own kernels can hand its inputs
  # to the host without a copy record
  host_memory_calls: int = 0
  host_memory_bytes: int = 0
  lost: int = 0  # records CUPTI dropped or the collector could not keep
  truncated: bool = False  # more distinct runs than one message carries
  error: str = ""  # the collector failed while flushing
  # each forward's span on the device clock, in order (ns): the start of its post marker copy less the
  # end of its pre marker copy (``ForwardRequest.span_markers``); () where they do not pair up
  forward_ns: tuple[int, ...] = ()
  # the device time (ns) of the worker's head starts before the pre markers (``head_start``), left out
  # of ``kernels`` (the verifier's own spins)
  head_ns: int = 0
  # a diagnostic of the spans, summed over the forwards (``device_records.span_edges``): the device idle
  # on the forward's stream between its pre marker and its first work, and between its last work and
  # its post marker (ns)
  lead_ns: int = 0
  tail_ns: int = 0


@record
class CalibrationReady:
  error: str = ""  # why the reference could not be built here ("" when it was)


@record
class CandidateFailure:
  """The candidate failed in its own process (it can only report this against itself)."""

  kind: FailureKind
  reason: str


@record
class CandidateStarting:
  """The candidate process's last word before it runs candidate code (everything before is the
  runtime's own work; a failure after it is the candidate's)."""


@record
class Loaded:
  build_events: tuple[dict[str, Any], ...]
  load_s: float
  build_cached: bool
  device_name: str = ""
  # how long the load waited for the prefetched buffers' mapping after it ended
  map_wait_s: float = 0.0


@record
class ProfileEvidence:
  """Raw runtime-check evidence from one profiled forward (judged in the checker)."""

  extension_calls: int
  gpu_kernels: dict[str, float]  # kernel name -> device microseconds
  aten_ops: tuple[str, ...]
  profiler_error: str = ""


# Largest marker copy (``ForwardRequest.marker``) the checker draws, in bytes.
MARKER_MAX_BYTES = 4096

# The candidate's split of its exchange work (``ForwardDone.parts_s``), reported as exchange_rt_<part>.
CANDIDATE_EXCHANGE_PARTS = ("map", "stage_in", "publish")


@record
class ForwardDone:
  call: int
  outputs: tuple[OutputSpec, ...]
  evidence: ProfileEvidence | None = None
  wall_s: float = 0.0  # the forward alone (call + synchronize), on the candidate's clock
  # the exchange work around it there, by CANDIDATE_EXCHANGE_PARTS
  parts_s: dict[str, float] = dataclasses.field(default_factory=dict)
  # perf_counter when the request was read and when this answer was made (diagnostics of the
  # wake-ups on either side; the host has one monotonic clock)
  received_at: float = 0.0
  replying_at: float = 0.0
  burst_outputs: tuple[tuple[OutputSpec, ...], ...] = ()  # one per ``ForwardRequest.burst`` call


# ---- service <-> checker -------------------------------------------------------------------------
@record
class TimingCalibration:
  """What a timed call's round trip costs beside the candidate's forward, for one task, measured before
  any candidate code existed (the service keeps it with the baseline; ``checker.Check._calibrate``):
  ``null_ms``, the round trip with no model, and ``excess_ms``, what the reference's round trip (in a
  candidate process, before its candidate loaded) adds over its paired null beyond the reference's own
  time in process (``source`` "reference"; 0 with ``source`` "null" where the reference cannot run
  there)."""

  null_ms: float
  excess_ms: float
  source: str  # "reference" | "null"
  reference_exchange_ms: float = 0.0  # median reference round trip through the exchange
  reference_in_process_ms: float = 0.0  # median reference call timed in process (CUDA events)
  calls: int = 0  # pairs behind the medians
  # forwards per round trip it was measured with (``null_ms`` is one such round trip; ``excess_ms`` and
  # the reference's times are per forward)
  burst_calls: int = 1
  clock: str = "wall"  # its times: "wall" (perf_counter) or "cpu" (the candidate's CPU time)
  null_spread_ms: float = 0.0  # interquartile range of its null round trips (the later half)


@record
class RunJob:
  job_id: str
  reference_source: str
  candidate_source: str
  options: VerifyOptions
  build_root: str
  kernel_names: tuple[str, ...] = ()
  baseline: Runtime | None = None  # reference timing measured earlier (service cache)
  calibration: TimingCalibration | None = None  # measured with that baseline (service cache)
  split_build: bool = True
  use_pch: bool = True
  gpu_memory_fraction: float = 0.0
  # where the checker reads the candidate's CPU time on the CPU backend (``verifier.check.cpu_clock``;
  # "" for the wall clock)
  cpu_clock: str = ""
  # the candidate worker's sandbox (PID 1 of its namespace, as the service sees it): the checker samples
  # the process tree under it (host_sampler); 0: not known
  worker_pid: int = 0


@record
class Stage:
  """Progress of the checker on a job: where it is (``reference``, ``candidate``, ``timing``)."""

  job_id: str
  name: str


@record
class CheckReport:
  """The checker's verdict. ``candidate_gone``: the candidate's channel closed mid-check (the service
  decides whose fault that was from how the process ended and whether ``candidate_started``)."""

  job_id: str
  kind: FailureKind
  reason: str = ""
  compiled: bool = False
  correct: bool = False
  strict_correct: bool = False
  max_abs_diff: float = 0.0
  candidate: Runtime | None = None
  baseline: Runtime | None = None
  baseline_measured: bool = False
  calibration: TimingCalibration | None = None
  calibration_measured: bool = False
  speedup: float = 0.0
  ref_peak_bytes: int = 0
  gpu_total_bytes: int = 0
  device_name: str = ""
  build_cached: bool = False
  stage: str = ""
  candidate_gone: bool = False
  candidate_started: bool = False  # the candidate said it starts its code (CandidateStarting)
  infrastructure: bool = False  # the checker's own device or process failed (not the candidate)
  device_oom: bool = (
    False  # a device ran out of memory (maybe a shared GPU over-committed: re-run alone)
  )
  reference_stateful: bool = False
  transport: str = ""
  phases: dict[str, float] = dataclasses.field(default_factory=dict)
  warnings: tuple[str, ...] = ()


# ---- service <-> build worker --------------------------------------------------------------------
@record
class BuildJob:
  reference_source: str
  candidate_source: str
  build_root: str
  seed: int
  split_build: bool = True
  use_pch: bool = True
  pch_request: dict[str, Any] | None = None  # build a precompiled torch header instead (pch.py)
  # compile workers: build this one load_inline call (no candidate code runs; build_request.check)
  compile_request: dict[str, Any] | None = None
  tmp_tag: str = ""  # compile workers: names their build directories (build_cache.remove_tmp)


@record
class CompileNeeded:
  """Build worker -> service: the candidate called load_inline with these arguments and the cache has no
  build of them; the service has a compile worker build and publish them."""

  params: dict[str, Any]


@record
class CompileResult:
  """Service -> build worker: the trusted compile's event (key, cached, seconds, error, ...)."""

  event: dict[str, Any]


@record
class BuildProgress:
  """The module imported (its load_inline calls are done): the compile slot can go."""

  build_events: tuple[dict[str, Any], ...]


@record
class BuildReport:
  kind: FailureKind
  reason: str = ""
  build_events: tuple[dict[str, Any], ...] = ()
  cached: bool = False
  pch: dict[str, Any] | None = None


# ---- service <-> fork server ---------------------------------------------------------------------
@record
class ForkRequest:
  """Fork one worker; its end of a fresh channel socket travels with this message."""

  role: str  # "candidate" | "build" (runs the candidate, cache read-only) | "compile" (runs none)
  scratch: str
  env: dict[str, str]
  writable: tuple[str, ...]
  readable: tuple[str, ...] = ()
  mem_mb: int = 0
  warm_profiler: bool = True
  mount_namespace: bool = True  # the pool turns these off (with a warning) if workers cannot start
  landlock: bool = True
  block_sockets: bool = (
    True  # seccomp: no socket/socketpair/connect once started (confine.block_sockets)
  )
  scratch_mb: int = 0  # the scratch directory's quota (a private tmpfs; 0: none)
  max_tasks: int = 0  # its PID namespace's cap (confine.cap_pid_namespace; 0: none)
  # RLIMIT_NPROC in a user namespace of the worker's own (confine.own_user_namespace; 0: none), where
  # the service has no cgroup to limit tasks with and does not run as root
  nproc_limit: int = 0


@record
class Forked:
  pid: int  # the waiter left in the fork server's PID namespace (its exit mirrors the worker's)
  sandbox_pid: int  # the worker, PID 1 of its own namespace (as seen from outside)


@record
class ForkFailed:
  reason: str


@record
class Exited:
  pid: int
  returncode: int  # negative: killed by that signal
