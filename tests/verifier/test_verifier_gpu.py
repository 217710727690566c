"""GPU tests (``pytest -m gpu tests/verifier``) on an NVIDIA host: adversarial kernels are rejected with the
right kind and the pool recovers; tensors cross between the checker and the candidate through device
buffers (CUDA VMM file descriptors); a reference that updates its own state (KernelBench's earlier
VanillaRNN) judges its identity candidate correct; DICE's 99 known-good infilling solutions are checked
against their ``pytorch_code`` and a JSON report is written to ``$VERIFIER_REPORT_DIR`` (default: the
pytest tmp dir).
"""

import asyncio
import collections
import dataclasses
import json
import os
import pathlib
import time

import pytest

torch = pytest.importorskip("torch")

import verifier_gpu_cases as g  # noqa: E402
import verifier_gpu_evidence_cases as ev  # noqa: E402
from verifier_loop import BackgroundLoop  # noqa: E402

from verifier.api.contract import FailureKind, VerifyOptions, VerifyRequest  # noqa: E402
from verifier.check.timed_calls import MAX_BURST  # noqa: E402
from verifier.bench import DEVICE_CLOCK_PHASES  # noqa: E402
from verifier.ipc import head_start  # noqa: E402
from verifier.ipc.head_start import HEAD_START_US  # noqa: E402
from verifier.serve.service import ServiceConfig, VerifierService, default_compile_workers  # noqa: E402

pytestmark = [
  pytest.mark.gpu,
  pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run on a GPU host)"
  ),
]

REPO = pathlib.Path(__file__).resolve().parents[2]
OPTS = VerifyOptions(device="cuda", timeout_s=120)


@pytest.fixture(scope="module")
def gpu_service(tmp_path_factory):
  root = tmp_path_factory.mktemp("gpu_verifier")
  major, minor = torch.cuda.get_device_capability(0)
  cfg = ServiceConfig(
    device="cuda",
    gpus=("0",),
    slots_per_gpu=4,
    compile_workers=default_compile_workers(),
    cache_dir=os.environ.get("VERIFIER_CACHE_DIR", str(root / "builds")),
    scratch_root=str(root / "scratch"),
    arch_list=f"{major}.{minor}",
    isolate_network=os.environ.get("VERIFIER_NO_NETNS") != "1",
    split_build=os.environ.get("VERIFIER_NO_SPLIT_BUILD") != "1",
    # the seccomp socket filter is on for CUDA candidates (the default); VERIFIER_BLOCK_SOCKETS_CUDA=0
    # runs the suite without it
    block_sockets_cuda=os.environ.get("VERIFIER_BLOCK_SOCKETS_CUDA") != "0",
  )
  loop = BackgroundLoop()
  svc = VerifierService(cfg)
  loop.run(svc.start())
  yield loop, svc
  loop.run(svc.close())
  loop.close()


def _verify(gpu_service, *reqs, on_result=None):
  """The results of ``reqs``, verified at once; ``on_result(request, result)`` as each arrives."""
  loop, svc = gpu_service

  async def one(r):
    res = await svc.verify(r)
    if on_result is not None:
      on_result(r, res)
    return res

  async def go():
    return await asyncio.gather(*(one(r) for r in reqs))

  return loop.run(go())


def _req(rid, ref, cand, **kw):
  return VerifyRequest(rid, rid, ref, cand, dataclasses.replace(OPTS, **kw))


def test_good_kernels_pass_with_a_speedup(gpu_service):
  # The add is timed at 16384^2 (about 0.6 ms): the checker's clock takes a round trip of ~2 ms with
  # ~0.1-0.2 ms of jitter beside each call, so the 4096^2 add (0.09 ms) was below its resolution.
  big_add = g.ADD_REFERENCE.replace("torch.randn(4096, 4096)", "torch.randn(16384, 16384)")
  add, mm = _verify(
    gpu_service,
    _req("good-add", big_add, g.GOOD_ADD, measure_performance=True),
    _req("good-mm", g.MATMUL_REFERENCE, g.GOOD_MATMUL, measure_performance=True),
  )
  for r in (add, mm):
    assert r.failure_kind is FailureKind.OK and r.reward == 1.0, (r.reason, r.logs[-3000:])
    # 100 timed calls, rounded up to whole bursts (several forwards to a round trip where they fit)
    assert r.speedup > 0 and 100 <= r.candidate.num_trials < 100 + MAX_BURST and r.device_name
  assert add.speedup > 0.5  # an elementwise add is memory-bound: about as fast as aten's


