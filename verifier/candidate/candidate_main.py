"""The candidate's process: imports the candidate, builds ``ModelNew`` and runs the forwards the checker asks
for. It holds nothing of the verdict: no reference, no golden outputs, no comparison, no result file. Its
only link to the world is the channel to the checker, where every message it sends is untrusted input.

Per request (``records``): ``ProbeRequest`` (can device buffers be mapped here?), ``CalibrationModel``
(before any candidate code: build the task's reference, the workload of the checker's calibrated round
trips; dropped when the candidate loads), ``CandidateJob`` (load;
``CandidateStarting`` goes out right before the candidate's code first runs),
``ForwardRequest`` (one forward on the given buffers, or a timed burst of them; outputs copied into the checker's buffers; inputs are
the buffers themselves where they live on this process's device, so the checker sees any mutation, else
staged copies written back; ``calibrate`` runs the same exchange on the calibration model, or with
no model, so the checker can measure what a round trip costs beside the forward), ``Shutdown``. This process times
nothing that the verdict uses but the device records of its forwards' spans (marker copies the checker sized
around each forward, on the device clock, the first behind a head start: ``head_start``), which the checker
floors by its own clock.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import itertools
import os
import queue
import threading
import time
import traceback

import torch

from verifier.api.contract import FailureKind
from verifier.build import build_cache
from verifier.candidate import device_records, evidence
from verifier.ipc import exchange, head_start, tensors
from verifier.ipc.channel import Channel, ChannelClosed
from verifier.ipc.tensors import set_seed
from verifier.ipc.records import (
  MARKER_MAX_BYTES,
  CalibrationModel,
  CalibrationReady,
  CandidateFailure,
  CandidateJob,
  CandidateStarting,
  DeviceRecords,
  ForwardDone,
  ForwardRequest,
  Loaded,
  OutputSpec,
  ProbeReply,
  ProfileEvidence,
  ProbeRequest,
  RecordsQuery,
  RecordsStatus,
  Shutdown,
)


def classify_exception(exc: BaseException, default: FailureKind) -> FailureKind:
  text = f"{type(exc).__name__}: {exc}"
  name = type(exc).__name__
  if (
    name in ("AcceleratorError", "CudaError")
    or "CUDA error" in text
    or "cudaError" in text
    or "illegal memory access" in text
    or "device-side assert" in text
  ):
    return FailureKind.CUDA_ERROR
  if (
    isinstance(exc, MemoryError)
    or name == "OutOfMemoryError"
    or "out of memory" in text.lower()
    or "can't allocate memory" in text
    or "bad_alloc" in text
  ):
    return FailureKind.OUT_OF_MEMORY
  return default


def short(exc: BaseException, limit: int = 4000) -> str:
  text = f"{type(exc).__name__}: {exc}"
  return text if len(text) <= limit else text[:limit] + " ..."


class _Failed(Exception):
  def __init__(self, kind: FailureKind, reason: str):
    super().__init__(reason)
    self.kind, self.reason = kind, reason


class CandidateRuntime:
  def __init__(self, chan: Channel, device: str, scratch: str):
    self.chan = chan
    self.device = torch.device("cuda:0" if device == "cuda" else "cpu")
    self.scratch = scratch
    self.buffers: dict[int, exchange.SharedBuffer] = {}
    self.model = None
    self.calibration: torch.nn.Module | None = None  # the reference, until the candidate loads
    self.received_at = 0.0  # perf_counter when the last request was read (a diagnostic)
    self.cache: build_cache.CachedLoadInline | None = None
    # Bound before any candidate code runs: replacing the module attribute later changes nothing here.
    self.collect_evidence = evidence.collect_evidence
    collector = device_records.COLLECTOR
    self.records = collector if collector is not None and collector.active else None
    self.markers = None  # (source, destination) device buffers of the marker copies
    self.head = head_start.NONE  # the spin before each pre marker (``head_start``), once calibrated

  # ---- messages ---------------------------------------------------------------------------------
  def serve(self) -> None:
    _freeze_heap()
    handlers = {
      ProbeRequest: self.probe,
      RecordsQuery: self.records_status,
      CalibrationModel: self.calibration_model,
      CandidateJob: self.load,
      ForwardRequest: self.forward,
    }
    while True:
      try:
        msg, fds = self.chan.recv(*handlers, Shutdown, max_fds=exchange_limit())
      except ChannelClosed:
        return
      self.received_at = time.perf_counter()
      if isinstance(msg, Shutdown):
        return
      try:
        reply = handlers[type(msg)](msg, fds)
      except _Failed as f:
        reply = CandidateFailure(f.kind, f.reason)
      self.chan.send(reply)
      if self.records is not None and isinstance(reply, (ForwardDone, Loaded)):
        self.chan.send(self._device_records(reply, msg))

  def _map(self, refs, fds) -> None:
    _check_announced(refs, fds)
    for ref, fd in zip(refs, fds):
      self.buffers[ref.buffer] = exchange.open_buffer(ref, fd)

  def probe(self, req: ProbeRequest, fds) -> ProbeReply:
    """Before any candidate code: can this process map the checker's device buffers?"""
    try:
      self._map([req.probe], fds)
      value = float(self.buffers[req.probe.buffer].view(req.tensor).float().sum().item())
      return ProbeReply(value, req.probe.kind)
    except Exception as e:  # noqa: BLE001 - the checker falls back to host buffers
      return ProbeReply(0.0, "", short(e, 600))

  def records_status(self, req: RecordsQuery, fds) -> RecordsStatus:
    """Before any candidate code: whether device records are collected here; allocates the marker
    copies' buffers and calibrates the head start (its spins land in a round trip no rule judges: a
    calibration's, or the load's, whose records only count contexts and graphs)."""
    if self.records is None:
      collector = device_records.COLLECTOR
      return RecordsStatus(collector.error if collector is not None else "no collector started")
    try:
      n = MARKER_MAX_BYTES
      self.markers = tuple(torch.zeros(n, dtype=torch.uint8, device=self.device) for _ in range(2))
    except Exception as e:  # noqa: BLE001 - no records then: the checker profiles in process
      self.records = None
      return RecordsStatus(f"marker buffers: {short(e, 300)}")
    self.head = head_start.calibrated()
    return RecordsStatus(head_start_us=self.head.us, head_start_error=self.head.why)

  def _marker(self, n: int) -> None:
    """A device-to-device copy of ``n`` bytes, on the current stream (its record vouches for the
    records of this request)."""
    if n and self.markers is not None:
      src, dst = self.markers
      dst[:n].copy_(src[:n])

  def _device_records(self, reply, req) -> DeviceRecords:
    """What ran on the device since the last records (after a load: its work, once finished; after
    a forward request, with each forward's span between its span markers)."""
    call = reply.call if isinstance(reply, ForwardDone) else -1
    try:
      if call < 0:
        torch.cuda.synchronize()
        return self.records.take(call)
      head = bool(self.head.cycles) and len(req.span_markers) == 2
      return self.records.take(call, req.marker, req.span_markers, 1 + len(req.burst), head)
    except Exception as e:  # noqa: BLE001 - reported as missing evidence
      return DeviceRecords(call, error=short(e, 300))

  def calibration_model(self, req: CalibrationModel, fds) -> CalibrationReady:
    """Before any candidate code: build the task's reference (trusted task data) as the workload of the
    checker's calibrated round trips. Global settings it changes are put back afterwards, so the
    candidate later runs under the process's own defaults."""
    try:
      self._map(req.buffers, fds)
      init = [self._on_device(exchange.receive_value(v, self.buffers), True) for v in req.init_args]
      with _settings_restored():
        namespace = {"__name__": "reference", "__builtins__": __builtins__}
        exec(compile(req.reference_source, "reference", "exec"), namespace)
        set_seed(req.seed)
        with torch.no_grad():
          self.calibration = namespace["Model"](*init).to(self.device)
      return CalibrationReady()
    except Exception as e:  # noqa: BLE001 - the checker calibrates with no model instead
      self.calibration = None
      return CalibrationReady(short(e, 600))

  def load(self, job: CandidateJob, fds) -> Loaded:
    """Import the candidate and build ``ModelNew``, while a thread maps the first forward's buffers (a
    driver call per buffer whose cost grows with its size: hidden behind the load where it can be)."""
    if self.calibration is not None:  # the reference goes before any candidate code runs
      self.calibration = None
      gc.collect()
      if self.device.type == "cuda":
        torch.cuda.empty_cache()
    _check_announced(job.buffers + job.prefetch, fds)
    n = len(job.buffers)
    self._map(job.buffers, fds[:n])
    prefetch = _Prefetch(self, job.prefetch, fds[n:])
    try:
      loaded = self._load(job)
    except BaseException:
      prefetch.join(quiet=True)  # the candidate's own failure is the verdict
      raise
    return dataclasses.replace(loaded, map_wait_s=prefetch.join())

  def _load(self, job: CandidateJob) -> Loaded:
    if self.device.type == "cuda" and job.gpu_memory_fraction:
      torch.cuda.set_per_process_memory_fraction(job.gpu_memory_fraction)
    self.cache = build_cache.install(
      job.build_root,
      split=job.split_build,
      use_pch=job.use_pch,
      publish=False,
      scratch=self.scratch,
    )
    t0 = time.monotonic()
    # From here on, whatever happens to this process is the candidate's doing.
    self.chan.send(CandidateStarting())
    try:
      namespace = {"__name__": "candidate", "__builtins__": __builtins__}
      exec(compile(job.candidate_source, "candidate", "exec"), namespace)
    except BaseException as e:  # noqa: BLE001 - every failure of candidate code is a verdict
      raise self._load_failure(e, FailureKind.IMPORT_ERROR, "candidate module raised") from None
    if "ModelNew" not in namespace:
      raise _Failed(FailureKind.MISSING_MODEL_NEW, "candidate module defines no ModelNew")
    try:
      # Private copies: the model may keep its constructor's tensors.
      init = [self._on_device(exchange.receive_value(v, self.buffers), True) for v in job.init_args]
      set_seed(job.seed)
      with torch.no_grad():
        self.model = namespace["ModelNew"](*init).to(self.device)
    except BaseException as e:  # noqa: BLE001
      raise self._load_failure(e, FailureKind.INIT_ERROR, "ModelNew(*init_inputs) raised") from None
    _freeze_heap()
    events = tuple(self.cache.events)
    return Loaded(
      build_events=events,
      load_s=time.monotonic() - t0,
      build_cached=bool(events) and all(ev["cached"] for ev in events),
      device_name=torch.cuda.get_device_name(0) if self.device.type == "cuda" else "cpu",
    )

  def _load_failure(self, e: BaseException, default: FailureKind, what: str) -> _Failed:
    failed = [ev for ev in self.cache.events if ev["error"]]
    if failed:
      return _Failed(
        FailureKind.COMPILE_ERROR,
        f"building extension {failed[0]['name']!r} failed: {failed[0]['error']}",
      )
    return _Failed(classify_exception(e, default), f"{what}: {short(e)}")

  def _args(self, values) -> tuple[list, list]:
    """(the checker's buffer views, the arguments the forward gets): the views themselves where they are on
    this process's device (no copy; a mutation lands in the checker's buffer), else copies on the device."""
    views = [exchange.receive_value(v, self.buffers) for v in values]
    return views, [self._on_device(v) for v in views]

  def _on_device(self, value, copy: bool = False):
    """``value`` with its tensors on this process's device: copies where they are elsewhere (or
    ``copy``), else the tensors themselves."""
    if isinstance(value, torch.Tensor):
      if copy or value.device != self.device:
        return value.to(self.device, copy=True)
      return value
    if isinstance(value, (list, tuple)):
      return type(value)(self._on_device(v, copy) for v in value)
    return value

  def _sync(self) -> float:
    if self.device.type == "cuda":
      torch.cuda.synchronize()
    return time.monotonic()

  def forward(self, req: ForwardRequest, fds) -> ForwardDone:
    """One forward, or a timed burst of them (``req.burst``) back to back with no synchronisation
    between; ``wall_s`` is the forward alone (a burst's forwards and publishing), ``parts_s`` the
    exchange work around it here (mapping new buffers, staging inputs, publishing outputs and staged
    inputs back)."""
    if self.model is None and not req.calibrate:
      raise _Failed(FailureKind.RUNTIME_ERROR, "forward requested before the model was loaded")
    evidence = None
    calls = [(req.seed, req.args, req.outputs)] + [(c.seed, c.args, c.outputs) for c in req.burst]
    try:  # copying the inputs in can fail too (a full GPU): classified like the forward's own errors
      t_map = time.monotonic()
      self._map(req.new_buffers, fds)
      t_stage = time.monotonic()
      staged = [self._args(args) for _, args, _ in calls]
      self._marker(req.marker)
      t0 = t1 = self._sync()
      specs = []
      pre, post = req.span_markers if len(req.span_markers) == 2 else (0, 0)
      spans = bool(pre and post and self.markers is not None)
      for k, ((seed, _, targets), (views, args)) in enumerate(zip(calls, staged)):
        set_seed(seed)
        if spans:  # the device clock's start: like a CUDA event after a sync, behind a head start
          self._sync()
          self.head()  # the call's launches queue while the device spins (``head_start``)
          self._marker(pre)
        if req.calibrate and self.calibration is not None and not req.null:
          with torch.no_grad():
            out = self.calibration(*args)
        elif req.calibrate:
          out = _null_outputs(targets, self.device)
        elif req.profile and k == 0 and self.records is not None:
          before = sum(self.cache.calls.values())  # the device records judge the rest
          out = self._call(args)
          evidence = ProfileEvidence(sum(self.cache.calls.values()) - before, {}, ())
        elif req.profile and k == 0:
          evidence, out = self.collect_evidence(
            lambda: self._call(args), self.device, self.cache.calls
          )
        else:
          out = self._call(args)
        # The device clock's end: right after the call on its stream, where a CUDA event would be
        # recorded (after a synchronise it would add the host's wake-up and a launch: +0.06 ms a call
        # on a 0.11 ms ReLU, H200 2026-12-04); work left on other streams extends the span in
        # ``forward_spans``. Before the outputs are copied.
        self._marker(post if spans else 0)
        if len(calls) == 1 or spans:
          t1 = self._sync()
        specs.append(self._publish(out, targets, args, req.poison))
        _copy_back(views, args)
        del out
      self._marker(req.marker)
      t2 = self._sync()
      if len(calls) > 1:
        t1 = t2
    except _Failed:
      raise
    except BaseException as e:  # noqa: BLE001
      raise _Failed(
        classify_exception(e, FailureKind.RUNTIME_ERROR), f"forward raised: {short(e)}"
      ) from None
    parts = {"map": t_stage - t_map, "stage_in": t0 - t_stage, "publish": t2 - t1}
    return ForwardDone(
      req.call,
      specs[0],
      evidence,
      t1 - t0,
      parts,
      self.received_at,
      time.perf_counter(),
      burst_outputs=tuple(specs[1:]),
    )

  def _call(self, args):
    with torch.no_grad():
      return self.model(*args)

  def _publish(self, out, targets, args, poison: bool = True) -> tuple[OutputSpec, ...]:
    """Describe each output leaf and copy the ones that match an expected tensor into its buffer; then
    (``poison``) poison the outputs, except those that are the model's state or the forward's own
    inputs (an input is the checker's buffer: poisoning it would be read as the candidate's
    mutation). An output in any other exchange buffer is refused (``_in_exchange``)."""
    specs = []
    arg_spans = [_span(t) for t in tensors.flatten(args) if isinstance(t, torch.Tensor)]
    for k, (leaf, target) in enumerate(itertools.zip_longest(tensors.flatten(out), targets)):
      if isinstance(leaf, torch.Tensor):
        found = self._in_exchange(leaf, arg_spans)
        if found is not None:
          raise _Failed(
            FailureKind.RUNTIME_ERROR,
            f"output {k} lies in the verifier's exchange buffer {found}, which is none of this "
            "forward's inputs: an output must be a tensor of the candidate's own (or an input)",
          )
        plain = type(leaf) in (torch.Tensor, torch.nn.Parameter)
        spec = dict(
          kind="tensor",
          type_name=type(leaf).__name__,
          dtype=str(leaf.dtype).removeprefix("torch."),
          shape=tuple(leaf.shape),
          device=str(leaf.device),
          plain=plain,
        )
        copied = False
        if (
          target is not None
          and plain
          and leaf.device == self.device
          and tuple(leaf.shape) == tuple(target.shape)
          and spec["dtype"] == target.dtype
          and target.buffer in self.buffers
        ):
          _copy_into(self.buffers[target.buffer].view(target), leaf.detach())
          copied = True
        specs.append(OutputSpec(copied=copied, **spec))
      elif leaf is None or isinstance(leaf, (bool, int, float, str)):
        specs.append(OutputSpec(kind="data", type_name=type(leaf).__name__, data=leaf))
      else:
        specs.append(OutputSpec(kind="other", type_name=type(leaf).__name__))
    if poison:
      inputs = {t.untyped_storage().data_ptr() for t in tensors.flatten(args) if torch.is_tensor(t)}
      models = [m for m in (self.model, self.calibration) if m is not None]
      tensors.poison(out, tensors.storages_of(*models) | inputs)
    return tuple(specs)

  def _in_exchange(self, leaf: torch.Tensor, arg_spans) -> int | None:
    """The exchange buffer ``leaf``'s storage overlaps, if one does that holds none of the forward's
    arguments (``arg_spans``: their storages' ``_span``s; None: none). No honest forward sees those buffers: the ones the checker reads its
    outputs from were found through the worker's own frames (red team 42, Hole E2, whose output was
    that buffer: the publishing copy was then a no-op, and the time it saved paid for library compute).
    An input returned as is, or a view of one, stays an output like any other."""
    lo, hi = _span(leaf)
    if lo == hi:
      return None
    for b in self.buffers.values():
      raw = b.raw  # uint8, over the whole mapping
      if raw is None or raw.device != leaf.device:
        continue
      start = raw.data_ptr()
      end = start + raw.numel()
      if lo < end and start < hi and not any(a < end and start < z for a, z in arg_spans):
        return b.id
    return None


