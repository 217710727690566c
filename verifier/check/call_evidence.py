"""Evidence on every judged call, kept by the checker for one check: where the candidate process's CPU
time went (``host_sampler``, from outside it) and what ran on its GPU (``DeviceRecords`` from its
collector, vouched for by marker copies), one window per round trip; judged by ``host_evidence`` and
``device_evidence``. docs/verifier-security.md, "Evidence on every judged call", says what each source
sees and what it cannot.
"""

from __future__ import annotations

import random

from verifier.api.contract import FailureKind
from verifier.check import device_evidence, host_evidence
from verifier.check.host_sampler import HostSampler, SamplerUnavailable
from verifier.check.runtime_check import RuntimeVerdict
from verifier.ipc.records import MARKER_MAX_BYTES, DeviceRecords
from verifier.sandbox.task_limits import RUNTIME_TRANSIENT_TASKS

STALL_WARNING = "host evidence: a stall: "


class CallEvidence:
  """Windows of evidence, one per round trip with the candidate's process: ``null`` (no model, before
  any candidate code), ``reference`` (the calibration's), ``call`` (the candidate's forwards),
  ``profiled`` (a forward under the in-process profiler, whose own work is not the candidate's: not
  judged by the host rule) and ``null_after`` (no model, after the candidate loaded)."""

  def __init__(self, device: str, build_root: str, strictness, kernel_names=()):
    self.device, self.build_root, self.strictness = device, build_root, strictness
    self.kernel_names = tuple(kernel_names)
    self.device_buffers = False  # set by the checker once the transport is known
    self.sampler: HostSampler | None = None
    self.records_on = False
    self.rng = random.SystemRandom()
    self.host: list[tuple[str, int, int, int, int]] = []  # (kind, size, forwards, t0, t1)
    self.device_windows: list[device_evidence.DeviceWindow] = []
    self.load: DeviceRecords | None = None
    self.calls = 0
    self.warnings: list[str] = []
    self.summary: host_evidence.HostVerdict | None = None

  @property
  def host_on(self) -> bool:
    return self.sampler is not None

  def attach(self, worker_pid: int) -> None:
    """Start sampling the worker's process tree (before any candidate code runs)."""
    if not self.strictness.runtime_check:
      return
    if worker_pid <= 0:
      self.warnings.append("host evidence off: the checker was not told the worker's process")
      return
    try:
      self.sampler = HostSampler.attach(worker_pid)
    except SamplerUnavailable as e:
      self.warnings.append(f"host evidence unavailable on this host: {e}")

  def markers(self) -> tuple[int, tuple[int, ...]]:
    """A request's marker copy sizes, distinct and drawn at random (none without device records): the
    round trip's and each forward's (pre, post), the same on every request whatever it is."""
    if not self.records_on:
      return 0, ()
    marker, pre, post = self.rng.sample(range(1, MARKER_MAX_BYTES + 1), 3)
    return marker, (pre, post)

  def window(
    self,
    kind: str,
    size: int,
    t0: int,
    t1: int,
    label: str,
    records: DeviceRecords | None = None,
    marker: int = 0,
    input_bytes: int = 0,
  ) -> None:
    """One round trip of ``size`` forwards in [t0, t1] (``time.monotonic_ns``)."""
    forwards = size if kind in ("call", "profiled") else 0
    first = forwards > 0 and self.calls == 0
    self.calls += forwards > 0
    if self.sampler is not None:
      host_kind = "warmup" if first else kind  # the first forward may pay for lazy initialisation
      if kind == "null" and not any(k == "null_first" for k, *_ in self.host):
        host_kind = "null_first"  # so may the first round trip of the process
      self.host.append((host_kind, size, forwards, t0, t1))
    if self.records_on and kind in ("call", "profiled", "null_after"):
      self.device_windows.append(
        device_evidence.DeviceWindow(
          records, label, forwards, marker, input_bytes * size, fraction=not first
        )
      )

  def verdict(self) -> RuntimeVerdict:
    """Every rule over every window so far (the first failure), under the strictness's runtime
    check."""
    if not self.strictness.runtime_check:
      return RuntimeVerdict(FailureKind.OK)
    if self.records_on:
      v = device_evidence.judge_device(
        self.device_windows,
        self.load,
        self.kernel_names,
        self.strictness.max_foreign_fraction,
        self.strictness.forbid_threads_streams,
        self.device_buffers,
      )
      if v.kind is not FailureKind.OK:
        return v
    if self.sampler is not None:
      h = self.judge_host()
      cut = self.evidence_cut()
      if cut.kind is not FailureKind.OK:
        return cut
      if h.kind is not FailureKind.OK:
        return RuntimeVerdict(h.kind, h.reason)
      if self.strictness.forbid_threads_streams:
        return self.judge_tasks()
    return RuntimeVerdict(FailureKind.OK)

  def evidence_cut(self) -> RuntimeVerdict:
    """EVIDENCE_MISSING where the candidate's process cut the host evidence short: it ran another program
    (red team 47: an exec of a file the worker may not read makes the process non-dumpable, and the
    kernel then ends every perf event attached to it, so nothing it did later was sampled and every
    window was empty; the exec record comes before that), or it made side-band records faster than the
    checker reads them, so a mapping record may be lost (``HostSampler``; red team 46, L1). Neither
    happens in an honest worker."""
    self.sampler.drain()
    table = self.sampler.table
    if table.execs:
      return RuntimeVerdict(
        FailureKind.EVIDENCE_MISSING,
        f"the candidate's process ran another program ({table.execs} exec(s)): an exec may end the "
        "checker's sampling of the process, and no honest worker runs one",
      )
    if table.blind_from is not None:
      return RuntimeVerdict(
        FailureKind.EVIDENCE_MISSING,
        "the candidate's process made mapping, task or name records faster than the checker reads "
        "them (their ring came close to full), so what its code ran since is unknown",
      )
    return RuntimeVerdict(FailureKind.OK)

  def judge_tasks(self) -> RuntimeVerdict:
    """Tasks created since the attach and alive at once, from the kernel's fork and exit records, against
    what the runtime itself may start (``task_limits.RUNTIME_TRANSIENT_TASKS``). The pids cgroup's peak
    counts every task alive, so ending one of the runtime's own threads made room for one of the
    candidate's (red team 46, T1); a runtime task ending frees nothing here."""
    self.sampler.drain()
    table = self.sampler.table
    allowed = RUNTIME_TRANSIENT_TASKS.get(self.device, 0)
    if table.tasks_peak > allowed:
      return RuntimeVerdict(
        FailureKind.THREAD_OR_STREAM,
        f"the candidate started threads or processes: {table.tasks_peak} alive at once beyond its "
        f"runtime's own, {table.tasks_created} in all (the kernel's count, from its fork and exit "
        "records since the checker attached)",
      )
    return RuntimeVerdict(FailureKind.OK)

  def judge_host(self) -> host_evidence.HostVerdict:
    stopped = f"host evidence incomplete: the sampler stopped ({self.sampler.error})"
    if self.sampler.error and stopped not in self.warnings:
      self.warnings.append(stopped)
    windows: dict[str, list] = {"call": [], "null": [], "null_after": [], "warmup": []}
    for kind, size, forwards, t0, t1 in self.host:
      if kind in windows:
        windows[kind].append(host_evidence.HostWindow(self.sampler.count(t0, t1), forwards, size))
    if not windows["call"]:  # the warm-up was the only unprofiled call: judged all the same
      windows["call"] = windows["warmup"]
    v = host_evidence.judge_host(
      windows["call"],
      windows["null"],
      self.sampler.period_ns,
      self.build_root,
      self.device,
      nulls_after=windows["null_after"],
      stalls=None if self.records_on else 0,  # a stall is set aside only beside device records
    )
    self.summary = v
    # a hiccup an operator may want to see: the latest judgement's, once
    self.warnings = [w for w in self.warnings if not w.startswith(STALL_WARNING)]
    if v.stall_ms > 0:
      self.warnings.append(f"{STALL_WARNING}{v.stall_ms:.1f} ms of one round trip set aside")
    return v

  def phases(self) -> dict[str, float]:
    """Diagnostics for the report: the host evidence's milliseconds."""
    v = self.summary
    if v is None:
      return {}
    return {
      "host_own_ms": v.own_ms,
      "host_foreign_ms": v.foreign_ms,
      "host_excess_ms": v.excess_ms,
      "host_allowed_ms": v.allowed_ms,
      "host_drift_ms": v.drift_ms,
      "host_unmet_max_ms": max(v.unmet_by_window_ms, default=0.0),
      "host_stall_ms": v.stall_ms,
    }

  def close(self) -> None:
    if self.sampler is not None:
      self.sampler.close()