def test_the_checkers_clock_agrees_with_in_process_cuda_events(gpu_service):
  """Issue 25: a pass-through candidate (the reference's own code) timed on the checker's clock around
  each round trip, less the calibrated exchange cost, within 10% of its baseline: the same code timed by
  the previous method (CUDA events around each call, in process)."""
  from verifier.bench import pass_through

  ref = g.MATMUL_REFERENCE.replace("N = 1024", "N = 4096")
  (r,) = _verify(
    gpu_service,
    _req("clock-mm", ref, pass_through(ref), strictness="off", measure_performance=True),
  )
  assert r.failure_kind is FailureKind.OK, (r.reason, r.logs[-2000:])
  ratio = r.candidate.mean_ms / r.baseline.mean_ms
  assert 0.9 <= ratio <= 1.1, (ratio, r.candidate, r.baseline)


ADVERSARIAL = [
  (
    "result_reuse",
    g.MATMUL_REFERENCE,
    g.RESULT_REUSE,
    {FailureKind.WRONG_OUTPUT, FailureKind.NONFINITE_OUTPUT},
  ),
  ("input_zeroing", g.MATMUL_REFERENCE, g.INPUT_ZEROING, {FailureKind.INPUT_MUTATION}),
  ("non_default_stream", g.MATMUL_REFERENCE, g.NON_DEFAULT_STREAM, {FailureKind.THREAD_OR_STREAM}),
  (
    "illegal_memory_access",
    g.MATMUL_REFERENCE,
    g.ILLEGAL_ADDRESS,
    {FailureKind.CUDA_ERROR, FailureKind.CRASH},
  ),
  (
    "defined_never_launched",
    g.MATMUL_REFERENCE,
    g.DEFINED_NOT_LAUNCHED_STATIC,
    {FailureKind.KERNEL_NOT_LAUNCHED},
  ),
  (
    "dead_launch_host_compute",
    g.MATMUL_REFERENCE.replace("N = 1024", "N = 256"),
    g.NEVER_LAUNCHED,
    {FailureKind.KERNEL_NOT_LAUNCHED},
  ),
  ("torch_matmul_forward", g.MATMUL_REFERENCE, g.TORCH_MATMUL_FORWARD, {FailureKind.TORCH_COMPUTE}),
]


@pytest.mark.parametrize("name,ref,cand,kinds", ADVERSARIAL, ids=[a[0] for a in ADVERSARIAL])
def test_adversarial_kernel_is_rejected_and_pool_recovers(gpu_service, name, ref, cand, kinds):
  bad, good = _verify(
    gpu_service,
    _req(f"adv-{name}", ref, cand),
    _req(f"good-after-{name}", g.ADD_REFERENCE, g.GOOD_ADD),
  )
  assert bad.failure_kind in kinds, (bad.failure_kind, bad.reason, bad.logs[-3000:])
  assert bad.reward == 0.0
  assert good.failure_kind is FailureKind.OK and good.reward == 1.0, (
    good.reason,
    good.logs[-2000:],
  )


