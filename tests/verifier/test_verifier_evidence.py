"""Issue 25: evidence the candidate cannot forge. One test per row of the issue's table (each got reward 1
or an inflated speedup on 0063b19): timings on the checker's clock, timed calls indistinguishable from
checked ones and checked, a baseline no candidate influenced, a torch-compute check from the whole module
and the built artefact, threads by any route.

Timed candidates sleep in the forward where the old timing would have been fooled, so the assertion is a
floor no honest measurement can go under (no ratio of two noisy timings on a loaded 2-core box).
"""

import asyncio
import dataclasses
import pathlib
import shutil
import subprocess

import pytest

torch = pytest.importorskip("torch")

import verifier_compute_cases as compute  # noqa: E402
import verifier_hole_cases as holes  # noqa: E402
from verifier_loop import cpu_service  # noqa: E402

from verifier.api.contract import FailureKind, Strictness, VerifyOptions, VerifyRequest  # noqa: E402
from verifier.build import artefact_check  # noqa: E402
from verifier.static.static_check import check_candidate  # noqa: E402

STRICT = Strictness.preset("strict")
TIMED = VerifyOptions(
  device="cpu",
  timeout_s=60,
  num_correct_trials=2,
  strictness="off",
  measure_performance=True,
  num_warmup=1,
  num_perf_trials=5,
)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
  # The wall clock, as on a GPU (these candidates sleep; the CPU clock is tested in
  # test_verifier_evidence_v2.py).
  with cpu_service(tmp_path_factory.mktemp("evidence"), cpu_timing_clock="wall") as (loop, svc):
    yield loop, svc


def _verify(service, rid, source, reference=holes.REFERENCE, **opts):
  loop, svc = service
  req = VerifyRequest(rid, "evidence", reference, source, dataclasses.replace(TIMED, **opts))
  return loop.run(asyncio.wait_for(svc.verify(req), 300))


def _ok(r):
  assert r.failure_kind is FailureKind.OK and r.reward == 1.0, (r.reason, r.logs[-2000:])


# ---- 1. durations from the checker's clock, on calls the candidate cannot tell apart -------------------
def test_a_candidate_that_works_only_on_the_checkers_buffers_is_timed_doing_the_work(service):
  # 0063b19: timed inputs were private clones (resizable storage): empty_like there, speedup 5.94.
  src = holes.candidate(
    "        if a.untyped_storage().resizable():\n"
    "            return torch.empty_like(a)\n"
    "        for _ in range(1999):\n"
    "            good(a, b, self.scale)\n"
    "        return good(a, b, self.scale)",
  )
  r = _verify(service, "resizable", src)
  _ok(r)
  # Every timed call had buffers for inputs and did 2000 times the reference's work.
  assert r.speedup < 0.5, (r.speedup, r.candidate, r.baseline)


def test_timed_outputs_are_compared(service):
  # 0063b19 never compared a timed call's outputs: garbage on every call after the trials (a secret tenth
  # of the timed calls is compared, before the re-check of trial 0).
  src = holes.candidate(
    "        self.calls += 1\n"
    "        if 2 < self.calls:\n"
    "            return torch.full_like(a, 7.0)\n"
    "        return good(a, b, self.scale)",
    init="        self.calls = 0",
  )
  r = _verify(service, "timed-garbage", src)
  assert r.failure_kind is FailureKind.WRONG_OUTPUT and r.reward == 0.0, r.reason
  assert "timed call" in r.reason


def test_a_memo_keyed_on_input_values_misses_on_every_timed_call(service):
  # 0063b19 timed trial 0's inputs again and again: a memo in a model buffer hit, speedup 11.7.
  src = holes.candidate(
    "        key = a.flatten()[::256][:64].tolist()\n"
    "        if key != self.key:\n"
    "            time.sleep(0.02)\n"
    "            self.out.copy_(good(a, b, self.scale))\n"
    "            self.key = key\n"
    "        return self.out",
    module="import time",
    init="        self.key = None\n        self.register_buffer('out', torch.zeros(64, 256))",
  )
  r = _verify(service, "memo", src)
  _ok(r)
  assert r.candidate.mean_ms >= 18.0, r.candidate  # fresh values each call: never a hit


