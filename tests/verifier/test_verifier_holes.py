"""Issue 14's holes, each tried against a running CPU service with a candidate written for it: the
candidate gets reward 0 with the right kind (or, for containment, is contained), no file appears outside
its scratch, no process of it outlives the check, and the service then serves a good candidate.

One module-scoped service; the candidates share one pybind11-only extension (built once, in seconds).
"""

import asyncio
import dataclasses
import logging
import math
import os
import signal
import time

import pytest

torch = pytest.importorskip("torch")

import verifier_hole_cases as holes  # noqa: E402
from verifier_loop import cpu_service  # noqa: E402

from verifier.api.contract import FailureKind, VerifyOptions, VerifyRequest  # noqa: E402
from verifier.check.timed_calls import MAX_BURST  # noqa: E402

OPTS = VerifyOptions(device="cpu", timeout_s=60, num_correct_trials=2, strictness="off")


@pytest.fixture(scope="module")
def service(tmp_path_factory):
  root = tmp_path_factory.mktemp("holes")
  with cpu_service(root, cpu_slots=2) as (loop, svc):
    yield loop, svc, root


def _verify(service, *reqs):
  loop, svc, _ = service

  async def go():
    return await asyncio.gather(*(svc.verify(r) for r in reqs))

  return loop.run(go())


def _req(rid, source, reference=holes.REFERENCE, **opts):
  return VerifyRequest(rid, "holes", reference, source, dataclasses.replace(OPTS, **opts))


def _processes_with(marker: str) -> list[int]:
  found = []
  for d in os.listdir("/proc"):
    if d.isdigit():
      try:
        with open(f"/proc/{d}/cmdline", "rb") as f:
          if marker.encode() in f.read():
            found.append(int(d))
      except OSError:
        pass
  return found


def test_good_candidate_passes_and_its_build_is_cold_then_cached(service):
  first, again = _verify(service, _req("good-cold", holes.GOOD), _req("good-warm", holes.GOOD))
  assert first.failure_kind is FailureKind.OK and first.reward == 1.0, first.reason + first.logs
  assert again.failure_kind is FailureKind.OK
  # The first compiled and the second waited for that compile: neither is "cached"; a later one is
  # (the run stage always finds the extension in the cache; that used to be reported as cached).
  assert not first.build_cached and not again.build_cached
  (later,) = _verify(service, _req("good-later", holes.GOOD))
  assert later.build_cached and later.reward == 1.0


HOLES = [
  # (name, candidate, reference, options, kinds)
  ("forged_result_then_abort", holes.FORGED_RESULT, holes.REFERENCE, {}, {FailureKind.CRASH}),
  (
    "tensor_sum_patched_by_alias",
    holes.PATCHED_SUM,
    holes.REFERENCE,
    {},
    {FailureKind.WRONG_OUTPUT},
  ),
  (
    "frame_walk_to_the_reference",
    holes.FRAME_WALK,
    holes.REFERENCE,
    {},
    {FailureKind.WRONG_OUTPUT},
  ),
  (
    "tensor_sum_patched_strict",
    holes.PATCHED_SUM,
    holes.REFERENCE,
    {"strictness": "strict"},
    {FailureKind.MONKEY_PATCH},
  ),
  (
    "frame_walk_strict",
    holes.FRAME_WALK,
    holes.REFERENCE,
    {"strictness": "strict"},
    {FailureKind.FRAME_INTROSPECTION},
  ),
  (
    "forged_result_strict",
    holes.FORGED_RESULT,
    holes.REFERENCE,
    {"strictness": "strict"},
    {FailureKind.FORBIDDEN_IMPORT},
  ),
  (
    "inputs_drawn_ahead_from_the_request_seed",
    holes.INPUTS_DRAWN_AHEAD,
    holes.REFERENCE,
    {},
    {FailureKind.WRONG_OUTPUT},
  ),
  (
    "nondeterministic_reference",
    holes.NONDETERMINISTIC_IDENTITY,
    holes.NONDETERMINISTIC_REFERENCE,
    {},
    {FailureKind.REFERENCE_ERROR},
  ),
]


@pytest.mark.parametrize("name,cand,ref,opts,kinds", HOLES, ids=[h[0] for h in HOLES])
def test_hole_gets_reward_zero_and_the_service_serves_the_next_candidate(
  service, name, cand, ref, opts, kinds
):
  _, _, root = service
  before = set(os.listdir("."))
  bad, good = _verify(
    service, _req(f"hole-{name}", cand, ref, **opts), _req(f"good-after-{name}", holes.GOOD)
  )
  assert bad.failure_kind in kinds, (bad.failure_kind, bad.reason, bad.logs[-2000:])
  assert bad.reward == 0.0 and bad.shaped_reward == 0.0
  assert not bad.failure_kind.deceptive or bad.deceptive
  assert good.failure_kind is FailureKind.OK and good.reward == 1.0, good.reason + good.logs
  assert set(os.listdir(".")) == before and not (root / "result.json").exists()


