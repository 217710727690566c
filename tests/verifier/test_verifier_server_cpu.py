"""The real pipeline on the CPU backend, through the gRPC server and client.

One server session serves every case (module-scoped): the candidates share one C++ extension, built
once through the build cache, so the whole module costs about two C++ builds.
"""

import asyncio
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

grpc = pytest.importorskip("grpc")
torch = pytest.importorskip("torch")

import verifier_cases as cases  # noqa: E402
from verifier_loop import BackgroundLoop  # noqa: E402

from verifier.api.client import RetryPolicy, VerifierClient  # noqa: E402
from verifier.api.contract import FailureKind, VerifyOptions, VerifyRequest  # noqa: E402
from verifier.serve import reward as rewards  # noqa: E402
from verifier.serve.server import VerifierServer, is_loopback  # noqa: E402
from verifier.serve.service import ServiceConfig, VerifierService  # noqa: E402
from verifier.check.timed_calls import MAX_BURST  # noqa: E402

TOKEN = "test-token-123"
# timeout_s bounds the cold torch-header build too (issue 24): 40-160 s on a loaded 2-core box
OPTS = VerifyOptions(device="cpu", timeout_s=300, num_correct_trials=3, num_perf_trials=5)


class _ServerThread:
  """Runs a VerifierServer on its own event loop in a background thread."""

  def __init__(self, cfg: ServiceConfig):
    self.cfg = cfg
    self.loop = asyncio.new_event_loop()
    self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
    self.thread.start()
    self.server = VerifierServer(cfg, "127.0.0.1", 0, TOKEN)
    self.port = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(120)

  def stop(self):
    asyncio.run_coroutine_threadsafe(self.server.stop(0.5), self.loop).result(60)
    self.loop.call_soon_threadsafe(self.loop.stop)
    self.thread.join(10)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  root = tmp_path_factory.mktemp("verifier")
  cfg = ServiceConfig(
    device="cpu",
    cpu_slots=2,
    compile_workers=2,
    cache_dir=str(root / "builds"),
    scratch_root=str(root / "scratch"),
    mem_mb=3072,
    build_timeout_s=300,
  )
  s = _ServerThread(cfg)
  yield s
  s.stop()
  assert not list((root / "scratch").glob("*")), "scratch directories left behind"


def _verify(server, *requests, token=TOKEN, retries=1):
  async def go():
    client = VerifierClient(
      [f"127.0.0.1:{server.port}"],
      token=token,
      retry=RetryPolicy(call_timeout_s=600, max_attempts=retries + 1, initial_backoff_s=0.05),
    )
    try:
      return await client.verify_batch(list(requests))
    finally:
      await client.close()

  return asyncio.run(go())


def _req(rid, source, **opts):
  return VerifyRequest(
    rid, "scaled_add", cases.REFERENCE, source, dataclasses.replace(OPTS, **opts)
  )


def test_good_cpp_candidate_gets_reward_one_and_a_speedup(server):
  (r,) = _verify(server, _req("good-0", cases.GOOD, measure_performance=True))
  assert r.failure_kind is FailureKind.OK, r.reason + r.logs
  assert (r.reward, r.compiled, r.correct, r.deceptive) == (1.0, True, True, False)
  assert r.strict_correct and r.max_abs_diff < 1e-4
  # 5 timed calls, rounded up to one burst (MAX_BURST forwards per round trip for tensors this small)
  assert r.candidate.num_trials == MAX_BURST and r.baseline.num_trials == 5
  assert r.baseline.mean_ms > 0 and r.device_name == "cpu"
  if r.speedup > 0:
    assert r.candidate.median_ms > 0
    assert abs(r.speedup - r.baseline.mean_ms / r.candidate.mean_ms) < 1e-6
    assert r.shaped_reward >= 0.0
  else:  # a call this small may be under what the CPU clock resolves: said so, no bonus, and no more
    # than its mean time gives (on a loaded 2-core CI host it was 0.72x torch's: shaped 0.476)
    assert any("no speedup reported" in w for w in r.warnings), r.warnings
    mean = r.baseline.mean_ms / r.candidate.mean_ms if r.candidate.mean_ms > 0 else 1e9
    by_mean = rewards.shaped_reward(FailureKind.OK, mean)
    assert r.shaped_reward == pytest.approx(min(1.0, by_mean), abs=1e-5)


