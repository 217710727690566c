"""A burst of honest builds under the fair compile slots, one fresh service per compile quantum.

Fair slots (verifier/build/fair_slots.py) suspend a build that has held a slot for a quantum while a
build that ran less waits: an honest request behind hostile builds runs within about a quantum per
build ahead of it (issue 37 item 7). A burst of honest builds longer than the quantum (an RL step's
candidates, a cold cache, no precompiled header yet) is shared the same way: every build gets its first
turn before any finishes, so none reaches the run stage early and all start before the PCH exists.
This bench measures that trade. For each `--quanta` value a fresh service with its own empty cache gets
`--n` distinct flag-less candidates at once (no PCH warm-up, the PCH built in the background after the
first build, as the service does) and reports, per request, when its verdict came (seconds since the
burst) and its build seconds; then a summary per quantum (with how many builds used the PCH).

  PYTHONPATH=. python -m experiments.bench_build_burst --n=6 --workers=2 --quanta=10,30,1e9

`1e9` never suspends (first come, first served). On `cuda` the candidates are KernelBench's one-shot
add example; on `cpu`, the C++ test extension of tests/verifier/verifier_cases.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time

from experiments.bench_pch_warm import _candidates
from verifier.api.contract import VerifyOptions, VerifyRequest
from verifier.serve.service import ServiceConfig, VerifierService


def summarize(quantum_s: float, rows: list[dict], on_pch: int, preemptions: int) -> dict:
  """First, median and last verdict (s since the burst), mean build s, builds on the PCH."""
  done = sorted(r["verdict_s"] for r in rows)
  return {
    "quantum_s": quantum_s,
    "n": len(rows),
    "first_verdict_s": round(done[0], 1),
    "median_verdict_s": round(statistics.median(done), 1),
    "last_verdict_s": round(done[-1], 1),
    "mean_build_s": round(statistics.fmean(r["build_s"] for r in rows), 1),
    "on_pch": on_pch,
    "ok": sum(r["kind"] == "OK" for r in rows),
    "preemptions": preemptions,
  }


async def _burst(quantum_s: float, device: str, n: int, workers: int, root: str) -> dict:
  tag = f"q{int(quantum_s)}" if quantum_s < 1e6 else "fifo"  # a valid extension name part
  cfg = ServiceConfig(
    device=device,
    cpu_slots=1,
    compile_workers=workers,
    cache_dir=os.path.join(root, tag, "builds"),
    scratch_root=os.path.join(root, tag, "scratch"),
    build_timeout_s=900,
    compile_quantum_s=quantum_s,
  )
  ref, cands = _candidates(device, n)
  cands = [c.replace("pch_bench_", f"burst_{tag}_") for c in cands]
  opts = VerifyOptions(device=device, timeout_s=900, num_correct_trials=1, strictness="off")
  svc = VerifierService(cfg)
  await svc.start()
  try:
    t0 = time.monotonic()

    async def one(i: int, cand: str) -> dict:
      r = await svc.verify(VerifyRequest(f"{tag}-{i}", "burst", ref, cand, opts))
      return {
        "quantum_s": quantum_s,
        "i": i,
        "kind": r.failure_kind.value,
        "verdict_s": round(time.monotonic() - t0, 1),
        "build_s": round(r.compile_s, 1),
      }

    rows = await asyncio.gather(*(one(i, c) for i, c in enumerate(cands)))
    for r in rows:
      print(json.dumps(r), flush=True)
    on_pch = sum(ev["pch"] for ev in svc.metrics.build_s)  # the burst's compiles on the PCH
    return summarize(quantum_s, rows, on_pch, svc.build_stage.slots.preemptions)
  finally:
    await svc.close()


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--n", type=int, default=6, help="candidates in the burst")
  p.add_argument("--workers", type=int, default=2, help="compile slots (compile_workers)")
  p.add_argument(
    "--quanta", default="10,30,1e9", help="compile quanta in seconds, one service each"
  )
  p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
  a = p.parse_args()
  out = []
  with tempfile.TemporaryDirectory(prefix="build-burst-") as root:
    for q in (float(x) for x in a.quanta.split(",")):
      out.append(asyncio.run(_burst(q, a.device, a.n, a.workers, root)))
      print(json.dumps({"summary": out[-1]}), flush=True)
  print(
    "| quantum s | OK | first verdict s | median | last | mean build s | on PCH | preemptions |"
  )
  print("| --- | --- | --- | --- | --- | --- | --- | --- |")
  for s in out:
    print(
      f"| {s['quantum_s']:g} | {s['ok']}/{s['n']} | {s['first_verdict_s']} | {s['median_verdict_s']} | "
      f"{s['last_verdict_s']} | {s['mean_build_s']} | {s['on_pch']}/{s['n']} | {s['preemptions']} |"
    )


if __name__ == "__main__":
  main()
