"""Run workers forked from the fork server (``fork_server=True``, verifier/zygote.py) keep the sandbox's
guarantees: one fresh process per candidate, crash/timeout/memory kills with the right kind, and recovery."""

import asyncio
import dataclasses
import os

import pytest

torch = pytest.importorskip("torch")

import verifier_cases as cases  # noqa: E402
from verifier_loop import BackgroundLoop  # noqa: E402

from verifier.contract import FailureKind, VerifyOptions, VerifyRequest  # noqa: E402
from verifier.service import ServiceConfig, VerifierService  # noqa: E402

OPTS = VerifyOptions(device="cpu", timeout_s=90, num_correct_trials=2)


@pytest.fixture(scope="module")
def forked(tmp_path_factory):
  root = tmp_path_factory.mktemp("forked")
  cfg = ServiceConfig(
    device="cpu",
    cpu_slots=2,
    compile_workers=1,
    cache_dir=str(root / "builds"),
    scratch_root=str(root / "scratch"),
    mem_mb=3072,
    build_timeout_s=300,
    fork_server=True,
    use_pch=False,
  )
  loop = BackgroundLoop()
  svc = VerifierService(cfg)
  loop.run(svc.start())
  yield loop, svc
  server = svc.run_pools["cpu"][0].fork_server
  pid = server.proc.pid
  loop.run(svc.close())
  loop.close()
  assert not list((root / "scratch").glob("*")), "scratch directories left behind"
  with pytest.raises(ProcessLookupError):
    os.kill(pid, 0)  # the fork server is gone too


def _verify(forked, *reqs):
  loop, svc = forked

  async def go():
    return await asyncio.gather(*(svc.verify(r) for r in reqs))

  return loop.run(go())


def _req(rid, source, **opts):
  return VerifyRequest(
    rid, "scaled_add", cases.REFERENCE, source, dataclasses.replace(OPTS, **opts)
  )


def test_forked_worker_verifies_a_good_candidate_without_importing_torch_again(forked):
  (r,) = _verify(forked, _req("good", cases.GOOD))
  assert r.failure_kind is FailureKind.OK and r.reward == 1.0, r.reason + r.logs
  phases = forked[1].metrics.snapshot()["run_phase_mean_s"]
  assert "startup_fork" in phases and "startup_import_torch" not in phases
  assert forked[1].run_pools["cpu"][0].fork_server.failures == 0


@pytest.mark.parametrize(
  "name,source,kind,needle",
  [
    ("segfault", cases.candidate("segfault"), FailureKind.CRASH, "SIGSEGV"),
    ("infinite_loop", cases.candidate("spin"), FailureKind.TIMEOUT, "wall-clock limit"),
    ("huge_allocation", cases.candidate("huge_alloc"), FailureKind.OUT_OF_MEMORY, "alloc"),
    (
      "input_mutation",
      cases.candidate("zero_inputs"),
      FailureKind.INPUT_MUTATION,
      "modified input",
    ),
  ],
  ids=["segfault", "infinite_loop", "huge_allocation", "input_mutation"],
)
def test_forked_worker_failures_get_their_kind_and_the_next_candidate_passes(
  forked, name, source, kind, needle
):
  bad, good = _verify(
    forked,
    _req(f"bad-{name}", source, timeout_s=8 if name == "infinite_loop" else 90),
    _req(f"good-after-{name}", cases.GOOD),
  )
  assert bad.failure_kind is kind, (bad.failure_kind, bad.reason, bad.logs[-2000:])
  assert bad.reward == 0.0 and needle.lower() in (bad.reason + bad.logs).lower(), bad.reason
  assert good.failure_kind is FailureKind.OK and good.reward == 1.0, good.reason + good.logs