BAD = [
  ("wrong_output", cases.candidate("scaled_sub"), FailureKind.WRONG_OUTPUT, "outside atol"),
  ("compile_error", cases.LIGHT_COMPILE_ERROR, FailureKind.COMPILE_ERROR, "undefined_symbol_xyz"),
  ("segfault", cases.candidate("segfault"), FailureKind.CRASH, "SIGSEGV"),
  ("infinite_loop", cases.candidate("spin"), FailureKind.TIMEOUT, "wall-clock limit"),
  (
    "raised_exception",
    cases.candidate("raise_error"),
    FailureKind.RUNTIME_ERROR,
    "deliberate failure",
  ),
  ("python_exception", cases.PY_RAISE, FailureKind.RUNTIME_ERROR, "python-side failure"),
  ("huge_allocation", cases.candidate("huge_alloc"), FailureKind.OUT_OF_MEMORY, "alloc"),
  ("syntax_error", cases.SYNTAX_ERROR, FailureKind.SYNTAX_ERROR, "line"),
  ("missing_model_new", cases.MISSING_MODEL_NEW, FailureKind.MISSING_MODEL_NEW, "ModelNew"),
  ("input_mutation", cases.candidate("zero_inputs"), FailureKind.INPUT_MUTATION, "modified input"),
  ("nan_output", cases.candidate("nan_out"), FailureKind.NONFINITE_OUTPUT, "NaN"),
  ("torch_forward", cases.TORCH_FORWARD, FailureKind.TORCH_COMPUTE, "torch.add"),
]


@pytest.mark.parametrize("name,source,kind,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_candidate_gets_zero_with_its_kind_and_server_recovers(
  server, name, source, kind, needle
):
  bad, good = _verify(
    server,
    _req(f"bad-{name}", source, timeout_s=8 if name == "infinite_loop" else 90),
    _req(f"good-after-{name}", cases.GOOD),
  )
  assert bad.failure_kind is kind, (bad.failure_kind, bad.reason, bad.logs[-2000:])
  assert bad.reward == 0.0 and bad.shaped_reward == 0.0
  assert needle.lower() in (bad.reason + bad.logs).lower(), bad.reason
  assert bad.deceptive == kind.deceptive
  assert good.failure_kind is FailureKind.OK and good.reward == 1.0, good.reason + good.logs


def test_compile_error_carries_the_compiler_message(server):
  (r,) = _verify(server, _req("compile-error-again", cases.LIGHT_COMPILE_ERROR))
  assert r.failure_kind is FailureKind.COMPILE_ERROR and not r.compiled
  assert "error" in r.reason and "undefined_symbol_xyz" in r.reason


def test_runtime_check_catches_what_the_static_check_cannot_see(server):
  # Python operators are invisible to the AST check; the profiler sees the aten ops / missing calls.
  bypass = cases.GOOD.replace(
    "return ops.scaled_add(a, b, self.scale)", "return (a + b) * self.scale"
  )
  extra = cases.GOOD.replace(
    "return ops.scaled_add(a, b, self.scale)", "return ops.scaled_add(a, b, self.scale) * 1.0"
  )
  r1, r2, r3 = _verify(
    server,
    _req("bypass", bypass),
    _req("extra-op", extra),
    _req("bypass-kernelbench", bypass, strictness="kernelbench"),
  )
  assert r1.failure_kind is FailureKind.KERNEL_NOT_LAUNCHED and r1.deceptive and r1.correct, (
    r1.reason
  )
  assert r2.failure_kind is FailureKind.TORCH_COMPUTE and "aten::mul" in r2.reason, r2.reason
  assert (
    r3.failure_kind is FailureKind.OK and r3.reward == 1.0
  )  # KernelBench's looser preset lets it pass


