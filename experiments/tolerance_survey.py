"""How the verifier's output comparison treats honest rounding and cheap forgeries, on CPU.

For each reference (DICE's 99 known-good tasks, KernelBench levels 1-3; module-level sizes shrunk to at
most ``--max_dim``, the batch to ``--max_batch``: level-1 tensors reach gigabytes), the float32 reference output ``r`` is judged against:

- ``identity``: a second fresh instance of the reference (KernelBench's pass-through candidate);
- ``honest`` / ``honest x10``: ``r`` plus the reference's own float32 rounding error (``r64 - r``, the
  same model and inputs in float64) and ten times it: a kernel with a different summation order, and
  a sloppier one;
- ``zeros`` and ``mean``: the all-zero output and the output's mean everywhere (the forgeries that
  atol alone lets through on small or near-zero outputs).

``verifier.check.correctness.compare_outputs`` decides each, with the norm rule (now) and without it
(``NORM_RTOL`` = inf: the rule before issue 37). Prints one table row per verdict class and the tasks
whose verdict the norm rule changes; ``--json`` writes every task's numbers.

  PYTHONPATH=$PWD python experiments/tolerance_survey.py --sets dice,kb1,kb2,kb3 --json out.json
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import math
import pathlib
import signal
import sys
import time

import torch

from verifier.check import correctness

DATA = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data"
CASES = ("identity", "honest", "honest x10", "zeros", "mean")


def shrink_sizes(source: str, max_dim: int, max_batch: int) -> str:
  """``source`` with every module-level integer constant above ``max_dim`` halved until it fits
  (``batch_size`` capped at ``max_batch``): level-1 tensors reach gigabytes."""
  tree = ast.parse(source)
  lines = source.splitlines()
  for node in tree.body:
    if (
      isinstance(node, ast.Assign)
      and len(node.targets) == 1
      and isinstance(node.targets[0], ast.Name)
      and isinstance(node.value, ast.Constant)
      and type(node.value.value) is int
    ):
      name, v = node.targets[0].id, node.value.value
      cap = max_batch if name == "batch_size" else max_dim
      while v > cap:
        v //= 2
      lines[node.lineno - 1] = f"{name} = {v}"
  return "\n".join(lines)


def _outputs(source: str, seed: int, dtype: torch.dtype, perturb: bool = False):
  ns = {"__name__": "reference"}
  exec(compile(source, "reference", "exec"), ns)
  torch.manual_seed(seed)
  init = ns["get_init_inputs"]()
  torch.manual_seed(seed + 1)
  inputs = ns["get_inputs"]()
  if perturb:
    inputs = correctness.perturbed(inputs, seed)

  def cast(v):
    if torch.is_tensor(v) and v.is_floating_point():
      return v.to(dtype)
    return v

  torch.manual_seed(seed)
  model = ns["Model"](*init).to(dtype)
  with torch.no_grad():
    torch.manual_seed(seed + 2)
    return model(*[cast(v) for v in inputs])


def _leaves(out) -> list[torch.Tensor]:
  if torch.is_tensor(out):
    return [out]
  if isinstance(out, (list, tuple)):
    return [t for o in out for t in _leaves(o)]
  return []


def judge(
  ref: torch.Tensor, out: torch.Tensor, atol: float, rtol: float, norm: bool = True
) -> tuple[str, str]:
  """(verdict now, verdict without the norm rule); ``norm``: whether the reference determines this
  output (``correctness.determined``)."""
  now = correctness.compare_outputs(ref, out, atol, rtol, "t", (norm,)).kind.value
  keep = correctness.NORM_RTOL
  correctness.NORM_RTOL = math.inf
  try:
    before = correctness.compare_outputs(ref, out, atol, rtol, "t").kind.value
  finally:
    correctness.NORM_RTOL = keep
  return now, before


def survey_one(source: str, atol: float, rtol: float, seed: int = 0) -> dict:
  r32 = _leaves(_outputs(source, seed, torch.float32))
  again = _leaves(_outputs(source, seed, torch.float32))
  r64 = _leaves(_outputs(source, seed, torch.float64))
  moved = _leaves(_outputs(source, seed, torch.float32, perturb=True))
  norm_rule = correctness.determined(r32, moved)
  row = {c: [] for c in CASES}
  stats = {"rel_err": 0.0, "rms": 0.0, "n": 0}
  stats["noise_outputs"] = 0
  for a, b, c, norm in zip(r32, again, r64, norm_rule):
    if not a.is_floating_point():  # integers and booleans are compared exactly
      continue
    stats["noise_outputs"] += not norm
    err = c.to(a.dtype) - a
    fin = torch.isfinite(a)
    n = int(fin.sum())
    e = float(torch.linalg.vector_norm(torch.where(fin, err, 0.0)))
    stats["rel_err"] = max(stats["rel_err"], e / max(float(a[fin].norm()), 1e-300))
    stats["rms"] = max(stats["rms"], e / math.sqrt(max(n, 1)))
    stats["n"] += n
    mean = a[fin].mean() if n else torch.tensor(0.0)
    for case, out in (
      ("identity", b),
      ("honest", a + torch.nan_to_num(err)),
      ("honest x10", a + 10 * torch.nan_to_num(err)),
      ("zeros", torch.zeros_like(a)),
      ("mean", torch.full_like(a, float(mean))),
    ):
      row[case].append(judge(a, out, atol, rtol, norm))
  if not any(row.values()):
    raise ValueError("no floating-point output")
  verdicts = {}
  for case, pairs in row.items():
    now = next((p[0] for p in pairs if p[0] != "OK"), "OK")
    before = next((p[1] for p in pairs if p[1] != "OK"), "OK")
    verdicts[case] = (now, before)
  return {"verdicts": verdicts, **stats}


def references(sets: list[str], max_dim: int, max_batch: int):
  """(set, name, source) of every reference in ``sets``."""
  for s in sets:
    if s == "dice":
      tasks = json.loads((DATA / "dice_rl" / "kernel_infilling_evaluation.json").read_text())
      for t in tasks:
        yield s, str(t["id"]), shrink_sizes(t["pytorch_code"], max_dim, max_batch)
    elif s.startswith("kb"):
      for line in (DATA / "kernelbench" / f"level{s[2:]}.jsonl").read_text().splitlines():
        d = json.loads(line)
        yield s, d["name"], shrink_sizes(d["code"], max_dim, max_batch)
    else:
      raise SystemExit(f"tolerance_survey: error: unknown set {s!r} (dice, kb1, kb2, kb3)")


def _too_slow(signum, frame):
  raise TimeoutError("over --limit_s on this CPU")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="tolerance_survey")
  p.add_argument("--sets", default="dice,kb1,kb2,kb3")
  p.add_argument("--max_dim", type=int, default=64)
  p.add_argument("--max_batch", type=int, default=2)
  p.add_argument("--atol", type=float, default=1e-2)
  p.add_argument("--rtol", type=float, default=1e-2)
  p.add_argument("--limit_s", type=int, default=30, help="seconds per reference")
  p.add_argument("--json", default="")
  a = p.parse_args(argv)
  torch.set_num_threads(1)
  results, failed = [], []
  table = collections.Counter()
  t0 = time.monotonic()
  signal.signal(signal.SIGALRM, _too_slow)
  for s, name, src in references(a.sets.split(","), a.max_dim, a.max_batch):
    signal.alarm(a.limit_s)
    try:
      r = survey_one(src, a.atol, a.rtol)
    except Exception as e:  # noqa: BLE001 - a reference that does not run shrunk (or on CPU)
      failed.append((s, name, f"{type(e).__name__}: {str(e)[:120]}"))
      continue
    finally:
      signal.alarm(0)
    results.append({"set": s, "name": name, **r})
    for case, (now, before) in r["verdicts"].items():
      table[(s, case, before, now)] += 1
  print(
    f"{len(results)} references judged, {len(failed)} did not run ({time.monotonic() - t0:.0f} s)"
  )
  print("| set | case | before (atol/rtol only) | now (+ norm rule) | references |")
  print("| --- | --- | --- | --- | --- |")
  for (s, case, before, now), k in sorted(table.items()):
    print(f"| {s} | {case} | {before} | {now} | {k} |")
  changed = [
    (r["set"], r["name"], c)
    for r in results
    for c, (now, before) in r["verdicts"].items()
    if now != before and c in ("identity", "honest", "honest x10")
  ]
  print("honest verdicts changed by the norm rule:", changed or "none")
  worst = sorted(results, key=lambda r: -r["rel_err"])[:5]
  print("largest float32 rounding (rel. L2, rms):")
  for r in worst:
    print(f"  {r['set']} {r['name']}: {r['rel_err']:.3g}, {r['rms']:.3g}")
  if a.json:
    pathlib.Path(a.json).write_text(json.dumps({"results": results, "failed": failed}, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
