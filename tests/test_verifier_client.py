"""The one verifier client (`verifier.api.client`) through the learner's thread face
(`dice_jax.verifier_client.ThreadedVerifier`): exactly-once outcomes across a service killed and restarted,
lost answers, dead endpoints, tokens; and once against the real CPU verifier killed with SIGKILL.

The fast tests run a gRPC test double of the service (`_ScriptedService`, below) in its own event
loop thread: it judges a candidate by a marker in its text and can be stopped mid-call and started
again on the same port. The real-verifier test is marked slow (one C++ build, cached afterwards).
"""

from __future__ import annotations

import asyncio
import collections
import os
import re
import signal
import socket
import threading
import time

import grpc
import pytest

from dice_jax.verifier_client import ThreadedVerifier
from verifier.api import client as vc
from verifier.api.proto import health_pb2, health_pb2_grpc, verifier_pb2, verifier_pb2_grpc

FAST = vc.RetryPolicy(initial_backoff_s=0.05, max_backoff_s=0.3, max_wait_s=30.0)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class _ScriptedService(verifier_pb2_grpc.VerifierServicer):
  """TEST DOUBLE of the verifier service: 'GOOD' in a candidate -> correct, else wrong_output.

  `delay_s` per call; `drop_first_answer`: the first call of each id does the work, then fails
  with UNAVAILABLE as a lost connection would (the retry gets the remembered answer)."""

  def __init__(self, delay_s=0.0, drop_first_answer=False, token=""):
    self.delay_s, self.drop_first_answer, self.token = delay_s, drop_first_answer, token
    self.calls = collections.Counter()  # request id -> calls received
    self.answered = {}

  async def Verify(self, request, context):
    if self.token and dict(context.invocation_metadata()).get("authorization") != (
      f"Bearer {self.token}"
    ):
      await context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong token")
    rid = request.request_id
    self.calls[rid] += 1
    if rid not in self.answered:
      await asyncio.sleep(self.delay_s)
      good = "GOOD" in request.candidate_source
      self.answered[rid] = verifier_pb2.VerifyResult(
        request_id=rid,
        task_id=request.task_id,
        compiled=True,
        correct=good,
        reward=float(good),
        failure_kind=verifier_pb2.FAILURE_KIND_OK
        if good
        else verifier_pb2.FAILURE_KIND_WRONG_OUTPUT,
      )
      if self.drop_first_answer:
        await context.abort(grpc.StatusCode.UNAVAILABLE, "connection lost after the work")
    return self.answered[rid]


class _Health(health_pb2_grpc.HealthServicer):
  async def Check(self, request, context):
    return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


class _ServerThread:
  """Runs a grpc.aio server for `service` on 127.0.0.1:port in its own loop; stop() drops
  in-flight calls like a killed process, start() brings it back on the same port."""

  def __init__(self, service, port=None):
    self.service, self.port = service, port or _free_port()
    self.loop = asyncio.new_event_loop()
    self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
    self.thread.start()
    self.server = None

  def _run(self, coro):
    return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

  def start(self):
    async def go():
      self.server = grpc.aio.server()
      verifier_pb2_grpc.add_VerifierServicer_to_server(self.service, self.server)
      health_pb2_grpc.add_HealthServicer_to_server(_Health(), self.server)
      assert self.server.add_insecure_port(f"127.0.0.1:{self.port}") == self.port
      await self.server.start()

    self._run(go())
    return self

  def stop(self):
    self._run(self.server.stop(grace=None))

  def close(self):
    if self.server is not None:
      self.stop()
    self.loop.call_soon_threadsafe(self.loop.stop)
    self.thread.join(5)

  @property
  def address(self):
    return f"127.0.0.1:{self.port}"


@pytest.fixture
def scripted():
  servers = []

  def make(**kw):
    s = _ServerThread(_ScriptedService(**kw)).start()
    servers.append(s)
    return s

  yield make
  for s in servers:
    s.close()


def _items(n):
  return [
    (f"task{i}", "REFERENCE", f"candidate {i} {'GOOD' if i % 3 == 0 else 'BAD'}") for i in range(n)
  ]