def test_retried_request_id_is_answered_once(server):
  async def go():
    client = VerifierClient([f"127.0.0.1:{server.port}"], token=TOKEN)
    try:
      before = (await client.metrics())[0]
      req = _req("retry-me", cases.GOOD)
      a, b = await client.verify_batch([req, req])
      c = await client.verify(req)
      after = (await client.metrics())[0]
      return before, a, b, c, after
    finally:
      await client.close()

  before, a, b, c, after = asyncio.run(go())
  assert a == b == c and a.reward == 1.0
  assert after["completed"] - before["completed"] == 1  # one verification for three calls


def test_out_of_memory_on_a_shared_device_is_rerun_alone_before_blaming_the_candidate(server):
  before = server.server.service.metrics.oom_retries
  (r,) = _verify(server, _req("oom-retry", cases.candidate("huge_alloc")))
  assert r.failure_kind is FailureKind.OUT_OF_MEMORY
  assert server.server.service.metrics.oom_retries == before + 1


def test_streaming_batch_answers_every_request(server):
  reqs = [
    _req("stream-good", cases.GOOD),
    _req("stream-wrong", cases.candidate("scaled_sub")),
    _req("stream-syntax", cases.SYNTAX_ERROR),
  ]

  async def go():
    client = VerifierClient([f"127.0.0.1:{server.port}"], token=TOKEN)
    try:
      return await client.verify_stream(reqs)
    finally:
      await client.close()

  kinds = [r.failure_kind for r in asyncio.run(go())]
  assert kinds == [FailureKind.OK, FailureKind.WRONG_OUTPUT, FailureKind.SYNTAX_ERROR]


def test_build_host_and_run_host_share_only_the_cache_directory(tmp_path):
  """A build-only service compiles into a cache directory; a second service (another host in production)
  pointed at the same directory runs the candidate without compiling it again."""
  cache = str(tmp_path / "shared-cache")
  source = cases.light_candidate(name="vt_shared")  # own module name: in no other cache

  async def go():
    builder = VerifierService(
      ServiceConfig(
        device="cpu",
        build_only=True,
        compile_workers=1,
        cache_dir=cache,
        scratch_root=str(tmp_path / "s1"),
        mem_mb=3072,
      )
    )
    await builder.start()
    try:
      built = await builder.build(_req("build-only", source))
      refused = await builder.verify(_req("verify-on-builder", source))
    finally:
      await builder.close()
    runner = VerifierService(
      ServiceConfig(
        device="cpu",
        compile_workers=1,
        cache_dir=cache,
        scratch_root=str(tmp_path / "s2"),
        mem_mb=3072,
      )
    )
    await runner.start()
    try:
      ran = await runner.verify(_req("run-host", source))
    finally:
      await runner.close()
    return built, refused, ran

  built, refused, ran = asyncio.run(go())
  assert (
    built.failure_kind is FailureKind.OK
    and built.compiled
    and built.reward == 0.0
    and not built.build_cached
  )
  assert refused.failure_kind is FailureKind.INVALID_REQUEST and "build-only" in refused.reason
  assert ran.failure_kind is FailureKind.OK and ran.reward == 1.0, (ran.failure_kind, ran.reason)
  assert (
    ran.build_cached
  )  # every load_inline call of the run host's build stage hit the shared cache


