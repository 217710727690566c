r"""What a candidate with a compile error costs the compile pool, build by build.

  PYTHONPATH=. python -m experiments.bench_broken_build --n=3 --out=DIR/broken_build.json

Early in RL most candidates do not compile, and each one holds a compile slot for every build the
cache tries (verifier/build/build_cache.py): the lean split build, the full split when ``main.cpp``
failed, the fast build, then the stock build, which decides. Since a failed split build now goes
straight to the stock build, a candidate whose kernels do not compile pays lean split + stock instead
of lean split + fast + stock. This times each of those builds apart, with the real ``load_inline``
and no precompiled header, on DICE's known-good infilling solutions (``--tasks``, when present; else
one embedded kernel) with one error injected in device code (``threadIdx.x`` -> ``threadIdx.q``, as
a model's typo would be), and reports both chains.

On a CPU-only torch (no CUDA build, so ``cpp_extension.CUDA_HOME`` is None) the bench points
``CUDA_HOME`` at the ``nvcc`` on PATH (and ``TORCH_CUDA_ARCH_LIST`` at 9.0) for the duration of the
run: a broken candidate fails in nvcc or g++ and never reaches the link, which is the part a CPU torch
could not do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import tempfile
import time

from experiments.data_root import data_path
from verifier.build.build_cache import fast_variant
from verifier.build.split_build import split_variant

_EMBEDDED = {
  "name": "embedded_scale",
  "cpp_sources": "torch::Tensor scale(torch::Tensor x);",
  "cuda_sources": r"""
#include <torch/extension.h>
__global__ void scale_kernel(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.f * x[i];
}
torch::Tensor scale(torch::Tensor x) {
    auto y = torch::empty_like(x);
    int n = x.numel();
    scale_kernel<<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}
""",
  "functions": ["scale"],
}


def dice_candidates(path: str, n: int) -> list[dict]:
  """The first ``n`` DICE infilling solutions the split build accepts, as ``load_inline`` arguments
  (their sources are module-level string constants; the functions are the C++ declarations')."""
  with open(path) as f:
    tasks = json.load(f)
  out = []
  for i, t in enumerate(tasks):
    strings = [
      eval(m.group(1))  # noqa: S307 - a string literal from the data file
      for m in re.finditer(r'^\w+\s*=\s*(r?"""[\s\S]*?""")', t["cuda_code"], re.M)
    ]
    cuda = [s for s in strings if "__global__" in s]
    cpp = [s for s in strings if "__global__" not in s and "(" in s and "{" not in s]
    if not cuda or not cpp:
      continue
    functions = re.findall(r"(\w+)\s*\([^;]*\)\s*;", cpp[0])
    params = {
      "name": f"dice_{i}",
      "cpp_sources": cpp[0],
      "cuda_sources": cuda[0],
      "functions": functions,
    }
    if functions and split_variant(params, lean=True) is not None and "threadIdx.x" in cuda[0]:
      out.append(params)
    if len(out) == n:
      break
  return out


def broken(params: dict) -> dict:
  """The same candidate with one error in its device code."""
  return dict(params, cuda_sources=params["cuda_sources"].replace("threadIdx.x", "threadIdx.q", 1))


@contextlib.contextmanager
def cuda_home_for_compiling():
  """``cpp_extension.CUDA_HOME`` from the nvcc on PATH while a CPU-only torch compiles (restored after)."""
  import torch.utils.cpp_extension as cpp_extension

  saved, saved_arch = cpp_extension.CUDA_HOME, os.environ.get("TORCH_CUDA_ARCH_LIST")
  if saved is None:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # no device to ask: the H100/H200's
    nvcc = shutil.which("nvcc")
    if nvcc is None:
      raise SystemExit("bench_broken_build: needs nvcc on PATH")
    # nvcc itself, or a wrapper script (`exec /usr/local/cuda-13.0/bin/nvcc "$@"`)
    with open(nvcc, "rb") as f:
      head = f.read(200)
    m = re.search(rb"exec\s+(\S+)/bin/nvcc", head)
    cpp_extension.CUDA_HOME = (
      m.group(1).decode() if m else os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    )
  try:
    yield cpp_extension.CUDA_HOME
  finally:
    cpp_extension.CUDA_HOME = saved
    if saved_arch is None:
      os.environ.pop("TORCH_CUDA_ARCH_LIST", None)


def time_build(params: dict, root: str) -> tuple[float, str]:
  """Seconds one ``load_inline`` of ``params`` takes in a fresh directory, and its error ("" if none)."""
  from torch.utils.cpp_extension import load_inline

  directory = tempfile.mkdtemp(dir=root)
  t0 = time.monotonic()
  try:
    load_inline(**params, build_directory=directory, verbose=False)
    error = ""
  except Exception as e:  # noqa: BLE001 - the error is what is measured
    error = str(e)
  seconds = time.monotonic() - t0
  shutil.rmtree(directory, ignore_errors=True)
  return seconds, error


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--n", type=int, default=3, help="candidates (DICE solutions with an error)")
  default_tasks = data_path("dice_rl", "kernel_infilling_evaluation.json")
  parser.add_argument("--tasks", default=default_tasks, help="DICE's infilling tasks (JSON)")
  parser.add_argument("--out", default="", help="JSON file for the results")
  args = parser.parse_args()
  candidates = dice_candidates(args.tasks, args.n) if os.path.exists(args.tasks) else [_EMBEDDED]
  rows = []
  with cuda_home_for_compiling() as cuda_home, tempfile.TemporaryDirectory() as root:
    print(f"CUDA_HOME {cuda_home}; {len(candidates)} broken candidate(s)", flush=True)
    for params in candidates:
      bad = broken(params)
      builds = {
        "lean_split": split_variant(bad, lean=True),
        "fast": fast_variant(bad),
        "stock": bad,
      }
      row = {"name": params["name"]}
      for kind, build in builds.items():
        if build is None:
          row[kind] = None
          continue
        seconds, error = time_build(build, root)
        if "error" not in error.lower() or "FAILED" not in error:  # a compiler's error, under ninja
          raise SystemExit(
            f"{params['name']}: the {kind} build did not fail in a compiler: {error!r}"
          )
        row[kind] = round(seconds, 2)
        row[f"{kind}_error"] = next(
          (line for line in error.splitlines() if "error" in line and "Error building" not in line),
          "",
        )[-200:]
      row["old_chain_s"] = round(sum(row[k] or 0.0 for k in builds), 2)
      row["new_chain_s"] = round(row["lean_split"] + row["stock"], 2)
      rows.append(row)
      print(
        f"{row['name']}: lean split {row['lean_split']} s, fast {row['fast']} s, stock {row['stock']} s;"
        f" chain {row['old_chain_s']} -> {row['new_chain_s']} s",
        flush=True,
      )
  summary = {
    "candidates": len(rows),
    "old_chain_mean_s": round(statistics.fmean(r["old_chain_s"] for r in rows), 2),
    "new_chain_mean_s": round(statistics.fmean(r["new_chain_s"] for r in rows), 2),
  }
  summary["ratio_new_over_old"] = round(
    summary["new_chain_mean_s"] / summary["old_chain_mean_s"], 3
  )
  print(json.dumps(summary), flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"rows": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
  main()