def test_service_killed_and_restarted_mid_step_every_outcome_arrives_once(scripted):
  server = scripted(delay_s=0.4)
  items = _items(24)
  with ThreadedVerifier(server.address, retry=FAST, token="") as client:
    client.wait_ready(10)
    futures = [client.submit(*it) for it in items] + [client.submit(*items[0])]  # one duplicate
    time.sleep(0.2)  # every call is in flight now
    server.stop()  # in-flight calls die with the "process"
    time.sleep(0.8)  # the client backs off and retries against a closed port meanwhile
    server.start()
    outcomes = [f.result(timeout=30) for f in futures]
    stats, health = client.stats(), client.health()
  assert [o.task_id for o in outcomes[:-1]] == [t for t, _, _ in items]
  assert [o.correct for o in outcomes[:-1]] == ["GOOD" in c for _, _, c in items]
  assert outcomes[-1] == outcomes[0]  # the duplicate shares the first submission's outcome
  assert stats["answered"] == 24 and stats["deduplicated"] == 1 and stats["ignored"] == 0
  assert stats["retries"] >= 24  # every request was in flight when the service died
  assert health[0]["up"] and health[0]["errors"] >= 1 and health[0]["answered"] == 24
  # each id was sent again after the restart; the restarted service answered each once
  assert sorted(server.service.answered) == sorted({o.request_id for o in outcomes})


def test_lost_answer_is_retried_and_delivered_once(scripted):
  server = scripted(drop_first_answer=True)
  items = _items(6)
  with ThreadedVerifier(server.address, retry=FAST, token="") as client:
    outcomes = client.verify_batch(items)
    stats = client.stats()
  assert [o.correct for o in outcomes] == [True, False, False, True, False, False]
  assert all(n == 2 for n in server.service.calls.values())  # the work was done once, sent twice
  assert stats["answered"] == 6 and stats["retries"] == 6 and stats["ignored"] == 0


def test_dead_endpoint_is_marked_down_and_the_live_one_answers(scripted, caplog):
  live = scripted()
  dead = f"127.0.0.1:{_free_port()}"
  with ThreadedVerifier([dead, live.address], retry=FAST, token="") as client:
    outcomes = client.verify_batch(_items(8))
    health = {h["address"]: h for h in client.health()}
  assert [o.correct for o in outcomes] == [i % 3 == 0 for i in range(8)]
  assert health[live.address]["answered"] == 8
  assert not health[dead]["up"] or health[dead]["errors"] == 0  # down if it was ever tried
  if health[dead]["errors"]:
    assert any(dead in r.getMessage() for r in caplog.records)


def test_all_endpoints_down_gives_up_after_max_wait_naming_the_address(record_property):
  dead = f"127.0.0.1:{_free_port()}"
  policy = vc.RetryPolicy(initial_backoff_s=0.05, max_backoff_s=0.1, max_wait_s=0.6)
  with ThreadedVerifier(dead, retry=policy, token="") as client:
    t0 = time.monotonic()
    answer = client.submit("t", "ref", "cand")
    with pytest.raises(vc.VerifierUnavailable, match=dead) as e:
      answer.result(timeout=300)  # a hang guard only: it gives up after max_wait_s (0.6 s)
    record_property("seconds", time.monotonic() - t0)  # experiments/bench_bounds.py reads it
  attempts = int(re.search(r"after (\d+) attempts", str(e.value)).group(1))
  assert attempts >= 2  # it retried before giving up


def test_token_is_sent_and_a_wrong_one_is_refused(scripted):
  server = scripted(token="s3cret")
  with ThreadedVerifier(server.address, retry=FAST, token="s3cret") as client:
    assert client.verify("t", "ref", "GOOD").correct
  with ThreadedVerifier(server.address, retry=FAST, token="wrong") as client:
    with pytest.raises(PermissionError, match=server.address):
      client.verify("t", "ref", "GOOD")


def test_request_ids_are_content_hashes_and_endpoints_are_validated():
  a = vc.request_id("t", "ref", "cand", {"measure_performance": True})
  assert a == vc.request_id("t", "ref", "cand", {"measure_performance": True})
  assert len({a, vc.request_id("t", "ref", "cand2"), vc.request_id("u", "ref", "cand")}) == 3
  assert vc.parse_endpoints("a:1, b:2") == ["a:1", "b:2"]
  for bad in ("nohost", "h:port", "h:0", "a:1,a:1", ""):
    with pytest.raises(ValueError, match="verifier endpoint|no verifier|repeat"):
      vc.parse_endpoints(bad)
  with pytest.raises(ValueError, match="unknown_option"):
    ThreadedVerifier("127.0.0.1:1", options={"unknown_option": 1}, token="")