def _span(t: torch.Tensor) -> tuple[int, int]:
  """The addresses ``t``'s storage spans (empty where it has none to read)."""
  try:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()
  except (RuntimeError, NotImplementedError, TypeError):
    return 0, 0


@contextlib.contextmanager
def _settings_restored():
  """Process-wide torch settings a model's module might change, put back on exit."""
  saved = (
    torch.get_default_dtype(),
    torch.get_float32_matmul_precision(),
    torch.backends.cuda.matmul.allow_tf32,
    torch.backends.cudnn.allow_tf32,
    torch.backends.cudnn.benchmark,
    torch.backends.cudnn.deterministic,
  )
  try:
    yield
  finally:
    torch.set_default_dtype(saved[0])
    torch.set_float32_matmul_precision(saved[1])
    (
      torch.backends.cuda.matmul.allow_tf32,
      torch.backends.cudnn.allow_tf32,
      torch.backends.cudnn.benchmark,
      torch.backends.cudnn.deterministic,
    ) = saved[2:]


def _check_announced(refs, fds) -> None:
  """Refuses descriptors that do not match the buffers announced with them (closing them)."""
  if len(refs) != len(fds):
    for fd in fds:
      os.close(fd)
    raise _Failed(FailureKind.RUNTIME_ERROR, "buffer descriptors do not match their announcement")


