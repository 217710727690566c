"""Command line: ``python -m verifier {serve,check,bench}``."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import pathlib
import signal
import sys

from verifier import batch, verdict_file
from verifier.api import waiting
from verifier.api.client import VerifierUnavailable, parse_endpoints
from verifier.api.contract import VerifyOptions, VerifyResult
from verifier.serve.service import ServiceConfig, default_compile_workers, default_mem_mb
from verifier.serve.torch_build import TorchBuild, cuda_refusal


def _service_args(p: argparse.ArgumentParser) -> None:
  p.add_argument(
    "--flagfile", metavar="PATH", help="read more flags from PATH (one per line, # comments)"
  )
  p.add_argument(
    "--device", choices=("cuda", "cpu"), default=None, help="default: cuda if a GPU is visible"
  )
  p.add_argument(
    "--gpus",
    default=None,
    help="comma-separated GPU indices, e.g. 0,1 (default 0 when a GPU is visible); refused, like "
    "--device cuda, where torch has no CUDA",
  )
  p.add_argument(
    "--slots-per-gpu", type=int, default=4, help="concurrent reward-mode candidates per GPU"
  )
  p.add_argument(
    "--compile-workers",
    type=int,
    default=default_compile_workers(),
    help="concurrent candidate builds (default: all CPUs but two)",
  )
  p.add_argument(
    "--fork-server",
    action="store_true",
    help="accepted for old scripts: every worker is now forked from a fork server",
  )
  p.add_argument(
    "--block-sockets-cuda",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="CUDA candidates may not create sockets (seccomp, applied after their CUDA context exists; "
    "build, compile and CPU workers always are); --no-block-sockets-cuda lifts it for CUDA candidates",
  )
  p.add_argument(
    "--no-warm-profiler",
    action="store_true",
    help="candidates skip starting the profiler before their job (cheaper when no job is strict)",
  )
  p.add_argument(
    "--run-prewarm",
    type=int,
    default=0,
    help="run workers kept starting per GPU (0: 3 x slots + 2; each takes ~5 s of CPU to start)",
  )
  p.add_argument(
    "--cache-dir", default=ServiceConfig.cache_dir, help="build cache (share it between hosts)"
  )
  p.add_argument(
    "--cache-max-gb",
    type=float,
    default=ServiceConfig.cache_max_gb,
    help="evict least-recently-used builds above this size (0: never)",
  )
  p.add_argument(
    "--cache-min-free-gb",
    type=float,
    default=ServiceConfig.cache_min_free_gb,
    help="below this much free disk under --cache-dir, evict builds whatever their age",
  )
  p.add_argument(
    "--pch-max-flag-sets",
    type=int,
    default=ServiceConfig.pch_max_flag_sets,
    help="precompiled torch headers for at most this many flag sets in the cache (built one at a time)",
  )
  p.add_argument(
    "--scratch-root",
    default=ServiceConfig.scratch_root,
    help="parent of the per-candidate scratch dirs",
  )
  p.add_argument(
    "--mem-mb",
    type=int,
    default=None,
    help="host memory per worker's process tree, in MiB (default: half of this host's, at most 32768)",
  )
  p.add_argument(
    "--scratch-mb",
    type=int,
    default=ServiceConfig.scratch_mb,
    help="each worker's scratch quota in MiB (a private tmpfs; host memory on top of --mem-mb)",
  )
  p.add_argument(
    "--max-processes",
    type=int,
    default=ServiceConfig.max_processes,
    help="processes a worker may run at once (its whole PID namespace; 0: no limit)",
  )
  p.add_argument(
    "--gpu-memory-fraction",
    type=float,
    default=0.0,
    help="cap of each run worker's CUDA caching allocator, as a fraction of the GPU (0: none)",
  )
  p.add_argument("--arch", default=None, help="TORCH_CUDA_ARCH_LIST for builds (default: detected)")
  p.add_argument(
    "--no-network-isolation",
    action="store_true",
    help="let candidates reach the network (default: each worker in its own network namespace)",
  )
  p.add_argument(
    "--split-build",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="compile kernels apart from the torch headers (split_build.py; --no-split-build: one .cu)",
  )
  p.add_argument(
    "--pch",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="compile main.cpp on a precompiled torch header kept in --cache-dir (pch.py)",
  )
  p.add_argument(
    "--warm-pch",
    action=argparse.BooleanOptionalAction,
    default=None,
    help="serve: build the precompiled header of flag-less builds at start, beside serving (default: "
    "on with --device cuda, off on CPU hosts, where it would take cores from the first requests); "
    "bench: before its phases (default: as serve, but off when the first phase is single)",
  )


def _config(a, serving_here: bool = True) -> ServiceConfig:
  """The service config of the flags; ``serving_here``: a service runs in this process, so a CUDA
  request that this host's torch cannot serve is refused (ValueError, one line)."""
  build = TorchBuild.detect()
  refusal = cuda_refusal(a.device, a.gpus, build) if serving_here else ""
  if refusal:
    raise ValueError(refusal)
  device = a.device or ("cuda" if build.gpu_visible else "cpu")
  arch = a.arch if a.arch is not None else (build.arch if device == "cuda" else "")
  return ServiceConfig(
    device=device,
    gpus=tuple(g for g in (a.gpus or "0").split(",") if g),
    slots_per_gpu=a.slots_per_gpu,
    compile_workers=a.compile_workers,
    cache_dir=a.cache_dir,
    cache_max_gb=a.cache_max_gb,
    cache_min_free_gb=a.cache_min_free_gb,
    pch_max_flag_sets=a.pch_max_flag_sets,
    scratch_root=a.scratch_root,
    mem_mb=a.mem_mb if a.mem_mb is not None else default_mem_mb(),
    scratch_mb=a.scratch_mb,
    max_processes=a.max_processes,
    gpu_memory_fraction=a.gpu_memory_fraction,
    arch_list=arch,
    isolate_network=not a.no_network_isolation,
    split_build=a.split_build,
    use_pch=a.pch,
    run_prewarm=a.run_prewarm,
    warm_profiler=not a.no_warm_profiler,
    block_sockets_cuda=a.block_sockets_cuda,
  )


