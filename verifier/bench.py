"""``python -m verifier bench``: where the time goes on a verifier host.

Phases (each recorded in the JSON report as it finishes; later phases are skipped when ``--budget-s``
runs out):
  stock        stock ``load_inline`` of KernelBench's one-kernel example in a fresh process and build dir
  single       the same candidate through this verifier (cold cache), one at a time; then renamed, once the
               precompiled torch header exists (on ``--device cpu``: the demo's C++ relu instead)
  startup      candidate-worker supply: N workers forked at once from the fork server (time to ready)
  compile      N unique DICE candidates through the build stage (``compile_workers`` in parallel)
  dice_e2e     N unique DICE candidates end to end (static check, cold build, run; strict): rate, verdicts
               (non-OK ones again under the kernelbench preset) and what the checker/candidate separation
               cost
  gpu_dice     the same N candidates through the GPU stage in reward mode (builds cached): rate and verdicts
  gpu_level1   KernelBench level-1 problems with a pass-through candidate (the reference renamed ModelNew,
               strictness off): GPU-stage rate in reward mode, then with timing on (cold and cached
               baseline), with each timed candidate's mean over its baseline (``timing_methods``: the
               checker's clock against the previous in-process CUDA-event method on the same code)
  identity     every KernelBench level 1-3 problem's reference renamed ModelNew, strictness off: must all pass

Separation cost (per phase): the checker's staging of buffers, the round trips around the candidate's
forward (mapping, staging, publishing outputs, messages) and the part of the first forward's buffer mapping
its load did not hide (``exchange_stage`` + ``exchange_round_trip`` + ``exchange_load_map_wait``, per
candidate) as a share of the slot time each candidate had at the measured rate.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

from verifier.api.contract import FailureKind, VerifyOptions, VerifyRequest
from verifier.ipc.records import CANDIDATE_EXCHANGE_PARTS
from verifier.serve.service import ServiceConfig, VerifierService

REPO = pathlib.Path(__file__).resolve().parents[1]
SEPARATION_PHASES = ("exchange_stage", "exchange_round_trip", "exchange_load_map_wait")
# the device clock's decision and both clocks' estimates (``Check._choose_clock``), the head starts
DEVICE_CLOCK_PHASES = (
  "timing_device_clock",
  "timing_device_floored",
  "timing_host_mean_ms",
  "timing_device_mean_ms",
  "timing_device_kernel_ms",
  "timing_device_floor_ms",
  "timing_device_allowance_ms",
  "timing_device_allowance_used",
  "calibration_reference_device_ms",
  "timing_head_start_us",
  "timing_head_start_device_us",
  "timing_device_lead_us",
  "timing_device_tail_us",
  "baseline_head_start_us",
)
# a timed candidate's own phases, kept per problem (``gpu_level1``)
TIMING_PHASES = (
  "exchange_call_before_ms",
  "exchange_call_during_ms",
  "exchange_excess_ms",
  "exchange_overhead_ms",
  "reference_exchange_ms",
  "reference_in_process_ms",
  "calibration",
  "timing",
  "exchange_rt_publish",
  "exchange_rt_wake_in",
  "exchange_rt_wake_out",
  "exchange_rt_stage_in",
  "exchange_round_trip",
  "candidate_forward",
  "timing_inputs",
  "timing_stage",
  "timing_flush",
  "timing_call",
  "timing_judge",
  "timing_null",
  "timing_burst_calls",
  "timing_drawn_into_buffers",
  *DEVICE_CLOCK_PHASES,
)
DATA_DIRS = [
  REPO / ".gpu_data" / "verifier",
  REPO.parent / "shared" / "data" / "dice_rl",
  REPO.parent / "shared" / "data" / "kernelbench",
]

STOCK_SCRIPT = r"""
import sys, time, torch
from torch.utils.cpp_extension import load_inline
ns = {}
src = open(sys.argv[1]).read()
t0 = time.monotonic()
exec(compile(src, "candidate", "exec"), ns)
print("STOCK_SECONDS", time.monotonic() - t0)
"""


def _find(name: str, explicit: str = "") -> pathlib.Path:
  if explicit:
    return pathlib.Path(explicit)
  for d in DATA_DIRS:
    if (d / name).is_file():
      return d / name
  raise FileNotFoundError(f"{name} not found in {[str(d) for d in DATA_DIRS]}")


def _tool_version(cmd: list[str]) -> str:
  try:
    return (
      subprocess.run(cmd, capture_output=True, text=True, timeout=20)
      .stdout.strip()
      .splitlines()[-1]
    )
  except Exception as e:  # noqa: BLE001
    return f"unavailable ({e})"


def env_info() -> dict:
  import torch

  return {
    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    "python": platform.python_version(),
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "cores": os.cpu_count(),
    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
    "nvcc": _tool_version(["nvcc", "--version"]),
    "gcc": subprocess.run(["gcc", "--version"], capture_output=True, text=True).stdout.split("\n")[
      0
    ],
  }


def rename_extensions(candidate: str, suffix: str) -> str:
  """The same candidate with every load_inline extension renamed (a new build key: it builds again)."""
  return re.sub(
    r"""(\bname\s*=\s*["'])(\w+)(["'])""",
    lambda m: m.group(1) + m.group(2) + suffix + m.group(3),
    candidate,
  )


def pass_through(reference: str) -> str:
  """A candidate that is the reference under the name ModelNew (exercises the GPU stage, no kernel)."""
  return re.sub(r"\bModel\b", "ModelNew", reference)


def under_kernelbench_rules(reqs: list[VerifyRequest], results) -> list[VerifyRequest]:
  """The requests that were not OK, again under the `kernelbench` preset (ids suffixed "-kb"): which
  rejections are this verifier's own rules."""
  return [
    dataclasses.replace(
      q,
      request_id=q.request_id + "-kb",
      options=dataclasses.replace(q.options, strictness="kernelbench"),
    )
    for q, r in zip(reqs, results)
    if r.failure_kind is not FailureKind.OK
  ]


class Bench:
  def __init__(self, a, cfg: ServiceConfig):
    self.a, self.cfg = a, cfg
    self.report: dict = {"env": env_info(), "config": dataclasses.asdict(cfg)}
    self.t_end = time.monotonic() + a.budget_s
    self.after_rates: list = []  # diagnostics that run once every phase is done (coroutine factories)
    self.out = pathlib.Path(a.out) if a.out else None

  def left(self) -> float:
    return self.t_end - time.monotonic()

  def save(self, phase: str, data) -> None:
    self.report[phase] = data
    print(f"[bench] {phase}: {json.dumps(data)[:1500]}", flush=True)
    if self.out:
      self.out.parent.mkdir(parents=True, exist_ok=True)
      self.out.write_text(json.dumps(self.report, indent=1))

  def stock(self, candidate: str) -> None:
    with tempfile.TemporaryDirectory() as d:
      path = os.path.join(d, "cand.py")
      pathlib.Path(path).write_text(candidate)
      env = dict(os.environ, TORCH_EXTENSIONS_DIR=os.path.join(d, "ext"))
      if self.cfg.arch_list:
        env["TORCH_CUDA_ARCH_LIST"] = self.cfg.arch_list
      t0 = time.monotonic()
      p = subprocess.run(
        [sys.executable, "-c", STOCK_SCRIPT, path],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
      )
      wall = time.monotonic() - t0
    m = re.search(r"STOCK_SECONDS ([\d.]+)", p.stdout)
    self.save(
      "stock",
      {
        "load_inline_s": float(m.group(1)) if m else None,
        "process_wall_s": wall,
        "ok": p.returncode == 0,
        "stderr_tail": p.stderr[-800:] if p.returncode else "",
      },
    )

  async def single(self, svc: VerifierService, reference: str, candidate: str) -> None:
    """One candidate alone on a cold cache; then, once the service has built its precompiled torch header
    (pch.py), the same candidate under another extension name (so it builds again, with the PCH)."""
    opts = VerifyOptions(device=self.cfg.device, timeout_s=300)
    out = {}
    for tag, cand in (("cold", candidate), ("with_pch", rename_extensions(candidate, "_pch"))):
      if tag == "with_pch":
        t0 = time.monotonic()
        await asyncio.gather(*svc.pch_builds.values(), return_exceptions=True)
        out["pch_build"] = (
          svc.metrics.pch_builds[-1] if svc.metrics.pch_builds else "none scheduled"
        )
        out["pch_wait_s"] = time.monotonic() - t0
      t0 = time.monotonic()
      r = await svc.verify(VerifyRequest(f"bench-single-{tag}", "one_shot", reference, cand, opts))
      out[tag] = {
        "kind": r.failure_kind.value,
        "compile_s": r.compile_s,
        "run_s": r.run_s,
        "total_s": time.monotonic() - t0,
        "reason": r.reason[:300],
        "build_events": svc.metrics.build_s[-1:],
      }
      self.save("single", out)

  async def compile_stage(self, svc: VerifierService, tasks: list[dict]) -> None:
    async def one(t):
      t0 = time.monotonic()
      b = await svc._build(
        VerifyRequest(
          f"build-{t['id']}",
          str(t["id"]),
          t["pytorch_code"],
          t["cuda_code"],
          VerifyOptions(device=self.cfg.device),
        )
      )
      return t0, time.monotonic(), b

    t0 = time.monotonic()
    res = await asyncio.gather(*(one(t) for t in tasks))
    wall = time.monotonic() - t0
    build_s = [sum(e.get("seconds", 0.0) for e in b.events) for _, _, b in res if b.events]
    fast = sum(1 for _, _, b in res for e in b.events if e.get("fast"))
    self.save(
      "compile",
      {
        "candidates": len(tasks),
        "workers": self.cfg.compile_workers,
        "wall_s": wall,
        "candidates_per_min": 60 * len(tasks) / wall,
        "candidates_per_min_per_16_cores": 60 * len(tasks) / wall * 16 / (os.cpu_count() or 16),
        "median_build_s_under_load": statistics.median(build_s) if build_s else None,
        "p90_build_s_under_load": sorted(build_s)[int(0.9 * (len(build_s) - 1))]
        if build_s
        else None,
        "fast_variant_builds": fast,
        "split_builds": sum(1 for e in svc.metrics.build_s if e.get("split")),
        "pch_builds": sum(1 for e in svc.metrics.build_s if e.get("pch")),
        "kinds": dict(collections.Counter(b.kind.value for _, _, b in res)),
        "fast_fallbacks": [e["fast_error"] for e in svc.metrics.build_s if e["fast_error"]][:5],
      },
    )

  async def gpu_dice(self, svc: VerifierService, tasks: list[dict]) -> None:
    opts = VerifyOptions(device="cuda", timeout_s=120)
    reqs = [
      VerifyRequest(f"dice-{t['id']}", str(t["id"]), t["pytorch_code"], t["cuda_code"], opts)
      for t in tasks
    ]
    t0 = time.monotonic()
    res = await asyncio.gather(*(svc.verify(r) for r in reqs))
    wall = time.monotonic() - t0
    phases_mean = svc.metrics.snapshot()["run_phase_mean_s"]
    redo = under_kernelbench_rules(reqs, res)
    kb = {r.request_id[:-3]: r for r in await asyncio.gather(*(svc.verify(q) for q in redo))}
    rows = [
      {
        "id": r.task_id,
        "kind": r.failure_kind.value,
        "reason": r.reason[:400],
        "strict_fp32": r.strict_correct,
        "max_abs_diff": r.max_abs_diff,
        "run_s": r.run_s,
        "kernelbench_kind": kb[r.request_id].failure_kind.value if r.request_id in kb else "OK",
        "kernelbench_reason": kb[r.request_id].reason[:400] if r.request_id in kb else "",
        "logs": r.logs[-600:] if r.failure_kind is not FailureKind.OK else "",
      }
      for r in res
    ]
    self.save(
      "gpu_dice",
      {
        "candidates": len(reqs),
        "wall_s": wall,
        "candidates_per_min": 60 * len(reqs) / wall,
        "strict": dict(collections.Counter(x["kind"] for x in rows)),
        "kernelbench": dict(collections.Counter(x["kernelbench_kind"] for x in rows)),
        "strict_fp32_1e-4": sum(x["strict_fp32"] for x in rows),
        "run_phase_mean_s": phases_mean,
        "rows": rows,
      },
    )

  async def startup(self) -> None:
    """How fast candidate workers become ready: ``--startup-workers`` forked at once."""
    from verifier.sandbox.pool import PoolConfig, WorkerPool

    c, n = self.cfg, self.a.startup_workers
    pool = WorkerPool(
      PoolConfig(
        role="candidate",
        device=c.device,
        gpu_index=c.gpus[0] if c.gpus else "",
        scratch_root=c.scratch_root,
        mem_mb=c.mem_mb,
        isolate_network=c.isolate_network,
        arch_list=c.arch_list,
        prewarm=0,
        build_root=c.cache_dir,
        warm_profiler=c.warm_profiler,
      )
    )
    out = {}
    for round_name in ("with_fork_server_start", "fork_server_running"):
      t0 = time.monotonic()
      workers = await asyncio.gather(*(pool.fork() for _ in range(n)))
      ready_at, phases = [], collections.Counter()
      for w in workers:
        try:
          msg = await w.wait_ready(600)
          ready_at.append(time.monotonic() - t0)
          phases.update(msg.startup_phases)
        except Exception:  # noqa: BLE001 - counted as not ready
          pass
      wall = max(ready_at) if ready_at else float("nan")
      for w in workers:
        w.discard()
      out[round_name] = {
        "workers": n,
        "ready": len(ready_at),
        "wall_s": wall,
        "median_ready_s": statistics.median(ready_at) if ready_at else None,
        "workers_per_min": 60 * len(ready_at) / wall if ready_at else 0.0,
        "startup_phase_mean_s": {k: v / max(len(ready_at), 1) for k, v in phases.items()},
      }
      self.save("startup", out)
    await pool.close()

  def separation(self, svc: VerifierService, rate_per_min: float, slots: int) -> dict:
    """What the checker/candidate separation cost per candidate, as a share of its slot time."""
    mean = svc.metrics.snapshot()["run_phase_mean_s"]
    extra = sum(mean.get(k, 0.0) for k in SEPARATION_PHASES)
    slot_s = slots * 60.0 / rate_per_min if rate_per_min else float("nan")
    return {
      "per_candidate_s": extra,
      "slot_s_per_candidate": slot_s,
      "share_of_rate": extra / slot_s if slot_s == slot_s and slot_s > 0 else None,
      "parts_s": {k: mean.get(k, 0.0) for k in SEPARATION_PHASES},
      "stage_alloc_s": mean.get("exchange_stage_alloc", 0.0),
      "round_trip_parts_s": {
        k: mean.get(f"exchange_rt_{k}", 0.0)
        for k in (*CANDIDATE_EXCHANGE_PARTS, "wake_in", "wake_out")
      },
      "candidate_forward_s": mean.get("candidate_forward", 0.0),
      "compare_s": mean.get("compare", 0.0),
    }

  async def dice_e2e(self, svc: VerifierService, tasks: list[dict]) -> None:
    """Unique candidates end to end (cold builds), strict; verdicts; non-OK ones again under kernelbench."""
    opts = VerifyOptions(device=self.cfg.device, timeout_s=180)
    reqs = [
      VerifyRequest(f"e2e-{t['id']}", str(t["id"]), t["pytorch_code"], t["cuda_code"], opts)
      for t in tasks
    ]
    self.reset_phases(svc)
    first_build = len(svc.metrics.build_s)
    t0 = time.monotonic()
    res = await asyncio.gather(*(svc.verify(r) for r in reqs))
    wall = time.monotonic() - t0
    rate = 60 * len(reqs) / wall
    builds = svc.metrics.build_s[first_build:]
    out = {
      "candidates": len(reqs),
      "wall_s": wall,
      "candidates_per_min": rate,
      "strict": dict(collections.Counter(r.failure_kind.value for r in res)),
      "strict_fp32_1e-4": sum(r.strict_correct for r in res),
      "build_cached": sum(r.build_cached for r in res),
      "builds": {
        "count": len(builds),
        "median_s": statistics.median(e["seconds"] for e in builds) if builds else None,
        **{k: sum(1 for e in builds if e.get(k)) for k in ("split", "lean", "pch", "lean_error")},
      },
      "run_phase_mean_s": svc.metrics.snapshot()["run_phase_mean_s"],
      "tasks_beyond_baseline": dict(svc.metrics.tasks_beyond_baseline),
      "separation": self.separation(svc, rate, self.cfg.slots_per_gpu),
      "transports": dict(svc.metrics.transports),
      "failures": [
        (r.task_id, r.failure_kind.value, r.reason[:300])
        for r in res
        if r.failure_kind
        not in (FailureKind.OK, FailureKind.FOREIGN_KERNELS, FailureKind.NO_KERNEL)
      ],
    }
    self.save("dice_e2e", out)
    self.after_rates.append(lambda: self.dice_e2e_under_kernelbench(svc, reqs, res, out))

  async def dice_e2e_under_kernelbench(self, svc: VerifierService, reqs, res, out: dict) -> None:
    """dice_e2e's non-OK candidates again under the kernelbench preset: a diagnostic, run after every rate
    phase (its unsplittable stock builds took 83 s on an H200 and left the timed phase no budget)."""
    redo = under_kernelbench_rules(reqs, res)
    kb = await asyncio.gather(*(svc.verify(q) for q in redo))
    out["kernelbench_for_non_ok"] = dict(collections.Counter(r.failure_kind.value for r in kb))
    out["kernelbench_failures"] = [
      (r.task_id, r.failure_kind.value, r.reason[:300])
      for r in kb
      if r.failure_kind is not FailureKind.OK
    ]
    self.save("dice_e2e", out)

  def reset_phases(self, svc: VerifierService) -> None:
    svc.metrics.run_phase_s.clear()
    svc.metrics.run_phase_n.clear()

  async def identity(self, svc: VerifierService, problems: list[dict]) -> None:
    """Every problem's own reference as its candidate (strictness off): a verifier that rejects one of
    these rejects correct work."""
    opts = VerifyOptions(device="cuda", strictness="off", timeout_s=300)
    reqs = [
      VerifyRequest(
        f"identity-{p['level']}-{p['problem_id']}",
        p["name"],
        p["code"],
        pass_through(p["code"]),
        opts,
      )
      for p in problems
    ]
    self.reset_phases(svc)
    t0 = time.monotonic()
    level = {r.request_id: p["level"] for p, r in zip(problems, reqs)}
    res = []
    for fut in asyncio.as_completed([svc.verify(r) for r in reqs]):
      res.append(await fut)
      if len(res) % 25 == 0 or len(res) == len(reqs):  # progress survives a time limit
        wall = time.monotonic() - t0
        by_level = collections.defaultdict(collections.Counter)
        for r in res:
          by_level[level[r.request_id]][r.failure_kind.value] += 1
        self.save(
          "identity",
          {
            "problems": len(reqs),
            "done": len(res),
            "ok": sum(r.failure_kind is FailureKind.OK for r in res),
            "wall_s": wall,
            "candidates_per_min": 60 * len(res) / wall,
            "by_level": {str(k): dict(v) for k, v in sorted(by_level.items())},
            "oom_retries_so_far": svc.metrics.oom_retries,
            "failures": [
              (r.task_id, r.failure_kind.value, r.reason[:300])
              for r in res
              if r.failure_kind is not FailureKind.OK
            ],
          },
        )

  async def gpu_level1(self, svc: VerifierService, problems: list[dict]) -> None:
    def reqs(tag, probs, samples=1, **kw):
      # RL verifies a group of samples per task; distinct sources (a comment) so none is deduplicated.
      o = VerifyOptions(device="cuda", strictness="off", timeout_s=180, **kw)
      return [
        VerifyRequest(
          f"{tag}-{p['problem_id']}-{k}",
          p["name"],
          p["code"],
          pass_through(p["code"]) + f"\n# sample {k}\n",
          o,
        )
        for p in probs
        for k in range(samples)
      ]

    out = {}
    timed_kw = {"measure_performance": True}
    passes = [
      ("reward", problems, {"samples": self.a.level1_samples}),
      ("timed_cold", problems[: self.a.timed], timed_kw),
      ("timed_cached_baseline", problems[: self.a.timed], timed_kw),
    ]
    # more cached passes (`--timed-passes`): the median of the passes per problem (item 9's rule)
    passes += [
      (f"timed_cached_{i}", problems[: self.a.timed], timed_kw)
      for i in range(2, self.a.timed_passes)
    ]
    for tag, probs, kw in passes:
      if self.left() < 60 or not probs:
        out[tag] = "skipped: bench budget used up" if probs else "skipped: no problems"
        continue
      rs = reqs(tag, probs, **kw)
      timed = kw.get("measure_performance", False)
      self.reset_phases(svc)
      t0 = time.monotonic()
      if timed:  # one at a time (a timed run owns the device anyway), each one's timing phases kept
        res, per_problem = [], {}
        for r in rs:
          before = dict(svc.metrics.run_phase_s)
          res.append(await svc.verify(r))
          after = dict(svc.metrics.run_phase_s)
          per_problem[r.task_id] = {
            k: after[k] - before.get(k, 0.0) for k in TIMING_PHASES if k in after
          }
      else:
        res = await asyncio.gather(*(svc.verify(r) for r in rs))
      wall = time.monotonic() - t0
      rate = 60 * len(rs) / wall
      out[tag] = {
        "candidates": len(rs),
        "wall_s": wall,
        "candidates_per_min": rate,
        "separation": self.separation(svc, rate, 1 if timed else self.cfg.slots_per_gpu),
        "kinds": dict(collections.Counter(r.failure_kind.value for r in res)),
        "median_run_s": statistics.median(r.run_s for r in res),
        "run_phase_mean_s": svc.metrics.snapshot()["run_phase_mean_s"],
        "tasks_beyond_baseline_so_far": dict(svc.metrics.tasks_beyond_baseline),
        "oom_retries_so_far": svc.metrics.oom_retries,
        "baselines_measured_so_far": svc.metrics.baselines_measured,
        "failures": [
          (r.task_id, r.failure_kind.value, r.reason[:160])
          for r in res
          if r.failure_kind is not FailureKind.OK
        ][:20],
      }
      if timed:
        out[tag]["timing_methods"] = timing_methods(res)
        out[tag]["per_problem_phases"] = per_problem
        out["timing_median"] = timing_median(out)
      self.save("gpu_level1", out)


def timing_methods(results) -> dict:
  """The checker's clock against the previous method, in one run: a pass-through candidate runs the
  reference's own code, and the baseline is that code timed by the previous method (CUDA events around
  each call, in process), so new / old is the candidate's mean over the baseline's."""
  ratios = {
    r.task_id: r.candidate.mean_ms / r.baseline.mean_ms
    for r in results
    if r.failure_kind is FailureKind.OK and r.candidate and r.baseline and r.baseline.mean_ms > 0
  }
  return {
    "new_over_old": ratios,
    "within_10pct": sum(0.9 <= v <= 1.1 for v in ratios.values()),
    "compared": len(ratios),
  }


def timing_median(phases: dict) -> dict:
  """Over the timed passes so far (cold and cached): each problem's median new / old, how many of
  them are within 10 %, and the mean cached rate (issue 37 item 9: the median of 3 runs)."""
  timed = [v for k, v in phases.items() if k.startswith("timed_") and isinstance(v, dict)]
  runs = collections.defaultdict(list)
  for v in timed:
    for task, r in v.get("timing_methods", {}).get("new_over_old", {}).items():
      runs[task].append(r)
  median = {task: statistics.median(rs) for task, rs in runs.items()}
  cached = [v["candidates_per_min"] for k, v in phases.items() if k.startswith("timed_cached")]
  return {
    "passes": len(timed),
    "new_over_old_median": median,
    "within_10pct": sum(0.9 <= v <= 1.1 for v in median.values()),
    "compared": len(median),
    "cached_per_min_mean": statistics.fmean(cached) if cached else None,
  }


def _jsonl(name: str, explicit: str = "") -> list[dict]:
  return [
    json.loads(line) for line in _find(name, explicit).read_text().splitlines() if line.strip()
  ]


def warms_pch(asked: bool | None, device: str, phases: list[str]) -> bool:
  """Whether the bench builds the precompiled header before its phases, as ``serve`` does at start:
  ``--warm-pch`` if given; else on a GPU host unless the first phase is ``single``, which times one
  cold build and leaves the header built for the phases after it (the protocol of the e2e rates
  before session 29)."""
  if asked is not None:
    return asked
  return device == "cuda" and phases[:1] != ["single"]


async def run(a, cfg: ServiceConfig) -> int:
  cfg = dataclasses.replace(
    cfg, cache_dir=tempfile.mkdtemp(prefix="bench-cache-"), build_timeout_s=900
  )
  b = Bench(a, cfg)
  if cfg.device == "cuda":
    ref = _find("one_shot_model_ex_add.py.txt").read_text()
    cand = _find("one_shot_model_new_ex_add.py.txt").read_text()
  else:  # the CPU backend: the demo's known-good C++ relu
    demo = REPO / "experiments" / "demo_data"
    ref = json.loads((demo / "pairs.jsonl").read_text().splitlines()[0])["pytorch_code"]
    cand = (demo / "relu_cpu_candidate.py").read_text()
  phases = [p for p in a.phases.split(",") if p]
  dice = (
    json.loads(_find("kernel_infilling_evaluation.json").read_text())[
      a.offset : a.offset + a.candidates
    ]
    if {"compile", "gpu_dice", "dice_e2e"} & set(phases)
    else []
  )
  level1 = _jsonl("level1.jsonl", a.kernelbench) if "gpu_level1" in phases else []
  levels = (
    [p for name in ("level1.jsonl", "level2.jsonl", "level3.jsonl") for p in _jsonl(name)]
    if "identity" in phases
    else []
  )
  if "stock" in phases and not a.skip_stock:
    b.stock(cand)
  if "startup" in phases:
    await b.startup()
  svc = VerifierService(cfg)
  t0 = time.monotonic()
  await svc.start()
  b.save("service_start_s", time.monotonic() - t0)
  if warms_pch(a.warm_pch, cfg.device, phases):  # as `serve` does at start
    t0 = time.monotonic()
    b.save("pch_warm", {"ready": await svc.warm_pch(), "s": time.monotonic() - t0})
  try:
    for phase in phases:
      if phase == "single":  # first, alone: it also builds the precompiled header later phases use
        await b.single(svc, ref, cand)
        b.save("single_build_events", list(svc.metrics.build_s))
        continue
      if b.left() < 60:
        b.save(f"{phase}_skipped", "bench budget used up")
        continue
      if phase == "compile":
        await b.compile_stage(svc, dice)
      elif phase == "dice_e2e":
        await b.dice_e2e(svc, dice)
      elif phase == "gpu_dice" and cfg.device == "cuda":
        await b.gpu_dice(svc, dice)
      elif phase == "gpu_level1" and cfg.device == "cuda":
        await b.gpu_level1(svc, level1[: a.level1])
      elif phase == "identity" and cfg.device == "cuda":
        await b.identity(svc, levels)
    for diagnostic in b.after_rates:
      if b.left() > 60:
        await diagnostic()
  finally:
    b.save("metrics", svc.metrics.snapshot())
    await svc.close()
  return 0