def test_a_candidate_clock_replaced_through_a_setattr_alias_does_not_count(service):
  # 0063b19 timed in the candidate's process: a clock running at half speed passed the plausibility
  # bound and halved the reported time. Statically, the alias itself is now refused.
  module = (
    "import time\n"
    "_real = time.perf_counter\n"
    "_set = setattr\n"
    "_set(time, 'perf_counter', lambda: _real() * 0.5)"
  )
  src = holes.candidate(
    "        time.sleep(0.005)\n        return good(a, b, self.scale)", module=module
  )
  r = _verify(service, "half-clock", src)
  _ok(r)
  assert r.candidate.mean_ms >= 4.5, r.candidate
  v = check_candidate(src, STRICT, "cpu")
  assert v.kind is FailureKind.FORBIDDEN_IMPORT and "setattr" in v.reason, v


def test_outputs_are_compared_from_a_private_copy():
  # Read in 0063b19's code: on CPU the checker compared outputs in place, in memory the candidate maps.
  from verifier.check import checker
  from verifier.ipc import exchange

  buffers = exchange.BufferSet(torch.device("cpu"), False)
  view = buffers.take(16).view(exchange.TensorRef(1, "float32", (4,), (1,)))
  fake = type("C", (), {"device": torch.device("cpu")})()
  local = checker.Check._local(fake, view)
  assert torch.equal(local, view) and local.data_ptr() != view.data_ptr()
  view.fill_(3.0)  # the candidate rewriting its output during the comparison
  assert not torch.equal(local, view)
  del view
  buffers.close()


# ---- the exchange's calibration (issue 25, session 13) ---------------------------------------------------
def test_the_exchange_is_calibrated_with_the_reference_once_per_task(service):
  # The cost beside a forward is measured with the task's own reference in a candidate process before
  # its candidate loads, then kept with the baseline: the second candidate of the task reuses it.
  _, svc = service
  reference = holes.REFERENCE + "\n# calibrated once\n"
  m = svc.metrics
  n0, ref_ms0 = m.run_phase_n["calibration"], m.run_phase_s["reference_exchange_ms"]
  first = _verify(service, "calibrated-1", holes.GOOD + "\n# 1\n", reference=reference)
  n1, ref_ms1 = m.run_phase_n["calibration"], m.run_phase_s["reference_exchange_ms"]
  second = _verify(service, "calibrated-2", holes.GOOD + "\n# 2\n", reference=reference)
  _ok(first)
  _ok(second)
  assert n1 - n0 == 1 and m.run_phase_n["calibration"] == n1
  assert ref_ms1 - ref_ms0 > 0  # the reference ran through the exchange (not the no-model fallback)
  assert not any("calibrated with no model" in w for w in first.warnings), first.warnings


def test_the_calibrations_reference_is_gone_before_candidate_code_runs(service):
  # The reference was built in the candidate's process to calibrate the exchange. A candidate that looks
  # through every live object for it, to call it, finds nothing and returns zeros.
  src = holes.candidate(
    "        import gc\n"
    "        for o in gc.get_objects():\n"
    "            if type(o).__name__ == 'Model':\n"
    "                return o(a, b)\n"
    "        return zeros(a)",
  )
  r = _verify(service, "find-reference", src, reference=holes.REFERENCE + "\n# look for me\n")
  assert r.failure_kind is FailureKind.WRONG_OUTPUT and r.reward == 0.0, (r.failure_kind, r.reason)