async def _serve(a) -> int:
  from verifier.serve.server import TlsFiles, VerifierServer

  token = os.environ.get("VERIFIER_TOKEN", "")
  if a.token_file:
    token = pathlib.Path(a.token_file).read_text().strip()
  if bool(a.tls_cert) != bool(a.tls_key):
    print("error: --tls-cert and --tls-key go together", file=sys.stderr)
    return 2
  try:
    cfg = _config(a)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  cfg.build_only = a.build_only
  tls = TlsFiles(a.tls_cert, a.tls_key) if a.tls_cert else None
  try:
    server = VerifierServer(cfg, a.host, a.port, token, a.stream_window, tls)
    port = await server.start()
  except (ValueError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    await server.stop(0) if "server" in locals() else None
    return 2
  print(f"verifier listening on {a.host}:{port}", flush=True)
  warm = a.warm_pch if a.warm_pch is not None else cfg.device == "cuda"
  warming = asyncio.ensure_future(server.service.warm_pch()) if warm else None
  stop = asyncio.Event()
  loop = asyncio.get_running_loop()
  for s in (signal.SIGINT, signal.SIGTERM):
    loop.add_signal_handler(s, stop.set)
  await stop.wait()
  if warming is not None:
    warming.cancel()
  await server.stop()
  return 0


def _check_options(a, device: str) -> VerifyOptions:
  return VerifyOptions(
    device=device,
    num_correct_trials=a.trials,
    atol=a.atol,
    rtol=a.rtol,
    measure_performance=not a.no_timing,
    num_perf_trials=a.timing_trials,
    num_warmup=a.warmup,
    strictness=a.strictness,
    timeout_s=a.timeout,
    min_speedup=a.min_speedup,
    compile_baseline=a.compile_baseline,
  )


def _print_one(r) -> None:
  """The detailed verdict of a single candidate."""
  print(
    f"kind={r.failure_kind.value} reward={r.reward:g} compiled={r.compiled} correct={r.correct} "
    f"strict_correct={r.strict_correct} deceptive={r.deceptive}"
  )
  if r.speedup:
    print(
      f"speedup={r.speedup:.3f} candidate={r.candidate.mean_ms:.4f} ms (median {r.candidate.median_ms:.4f}) "
      f"baseline={r.baseline.mean_ms:.4f} ms (median {r.baseline.median_ms:.4f})"
    )
  print(f"compile {r.compile_s:.1f} s, run {r.run_s:.1f} s, device {r.device_name}")
  if r.reason:
    print("reason:", r.reason)
  if r.logs and r.failure_kind.value != "OK":
    print("logs:\n" + r.logs)


# `verifier check` exit statuses
EXIT_PASSED, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_NO_VERIFIER = 0, 1, 2, 3
EXIT_STATUSES = (
  "exit status: 0 every candidate passed; 1 some did not; 2 bad input (one line); 3 no verifier "
  "answered (at start within --verifier_wait_s, or for some candidates later: with --out, a rerun "
  "judges only those)"
)


def _say(text: str) -> None:
  print(f"check: {text}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class _CheckRun:
  """What ``check`` judges and where, read from its flags (bad ones raise, naming the flag)."""

  cands: list[batch.Candidate]
  skipped: int  # JSONL rows without a candidate
  cfg: ServiceConfig  # of the service started here (no --verifier)
  opts: VerifyOptions
  addresses: list[str]  # --verifier
  token: str
  wait_s: float
  judged: dict[str, dict]  # request_id -> record already in --out
  writer: verdict_file.VerdictWriter | None

  @classmethod
  def from_flags(cls, a) -> "_CheckRun":
    cands, skipped = batch.load_candidates(a.path, a.reference, a.candidate, a.kernelbench)
    token = os.environ.get("VERIFIER_TOKEN", "")
    if a.token_file:
      token = batch.read_source(a.token_file, "--token-file").strip()
    addresses = parse_endpoints(a.verifier) if a.verifier else []
    cfg = _config(a, serving_here=not addresses)
    wait_s = waiting.check_wait_s(a.verifier_wait_s)
    judged, keep = verdict_file.load(a.out) if a.out else ({}, 0)
    writer = verdict_file.VerdictWriter(a.out, keep) if a.out else None
    opts = _check_options(a, cfg.device)
    return cls(cands, skipped, cfg, opts, addresses, token, wait_s, judged, writer)


async def _check(a) -> int:
  """Verifies one candidate or a batch (verifier/batch.py); exit status as ``EXIT_STATUSES``."""
  try:
    run = _CheckRun.from_flags(a)
  except (batch.InputError, ValueError) as e:
    print(f"check: error: {e}", file=sys.stderr)
    return EXIT_BAD_INPUT
  ids = [batch.request_id(c, run.opts) for c in run.cands]
  results = [VerifyResult.from_dict(run.judged[i]) if i in run.judged else None for i in ids]
  todo = [k for k, r in enumerate(results) if r is None]
  if len(todo) < len(results):
    _say(
      f"{len(results) - len(todo)} of {len(results)} candidate(s) already judged in {a.out}: "
      "skipped (another --out judges them again)"
    )
  if todo:
    stop = _Interrupt(a, run.writer)
    stop.install()
    try:
      await _verify(run, todo, results)
    except asyncio.CancelledError:
      if not stop.fired:
        raise
      return stop.exit_status()
    except VerifierUnavailable as e:
      print(f"check: error: {e}", file=sys.stderr)
      return EXIT_NO_VERIFIER
    except PermissionError as e:  # the service refused the token
      print(f"check: error: {e}", file=sys.stderr)
      return EXIT_BAD_INPUT
    finally:
      stop.remove()
      if run.writer is not None:
        run.writer.close()
  _print_results(a, run.cands, results)
  missing = sum(r is None for r in results)
  if missing:
    again = f"; rerun with --out {a.out} to judge only those" if a.out else ""
    _say(f"{missing} candidate(s) got no verdict: no verifier answered them{again}")
    return EXIT_NO_VERIFIER
  return EXIT_PASSED if all(r.reward > 0 for r in results) else EXIT_FAILED


def _interrupted(a) -> int:
  """Says a check was interrupted (and where its verdicts are); exit status 130."""
  kept = f"; the verdicts so far are in {a.out}, a rerun resumes" if a.out else ""
  _say(f"interrupted{kept}")
  return 130


class _Interrupt:
  """Ctrl-C (SIGINT) during a check: the first cancels the check, whose verdicts so far are already in
  ``--out`` (each written as it arrived); if the check has not ended ``STOP_GRACE_S`` later (a call
  that does not let go), or at a second Ctrl-C, the process ends anyway, exit status 130."""

  STOP_GRACE_S = 10.0

  def __init__(self, a, writer):
    self.a, self.writer, self.fired = a, writer, False
    self.loop = asyncio.get_running_loop()
    self.task = asyncio.current_task()

  def install(self) -> None:
    self.loop.add_signal_handler(signal.SIGINT, self._fire)

  def remove(self) -> None:
    self.loop.remove_signal_handler(signal.SIGINT)

  def _fire(self) -> None:
    if self.fired:
      self._end_now()
    self.fired = True
    self.task.cancel()
    self.loop.call_later(self.STOP_GRACE_S, self._end_now)

  def exit_status(self) -> int:
    return _interrupted(self.a)

  def _end_now(self) -> None:
    if self.writer is not None:
      self.writer.close()
    self.exit_status()
    sys.stderr.flush()
    os._exit(130)


async def _verify(run: _CheckRun, todo: list[int], results: list) -> None:
  """Judges the candidates at indices ``todo`` into ``results`` (None where no verifier answered),
  each verdict to ``--out`` as it arrives."""
  cfg, cands = run.cfg, [run.cands[k] for k in todo]
  if not run.addresses:
    cfg.pch_background = False  # a one-shot run would kill it before it is done
    cfg.prewarm = len(cands) > 1
    cfg.compile_workers = min(cfg.compile_workers, len(cands))
  note = f" ({run.skipped} without a candidate skipped)" if run.skipped else ""
  where = ", ".join(run.addresses) or f"a {cfg.device} verifier started here"
  _say(f"{len(cands)} candidate(s){note} on {where}; a cold C++/CUDA build takes 10-150 s")

  def on_result(i: int, r: VerifyResult) -> None:
    results[todo[i]] = r
    if run.writer is not None:
      run.writer.write(cands[i], r)

  progress = batch.Progress(len(cands))
  try:
    await batch.verify_batch(
      cands,
      run.opts,
      service_config=cfg,
      addresses=run.addresses,
      token=run.token,
      progress=progress,
      on_result=on_result,
      wait_s=run.wait_s,
      report=_say,
    )
  finally:
    progress.close()


def _print_results(a, cands, results) -> None:
  """The verdicts on stdout: JSON (--json), one candidate's details, or the summary table."""
  pairs = [(c, r) for c, r in zip(cands, results) if r is not None]
  if not pairs:
    return
  if a.json:
    out = [verdict_file.record(c, r) for c, r in pairs]
    print(json.dumps(out[0] if a.candidate else out, indent=2))
  elif len(pairs) == 1 and a.candidate:
    _print_one(pairs[0][1])
  else:
    print(batch.summary(*zip(*pairs)))


def expand_flagfiles(argv: list[str]) -> list[str]:
  """Replaces ``--flagfile=PATH`` / ``--flagfile PATH`` by the flags in PATH (one per line, ``#``
  comments; absl's format, which the experiments/ launchers read too)."""
  out: list[str] = []
  i = 0
  while i < len(argv):
    arg = argv[i]
    if arg == "--flagfile" or arg.startswith("--flagfile="):
      if arg == "--flagfile":
        if i + 1 == len(argv):
          raise batch.InputError("--flagfile needs a path")
        path, i = argv[i + 1], i + 2
      else:
        path, i = arg.split("=", 1)[1], i + 1
      text = batch.read_source(path, "--flagfile")
      lines = [ln.strip() for ln in text.splitlines()]
      out += expand_flagfiles([ln for ln in lines if ln and not ln.startswith("#")])
      continue
    out.append(arg)
    i += 1
  return out


def _default_kernelbench() -> str:
  path = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "..",
    "shared",
    "data",
    "kernelbench",
  )
  return os.path.normpath(path) if os.path.isdir(path) else ""


def _serve_parser(sub) -> None:
  """`serve`: the gRPC service on this host."""
  s = sub.add_parser("serve", help="run the gRPC verifier service")
  s.add_argument(
    "--host", default="127.0.0.1", help="address to listen on (non-loopback needs a token)"
  )
  s.add_argument("--port", type=int, default=50051, help="port to listen on (0: any free port)")
  s.add_argument(
    "--token-file", default="", help="file holding the bearer token (or set VERIFIER_TOKEN)"
  )
  s.add_argument(
    "--stream-window",
    type=int,
    default=256,
    help="requests of one VerifyStream call in flight at once",
  )
  s.add_argument("--tls-cert", default="", help="PEM certificate chain: serve TLS (with --tls-key)")
  s.add_argument("--tls-key", default="", help="PEM private key for --tls-cert")
  s.add_argument(
    "--build-only",
    action="store_true",
    help="compile host: serve Build only, into --cache-dir shared with GPU hosts",
  )
  _service_args(s)


def _check_parser(sub) -> None:
  """`check`: one pair, or a batch from a directory or JSONL."""
  c = sub.add_parser(
    "check",
    help="verify candidates against references: one pair, or a batch from a directory or JSONL",
    description=batch.__doc__.split("\n\n")[1].replace("``", "") if batch.__doc__ else None,
    epilog=EXIT_STATUSES,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  c.add_argument(
    "path",
    nargs="?",
    default=None,
    help="a directory or a .jsonl of candidates (see above); or use --reference and --candidate",
  )
  c.add_argument("--reference", help="the PyTorch reference file (class Model, get_inputs, ...)")
  c.add_argument("--candidate", help="the candidate file (class ModelNew)")
  c.add_argument(
    "--kernelbench",
    default=_default_kernelbench(),
    help="KernelBench problems for candidates named by problem id: level*.jsonl or a checkout "
    "(default: ../shared/data/kernelbench when present)",
  )
  c.add_argument(
    "--verifier",
    default="",
    help="HOST:PORT[,HOST:PORT...] of running services (default: start one in this process)",
  )
  c.add_argument(
    "--token-file", default="", help="file holding the bearer token (or set VERIFIER_TOKEN)"
  )
  c.add_argument(
    waiting.WAIT_FLAG,
    "--verifier-wait-s",
    dest="verifier_wait_s",
    type=float,
    default=waiting.VERIFIER_WAIT_S,
    metavar="SECONDS",
    help="with --verifier: how long to wait for the services to answer at start, in seconds (a "
    f"progress line every {waiting.WAIT_PROGRESS_EVERY_S:g} s meanwhile; then exit status 3)",
  )
  c.add_argument("--json", action="store_true", help="print the full results as JSON at the end")
  c.add_argument(
    "--out",
    default="",
    metavar="FILE",
    help="append each verdict to FILE as one JSON line as it arrives (with the input row's id); a "
    "rerun with the same FILE skips the candidates already judged there",
  )
  c.add_argument(
    "--trials", type=int, default=5, help="correctness trials, each with new random inputs"
  )
  c.add_argument(
    "--atol",
    type=float,
    default=1e-2,
    help="absolute tolerance of the output comparison (torch.allclose; DICE and KernelBench v0: 1e-2)",
  )
  c.add_argument(
    "--rtol", type=float, default=1e-2, help="relative tolerance of the output comparison"
  )
  c.add_argument(
    "--timing-trials", type=int, default=100, help="timed calls of the candidate and the baseline"
  )
  c.add_argument("--warmup", type=int, default=3, help="untimed warm-up calls before timing")
  c.add_argument("--no-timing", action="store_true", help="check correctness only (no speedup)")
  c.add_argument(
    "--compile-baseline",
    action="store_true",
    help="time torch.compile(reference) as the baseline instead of eager PyTorch",
  )
  c.add_argument(
    "--strictness",
    default="strict",
    choices=("strict", "kernelbench", "off"),
    help="anti-cheating rules: strict (default), kernelbench (its static checks), off (correctness only)",
  )
  c.add_argument(
    "--timeout",
    type=float,
    default=180.0,
    metavar="SECONDS",
    help="wall-clock limit of the run stage per candidate, in seconds (the build has its own)",
  )
  c.add_argument(
    "--min-speedup",
    type=float,
    default=0.0,
    help="a correct candidate passes only at this speedup or above (0: any)",
  )
  _service_args(c)


def _bench_parser(sub) -> None:
  """`bench`: compile/run throughput on this host."""
  b = sub.add_parser("bench", help="compile/run throughput on this host (see verifier/bench.py)")
  b.add_argument("--out", default="", help="write the JSON report here")
  b.add_argument(
    "--kernelbench", default="", help="level1.jsonl (default: ../shared/data relative to the repo)"
  )
  b.add_argument(
    "--candidates", type=int, default=99, help="DICE candidates for the compile and GPU stages"
  )
  b.add_argument(
    "--level1", type=int, default=100, help="KernelBench level-1 problems for the GPU-stage rate"
  )
  b.add_argument(
    "--startup-workers", type=int, default=16, help="workers started at once in the startup phase"
  )
  b.add_argument(
    "--level1-samples", type=int, default=1, help="candidates per level-1 problem (an RL group)"
  )
  b.add_argument("--timed", type=int, default=16, help="level-1 problems for the timing-on rate")
  b.add_argument(
    "--timed-passes",
    type=int,
    default=2,
    help="timed passes over them (cold, then cached; >= 3 for the median of 3 per problem)",
  )
  b.add_argument(
    "--budget-s", type=float, default=540, help="skip later phases past this many seconds"
  )
  b.add_argument("--skip-stock", action="store_true", help="skip the stock load_inline measurement")
  b.add_argument("--phases", default="stock,single,compile,dice_e2e,gpu_level1,identity")
  b.add_argument("--offset", type=int, default=0, help="first DICE candidate to use")
  _service_args(b)


def main(argv=None) -> int:
  try:
    argv = expand_flagfiles(list(sys.argv[1:] if argv is None else argv))
  except batch.InputError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  p = argparse.ArgumentParser(
    prog="python -m verifier",
    epilog="Any subcommand also reads flags from --flagfile=PATH (one flag per line).",
  )
  sub = p.add_subparsers(dest="cmd", required=True)
  _serve_parser(sub)
  _check_parser(sub)
  _bench_parser(sub)
  a = p.parse_args(argv)
  level = logging.WARNING if a.cmd == "check" else logging.INFO  # check shows its own progress
  logging.basicConfig(level=level, format="%(asctime)s %(name)s %(message)s")
  if a.cmd == "serve":
    return asyncio.run(_serve(a))
  if a.cmd == "check":
    try:
      return asyncio.run(_check(a))
    except KeyboardInterrupt:  # before the check's own handler is in place
      return _interrupted(a)
  from verifier import bench

  try:
    cfg = _config(a)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return asyncio.run(bench.run(a, cfg))
