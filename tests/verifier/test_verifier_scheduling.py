"""GPU-stage scheduling rules: memory-aware admission and reference timings measured once per task."""

import asyncio
import dataclasses

import pytest

torch = pytest.importorskip("torch")

import verifier_cases as cases  # noqa: E402

from verifier.api.contract import FailureKind, VerifyOptions, VerifyRequest  # noqa: E402
from verifier.check.timed_calls import MAX_BURST  # noqa: E402
from verifier.serve.service import ServiceConfig, VerifierService, admission_units  # noqa: E402

GiB = 1 << 30


def test_admission_units_scale_with_the_reference_peak_and_stay_within_the_device():
  total = 140 * GiB  # one slot of four is 35 GiB
  assert admission_units(2 * GiB, total, 4) == 1  # 3 x 2 + 1 = 7 GiB
  assert admission_units(11 * GiB, total, 4) == 1  # 34 GiB fits one slot
  assert admission_units(12 * GiB, total, 4) == 2  # 37 GiB does not
  assert admission_units(30 * GiB, total, 4) == 3
  assert admission_units(100 * GiB, total, 4) == 4  # never more than the device
  assert admission_units(0, total, 4) == 1  # unknown peak: one slot
  assert admission_units(50 * GiB, total, 1) == 1


def test_timed_runs_of_one_reference_share_a_single_baseline_measurement(tmp_path):
  """Three timed candidates for one task: the reference is timed once and the others reuse that timing."""
  opts = VerifyOptions(
    device="cpu", timeout_s=300, num_correct_trials=2, num_perf_trials=5, measure_performance=True
  )
  cfg = ServiceConfig(
    device="cpu",
    cpu_slots=2,
    compile_workers=1,
    cache_dir=str(tmp_path / "builds"),
    scratch_root=str(tmp_path / "scratch"),
    mem_mb=3072,
    build_timeout_s=300,
    use_pch=False,
  )

  async def go():
    svc = VerifierService(cfg)
    await svc.start()
    try:
      await svc._build(
        VerifyRequest("warm", "t", cases.REFERENCE, cases.GOOD, opts)
      )  # one build, shared
      reqs = [
        VerifyRequest(f"timed-{k}", "t", cases.REFERENCE, cases.GOOD + f"\n# sample {k}\n", opts)
        for k in range(3)
      ]
      return svc, await asyncio.gather(*(svc.verify(r) for r in reqs))
    finally:
      await svc.close()

  svc, results = asyncio.run(go())
  assert [r.failure_kind for r in results] == [FailureKind.OK] * 3, [r.reason for r in results]
  assert svc.metrics.baselines_measured == 1
  baselines = {dataclasses.astuple(r.baseline) for r in results}
  assert len(baselines) == 1 and results[0].baseline.num_trials == 5
  # the timed calls go in bursts of MAX_BURST for tensors this small: 5 rounded up to one burst
  assert all(r.candidate.num_trials == MAX_BURST for r in results)
  # a speedup, or a time under what the CPU clock resolves (said so)
  assert all(r.speedup > 0 or any("no speedup" in w for w in r.warnings) for r in results)
