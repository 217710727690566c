"""Host compute: whose code the candidate process's CPU time was spent in, judged from samples taken from
outside it (``host_sampler``). Pure functions; the checker feeds them windows of samples.

Each judged round trip (a correctness trial after the first, a timed burst) is a window of samples per
module; null round trips (the verifier's own exchange work with no model: staging, publishing outputs)
give what the verifier itself spends per request, measured before any candidate code ran. A module is the
candidate's own if it is a file of the verifier's build cache (``<build root>/<entry>/<name>.so``: only
honest builds of candidate sources land there); everything else is foreign: torch (``libtorch_cpu``),
numpy, BLAS, the interpreter, JIT code in anonymous memory, unknown addresses and lost samples alike. On a
GPU the device runtime's host code (the CUDA driver, where a synchronize spins, cuBLAS's launch paths,
...) is set aside: what those do on the device is judged from the device records instead.

The rule (in samples of ``period_ns`` of CPU time): the foreign time each judged round trip w adds over
the null round trips of its size, ``E_w = sum_m max(C_w,m - null_m, 0)`` over its modules m (a module
that spent less than in the null round trips pays for no other's: red team 42, Hole E2), is allowed up
to ``A_w = max(floor * forwards_w, ratio * own_w)`` of that same round trip; the request fails
(HOST_COMPUTE) when what no round trip's own allowance covers, ``U = sum_w (E_w - min(A_w, E_w))``,
exceeds ``Z * sigma`` with ``sigma^2 = C + sum(n_s^2) * var(null mean)`` (counts taken as Poisson:
sampling at fixed CPU-time intervals varies less, so this errs for the candidate). So a forward may
spend up to ``floor`` of CPU time outside its own code (interpreter, dispatch, allocation) and as much
again as its own code spends in the same round trip (an honest kernel that also zero-fills its output); a
candidate whose work is done by a library or the interpreter does not pass, nor one whose own kernel
runs in some round trips (the correctness trials) to excuse a library's work in others (the timed
calls): an allowance is not carried between round trips (it was until session 18: the pooled ``E > A +
Z * sigma`` let 3 judged trials of its own kernel cover torch in the timed calls). No round trip lowers
``U``: no excess is negative.

Drift: the null round trips are measured before the candidate loads, the judged ones later, and on a
shared host the same exchange work can cost up to about twice the CPU time a little later (another
process on the core's sibling or the memory bus: on the CI's 2-core host an honest candidate's bursts
spent 2.3x the nulls' time in the interpreter, session 17). So in the modules the verifier's exchange
itself runs in (``EXCHANGE``: the interpreter, the C library, torch's c10 core; not torch's operators,
numpy or BLAS, where a library computes), a module's excess up to ``DRIFT`` times its own null time is
set aside as drift. What that leaves a candidate is interpreter time of the order of the exchange's (a
fraction of a millisecond a forward on a CPU host): far under any work worth a reward.

Stalls (GPU only): on a GPU with device records the largest single round trip's unmet excess is set aside
(``STALLS``, where at least two round trips are judged; ``CallEvidence`` passes none without), so a
one-off host stall in one forward (session 35: honest DICE solutions on one H100 host, 4-13 ms of
interpreter and libc in one of four judged forwards) is not a verdict. Safe there because the host rule
is the second line on a GPU (a round trip that computes on the host moves its inputs there, which the
device records judge on every call), and because the other round trips must still be judged clean: a
candidate that computes on the host in one round trip only must produce every other judged output with
its own kernel, on fresh inputs. On a CPU this rule is the only evidence, and nothing is set aside.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import statistics

from verifier.api.contract import FailureKind

ENTRY = re.compile(r"^[0-9a-f]{32}$")
# Host code of device runtimes (the device work they start is judged from the device records).
DEVICE_RUNTIME = re.compile(
  r"^(libcuda\.so|libcudart|libcupti|libnvrtc|libnvJitLink|libnvidia-|libcublas|libcublasLt|libcudnn"
  r"|libcusparse|libcufft|libcurand|libcusolver|libnccl|libnvToolsExt|libtorch_cuda|libc10_cuda"
  r"|libcaffe2_nvrtc|verifier_cupti)"
)
FLOOR_MS = {"cpu": 0.1, "cuda": 2.0}  # foreign CPU time a forward may spend beside its own code
OWN_RATIO = 1.0
Z = 3.0
# modules the verifier's own exchange spends its time in (their drift is set aside, up to DRIFT x null)
EXCHANGE = re.compile(r"^(libpython3|python3|libc\.so|libc10\.so)")
DRIFT = 1.5
# Host libraries that only compute (no honest forward's dispatch or launch path runs there): their
# excess has a floor of its own, far under ``FLOOR_MS`` (an H200 ReLU of 4M floats in numpy on a
# zero-copy host buffer took ~1.5 ms a forward, under the 2 ms floor: rewarded, session 17).
COMPUTE_LIBRARY = re.compile(
  r"^(_multiarray_umath|_umath_linalg|_pocketfft|libopenblas|libscipy_openblas|libmkl|libblas"
  r"|liblapack|libcblas)"
)
COMPUTE_FLOOR_MS = 0.25
# Code of no file a loader loaded, judged like a compute library (no allowance from the candidate's
# own time): anonymous or unmapped code, forged, lost or unrecorded ranges, memfds and deleted files.
# Red team 48 (G): a copy of OpenBLAS in a memfd, run in slices timed between the sampler's ticks,
# was judged by the general rule, whose allowance the candidate's own waiting loop paid.
_NAMED = ("[vdso]", "[vsyscall]")


def no_loaded_file(path: str) -> bool:
  """Whether ``path`` names code of no file a loader loaded (``COMPUTE_LIBRARY``'s floor applies)."""
  if path.startswith("["):
    return path not in _NAMED
  return path.startswith("/memfd:") or path.endswith(" (deleted)")


# Round trips whose unmet excess is set aside as a host stall (the largest), per device; only where at
# least STALL_MIN_WINDOWS round trips are judged, so one always stays (module docstring).
STALLS = {"cpu": 0, "cuda": 1}
# judged round trips silent next to what the null round trips had (``_silent``)
SILENT_FRACTION, SILENT_MIN = 0.05, 40
STALL_MIN_WINDOWS = 2


@dataclasses.dataclass(frozen=True)
class HostWindow:
  """One round trip's samples per module path. ``forwards``: candidate forwards it ran (0 for a null
  round trip); ``size``: the forwards its request carried (a null round trip mirrors a burst's size)."""

  counts: dict[str, int]
  forwards: int
  size: int


@dataclasses.dataclass(frozen=True)
class HostVerdict:
  kind: FailureKind
  reason: str = ""
  own_ms: float = 0.0
  foreign_ms: float = 0.0  # in the judged windows, before the null round trips are subtracted
  excess_ms: float = 0.0  # foreign time beyond the null round trips'
  allowed_ms: float = 0.0  # what the rule allowed (before the significance margin)
  drift_ms: float = 0.0  # exchange modules' excess set aside as drift (not in excess_ms)
  sigma_ms: float = 0.0
  top: tuple[tuple[str, float], ...] = ()  # foreign modules by excess milliseconds
  # each judged round trip's excess beyond its own allowance, ms, in order (a one-off stall in one
  # round trip, or a slowness spread over all, on a host the nulls did not foresee)
  unmet_by_window_ms: tuple[float, ...] = ()
  stall_ms: float = 0.0  # the largest round trip's unmet excess, set aside as a stall (GPU only)


def module_class(path: str, own_root: str, device: str) -> str:
  """``own`` (a file of the build cache: ``<own_root>/<entry>/...``, named as the loader names it: a
  normalised path), ``runtime`` (a device runtime's host code, on a GPU only) or
  ``foreign``. Red team 45: a memfd named ``/../<own_root>/<entry>/x.so`` holding a copy of OpenBLAS was
  mapped as ``/memfd:/../<own_root>/...``, which ``relpath`` had collapsed into an own path."""
  if own_root and path.startswith("/") and os.path.normpath(path) == path:
    rel = os.path.relpath(path, own_root)
    parts = rel.split(os.sep)
    if len(parts) >= 2 and ENTRY.match(parts[0]) and not rel.startswith(".."):
      return "own"
  if device == "cuda" and DEVICE_RUNTIME.match(os.path.basename(path)):
    return "runtime"
  return "foreign"


def _split(counts: dict[str, int], classes: dict[str, str]) -> tuple[int, dict[str, int]]:
  own, foreign = 0, {}
  for path, n in counts.items():
    c = classes[path]
    if c == "own":
      own += n
    elif c == "foreign":
      foreign[path] = foreign.get(path, 0) + n
  return own, foreign


def _null_rates(nulls: list[HostWindow], classes: dict[str, str]) -> dict:
  """size -> (mean foreign samples per module, their total, number of round trips)."""
  by_size: dict[int, list[dict[str, int]]] = {}
  for w in nulls:
    by_size.setdefault(w.size, []).append(_split(w.counts, classes)[1])
  rates = {}
  for size, splits in by_size.items():
    per: dict[str, float] = {}
    for s in splits:
      for p, n in s.items():
        per[p] = per.get(p, 0.0) + n / len(splits)
    rates[size] = (per, sum(per.values()), len(splits))
  return rates


def judge_host(
  windows: list[HostWindow],
  nulls: list[HostWindow],
  period_ns: int,
  own_root: str,
  device: str,
  nulls_after: list[HostWindow] = (),
  floor_ms: float | None = None,
  ratio: float = OWN_RATIO,
  z: float = Z,
  drift: float = DRIFT,
  stalls: int | None = None,
) -> HostVerdict:
  """The host-compute verdict over judged ``windows``. ``nulls``: the verifier-only round trips made
  before any candidate code; ``nulls_after``: those made since, which the candidate's process answered
  (so they may only lower what is subtracted: per size, the smaller of the two estimates counts).
  Rule in the module docstring."""
  if not windows:
    return HostVerdict(FailureKind.OK, "no judged round trips")
  silent = _silent(windows, nulls)
  if silent:
    return HostVerdict(FailureKind.EVIDENCE_MISSING, silent)
  floor_ms = FLOOR_MS.get(device, FLOOR_MS["cpu"]) if floor_ms is None else floor_ms
  stalls = STALLS.get(device, 0) if stalls is None else stalls
  every = {p for w in (*windows, *nulls, *nulls_after) for p in w.counts}
  root = os.path.realpath(own_root) if own_root else ""
  classes = {p: module_class(p, root, device) for p in every}
  before, after = _null_rates(nulls, classes), _null_rates(nulls_after, classes)
  null_by_size: dict[int, tuple[dict[str, float], float, int]] = {}
  for w in windows:  # per size, the smaller of the two estimates (the candidate answered the later)
    if w.size not in null_by_size:
      null_by_size[w.size] = _null_for(before, w.size)
      if w.size in after and after[w.size][1] < null_by_size[w.size][1]:
        null_by_size[w.size] = after[w.size]
  ms = period_ns / 1e6
  own = foreign = excess = allowed = unmet = drifted = null_var = 0.0
  unmet_by_window: list[float] = []
  excess_by: dict[str, float] = {}
  sizes: dict[int, int] = {}  # size -> judged windows of that size
  forwards = 0
  for w in windows:
    o, f = _split(w.counts, classes)
    per = null_by_size[w.size][0]
    ex = {p: f.get(p, 0) - per.get(p, 0.0) for p in {*f, *per}}
    for p, n in per.items():  # the exchange's drift, set aside (module docstring)
      if EXCHANGE.match(os.path.basename(p)):
        d = min(max(ex[p], 0.0), drift * n)
        drifted += d
        ex[p] -= d
    # a module's savings pay for no other's (Hole E2: an output returned in the exchange's own buffer
    # made the publishing copy a no-op, and the copy libtorch saved paid for its ReLU there)
    ex = {p: max(n, 0.0) for p, n in ex.items()}
    e = sum(ex.values())
    a = max(floor_ms * w.forwards / ms, ratio * o)
    # a window's allowance covers its own excess only: own work in one round trip does not excuse
    # foreign work in another (a candidate's own kernel in the trials, torch's in the timed calls)
    unmet_by_window.append(e - min(a, max(e, 0.0)))
    unmet += unmet_by_window[-1]
    own, foreign, excess, allowed = own + o, foreign + sum(f.values()), excess + e, allowed + a
    forwards += w.forwards
    sizes[w.size] = sizes.get(w.size, 0) + 1
    for p, n in ex.items():
      excess_by[p] = excess_by.get(p, 0.0) + n
  stall = 0.0
  if stalls and len(windows) >= STALL_MIN_WINDOWS:  # a one-off host stall (module docstring)
    stall = sum(u for u in sorted(unmet_by_window, reverse=True)[:stalls] if u > 0)
    unmet -= stall
  sub_by: dict[str, float] = {}
  for size, count in sizes.items():  # windows of one size share one null mean: its variance adds up
    per, total, n_null = null_by_size[size]
    null_var += count * count * total / max(n_null, 1)
    for p, n in per.items():
      sub_by[p] = sub_by.get(p, 0.0) + count * n
  sigma = math.sqrt(foreign + null_var)
  top = tuple(
    (p, round(n * ms, 3)) for p, n in sorted(excess_by.items(), key=lambda kv: -kv[1])[:3] if n > 0
  )
  verdict = dict(
    own_ms=own * ms,
    foreign_ms=foreign * ms,
    excess_ms=excess * ms,
    allowed_ms=allowed * ms,
    drift_ms=drifted * ms,
    sigma_ms=sigma * ms,
    top=top,
    unmet_by_window_ms=tuple(round(u * ms, 3) for u in unmet_by_window),
    stall_ms=stall * ms,
  )
  library = {
    p: n
    for p, n in excess_by.items()
    if COMPUTE_LIBRARY.match(os.path.basename(p)) or no_loaded_file(p)
  }
  library_excess = sum(library.values())
  library_sigma = math.sqrt(sum(sub_by.get(p, 0.0) + max(n, 0.0) for p, n in library.items()))
  if library_excess > COMPUTE_FLOOR_MS * forwards / ms + z * library_sigma:
    names = ", ".join(
      f"{os.path.basename(p)} {n * ms:.1f} ms"
      for p, n in sorted(library.items(), key=lambda kv: -kv[1])
    )
    return HostVerdict(
      FailureKind.HOST_COMPUTE,
      f"the forwards spent {library_excess * ms:.1f} ms of CPU time in host compute libraries or code "
      f"of no loaded file over "
      f"{forwards} forward(s) (allowed: {COMPUTE_FLOOR_MS * forwards:.2f} ms); most in: {names}",
      **verdict,
    )
  if unmet > z * sigma:
    names = ", ".join(f"{os.path.basename(p)} {t:.1f} ms" for p, t in top) or "-"
    where = "interpreter, libraries or unknown code" if device == "cpu" else "host code"
    over = [u for u in unmet_by_window if u > 0]
    aside = f", {stall * ms:.1f} ms of one round trip set aside as a stall" if stall else ""
    return HostVerdict(
      FailureKind.HOST_COMPUTE,
      f"the forwards spent {excess * ms:.1f} ms of CPU time in {where} beyond the verifier's own "
      f"exchange work, against {own * ms:.1f} ms in the candidate's compiled code over {forwards} "
      f"forward(s), {unmet * ms:.1f} ms of it beyond what each round trip's own code allows "
      f"(allowed: {allowed * ms:.1f} ms in all; the largest in one round trip {max(over) * ms:.1f} "
      f"ms, {len(over)} of {len(windows)} over their own{aside}); most in: {names}",
      **verdict,
    )
  return HostVerdict(FailureKind.OK, "", **verdict)


def _silent(windows: list[HostWindow], nulls: list[HostWindow]) -> str:
  """Why the judged round trips hold too few samples to have been sampled at all, or "": fewer than
  ``SILENT_FRACTION`` of what the verifier's own exchange work alone left in the null round trips
  (their median) before any candidate code (of every module: an honest round trip does that work and more), where that
  is at least ``SILENT_MIN`` samples. A process whose events the kernel ended is silent (red team 47: an
  exec of a file it may not read; that exec now fails by its record, this holds for any other way)."""
  by_size: dict[int, list[int]] = {}
  for w in nulls:
    by_size.setdefault(w.size, []).append(sum(w.counts.values()))
  # the median: a null round trip that stalled on a loaded host does not raise the bar
  rates = {size: ({}, statistics.median(v), len(v)) for size, v in by_size.items()}
  expected = sum(_null_for(rates, w.size)[1] for w in windows)
  seen = sum(sum(w.counts.values()) for w in windows)
  if expected >= SILENT_MIN and seen < SILENT_FRACTION * expected:
    return (
      f"the judged round trips held {seen} samples of the candidate's process where the verifier's "
      f"own exchange work alone leaves ~{expected:.0f}: its sampling ended"
    )
  return ""


def _null_for(null_rate: dict, size: int) -> tuple[dict[str, float], float, int]:
  """The null round trip's foreign samples for a request of ``size`` forwards: measured at that size,
  else scaled from the nearest smaller size measured (none: nothing subtracted)."""
  if size in null_rate:
    return null_rate[size]
  smaller = [s for s in null_rate if s < size]
  if not smaller:
    return {}, 0.0, 1
  s = max(smaller)
  per, total, n = null_rate[s]
  k = size / s
  return {p: v * k for p, v in per.items()}, total * k, n
