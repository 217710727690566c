"""Entry point of one sandboxed worker process: ``python -m verifier.worker_main --role run|build``.

The parent (``sandbox.WorkerProcess``) starts it ahead of time; it applies its own limits, imports torch,
creates its CUDA context, then blocks on stdin for exactly one JSON job, writes ``result.json`` into its
scratch directory and exits. ``build`` executes the candidate module on CPU with the cached
``load_inline`` so the extension lands in the shared build cache; ``run`` checks and times it.
The correctness protocol follows KernelBench's ``run_and_check_correctness`` with the hardening listed
in reference/kernelbench_verifiers.md section 2.8.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
import traceback


def _write_result(scratch: str, result: dict) -> None:
  tmp = os.path.join(scratch, "result.json.tmp")
  with open(tmp, "w") as f:
    json.dump(result, f)
  os.replace(tmp, os.path.join(scratch, "result.json"))


def classify_exception(exc: BaseException, default):
  from verifier.contract import FailureKind

  text = f"{type(exc).__name__}: {exc}"
  name = type(exc).__name__
  if (
    name in ("AcceleratorError", "CudaError")
    or "CUDA error" in text
    or "cudaError" in text
    or "illegal memory access" in text
    or "device-side assert" in text
  ):
    return FailureKind.CUDA_ERROR
  if (
    isinstance(exc, MemoryError)
    or name == "OutOfMemoryError"
    or "out of memory" in text.lower()
    or "can't allocate memory" in text
    or "bad_alloc" in text
  ):
    return FailureKind.OUT_OF_MEMORY
  return default


def _short(exc: BaseException, limit: int = 4000) -> str:
  text = f"{type(exc).__name__}: {exc}"
  return text if len(text) <= limit else text[:limit] + " ..."


class Reject(Exception):
  """A verdict reached inside the worker (kind + reason)."""

  def __init__(self, kind, reason: str):
    super().__init__(reason)
    self.kind, self.reason = kind, reason


def _exec_module(source: str, filename: str) -> dict:
  namespace = {"__name__": filename, "__builtins__": __builtins__}
  exec(compile(source, filename, "exec"), namespace)
  return namespace


def _set_seed(seed: int) -> None:
  import torch

  torch.manual_seed(seed)
  if torch.cuda.is_available():
    torch.cuda.manual_seed_all(seed)


def run_build(job: dict) -> dict:
  """Execute the candidate module so its load_inline calls build into the shared cache."""
  from verifier import build_cache
  from verifier.contract import FailureKind

  if job.get("pch_request"):  # the service asks for a precompiled torch header (pch.py)
    from verifier import pch

    return dict(pch.build(job["pch_request"]), kind=FailureKind.OK.value, reason="", builds=[])
  cache = build_cache.install(
    job["build_root"], split=bool(job.get("split_build")), use_pch=bool(job.get("use_pch", True))
  )
  kind, reason = FailureKind.OK, ""
  try:
    ns = _exec_module(job["candidate_source"], "candidate")
    if "ModelNew" in ns and not any(e["error"] for e in cache.events):
      ref = _exec_module(job["reference_source"], "reference")
      _set_seed(job["options"]["seed"])
      ns["ModelNew"](*ref["get_init_inputs"]())  # triggers builds done lazily in __init__
  except BaseException as e:  # noqa: BLE001 - anything else is re-examined in the run stage
    failed = [ev for ev in cache.events if ev["error"]]
    if failed:
      kind, reason = (
        FailureKind.COMPILE_ERROR,
        f"building extension {failed[0]['name']!r} failed: {failed[0]['error']}",
      )
    elif not cache.events:
      reason = f"candidate raised before any build (re-checked in the run stage): {_short(e, 500)}"
  return {
    "kind": kind.value,
    "reason": reason,
    "builds": cache.events,
    "cached": bool(cache.events) and all(ev["cached"] for ev in cache.events),
  }


def run_check(job: dict) -> dict:
  import torch

  from verifier import build_cache, correctness, runtime_check, timing
  from verifier.contract import FailureKind, Runtime, Strictness

  opts = job["options"]
  strictness = Strictness.preset(opts["strictness"])
  device = torch.device("cuda:0" if opts["device"] == "cuda" else "cpu")
  out: dict = {
    "compiled": False,
    "correct": False,
    "strict_correct": False,
    "max_abs_diff": 0.0,
    "warnings": [],
    "device_name": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
  }
  atol, rtol, seed = opts["atol"], opts["rtol"], opts["seed"]
  stage = {"t0": time.monotonic()}

  phases: dict[str, float] = {}
  out["phases"] = phases

  def mark(name):
    now = time.monotonic()
    phases[name] = phases.get(name, 0.0) + now - stage.get("last", stage["t0"])
    stage["last"] = now

  def finish(kind, reason=""):
    out.update(kind=kind.value, reason=reason, run_s=time.monotonic() - stage["t0"])
    return out

  # 1. The reference, and its golden output for trial 0, before any candidate code runs.
  try:
    ref_ns = _exec_module(job["reference_source"], "reference")
    Model, get_inputs, get_init_inputs = (
      ref_ns["Model"],
      ref_ns["get_inputs"],
      ref_ns["get_init_inputs"],
    )
    _set_seed(seed)
    init_inputs = correctness.to_device(list(get_init_inputs()), device)
    with torch.no_grad():
      _set_seed(seed)
      ref_model = Model(*init_inputs).to(device)
    gen = torch.Generator().manual_seed(seed)
    trial_seeds = [
      int(s) for s in torch.randint(0, 2**31 - 1, (opts["num_correct_trials"],), generator=gen)
    ]

    def trial_inputs(i: int) -> list:
      # Generate directly on the device (torch.device as a context manager sets the default device
      # of factory functions): level-1 inputs reach gigabytes, too slow to draw on one CPU thread.
      _set_seed(trial_seeds[i])
      if device.type == "cuda":
        with torch.device(device):
          return correctness.to_device(list(get_inputs()), device)
      return correctness.to_device(list(get_inputs()), device)

    def run_ref(args, i):
      _set_seed(trial_seeds[i])
      with torch.no_grad():
        return ref_model(*correctness.clone_args(args))

    mark("reference_load")
    inputs0 = trial_inputs(0)
    golden0 = run_ref(inputs0, 0)
    correctness.empty_caches(device)
    if device.type == "cuda":  # sizes the service's memory-aware admission (service.py)
      out["ref_peak_bytes"] = int(torch.cuda.max_memory_allocated())
      out["gpu_total_bytes"] = int(torch.cuda.get_device_properties(0).total_memory)
    mark("golden")
  except KeyError as e:
    return finish(FailureKind.REFERENCE_ERROR, f"reference defines no {e.args[0]}")
  except BaseException as e:  # noqa: BLE001
    return finish(FailureKind.REFERENCE_ERROR, f"reference failed: {_short(e)}")

  # 2. Load the candidate (builds hit the cache filled by the build stage).
  cache = build_cache.install(
    job["build_root"], split=bool(job.get("split_build")), use_pch=bool(job.get("use_pch", True))
  )
  t_load = time.monotonic()
  try:
    cand_ns = _exec_module(job["candidate_source"], "candidate")
  except BaseException as e:  # noqa: BLE001
    failed = [ev for ev in cache.events if ev["error"]]
    if failed:
      return finish(
        FailureKind.COMPILE_ERROR,
        f"building extension {failed[0]['name']!r} failed: {failed[0]['error']}",
      )
    return finish(
      classify_exception(e, FailureKind.IMPORT_ERROR), f"candidate module raised: {_short(e)}"
    )
  if "ModelNew" not in cand_ns:
    return finish(FailureKind.MISSING_MODEL_NEW, "candidate module defines no ModelNew")
  try:
    _set_seed(seed)
    cand_init = correctness.to_device(list(get_init_inputs()), device)
    with torch.no_grad():
      _set_seed(seed)
      cand_model = cand_ns["ModelNew"](*cand_init).to(device)
  except BaseException as e:  # noqa: BLE001
    failed = [ev for ev in cache.events if ev["error"]]
    if failed:
      return finish(
        FailureKind.COMPILE_ERROR,
        f"building extension {failed[0]['name']!r} failed: {failed[0]['error']}",
      )
    return finish(
      classify_exception(e, FailureKind.INIT_ERROR), f"ModelNew(*init_inputs) raised: {_short(e)}"
    )
  out["compiled"] = True
  out["build_cached"] = bool(cache.events) and all(ev["cached"] for ev in cache.events)
  out["load_s"] = time.monotonic() - t_load
  mark("candidate_load")

  keep = correctness.storages_of(ref_model, cand_model)

  def run_cand(args, i):
    _set_seed(trial_seeds[i])
    with torch.no_grad():
      return cand_model(*args)

  def run_checked(args, i):
    """One candidate forward on its own input clones, finished, then the inputs checked for mutation."""
    cand_out = run_cand(args, i)
    if device.type == "cuda":
      torch.cuda.synchronize()
    which = correctness.mutated(inputs, args)
    if which:
      raise Reject(FailureKind.INPUT_MUTATION, f"trial {i}: the candidate modified {which}")
    return cand_out

  try:
    # 3+4. Trials with fresh inputs, fresh clones per model, mutation checks and outputs poisoned before
    # release. The candidate runs on both sides of the reference: before it in even trials, after it in
    # odd ones (one forward of each per trial). Trial 0 compares with the golden output, then re-runs the
    # reference now that candidate code has loaded and run: it must reproduce that output (REFERENCE_TAMPERED).
    max_abs, strict_ok = 0.0, True
    for i in range(opts["num_correct_trials"]):
      inputs = inputs0 if i == 0 else trial_inputs(i)
      correctness.empty_caches(device)
      cand_first = i % 2 == 0
      cand_out = run_checked(correctness.clone_args(inputs), i) if cand_first else None
      if i == 0:
        again = run_ref(inputs0, 0)
        c = correctness.compare_outputs(
          golden0, again, atol, rtol, "reference re-run after the candidate"
        )
        if c.kind is not FailureKind.OK:
          raise Reject(FailureKind.REFERENCE_TAMPERED, c.reason)
        correctness.poison(again, keep)
        del again
        ref_out = golden0
      else:
        ref_out = run_ref(inputs, i)
      if not cand_first:
        cand_out = run_checked(correctness.clone_args(inputs), i)
      c = correctness.compare_outputs(
        ref_out,
        cand_out,
        atol,
        rtol,
        f"trial {i} (candidate run {'before' if cand_first else 'after'} the reference)",
      )
      if c.kind is not FailureKind.OK:
        out["max_abs_diff"] = c.max_abs_diff
        raise Reject(c.kind, c.reason)
      max_abs, strict_ok = max(max_abs, c.max_abs_diff), strict_ok and c.strict_ok
      correctness.poison(cand_out, keep)
      if ref_out is not golden0:
        correctness.poison(ref_out, keep)
      del cand_out, ref_out
    correctness.empty_caches(device)
    out.update(correct=True, strict_correct=strict_ok, max_abs_diff=max_abs)
    mark("trials")

    # 5. Runtime anti-cheating check: where did the forward's work go?
    if strictness.runtime_check:
      v = runtime_check.check_forward(
        cand_model,
        correctness.clone_args(inputs0),
        device,
        tuple(job.get("kernel_names", ())),
        cache.calls,
        strictness,
      )
      out["own_gpu_us"], out["foreign_gpu_us"] = v.own_gpu_us, v.foreign_gpu_us
      mark("profile_check")
      if v.kind is not FailureKind.OK:
        raise Reject(v.kind, v.reason)

    # 6. Timing: candidate, then the reference (eager or torch.compile) unless the parent cached it.
    if opts["measure_performance"]:
      out["candidate"] = timing.time_forward(
        cand_model, inputs0, device, opts["num_perf_trials"], opts["num_warmup"]
      ).__dict__
      baseline = job.get("baseline")
      if not baseline:
        ref_timed = torch.compile(ref_model) if opts["compile_baseline"] else ref_model
        baseline = timing.time_forward(
          ref_timed, inputs0, device, opts["num_perf_trials"], opts["num_warmup"]
        ).__dict__
        out["baseline_measured"] = True
      out["baseline"] = baseline
      # Re-check after the timing loop (state- or cache-based cheats).
      c = correctness.compare_outputs(
        golden0,
        run_cand(correctness.clone_args(inputs0), 0),
        atol,
        rtol,
        "trial 0 re-checked after timing",
      )
      if c.kind is not FailureKind.OK:
        out["correct"] = False
        raise Reject(c.kind, c.reason)
      out["speedup"] = Runtime(**baseline).mean_ms / max(out["candidate"]["mean_ms"], 1e-9)
      mark("timing")
  except Reject as r:
    return finish(r.kind, r.reason)
  except BaseException as e:  # noqa: BLE001
    out["correct"] = False
    return finish(classify_exception(e, FailureKind.RUNTIME_ERROR), f"forward raised: {_short(e)}")
  return finish(FailureKind.OK)


def _warm_profiler(device: str, mark) -> None:
  """Pay CUDA context creation and CUPTI/profiler start-up before the job arrives."""
  import torch
  from torch.profiler import ProfilerActivity, profile

  acts = [ProfilerActivity.CPU]
  if device == "cuda":
    torch.cuda.init()
    acts.append(ProfilerActivity.CUDA)
  x = torch.ones(16, device="cuda" if device == "cuda" else "cpu")
  torch.cuda.synchronize() if device == "cuda" else None
  mark("startup_device_context")
  with profile(activities=acts) as prof:
    (x + 1).sum().item()
  prof.events()


class StartupClock:
  """Where a worker's start-up goes (reported with the result; BUILD_NOTES, Verifier)."""

  def __init__(self, t0: float | None = None):
    self.last = time.monotonic() if t0 is None else t0
    self.phases: dict[str, float] = {}

  def __call__(self, name: str) -> None:
    now = time.monotonic()
    self.phases[name], self.last = now - self.last, now