# Issue 37: every call judged from CUPTI records (and the host's CPU time sampled from outside). Each of
# these got reward 1 under strict at c10e1a8 (the table; verifier_gpu_evidence_cases says how).
EVIDENCE = [
  ("operator_matmul", g.MATMUL_REFERENCE, ev.OPERATOR_MATMUL, FailureKind.FOREIGN_KERNELS),
  ("cublas_dlsym", g.MATMUL_REFERENCE, ev.CUBLAS_DLSYM, FailureKind.FOREIGN_KERNELS),
  ("aten_relu_dlsym", ev.RELU_REFERENCE, ev.ATEN_RELU_DLSYM, FailureKind.FOREIGN_KERNELS),
  ("numpy_host", ev.RELU_REFERENCE, ev.NUMPY_HOST, FailureKind.HOST_COMPUTE),
  ("zero_copy_host", ev.RELU_REFERENCE, ev.ZERO_COPY_HOST, FailureKind.HOST_COMPUTE),
  # (session 23: the small task's copy was under the fixed 64 KiB bound, its pinned memory not recorded)
  ("numpy_host_small", ev.RELU_SMALL_REFERENCE, ev.NUMPY_HOST, FailureKind.HOST_COMPUTE),
  ("zero_copy_host_small", ev.RELU_SMALL_REFERENCE, ev.ZERO_COPY_HOST, FailureKind.HOST_COMPUTE),
  ("graph_dlsym", ev.RELU_REFERENCE, ev.GRAPH_DLSYM, FailureKind.THREAD_OR_STREAM),
  ("side_stream", ev.RELU_REFERENCE, ev.SIDE_STREAM, FailureKind.THREAD_OR_STREAM),
  ("second_context", ev.RELU_REFERENCE, ev.SECOND_CONTEXT, FailureKind.THREAD_OR_STREAM),
]


@pytest.mark.parametrize("name,ref,cand,kind", EVIDENCE, ids=[e[0] for e in EVIDENCE])
def test_work_not_done_by_the_candidates_own_kernels_gets_no_reward(
  gpu_service, name, ref, cand, kind
):
  # the honest ReLU beside each, at the small task's size where the bad one has it (the small-task
  # bounds must not refuse an honest kernel there)
  good_ref = ev.RELU_SMALL_REFERENCE if ref is ev.RELU_SMALL_REFERENCE else ev.RELU_REFERENCE
  bad, good = _verify(
    gpu_service,
    _req(f"ev-{name}", ref, cand, num_correct_trials=ev.TRIALS),
    _req(f"ev-good-after-{name}", good_ref, ev.GOOD_RELU, num_correct_trials=ev.TRIALS),
  )
  if name == "zero_copy_host" and any("host evidence unavailable" in w for w in bad.warnings):
    pytest.skip(f"this host refuses to sample the worker: {bad.warnings}")
  assert bad.failure_kind is kind and bad.reward == 0.0, (
    bad.failure_kind,
    bad.reason,
    bad.logs[-2000:],
  )
  assert good.failure_kind is FailureKind.OK and good.reward == 1.0, (good.reason, good.warnings)


def test_a_strict_verdict_says_whether_kernels_reach_pageable_host_memory(gpu_service):
  """Where the GPU's kernels read pageable host memory (HMM), a candidate's own kernels can hand its
  inputs to the host with no CUDA call, so no device record shows it: a strict report says so (a phase
  and a warning) exactly when the device's attribute is on (session 23: not yet seen on the H200)."""
  from verifier.ipc import cuda_driver

  on = cuda_driver.pageable_memory_access()
  (r,) = _verify(
    gpu_service, _req("hmm-good", ev.RELU_REFERENCE, ev.GOOD_RELU, num_correct_trials=ev.TRIALS)
  )
  print(f"pageable memory access (HMM): {on}")
  assert r.failure_kind is FailureKind.OK, (r.reason, r.warnings)
  assert any("pageable host memory" in w for w in r.warnings) == on, r.warnings


def test_every_call_is_judged_from_device_records_with_the_timing_on(gpu_service):
  (r,) = _verify(
    gpu_service,
    _req(
      "ev-good-timed", ev.RELU_REFERENCE, ev.GOOD_RELU + "\n# timed\n", measure_performance=True
    ),
  )
  assert r.failure_kind is FailureKind.OK and r.reward == 1.0 and r.speedup > 0, (
    r.reason,
    r.warnings,
  )
  assert not [w for w in r.warnings if "unavailable" in w or "incomplete" in w], r.warnings