def test_a_forged_result_file_never_reaches_the_verdict(service):
  (r,) = _verify(service, _req("forged-again", holes.FORGED_RESULT))
  assert r.failure_kind is FailureKind.CRASH and "SIGABRT" in r.reason, r.reason
  assert not r.correct and r.speedup == 0.0


def test_reference_that_updates_its_own_state_judges_its_identity_candidate_correct(service):
  (r,) = _verify(
    service,
    _req("stateful", holes.STATEFUL_IDENTITY, holes.STATEFUL_REFERENCE, num_correct_trials=4),
  )
  assert r.failure_kind is FailureKind.OK and r.reward == 1.0, (r.reason, r.logs[-2000:])
  assert r.strict_correct and r.max_abs_diff == 0.0


def test_stateful_reference_timed_and_rechecked_in_lock_step(service):
  (r,) = _verify(
    service,
    _req(
      "stateful-timed",
      holes.STATEFUL_IDENTITY + "\n# timed\n",
      holes.STATEFUL_REFERENCE,
      measure_performance=True,
      num_perf_trials=7,
      num_warmup=2,
    ),
  )
  assert r.failure_kind is FailureKind.OK, (r.reason, r.logs[-2000:])
  # 7 timed calls rounded up to one burst (MAX_BURST for tensors this small); a call this small may be
  # under what the CPU clock resolves (no speedup then, said so)
  assert r.candidate.num_trials == MAX_BURST
  assert r.speedup > 0 or any("no speedup reported" in w for w in r.warnings), r.warnings


def test_candidate_is_contained_no_file_outside_no_secrets_no_survivors(service, tmp_path):
  outside = tmp_path / "escaped.txt"
  (r,) = _verify(service, _req("escape", holes.escape(str(outside))))
  assert r.failure_kind is FailureKind.OK and r.reward == 1.0, (r.reason, r.logs[-2000:])
  assert not outside.exists()
  deadline = time.monotonic() + 120  # a hang guard: the kill reaches them at once
  while _processes_with(holes.MARKER) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert _processes_with(holes.MARKER) == [], "a setsid'd child outlived the check"


def test_init_that_never_returns_times_out_under_the_request_limit_and_frees_the_compile_slot(
  service, record_property
):
  loop, svc, _ = service
  # The spinner's build is a cache hit of the shared extension that takes as long as this one's: its
  # limit leaves room for it, so the spinner reaches its __init__ on a loaded machine too.
  (warm,) = _verify(service, _req("good-before-spin", holes.GOOD))
  assert warm.failure_kind is FailureKind.OK, warm.reason
  limit = max(6, math.ceil(3 * warm.compile_s))

  async def go():
    t0 = time.monotonic()
    spin = asyncio.ensure_future(svc.verify(_req("spin-init", holes.SPIN_INIT, timeout_s=limit)))
    await asyncio.sleep(0.5)
    # A different candidate needs the (single) compile slot while the spinner instantiates.
    good = await svc.verify(_req("good-during-spin", holes.GOOD + "\n# another build\n"))
    t_good = time.monotonic() - t0
    bad = await spin
    return bad, good, t_good, time.monotonic() - t0

  bad, good, t_good, t_bad = loop.run(go())
  record_property("good_seconds", t_good)  # experiments/bench_bounds.py reads them
  record_property("seconds", t_bad)
  record_property("limit_seconds", limit)
  record_property("seconds_over_limit", t_bad / limit)
  assert bad.failure_kind is FailureKind.TIMEOUT and "instantiating" in bad.reason, bad.reason
  assert f"limit of {limit} s" in bad.reason, bad.reason  # the request's, not the 300 s build limit
  assert good.failure_kind is FailureKind.OK, good.reason + good.logs


def _cache_files(root) -> dict[str, bytes]:
  out = {}
  for dirpath, _, files in os.walk(root):
    for f in files:
      path = os.path.join(dirpath, f)
      with open(path, "rb") as fh:
        out[os.path.relpath(path, root)] = fh.read()
  return out


def test_candidate_code_cannot_write_the_build_cache(service):
  _, _, root = service
  _verify(service, _req("good-before-poison", holes.GOOD))  # the shared extension is cached
  before = _cache_files(root / "builds")
  assert any(p.endswith("vt_holes.so") for p in before)
  (r,) = _verify(service, _req("poison", holes.POISON_CACHE))
  assert r.failure_kind is FailureKind.OK, (r.reason[:600], r.logs[-2000:])  # correct, contained
  assert _cache_files(root / "builds") == before, "candidate code changed the build cache"
  (good,) = _verify(service, _req("good-after-poison", holes.GOOD + "\n# after the poisoner\n"))
  assert good.failure_kind is FailureKind.OK and good.build_cached, good.reason + good.logs