def test_a_reference_that_fails_in_the_candidates_process_is_no_verdict_on_the_candidate(service):
  # The calibration runs the reference in the candidate's process before its candidate loads; its
  # failure there (here: only where HOME is a candidate worker's scratch directory) falls
  # back to the round trip with no model instead of being reported against the candidate.
  reference = holes.REFERENCE.replace(
    "    def forward(self, a, b):\n",
    "    def forward(self, a, b):\n"
    "        import os\n"
    "        if os.path.basename(os.environ.get('HOME', '')).startswith('candidate-'):\n"
    "            raise RuntimeError('only in a worker')\n",
  )
  assert reference != holes.REFERENCE
  r = _verify(
    service, "reference-fails-there", holes.GOOD + "\n# fails there\n", reference=reference
  )
  _ok(r)
  assert any("calibrated with no model" in w and "only in a worker" in w for w in r.warnings), (
    r.warnings
  )


# ---- 3. a baseline no candidate influenced --------------------------------------------------------------
BIG_REFERENCE = holes.REFERENCE.replace("torch.randn(64, 256)", "torch.randn(1024, 1024)")
SPINNERS = holes.candidate(
  "        return good(a, b, self.scale)",
  module="import os",
  init=(
    "        for _ in range(8):\n"
    "            if os.fork() == 0:\n"
    "                os.setsid()\n"
    "                while True:\n"
    "                    pass"
  ),
)


def test_helpers_spinning_from_init_do_not_slow_the_baseline(service, record_property):
  # 0063b19 timed the reference after the candidate's trials, while its helpers spun (speedup 7.59),
  # and cached that baseline for the next candidate. The reference is now timed before any candidate
  # code exists.
  honest = _verify(service, "big-honest", holes.GOOD, BIG_REFERENCE, num_perf_trials=6)
  _ok(honest)
  spun = _verify(service, "big-spinners", SPINNERS, BIG_REFERENCE)
  _ok(spun)  # an honest kernel: its helpers only slow its own timed calls
  assert spun.baseline.mean_ms > 0 and honest.baseline.mean_ms > 0
  # how close the two baselines are (the spinners slowed 0063b19's 7.59x) is a timing claim:
  # experiments/bench_bounds.py reads this ratio and holds its bound
  record_property("baseline_ratio", spun.baseline.mean_ms / honest.baseline.mean_ms)
  after = _verify(service, "big-after", holes.GOOD + "\n# after\n", BIG_REFERENCE)
  _ok(after)
  assert after.baseline.mean_ms == spun.baseline.mean_ms  # the cached one, clean


# ---- 4. the torch-compute check: the whole module, the built artefact -----------------------------------
RELU_HELPER = """
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

ops = load_inline(name="x", cpp_sources="int f(int a) { return a; }", functions=["f"])
ACTIVE = [False]


def helper(x):
    if ACTIVE[0]:  # flipped by whatever tells the profiled forward apart
        return torch.empty_like(x)
    return torch.relu(x)


class ModelNew(nn.Module):
    def forward(self, x):
        return helper(x)
"""


PLAIN = RELU_HELPER.replace("        return helper(x)", "        return x").replace(
  RELU_HELPER[RELU_HELPER.index("def helper") : RELU_HELPER.index("class ModelNew")], ""
)


def test_torch_compute_in_a_module_level_helper_is_refused():
  # 0063b19 scanned only ModelNew's methods; the helper ran torch.relu except under the profiler.
  v = check_candidate(RELU_HELPER, STRICT, "cpu")
  assert v.kind is FailureKind.TORCH_COMPUTE and "torch.relu" in v.reason, v
  lam = RELU_HELPER.replace("def helper(x):", "act = lambda x: torch.relu(x)\n\ndef helper_(x):")
  assert check_candidate(lam, STRICT, "cpu").kind is FailureKind.TORCH_COMPUTE
  # Torch compute named without a call: the forward is torch.relu itself.
  bare = PLAIN.replace("    def forward(self, x):\n        return x", "    forward = torch.relu")
  v = check_candidate(bare, STRICT, "cpu")
  assert v.kind is FailureKind.TORCH_COMPUTE and "torch.relu" in v.reason, v