def test_tensors_cross_through_device_buffers_and_the_worker_is_confined(gpu_service):
  (r,) = _verify(
    gpu_service, _req("transport-add", g.ADD_REFERENCE, g.GOOD_ADD + "\n# transport\n")
  )
  assert r.failure_kind is FailureKind.OK, (r.reason, r.logs[-2000:])
  assert gpu_service[1].metrics.transports.get("cuda_vmm", 0) >= 1, (
    dict(gpu_service[1].metrics.transports),
    r.warnings,
  )
  # "confinement degraded": the pool dropped a layer for every worker (on the H200 since session 11 a
  # Landlock-confined worker's CUDA start failed with error 304, and this test did not notice)
  degraded = (
    "unavailable",
    "refused",
    "not size-limited",
    "not disabled",
    "can read it",
    "confinement degraded",
  )
  assert not [w for w in r.warnings if any(d in w for d in degraded)], r.warnings


def test_stateful_reference_identity_candidate_passes(gpu_service):
  (r,) = _verify(
    gpu_service,
    _req("vanilla-rnn", g.VANILLA_RNN_REFERENCE, g.VANILLA_RNN_IDENTITY, strictness="off"),
  )
  assert r.failure_kind is FailureKind.OK and r.reward == 1.0, (r.reason, r.logs[-2000:])


def test_non_default_stream_is_timed_honestly_under_kernelbench_rules(gpu_service):
  """With the static checks off, a kernel launched on an unsynchronised side stream gains nothing.

  Its output races with the read of it: either the re-check after timing catches wrong values (what
  the H200 showed on 2026-11-29: 203,360 of 1,048,576 values off) or, when it passes, the device-wide
  synchronisation around the timed region charges it all of its work.
  """
  side, same = _verify(
    gpu_service,
    _req(
      "stream-kb",
      g.MATMUL_REFERENCE,
      g.NON_DEFAULT_STREAM,
      strictness="off",
      measure_performance=True,
    ),
    _req("same-kb", g.MATMUL_REFERENCE, g.GOOD_MATMUL, strictness="off", measure_performance=True),
  )
  assert same.failure_kind is FailureKind.OK, same.reason
  if side.failure_kind is FailureKind.OK:
    assert (
      side.candidate.median_ms > 0.5 * same.candidate.median_ms
    )  # no free speedup from hiding work
  else:
    # the race read as wrong values, or as the NaN the output buffer was poisoned with
    assert side.failure_kind in (FailureKind.WRONG_OUTPUT, FailureKind.NONFINITE_OUTPUT), (
      side.reason
    )
    assert side.reward == 0.0


def _data_file(name: str) -> pathlib.Path:
  for base in (
    os.environ.get("VERIFIER_DATA", ""),
    REPO / ".gpu_data" / "verifier",
    REPO.parent / "shared" / "data" / "dice_rl",
  ):
    if base and (pathlib.Path(base) / name).is_file():
      return pathlib.Path(base) / name
  pytest.skip(f"{name} not found (set VERIFIER_DATA or provide ../shared/data)")


