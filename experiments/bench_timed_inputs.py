"""Per-call cost of a timed call's fresh inputs and of a compared call's compare, old vs new, in one
process (issue 37, item 9).

Staging: the old way draws ``get_inputs()`` privately (``ReferenceTask.inputs_for``) and copies each
tensor into an exchange buffer (``exchange.send_value``); the new way draws straight into the buffers
(``exchange.DrawInto``) and copies only what ``get_inputs`` computed after its draws. Both then poison
one output buffer like the first input (``exchange.output_buffer``), as ``Check._stage`` does. Compare:
``correctness.compare_outputs`` with the full per-chunk statistics (``_chunk_stats_full``, the old
code) against the fewer passes of ``_chunk_stats``, on an output off by 1e-3 (over the strict
tolerance, under atol: a pass, the common case) and on an exact one. Old and new alternate, medians of
``--reps``; the staged values and the statistics are checked equal once.

On a GPU the buffers are device memory (``cuda_vmm``) as the checker's are, and every timing ends with a
synchronisation. Workloads: ``--sizes-mb`` synthetic ``[rand, rand]`` references (each input that
size), and on a GPU ``--level1 1,2,...`` real KernelBench level-1 problems (their own sizes).

  python -m experiments.bench_timed_inputs --sizes-mb 64,256 --reps 5 [--device cuda] [--level1 1,19]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import time

import torch

from verifier.api.contract import STRICT_TOLERANCE
from verifier.check import correctness
from verifier.check.reference import ReferenceTask, same_values
from verifier.ipc import exchange, tensors

SYNTHETIC = "import torch\n\ndef get_inputs():\n    return [torch.rand({n}), torch.rand({n})]\n"


def _sync(device: torch.device) -> None:
  if device.type == "cuda":
    torch.cuda.synchronize()


def _task(source: str, device: torch.device) -> ReferenceTask:
  namespace = {"__name__": "reference"}
  exec(compile(source, "reference", "exec"), namespace)
  return ReferenceTask("bench", device, 0, namespace, [], [1], False)


def stage_old(task, buffers, seed, template):
  buffers.release_all()
  inputs = task.inputs_for(seed)
  used, pairs = [], []
  args = [exchange.send_value(a, buffers, used, pairs) for a in inputs]
  exchange.output_buffer(template, buffers, used)
  return args, [v for _, v in pairs]


def stage_new(task, buffers, seed, template):
  buffers.release_all()
  drawn = exchange.DrawInto(buffers)
  inputs = task.inputs_for(seed, drawn)
  drawn.settle(inputs)
  used, pairs = [], []
  args = [exchange.send_value(a, buffers, used, pairs, drawn) for a in inputs]
  exchange.output_buffer(template, buffers, used)
  return args, [v for _, v in pairs]


def _timed(fn, device) -> float:
  _sync(device)
  t0 = time.perf_counter()
  fn()
  _sync(device)
  return time.perf_counter() - t0


def bench_stage(name: str, task: ReferenceTask, device, reps: int) -> dict:
  buffers = exchange.BufferSet(device, device.type == "cuda")
  template = next(t for t in tensors.flatten(task.inputs_for(0)) if isinstance(t, torch.Tensor))
  template = torch.empty_like(template)
  # equal values once (and warm buffers and allocator for both ways)
  _, old_views = stage_old(task, buffers, 7, template)
  old_vals = [v.clone() for v in old_views]
  _, new_views = stage_new(task, buffers, 7, template)
  assert same_values(old_vals, [v.clone() for v in new_views]), f"{name}: staged values differ"
  del old_vals, old_views, new_views
  draw, old, new = [], [], []
  for rep in range(reps):
    seed = 100 + rep
    draw.append(_timed(lambda: task.inputs_for(seed), device))
    old.append(_timed(lambda: stage_old(task, buffers, seed, template), device))
    new.append(_timed(lambda: stage_new(task, buffers, seed, template), device))
  buffers.close()
  o, n, d = (statistics.median(x) * 1e3 for x in (old, new, draw))
  return {"what": "stage", "name": name, "draw_ms": d, "old_ms": o, "new_ms": n, "ratio": n / o}


def _compare(ref, out, stats) -> correctness.Comparison:
  saved = correctness._chunk_stats
  correctness._chunk_stats = stats
  try:
    return correctness.compare_outputs(ref, out, 1e-2, 1e-2, "bench")
  finally:
    correctness._chunk_stats = saved


def bench_compare(mb: int, device, reps: int) -> list[dict]:
  n = mb * (1 << 20) // 4
  gen = torch.Generator(device=device).manual_seed(mb)
  ref = torch.randn(n, generator=gen, device=device)
  rows = []
  for label, out in (
    ("off_1e-3", ref + 1e-3 * torch.randn(n, generator=gen, device=device)),
    ("exact", ref.clone()),
  ):
    r = ref.reshape(-1)
    a = correctness._chunk_stats(r, out, 1e-2, 1e-2, STRICT_TOLERANCE)
    b = correctness._chunk_stats_full(r, out, 1e-2, 1e-2, STRICT_TOLERANCE)
    assert a == b, f"statistics differ: {a} vs {b}"
    old, new = [], []
    for _ in range(reps):
      old.append(_timed(lambda: _compare(ref, out, correctness._chunk_stats_full), device))
      new.append(_timed(lambda: _compare(ref, out, correctness._chunk_stats), device))
    o, w = statistics.median(old) * 1e3, statistics.median(new) * 1e3
    rows.append(
      {"what": "compare", "name": f"{mb} MB {label}", "old_ms": o, "new_ms": w, "ratio": w / o}
    )
  return rows


def _level1(ids: list[int]) -> list[tuple[str, str]]:
  from experiments.data_root import data_root

  path = data_root() / "kernelbench" / "level1.jsonl"
  rows = {r["problem_id"]: r for r in map(json.loads, path.read_text().splitlines())}
  return [(rows[i]["name"], rows[i]["code"]) for i in ids]


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
  p.add_argument("--sizes-mb", default="64,256", help="synthetic input sizes, MB per tensor")
  p.add_argument("--level1", default="", help="KernelBench level-1 problem ids (their own sizes)")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--out", default="", help="also write the rows as JSON here")
  a = p.parse_args(argv)
  kind = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
  device = torch.device(kind)
  sizes = [int(s) for s in a.sizes_mb.split(",") if s]
  rows = []
  for mb in sizes:
    src = SYNTHETIC.format(n=mb * (1 << 20) // 4)
    rows.append(bench_stage(f"2 x rand {mb} MB", _task(src, device), device, a.reps))
  for name, src in _level1([int(i) for i in a.level1.split(",") if i]):
    rows.append(bench_stage(name, _task(src, device), device, a.reps))
  for mb in sizes:
    rows += bench_compare(mb, device, a.reps)
  host = {
    "device": torch.cuda.get_device_name(0) if kind == "cuda" else platform.processor() or "cpu",
    "cpus": os.cpu_count(),
    "load": os.getloadavg()[0],
    "torch": torch.__version__,
    "threads": torch.get_num_threads(),
  }
  print(json.dumps(host))
  print(f"{'what':8} {'workload':40} {'old ms':>9} {'new ms':>9} {'new/old':>8} {'draw ms':>9}")
  for r in rows:
    draw = f"{r['draw_ms']:9.2f}" if "draw_ms" in r else ""
    print(
      f"{r['what']:8} {r['name'][:40]:40} {r['old_ms']:9.2f} {r['new_ms']:9.2f} {r['ratio']:8.3f} "
      f"{draw}"
    )
  print(
    "stage: old = private draw + copies + output poison; new = draw into buffers + output poison;"
  )
  print("draw = the private draw alone (old - draw: the copies' share)")
  if a.out:
    pathlib.Path(a.out).write_text(json.dumps({"host": host, "rows": rows}, indent=1))


if __name__ == "__main__":
  main()
