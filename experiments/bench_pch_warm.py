"""Cold-start builds with and without the PCH warm-up (`VerifierService.warm_pch`), in one process.

Two fresh services, each with its own empty build cache, build the same N flag-less candidates one at a time
(`extra_cflags=[""]`, as KernelBench's one-shot example writes them):
  cold    no PCH at all (`pch_background=False`, no warm-up): what a burst meets before any PCH exists;
  warm    `warm_pch()` first (its time reported apart), then the same candidates on the PCH.
Prints one JSON line per build and a summary with the mean build time of each and their ratio.

  PYTHONPATH=. python -m experiments.bench_pch_warm --n=4 [--device=cpu|cuda]

On `cuda` the candidates are KernelBench's one-shot add example (CUDA); on `cpu`, the C++ test extension
of tests/verifier/verifier_cases.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

from verifier.api.contract import VerifyOptions, VerifyRequest
from verifier.serve.service import ServiceConfig, VerifierService

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _candidates(device: str, n: int) -> tuple[str, list[str]]:
  """(reference, n distinct flag-less candidates)."""
  if device == "cuda":
    tpl = os.path.join(_REPO, "dice_jax", "data", "templates")
    ref = open(os.path.join(tpl, "model_ex_add.py.txt")).read()
    cand = open(os.path.join(tpl, "model_new_ex_add.py.txt")).read()
    return ref, [cand.replace('name="elementwise_add"', f'name="pch_bench_{i}"') for i in range(n)]
  sys.path.insert(0, os.path.join(_REPO, "tests", "verifier"))
  import verifier_cases as cases

  return cases.REFERENCE, [
    cases.candidate("scaled_add", name=f"pch_bench_{i}", cflags='[""]') for i in range(n)
  ]


async def _run(mode: str, device: str, n: int, root: str) -> dict:
  cfg = ServiceConfig(
    device=device,
    cpu_slots=1,
    compile_workers=1,
    cache_dir=os.path.join(root, mode, "builds"),
    scratch_root=os.path.join(root, mode, "scratch"),
    build_timeout_s=600,
    pch_background=False,
  )
  ref, cands = _candidates(device, n)
  opts = VerifyOptions(device=device, timeout_s=300, num_correct_trials=1, strictness="off")
  svc = VerifierService(cfg)
  await svc.start()
  try:
    warm_s = None
    if mode == "warm":
      t = time.monotonic()
      if not await svc.warm_pch():
        raise SystemExit("warm_pch failed; see the log")
      warm_s = time.monotonic() - t
    builds = []
    for i, cand in enumerate(cands):
      r = await svc.verify(VerifyRequest(f"{mode}-{i}", "pch-bench", ref, cand, opts))
      ev = svc.metrics.build_s[-1] if svc.metrics.build_s else {}
      row = {"mode": mode, "i": i, "kind": r.failure_kind.value, "build_s": round(r.compile_s, 2)}
      row["pch"] = bool(ev.get("pch"))
      print(json.dumps(row), flush=True)
      builds.append(r.compile_s)
    return {"mean_build_s": sum(builds) / len(builds), "warm_up_s": warm_s}
  finally:
    await svc.close()


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--n", type=int, default=4, help="candidates built in each mode")
  p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
  a = p.parse_args()
  with tempfile.TemporaryDirectory(prefix="pch-bench-") as root:
    cold = asyncio.run(_run("cold", a.device, a.n, root))
    warm = asyncio.run(_run("warm", a.device, a.n, root))
  print(
    json.dumps(
      {
        "device": a.device,
        "cores": os.cpu_count(),
        "n": a.n,
        "cold_mean_build_s": round(cold["mean_build_s"], 2),
        "warm_mean_build_s": round(warm["mean_build_s"], 2),
        "warm_up_s": round(warm["warm_up_s"], 2),
        "warm_over_cold": round(warm["mean_build_s"] / cold["mean_build_s"], 3),
      }
    )
  )


if __name__ == "__main__":
  main()