def test_a_compiler_flag_that_loads_code_is_refused_before_any_compiler_runs(service):
  (r,) = _verify(service, _req("plugin-flag", holes.PLUGIN_FLAG))
  assert r.failure_kind is FailureKind.COMPILE_ERROR and r.reward == 0.0, (r.reason, r.logs[-2000:])
  assert "-fplugin=/tmp/vt_plugin.so" in r.reason and "not allowed" in r.reason, r.reason


def test_the_flags_of_the_prompts_example_build_and_pass(service):
  (r,) = _verify(service, _req("prompt-example-flags", holes.PROMPT_EXAMPLE_FLAGS))
  assert r.failure_kind is FailureKind.OK and r.reward == 1.0, (r.reason, r.logs[-2000:])


def test_candidate_cannot_reach_a_unix_socket_daemon(service):
  import socket
  import tempfile
  import threading

  directory = tempfile.mkdtemp(prefix="vt-daemon-")  # short: a socket path has ~100 bytes
  path = os.path.join(directory, "daemon.sock")
  server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  server.bind(path)
  server.listen(8)
  server.settimeout(0.2)
  reached, stop = [], threading.Event()

  def accept():
    while not stop.is_set():
      try:
        conn, _ = server.accept()
      except OSError:
        continue
      reached.append(conn.recv(16))
      conn.close()

  thread = threading.Thread(target=accept, daemon=True)
  thread.start()
  try:
    (r,) = _verify(service, _req("unix-socket", holes.unix_socket_probe(path)))
  finally:
    stop.set()
    thread.join(5)
    server.close()
    os.unlink(path)
    os.rmdir(directory)
  assert r.failure_kind is FailureKind.OK and r.reward == 1.0, (r.reason[:600], r.logs[-2000:])
  assert reached == [], f"a worker reached the daemon's socket {len(reached)} times"


def test_request_id_reused_for_another_candidate_is_refused(service):
  (first,) = _verify(service, _req("reused-id", holes.GOOD))
  (second,) = _verify(service, _req("reused-id", holes.PATCHED_SUM))
  (again,) = _verify(service, _req("reused-id", holes.GOOD))
  assert first.failure_kind is FailureKind.OK
  assert second.failure_kind is FailureKind.INVALID_REQUEST and "reused-id" in second.reason
  assert again == first  # the same payload is answered once


def _kill_running(svc, job_id: str, which: str, deadline_s: float = 60) -> int:
  pool = svc.run_pools["cpu"][0]
  end = time.monotonic() + deadline_s
  while time.monotonic() < end:
    entry = pool.running.get(job_id)
    if entry is not None:
      worker, checker = entry
      pid = worker.sandbox_pid if which == "worker" else checker.proc.pid
      time.sleep(0.3)  # let it get into the forward
      os.kill(pid, signal.SIGKILL)
      return pid
    time.sleep(0.02)
  raise AssertionError(f"job {job_id} never ran")


@pytest.mark.parametrize("which", ["worker", "checker"])
def test_killed_from_outside_is_retried_and_never_blamed_on_the_candidate(service, which):
  loop, svc, _ = service
  before = svc.metrics.infrastructure_retries
  job_id = f"killed-{which}"
  fut = asyncio.run_coroutine_threadsafe(
    svc.verify(_req(job_id, holes.SLOW_GOOD + f"\n# {which}\n")), loop.loop
  )
  _kill_running(svc, job_id, which)
  r = fut.result(300)
  assert r.failure_kind is FailureKind.OK and r.reward == 1.0, (
    r.failure_kind,
    r.reason,
    r.logs[-1500:],
  )
  assert svc.metrics.infrastructure_retries == before + 1


def test_each_request_logs_one_info_line(service, caplog):
  with caplog.at_level(logging.INFO, logger="verifier.serve.service"):
    (r,) = _verify(service, _req("logged-once", holes.GOOD + "\n# logged\n"))
  lines = [rec.getMessage() for rec in caplog.records if "logged-once" in rec.getMessage()]
  assert r.reward == 1.0 and len(lines) == 1
  assert "task holes" in lines[0] and "OK in" in lines[0] and lines[0].endswith(" s")


def test_workers_are_forked_with_torch_imported(service):
  phases = service[1].metrics.snapshot()["run_phase_mean_s"]
  assert "startup_fork" in phases and "startup_import_torch" not in phases