def test_getattr_aliases_cannot_reach_sys_modules():
  # 0063b19 refused only calls literally named getattr; torch.sys reached sys.modules (and the worker's
  # profiler hook through it).
  base = PLAIN
  for line in (
    "g = getattr\nm = g(g(torch, 'sys'), 'modules')",
    "m = (lambda: torch)().sys.modules",
    "import sys as s\nm = s.modules",
    "b = __builtins__",
  ):
    v = check_candidate(base + "\n" + line + "\n", STRICT, "cpu")
    assert v.kind is FailureKind.FORBIDDEN_IMPORT, (line, v)
  assert check_candidate(base, STRICT, "cpu").kind is FailureKind.OK


def test_asking_whether_the_profiler_is_on_is_refused():
  # The helper of 0063b19's row 5 needs to tell the profiled forward apart; any way of naming the
  # profiler is refused (the C++ ways are undefined symbols: test below).
  for line in (
    "on = torch.autograd._profiler_enabled",
    "from torch.autograd import profiler",
    "on = torch.autograd.profiler._is_profiler_enabled",
  ):
    v = check_candidate(PLAIN + "\n" + line + "\n", STRICT, "cpu")
    assert v.kind is FailureKind.FRAME_INTROSPECTION and "profiler" in v.reason, (line, v)


def test_the_evidence_collector_is_bound_before_candidate_code():
  from verifier.candidate import candidate_main, evidence

  rt = candidate_main.CandidateRuntime(None, "cpu", "/nonexistent")
  real = evidence.collect_evidence
  evidence.collect_evidence = lambda *a: (None, None)  # what a candidate reaching it would do
  try:
    assert rt.collect_evidence is real
  finally:
    evidence.collect_evidence = real


OMP = PLAIN.replace(
  'cpp_sources="int f(int a) { return a; }"',
  'cpp_sources="int f(int a) {\\n#pragma omp parallel for num_threads(64)\\n'
  'for (int i = 0; i < a; ++i) {}\\nreturn a; }"',
)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_openmp_is_refused_like_other_threads(device):
  assert check_candidate(OMP, STRICT, device).kind is FailureKind.THREAD_OR_STREAM
  flag = OMP.replace("#pragma omp parallel for num_threads(64)", "").replace(
    'functions=["f"]', 'functions=["f"], extra_cflags=["-fopenmp"]'
  )
  v = check_candidate(flag, STRICT, device)
  assert v.kind is FailureKind.THREAD_OR_STREAM and "openmp" in v.reason, v