class _DiceReport:
  """DICE's verdicts as they arrive, for a run a time limit may cut: a line per verdict (seconds since
  the start, request, kind, compile and run seconds, what the service is doing) on stdout and in
  ``dice_progress.txt``; the report so far in ``dice_known_good.json`` (rewritten whole each time) and
  the service's mean seconds per run phase in ``dice_phases.json``."""

  def __init__(self, out: pathlib.Path, tasks: list, svc):
    self.out, self.svc = out, svc
    self.order = [t["id"] for t in tasks]
    self.ids = {_dice_request_id(t): t["id"] for t in tasks}
    self.entries: dict = {}
    self.t0 = time.monotonic()
    self.done = 0
    out.mkdir(parents=True, exist_ok=True)
    self.progress = open(out / "dice_progress.txt", "w")

  def line(self, text: str) -> None:
    text = f"dice {time.monotonic() - self.t0:7.1f} s: {text}"
    print(text, flush=True)
    self.progress.write(text + "\n")
    self.progress.flush()

  def strict(self, req, r) -> None:
    self._arrived(req, r)
    self.entries[self.ids[req.request_id]] = {
      "id": self.ids[req.request_id],
      "kind": r.failure_kind.value,
      "reason": r.reason[:600],
      "strict_correct": r.strict_correct,
      "max_abs_diff": r.max_abs_diff,
      "compile_s": r.compile_s,
      "run_s": r.run_s,
      "build_cached": r.build_cached,
      "kernelbench_kind": "OK" if r.failure_kind is FailureKind.OK else "",  # "": not yet known
      "kernelbench_reason": "",
      "logs": r.logs[-1500:] if r.failure_kind is not FailureKind.OK else "",
      "warnings": [w[:300] for w in r.warnings],
    }
    self.save()

  def kernelbench(self, req, r) -> None:
    self._arrived(req, r)
    self.entries[self.ids[req.request_id.removesuffix("-kb")]].update(
      kernelbench_kind=r.failure_kind.value, kernelbench_reason=r.reason[:600]
    )
    self.save()

  def _arrived(self, req, r) -> None:
    self.done += 1
    m = self.svc.metrics
    self.line(
      f"[{self.done}] {req.request_id} {r.failure_kind.value} compile {r.compile_s:.1f} s"
      f"{' (cached)' if r.build_cached else ''} run {r.run_s:.1f} s | pending {m.pending}, "
      f"building {m.in_build}, running {m.in_run}"
    )

  def save(self) -> None:
    report = [self.entries[i] for i in self.order if i in self.entries]
    _write_json(self.out / "dice_known_good.json", report)
    _write_json(self.out / "dice_phases.json", self.svc.metrics.snapshot()["run_phase_mean_s"])

  def close(self) -> None:
    self.progress.close()


def _dice_request_id(task: dict) -> str:
  return f"dice-{task['id']}"


def _write_json(path: pathlib.Path, value) -> None:
  """Whole or not at all: a run cut mid-write leaves the previous version."""
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(value, indent=1))
  os.replace(tmp, path)


def test_dice_known_good_solutions(gpu_service, tmp_path):
  tasks = json.loads(_data_file("kernel_infilling_evaluation.json").read_text())
  out = pathlib.Path(os.environ.get("VERIFIER_REPORT_DIR", tmp_path))
  dice = _DiceReport(out, tasks, gpu_service[1])
  reqs = [_req(_dice_request_id(t), t["pytorch_code"], t["cuda_code"]) for t in tasks]
  try:
    dice.line(f"{len(reqs)} under strict")
    results = _verify(gpu_service, *reqs, on_result=dice.strict)
    again = [
      dataclasses.replace(
        q,
        request_id=q.request_id + "-kb",
        options=dataclasses.replace(q.options, strictness="kernelbench"),
      )
      for q, r in zip(reqs, results)
      if r.failure_kind is not FailureKind.OK
    ]
    dice.line(f"{len(again)} not OK again under kernelbench")
    _verify(gpu_service, *again, on_result=dice.kernelbench)
  finally:
    dice.close()
  report = [dice.entries[t["id"]] for t in tasks]
  strict = collections.Counter(x["kind"] for x in report)
  kb = collections.Counter(x["kernelbench_kind"] for x in report)
  # jobs by the tasks they held beyond their runtime's own at the start (task_limits: the CUDA
  # runtime's later threads; RUNTIME_TRANSIENT_TASKS["cuda"] allows 2 under strict)
  beyond = dict(sorted(gpu_service[1].metrics.tasks_beyond_baseline.items()))
  print("strict:", dict(strict), "kernelbench:", dict(kb), "tasks beyond baseline:", beyond)
  assert strict["INTERNAL_ERROR"] == 0 and kb["INTERNAL_ERROR"] == 0
  assert kb["OK"] >= 60, dict(kb)