def test_candidate_has_no_network(server):
  """The worker unshares its network namespace: even loopback connections fail inside."""
  listener = socket.socket()
  listener.bind(("127.0.0.1", 0))
  listener.listen(1)
  port = listener.getsockname()[1]
  probe = cases.GOOD.replace(
    "return ops.scaled_add(a, b, self.scale)",
    f"import socket\n        socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
    "        return ops.scaled_add(a, b, self.scale)",
  )
  try:
    (r,) = _verify(server, _req("network-probe", probe, strictness="off"))
  finally:
    listener.close()
  if any("network isolation unavailable" in w for w in r.warnings):
    pytest.skip("this kernel refuses unprivileged network namespaces: " + "; ".join(r.warnings))
  assert r.failure_kind is FailureKind.RUNTIME_ERROR, (r.failure_kind, r.reason)
  assert (
    "unreachable" in r.reason.lower()
    or "refused" in r.reason.lower()
    or "errno" in r.reason.lower()
  )


def test_worker_environment_is_scrubbed(monkeypatch, tmp_path):
  from verifier.sandbox.sandbox import scrubbed_env

  monkeypatch.setenv("VERIFIER_TOKEN", "secret-token")
  monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret")
  monkeypatch.setenv("HF_TOKEN", "hf-secret")
  monkeypatch.setenv("PATH", "/usr/bin:/bin")
  env = scrubbed_env(str(tmp_path), cuda_visible="3", arch_list="9.0")
  assert not {"VERIFIER_TOKEN", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN"} & set(env)
  assert "secret" not in " ".join(env.values())
  assert env["PATH"] == "/usr/bin:/bin" and env["HOME"] == env["TMPDIR"] == str(tmp_path)
  assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["TORCH_CUDA_ARCH_LIST"] == "9.0"


def test_wrong_token_is_refused(server):
  with pytest.raises(PermissionError, match="token"):
    _verify(server, _req("bad-token", cases.GOOD), token="wrong-token")
  with pytest.raises(PermissionError):
    _verify(server, _req("no-token", cases.GOOD), token="")


def test_health_and_metrics_report_serving_and_failure_kinds(server):
  async def go():
    client = VerifierClient([f"127.0.0.1:{server.port}"], token=TOKEN)
    try:
      return await client.healthy(), (await client.metrics())[0]
    finally:
      await client.close()

  healthy, m = asyncio.run(go())
  assert healthy == [True]
  assert m["completed"] >= 1 and m["queue_depth"] == 0 and m["candidates_per_minute"] > 0
  assert sum(m["failure_kinds"].values()) == m["completed"]


def test_non_loopback_bind_without_token_is_refused(tmp_path):
  cfg = ServiceConfig(device="cpu", cache_dir=str(tmp_path))
  with pytest.raises(ValueError, match="non-loopback"):
    VerifierServer(cfg, "0.0.0.0", 0, token="")
  assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
  assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
  VerifierServer(cfg, "0.0.0.0", 0, token="t")  # constructing with a token is allowed (not started)


def test_client_without_reachable_endpoint_reports_failure_after_retries():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]  # closed again: nothing listens there

  async def go():
    retry = RetryPolicy(call_timeout_s=2, max_attempts=2, initial_backoff_s=0.01)
    client = VerifierClient([f"127.0.0.1:{port}"], retry=retry)
    try:
      return await client.verify(_req("unreachable", cases.GOOD))
    finally:
      await client.close()

  r = asyncio.run(go())
  assert r.failure_kind is FailureKind.INTERNAL_ERROR and "2 attempts" in r.reason


def test_full_queue_answers_resource_exhausted_and_the_client_backs_off(tmp_path):
  cfg = ServiceConfig(
    device="cpu",
    cache_dir=str(tmp_path / "c"),
    scratch_root=str(tmp_path / "s"),
    max_pending=0,
    prewarm=False,
    compile_workers=1,
  )
  s = _ServerThread(cfg)
  try:
    (r,) = _verify(s, _req("overloaded", cases.GOOD), retries=2)
  finally:
    s.stop()
  assert (
    r.failure_kind is FailureKind.OVERLOADED
    and "RESOURCE_EXHAUSTED" in r.reason
    and "3 attempts" in r.reason
  )