def read_stdin_job() -> dict:
  return json.loads(sys.stdin.read() or "{}")


def serve_one(
  role: str, device: str, scratch: str, notes: list[str], mark: StartupClock, read_job
) -> None:
  """The rest of a worker once torch is imported: warm the device, say ready, run one job, exit."""
  import torch

  if role == "run":
    _warm_profiler(device, mark)
    mark("startup_profiler")
  ready_at = time.monotonic()  # CLOCK_MONOTONIC: comparable with the parent's clock
  open(os.path.join(scratch, "ready"), "w").close()  # the pool hands out ready workers first
  job = read_job()
  if not job:
    os._exit(0)  # parent discarded a warm worker
  if role == "run" and device == "cuda" and job.get("gpu_memory_fraction"):
    torch.cuda.set_per_process_memory_fraction(float(job["gpu_memory_fraction"]))
  try:
    result = run_build(job) if role == "build" else run_check(job)
  except BaseException as e:  # noqa: BLE001
    result = {
      "kind": "INTERNAL_ERROR",
      "reason": f"worker failed: {_short(e)}\n{traceback.format_exc()[-2000:]}",
    }
  result["sandbox_notes"] = notes
  result["startup_phases"] = mark.phases
  result["worker_ready_at"] = ready_at
  _write_result(scratch, result)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)  # skip destructors of candidate extensions


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="verifier.worker_main")
  p.add_argument("--role", choices=("run", "build"), required=True)
  p.add_argument("--device", choices=("cuda", "cpu"), required=True)
  p.add_argument("--mem-mb", type=int, default=0)
  p.add_argument("--scratch", required=True)
  p.add_argument("--isolate-network", action="store_true")
  args = p.parse_args(argv)

  from verifier.sandbox import apply_child_limits

  mark = StartupClock()
  notes = apply_child_limits(
    args.mem_mb,
    args.isolate_network,
    limit_address_space=not (args.role == "run" and args.device == "cuda"),
  )
  faulthandler.enable()
  mark("startup_limits")
  import torch  # noqa: F401 - warm start: the import and the CUDA context are paid before the job arrives

  mark("startup_import_torch")
  import torch.utils.cpp_extension  # noqa: F401 - slow first import (setuptools)

  mark("startup_import_cpp_extension")
  serve_one(args.role, args.device, args.scratch, notes, mark, read_stdin_job)
  return 0


if __name__ == "__main__":
  sys.exit(main())