class Mapper:
  """The runtime's one helper thread: maps a job's first buffers while the candidate loads. Started
  before the worker says it is ready (``start_mapper``), so the kernel's count of the job's tasks at its
  start already holds it and a thread the candidate starts is one more (``task_limits``)."""

  def __init__(self):
    self.jobs: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=self._serve, name="verifier-mapper", daemon=True).start()

  def _serve(self) -> None:
    while True:
      fn, done = self.jobs.get()
      try:
        fn()
      except BaseException as e:  # noqa: BLE001 - raised again by the job's join
        done.error = e
      finally:
        done.set()

  def submit(self, fn) -> threading.Event:
    done = threading.Event()
    done.error = None
    self.jobs.put((fn, done))
    return done


_MAPPER: Mapper | None = None


def start_mapper() -> Mapper:
  global _MAPPER
  if _MAPPER is None:
    _MAPPER = Mapper()
  return _MAPPER


class _Prefetch:
  """Maps buffers on the mapper thread; ``join`` waits for it (returning the seconds waited) and raises
  its error."""

  def __init__(self, runtime: CandidateRuntime, refs, fds):
    self.done = start_mapper().submit(lambda: runtime._map(refs, fds)) if refs else None

  def join(self, quiet: bool = False) -> float:
    if self.done is None:
      return 0.0
    t0 = time.monotonic()
    self.done.wait()
    waited = time.monotonic() - t0
    if self.done.error is not None and not quiet:
      raise _Failed(
        classify_exception(self.done.error, FailureKind.RUNTIME_ERROR),
        f"mapping the first forward's buffers failed: {short(self.done.error)}",
      )
    return waited


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
  """The publish copy. On the CPU, for contiguous tensors, libc's ``memmove``: the null round trips then
  carry the verifier's own copy in libc, never in the module a library's compute runs in. Red team 43d:
  Python run through the builtins' ``exec`` from C++ no-opped the worker's checks, computed a library's
  ReLU (libtorch_cpu) straight into the output buffer, and the copy it skipped (libtorch_cpu's ``copy_``)
  netted against it in the host rule: untimed reward 1."""
  if dst.device.type == "cpu" and src.is_contiguous() and dst.is_contiguous() and src.numel():
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
  else:
    dst.copy_(src)