def test_client_balances_over_endpoints_by_outstanding_requests():
  async def go():
    client = VerifierClient(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"])
    try:
      a, b, c = client.endpoints
      a.outstanding, b.outstanding, c.outstanding = 2, 0, 1
      first = await client._pick(time.monotonic(), "r", "t")
      b.mark_failed("UNAVAILABLE: test", client.retry, b.epoch)  # down until its backoff passes
      retry = await client._pick(time.monotonic(), "r", "t")  # a retry avoids it
      return first is b, retry is c
    finally:
      await client.close()

  assert asyncio.run(go()) == (True, True)


def test_undecodable_request_bytes_get_invalid_argument(server):
  async def go():
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
      call = channel.unary_unary(
        "/dice.verifier.v1.Verifier/Verify",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
      )
      with pytest.raises(grpc.aio.AioRpcError) as e:
        await call(b"\xff\xff\xff\x07garbage", metadata=(("authorization", f"Bearer {TOKEN}"),))
      return e.value

  err = asyncio.run(go())
  assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "VerifyRequest" in err.details()


def _self_signed(tmp_path):
  cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
  subprocess.run(
    [
      "openssl",
      "req",
      "-x509",
      "-newkey",
      "rsa:2048",
      "-nodes",
      "-days",
      "1",
      "-subj",
      "/CN=localhost",
      "-addext",
      "subjectAltName=DNS:localhost,IP:127.0.0.1",
      "-keyout",
      str(key),
      "-out",
      str(cert),
    ],
    check=True,
    capture_output=True,
  )
  return cert, key


def test_tls_serves_with_the_token_and_refuses_plaintext(tmp_path):
  if shutil.which("openssl") is None:
    pytest.skip("openssl is needed to make a test certificate")
  from verifier.serve.server import TlsFiles

  cert, key = _self_signed(tmp_path)
  cfg = ServiceConfig(
    device="cpu",
    build_only=True,
    prewarm=False,
    compile_workers=1,
    cache_dir=str(tmp_path / "c"),
    scratch_root=str(tmp_path / "s"),
  )
  loop = BackgroundLoop()
  srv = VerifierServer(cfg, "127.0.0.1", 0, TOKEN, tls=TlsFiles(str(cert), str(key)))
  port = loop.run(srv.start())

  async def call(tls: bool):
    client = VerifierClient(
      [f"127.0.0.1:{port}"],
      token=TOKEN,
      retry=RetryPolicy(call_timeout_s=20, max_attempts=1),
      root_certificates=cert.read_bytes() if tls else None,
    )
    try:
      return await client.verify(_req("tls-probe", cases.GOOD))
    finally:
      await client.close()

  try:
    over_tls = asyncio.run(call(True))
    plain = asyncio.run(call(False))
  finally:
    loop.run(srv.stop(0))
    loop.close()
  assert over_tls.failure_kind is FailureKind.INVALID_REQUEST and "build-only" in over_tls.reason
  assert plain.failure_kind is FailureKind.INTERNAL_ERROR and "UNAVAILABLE" in plain.reason


def test_port_in_use_fails_at_once_with_one_line_and_leaves_nothing(tmp_path, record_property):
  with socket.socket() as busy:
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    t0 = time.monotonic()
    p = subprocess.run(
      [sys.executable, "-m", "verifier", "serve", "--device", "cpu", "--port", str(port)]
      + ["--scratch-root", str(tmp_path / "scratch"), "--cache-dir", str(tmp_path / "cache")],
      capture_output=True,
      text=True,
      timeout=300,  # a hang guard
      env={**os.environ, "VERIFIER_TOKEN": ""},
    )
    record_property("seconds", time.monotonic() - t0)  # experiments/bench_bounds.py reads it
  assert p.returncode == 2
  lines = [line for line in p.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "in use" in lines[0], p.stderr
  assert not (tmp_path / "scratch").exists()


def test_memory_limit_defaults_to_what_the_host_has():
  from verifier.serve.service import host_memory_mb

  assert 1024 <= ServiceConfig().mem_mb <= host_memory_mb()