# ------------------------------------------------------------------ the real service, SIGKILLed
_REFERENCE = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn(64, 64)]


def get_init_inputs():
    return []
"""


def _candidate(function: str) -> str:
  """Both candidates share one C++ source (one build, then cached); `neg_relu` is wrong."""
  return f'''import torch.nn as nn
from torch.utils.cpp_extension import load_inline

src = r"""
#include <torch/extension.h>
torch::Tensor relu(torch::Tensor x) {{
    auto o = torch::empty_like(x);
    const float* p = x.data_ptr<float>(); float* q = o.data_ptr<float>();
    for (int64_t i = 0; i < x.numel(); ++i) q[i] = p[i] > 0.f ? p[i] : 0.f;
    return o;
}}
torch::Tensor neg_relu(torch::Tensor x) {{
    auto o = torch::empty_like(x);
    const float* p = x.data_ptr<float>(); float* q = o.data_ptr<float>();
    for (int64_t i = 0; i < x.numel(); ++i) q[i] = p[i] < 0.f ? p[i] : 0.f;
    return o;
}}
"""
ext = load_inline(name="vc_relu", cpp_sources=src, functions=["relu", "neg_relu"])


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.{function}(x.contiguous())
'''


def _process_groups_below(pid: int) -> set[int]:
  """Process groups of `pid`'s descendants (the service's workers run in their own sessions)."""
  out, todo = set(), [pid]
  while todo:
    p = todo.pop()
    try:
      with open(f"/proc/{p}/task/{p}/children") as f:
        kids = [int(k) for k in f.read().split()]
    except OSError:
      continue
    for k in kids:
      try:
        out.add(os.getpgid(k))
      except ProcessLookupError:
        pass
    todo += kids
  return out - {os.getpgid(0)}


@pytest.mark.slow
def test_real_verifier_sigkilled_and_restarted_every_reward_arrives_once(tmp_path):
  pytest.importorskip("torch", reason="the verifier service needs torch")
  from verifier.serve.local import LocalVerifier

  good, bad = _candidate("relu"), _candidate("neg_relu")
  workdir, args = str(tmp_path), ("--no-pch",)
  with LocalVerifier(workdir, device="cpu", start_timeout_s=120, extra_args=args) as first:
    port = first.address.rsplit(":", 1)[1]
    with ThreadedVerifier(
      first.address, retry=vc.RetryPolicy(initial_backoff_s=0.2, max_backoff_s=2.0), token=""
    ) as client:
      # the build lands in the cache shared with the restarted service
      warm = client.verify_batch([("warm", _REFERENCE, good), ("warm", _REFERENCE, bad)])
      assert [o.correct for o in warm] == [True, False]
      items = [(f"t{i}", _REFERENCE, good if i % 2 else bad) for i in range(8)]
      futures = [client.submit(*it) for it in items]
      first_done = next(concurrent_as_completed(futures, timeout=120))
      orphans = _process_groups_below(first.proc.pid)
      os.kill(first.proc.pid, signal.SIGKILL)  # mid-step: the others are queued or running
      first.proc.wait(10)
      for group in orphans:  # its workers outlive it (own sessions): end them
        try:
          os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
          pass
      with LocalVerifier(workdir, device="cpu", extra_args=(*args, "--port", port)) as second:
        assert second.address == first.address
        outcomes = [f.result(timeout=300) for f in futures]
      stats = client.stats()
  assert first_done.done()
  assert [o.correct for o in outcomes] == [i % 2 == 1 for i in range(8)]
  assert [o.task_id for o in outcomes] == [f"t{i}" for i in range(8)]
  assert stats["answered"] == 10 and stats["ignored"] == 0 and stats["retries"] >= 1


def concurrent_as_completed(futures, timeout):
  import concurrent.futures

  return concurrent.futures.as_completed(futures, timeout=timeout)