def _null_outputs(targets, device: torch.device):
  """What a forward of no model returns: fresh tensors shaped like the expected outputs."""
  outs = tuple(
    torch.empty(t.shape, dtype=exchange.dtype_of(t.dtype), device=device)
    for t in targets
    if t is not None
  )
  return outs[0] if len(outs) == 1 else outs


def _copy_back(views: list, args: list) -> None:
  """Write staged (maybe mutated) copies of the inputs back to the checker's buffers."""
  for view, arg in zip(views, args):
    if isinstance(view, torch.Tensor) and isinstance(arg, torch.Tensor):
      if arg is not view and view.shape == arg.shape:
        view.copy_(arg)
    elif isinstance(view, (list, tuple)) and isinstance(arg, (list, tuple)):
      _copy_back(list(view), list(arg))


def _freeze_heap() -> None:
  """Move every object the process holds now (torch's ~170k, and after a load the candidate's module
  and model) out of the cyclic collector's reach (``gc.freeze``), so that a collection during a judged
  forward scans only what the forwards made. A full pass over them costs tens of milliseconds of
  interpreter time (63 ms on the dev VM), which the host evidence would charge to the round trip it
  falls in. Suspected, not shown, in DICE's known-good solutions judged HOST_COMPUTE on one H100 host
  (session 35): on CPU the code before this ran 300 forwards of a small candidate with no full pass,
  and a second host gave no such verdict with or without it. No collection is run first: it would cost
  that pass in every load; the load's own garbage stays for the worker's short life."""
  gc.freeze()


def exchange_limit() -> int:
  return exchange.FDS_PER_MESSAGE


def run(chan: Channel, device: str, scratch: str) -> None:
  try:
    CandidateRuntime(chan, device, scratch).serve()
  except ChannelClosed:
    pass
  except Exception:
    # Our own failure, or the candidate broke this process (its channel, its descriptors): the log says
    # why, the worker exits INTERNAL_EXIT, and the service retries only if no candidate code had run.
    traceback.print_exc()
    raise