_TWICE_KERNEL = r"""
#include <torch/extension.h>
__global__ void twice_kernel(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.f * x[i];
}
"""
_TWICE_HOST = {
  # tensors and torch:: factories only: main.cpp builds on the lean torch headers
  True: """
torch::Tensor twice(torch::Tensor x) {
    auto y = torch::empty_like(x);
    int n = x.numel();
    twice_kernel<<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}
""",
  # the C++ frontend (torch::nn) is not in the lean headers: g++ fails in main.cpp, extension.h builds it
  False: """
torch::Tensor twice(torch::Tensor x) {
    auto r = torch::nn::functional::relu(x);
    auto y = torch::empty_like(r);
    int n = r.numel();
    twice_kernel<<<(n + 255) / 256, 256>>>(r.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}
""",
}


@pytest.mark.parametrize("lean", [True, False], ids=["lean_headers", "extension_h_fallback"])
def test_split_build_on_lean_torch_headers_falls_back_to_extension_h(tmp_path, lean):
  from torch.utils.cpp_extension import load_inline

  from verifier.build.build_cache import CachedLoadInline

  cache = CachedLoadInline(load_inline, str(tmp_path), split=True, use_pch=False)
  module = cache(
    name=f"twice_{'lean' if lean else 'full'}",
    cpp_sources="torch::Tensor twice(torch::Tensor x);",
    cuda_sources=_TWICE_KERNEL + _TWICE_HOST[lean],
    functions=["twice"],
  )
  event = cache.events[-1]
  assert event["split"] and event["lean"] is lean and not event["error"], event
  if lean:
    assert "lean_error" not in event
  else:
    assert "main.cpp" in event["lean_error"] and "nn" in event["lean_error"], event["lean_error"]
  x = torch.randn(4099, device="cuda")
  torch.testing.assert_close(module.twice(x), 2 * (x if lean else x.relu()))


def _kernelbench_times(
  reference: str,
  candidate: str,
  build_root: str,
  scratch: str,
  device: str = "cuda",
  head=None,
) -> tuple:
  """The candidate's and the reference's mean times (ms) in this process, timed KernelBench's way
  (main's ``time_execution_with_cuda_event``: CUDA events on the current stream, L2 flushed before
  each call, warm-up first; ``timing.time_calls``, which the checker's baseline uses too), 100 calls
  each, on the same inputs. With ``head`` (a ``head_start.HeadStart``) each call's start event waits
  behind that spin, as the verifier's clocks do: device time alone, without the host's dispatch. The
  candidate's extension comes from the service's build cache (read-only: a miss builds under
  ``scratch``)."""
  import torch.utils.cpp_extension as cpp_extension

  from verifier.build import build_cache
  from verifier.check import timing

  ref, cand = {"__name__": "reference"}, {"__name__": "candidate"}
  exec(compile(reference, "reference", "exec"), ref)
  real = cpp_extension.load_inline
  build_cache.install(build_root, split=True, publish=False, scratch=scratch)
  try:
    exec(compile(candidate, "candidate", "exec"), cand)
  finally:
    cpp_extension.load_inline = real
  device = torch.device(device)
  torch.manual_seed(0)
  inputs = [x.to(device) for x in ref["get_inputs"]()]
  init = ref["get_init_inputs"]()
  models = cand["ModelNew"](*init).to(device), ref["Model"](*init).to(device)
  head = head or head_start.NONE
  return tuple(
    timing.time_forward(m, inputs, device, trials=100, warmup=3, head=head).mean_ms for m in models
  )