MOCK_ATEN = r"""
namespace c10 { struct Scalar { double v; }; }
namespace at {
struct Tensor { void* p; };
#define BACKEND_NS cpu
namespace BACKEND_NS { Tensor clamp_min(const Tensor&, const c10::Scalar&); }
namespace _ops { struct empty_like { static Tensor call(const Tensor&); }; }
void enableRecordFunction(bool);
namespace cuda { void* getCurrentCUDAStream(signed char); }
}
extern "C" void* PyImport_ImportModule(const char*);
extern "C" void GOMP_parallel(void (*)(void*), void*, unsigned, unsigned);
at::Tensor clamp(const at::Tensor& x, const c10::Scalar& s) { return at::BACKEND_NS::clamp_min(x, s); }
at::Tensor fresh(const at::Tensor& x) { at::cuda::getCurrentCUDAStream(0); return at::_ops::empty_like::call(x); }
void quiet() { at::enableRecordFunction(false); }
namespace at { bool hasCallbacks(); }
bool observed() { return at::hasCallbacks(); }
void* torch_module() { return PyImport_ImportModule("torch"); }
void omp(void (*f)(void*)) { GOMP_parallel(f, nullptr, 64, 0); }
#include <thread>
void spawn() { std::thread t([] {}); t.join(); }
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler")
def test_the_built_extensions_undefined_symbols_decide_whatever_macro_produced_them(tmp_path):
  # 0063b19 read the C++ before the preprocessor (at::BACKEND_NS::clamp_min passed) and never saw
  # RecordFunctionGuard(false) or torch reached through pybind11.
  (tmp_path / "m.cpp").write_text(MOCK_ATEN)
  so = tmp_path / "m.so"
  subprocess.run(["g++", "-shared", "-fPIC", "-o", str(so), str(tmp_path / "m.cpp")], check=True)
  found = {s: artefact_check.judge_symbol(s) for s in artefact_check.undefined_symbols(str(so))}
  kinds = {s: f.kind for s, f in found.items() if f is not None}
  expected = {
    "clamp_min": FailureKind.DIRECT_ATEN_CALL,  # at::cpu::clamp_min
    "enableRecordFunction": FailureKind.DIRECT_ATEN_CALL,
    "hasCallbacks": FailureKind.DIRECT_ATEN_CALL,  # is the profiler on?
    "PyImport_ImportModule": FailureKind.FORBIDDEN_IMPORT,
    "GOMP_parallel": FailureKind.THREAD_OR_STREAM,
    "St6thread": FailureKind.THREAD_OR_STREAM,  # std::thread
  }
  for part, kind in expected.items():
    assert {k for s, k in kinds.items() if part in s} == {kind}, (part, kinds)
  assert all(any(part in s for part in expected) for s in kinds), kinds  # nothing else refused
  allowed = [s for s, f in found.items() if f is None]
  assert any("empty_like" in s for s in allowed) and any(
    "getCurrentCUDAStream" in s for s in allowed
  )
  assert artefact_check.judge_extension(str(so)).kind in set(kinds.values())
  bad = tmp_path / "bad.so"
  bad.write_bytes(b"\x7fELF" + b"\0" * 10)
  assert artefact_check.judge_extension(str(bad)).kind is FailureKind.COMPILE_ERROR


# Rows 6 and 7 in one extension (one build): at::cpu::clamp_min through a macro, RecordFunction switched
# off, and torch.relu reached from C++ through pybind11.
MACRO_ATEN = holes.candidate("        return good(a, b, self.scale)").replace(
  "void zero_raw(",
  "namespace c10 { struct Scalar { double v; }; }\n"
  "namespace at { struct Tensor { void* p; }; void enableRecordFunction(bool);\n"
  "#define BACKEND_NS cpu\n"
  "namespace BACKEND_NS { Tensor clamp_min(const Tensor&, const c10::Scalar&); } }\n"
  "at::Tensor clamp(const at::Tensor& x, const c10::Scalar& s) "
  "{ return at::BACKEND_NS::clamp_min(x, s); }\n"
  "pybind11::object quiet_relu(pybind11::object x) { at::enableRecordFunction(false);\n"
  '  return pybind11::module_::import("torch").attr("relu")(x); }\n'
  "void zero_raw(",
)


def test_kernels_reached_past_the_source_rules_are_refused_from_the_built_extension(service):
  # 0063b19: at::cpu::clamp_min through #define BACKEND_NS cpu, and C++ calling torch's relu through
  # pybind11 with RecordFunction off, passed the source rules; reward 1.
  assert (
    check_candidate(MACRO_ATEN, STRICT, "cpu").kind is FailureKind.OK
  )  # the source rules miss it
  r = _verify(service, "macro-aten", MACRO_ATEN, strictness="strict", measure_performance=False)
  assert r.failure_kind in (FailureKind.DIRECT_ATEN_CALL, FailureKind.FORBIDDEN_IMPORT), r.reason
  assert r.reward == 0.0
  _, svc = service
  (so,) = [p for p in pathlib.Path(svc.cfg.cache_dir).glob("*/vt_holes.so") if _has_clamp(p)]
  kinds = {}
  for sym in artefact_check.undefined_symbols(str(so)):
    found = artefact_check.judge_symbol(sym)
    if found is not None:
      kinds[artefact_check.nested_name(sym)[-1:][0] if sym.startswith("_ZN") else sym] = found.kind
  assert kinds == {
    "clamp_min": FailureKind.DIRECT_ATEN_CALL,
    "enableRecordFunction": FailureKind.DIRECT_ATEN_CALL,
    "PyImport_ImportModule": FailureKind.FORBIDDEN_IMPORT,
  }, kinds


def _has_clamp(path) -> bool:
  return any("clamp_min" in s for s in artefact_check.undefined_symbols(str(path)))


# ---- issue 37: compute outside the candidate's own code, judged on every call ------------------------
COMPUTE_OPTS = dict(
  strictness="strict", num_correct_trials=compute.TRIALS, measure_performance=False
)


def _needs_host_evidence(r):
  unavailable = [w for w in r.warnings if "host evidence unavailable" in w]
  if unavailable:  # perf_event_paranoid >= 3 without root, or no perf support in the kernel
    pytest.skip(unavailable[0])


@pytest.mark.parametrize(
  "name,library",
  [
    ("OPERATOR", "libtorch_cpu"),
    ("METHODCALLER", "libtorch_cpu"),
    ("DLSYM_ATEN", "libtorch_cpu"),
    ("NUMPY", "_multiarray_umath"),
  ],
)
def test_work_done_by_a_library_or_numpy_gets_no_reward(service, name, library):
  # c10e1a8 rewarded all four (only the last trial was profiled, in process, through the dispatcher):
  # now the checker samples where the worker's CPU time goes, from outside it, on every judged call.
  src = getattr(compute, name)
  r = _verify(service, f"compute-{name}", src, compute.LIBRARY_REFERENCE, **COMPUTE_OPTS)
  _needs_host_evidence(r)
  assert r.failure_kind is FailureKind.HOST_COMPUTE and r.reward == 0.0, (r.failure_kind, r.reason)
  assert library in r.reason.split("most in:")[1].split(",")[0], r.reason


def test_an_honest_kernel_passes_the_host_evidence_in_trials_and_timed_calls(service):
  r = _verify(
    service,
    "compute-honest",
    compute.HONEST,
    compute.REFERENCE,
    **dict(COMPUTE_OPTS, measure_performance=True),
  )
  _ok(r)
  assert not [w for w in r.warnings if "host evidence" in w], r.warnings


def test_library_work_in_the_timed_calls_only_gets_no_reward(service):
  # its own kernel in every correctness trial, torch's in the timed calls
  r = _verify(
    service,
    "compute-timed-only",
    compute.TIMED_ONLY,
    compute.TIMED_REFERENCE,
    **dict(COMPUTE_OPTS, measure_performance=True),
  )
  _needs_host_evidence(r)
  assert r.failure_kind is FailureKind.HOST_COMPUTE and r.reward == 0.0, (r.failure_kind, r.reason)


def test_one_untimed_trial_is_raised_to_trials_the_host_evidence_can_judge(service):
  # 2b7db57: an RL request (one trial, no timing) had only its warm-up forward to judge, with none of a
  # first call's allowance: the honest kernel got HOST_COMPUTE (libpython, libtorch_python), so `make
  # demo`'s RL phase got reward 0. Its one trial is now three (warm-up, judged, profiled).
  one = dict(COMPUTE_OPTS, num_correct_trials=1)
  r = _verify(service, "compute-honest-1", compute.HONEST, compute.TIMED_REFERENCE, **one)
  _ok(r)
  # (numpy over the 4M-float reference: one judged forward of the 256K one is under the sampling's margin)
  r = _verify(service, "compute-numpy-1", compute.NUMPY, compute.REFERENCE, **one)
  _needs_host_evidence(r)
  assert r.failure_kind is FailureKind.HOST_COMPUTE and r.reward == 0.0, (r.failure_kind, r.reason)


def test_judged_requests_get_at_least_the_trials_the_evidence_needs():
  from verifier.check.checker import JUDGED_TRIALS, correctness_trials

  def trials(**o):
    return correctness_trials(VerifyOptions(device="cpu", **o))

  assert JUDGED_TRIALS == 3
  assert trials(num_correct_trials=1, measure_performance=False) == 3
  assert trials(num_correct_trials=5, measure_performance=False) == 5
  assert trials(num_correct_trials=1, measure_performance=True) == 1  # timed calls are judged
  assert trials(num_correct_trials=1, measure_performance=False, strictness="off") == 1