def test_a_kernel_under_a_tenth_of_a_millisecond_is_timed_like_cuda_events(
  gpu_service, tmp_path, monkeypatch
):
  """Issue 37, item 9's accuracy target: a float4 ReLU over 32M floats (~0.07 ms, about as fast as
  aten's) reported within 10 % of an independent KernelBench-style timing of the same pair in this
  process, the median of three runs (c10e1a8: 0.22, 0.28, 0.32 where that timing said 1.01-1.03: ~0.25
  ms a call charged to the candidate; session 20, on the host clock: 0.27-0.39 against 0.94; session 21,
  on the device clock: 0.75, the worker's 36 us path to the launch inside each span), each timed by the
  device clock (its forwards' spans between marker copies), not its floor, behind the head start
  (``head_start``: the worker spins before each pre marker, the checker's baseline before its start
  event); the independent timing here has none (KernelBench's own)."""
  _, svc = gpu_service
  before = dict(svc.metrics.run_phase_s)
  runs = _verify(
    gpu_service,
    *[
      _req(f"relu4-{i}", g.RELU_REFERENCE, g.GOOD_RELU4 + f"\n# {i}\n", measure_performance=True)
      for i in range(3)
    ],
  )
  for r in runs:
    assert r.failure_kind is FailureKind.OK, (r.reason, r.logs[-2000:])
  phases = {k: v - before.get(k, 0.0) for k, v in svc.metrics.run_phase_s.items()}
  monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", svc.cfg.arch_list)  # the service's build key
  cand_ms, ref_ms = _kernelbench_times(
    g.RELU_REFERENCE, g.GOOD_RELU4, svc.cfg.cache_dir, str(tmp_path)
  )
  # The same pair behind the head start in process: device time alone, what the verifier's clocks
  # compare. Beside the KernelBench-style ratio it splits a miss into the clocks' own error (this
  # ratio) and the host dispatch KernelBench's events count and the head start leaves out.
  dev_cand_ms, dev_ref_ms = _kernelbench_times(
    g.RELU_REFERENCE, g.GOOD_RELU4, svc.cfg.cache_dir, str(tmp_path), head=head_start.calibrated()
  )
  speedups = sorted(r.speedup for r in runs)
  independent = ref_ms / cand_ms
  device_only = dev_ref_ms / dev_cand_ms
  print(
    f"relu4: verifier speedups {[round(x, 3) for x in speedups]}, candidate ms "
    f"{[round(r.candidate.mean_ms, 4) for r in runs]}, baseline ms {runs[0].baseline.mean_ms:.4f}; "
    f"KernelBench-style in process: candidate {cand_ms:.4f} ms, reference {ref_ms:.4f} ms, "
    f"speedup {independent:.3f}; ratio {speedups[1] / independent:.3f}; in process behind the head "
    f"start: candidate {dev_cand_ms:.4f} ms, reference {dev_ref_ms:.4f} ms, speedup "
    f"{device_only:.3f}, ratio {speedups[1] / device_only:.3f}; sums over the runs: "
    + ", ".join(
      f"{k} {phases.get(k, 0.0):.4f}" for k in (*DEVICE_CLOCK_PHASES, "reference_in_process_ms")
    )
  )
  assert phases.get("timing_device_clock") == 3.0, phases  # every run on the device clock
  assert phases.get("timing_head_start_us") == 3 * HEAD_START_US, phases  # each worker spun
  assert 0.9 <= speedups[1] / independent <= 1.1, (speedups, independent, cand_ms, ref_ms)


def test_nothing_a_candidate_started_runs_on_the_gpu_after_its_verdict(gpu_service):
  """Issue 37, item 3: a kernel left spinning for a minute on a non-blocking stream of the candidate's:
  once the verdict is out, its process (and with it its CUDA context and the kernel) is gone (c10e1a8
  answered when the worker's waiter had died, before the kernel finished tearing the namespace down)."""
  (r,) = _verify(
    gpu_service, _req("spin-after", g.RELU_REFERENCE, g.SPINS_AFTER_ITS_VERDICT, strictness="off")
  )
  left = []
  for d in os.listdir("/proc"):
    try:
      with open(f"/proc/{d}/comm") as f:
        if f.read().strip() == g.COMM_GPU:
          left.append(int(d))
    except (OSError, ValueError):
      pass
  for pid in left:
    os.kill(pid, 9)
  assert not left, (r.failure_kind, r.reason)
