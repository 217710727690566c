r"""Known candidates for KernelBench level 1 on a GPU, with the metrics they must get.

  python -m experiments.eval_known --kernelbench=DIR --problems=19-32 --out=DIR/known.jsonl
  python -m experiments.eval --candidates=DIR/known.jsonl --levels=1 --problems=19-32 \
      --strictness=off --verifier=HOST:PORT --out=RUN
  python -m experiments.eval_known --check=RUN --expected=DIR/known.expected.json

Every problem's reference renamed ``ModelNew`` (the ``off`` preset checks correctness only), except
five problems with hand-written CUDA kernels whose verdicts are fixed by construction:
  19_ReLU       correct kernel (grid-stride loop)                    -> OK, speedup about 1
  20_LeakyReLU  wrong: 0.5 * x (inputs are torch.rand, >= 0)          -> WRONG_OUTPUT
  21_Sigmoid    correct, plus 1,000 dependent FMAs per element       -> OK, speedup < 0.5
  22_Tanh       a missing ';' in the CUDA source                     -> COMPILE_ERROR
  23_Softmax    no candidate                                         -> MISSING
Renamed references run the reference's own code, so their speedup is about 1 (in (0.5, 1.5)).
``--check`` compares the run's metrics.json with what that implies: compile rate, exec accuracy,
fast_0, fast_0.5, fast_1.5, fast_2, deceptive rate and failure kinds exactly; fast_0.8 and fast_1
(speedups near 1 fall either side) are printed, not checked. Exit status 0 when all match.
"""

import json
import os
import re
import sys

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("kernelbench", None, "KernelBench level1.jsonl or a directory holding it.")
flags.DEFINE_string("problems", "19-32", "Level-1 problem ids (a range a-b); must include 19-23.")
flags.DEFINE_string("out", None, "Where the candidates JSONL goes (and NAME.expected.json).")
flags.DEFINE_string("check", None, "A run directory of experiments.eval to check.")
flags.DEFINE_string("expected", None, "The expected.json written with the candidates.")

_ELEMENTWISE = r'''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cuda_source = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>

__global__ void {name}_kernel(const float* __restrict__ x, float* __restrict__ out, long long n) {{
    long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {{
        float v = x[i];{work}
        out[i] = {expr}
    }}
}}

torch::Tensor {name}_cuda(torch::Tensor x) {{
    auto out = torch::empty_like(x);
    long long n = x.numel();
    int threads = 256;
    long long blocks = {blocks};
    {name}_kernel<<<(unsigned int)blocks, threads>>>(x.data_ptr<float>(), out.data_ptr<float>(), n);
    return out;
}}
"""

cpp_source = "torch::Tensor {name}_cuda(torch::Tensor x);"

ext = load_inline(
    name="{name}_ext",
    cpp_sources=cpp_source,
    cuda_sources=cuda_source,
    functions=["{name}_cuda"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return ext.{name}_cuda(x.contiguous())
'''

# 1,000 dependent FMAs per element that IEEE semantics keep (acc * 0.f is not folded without
# fast-math; acc stays finite for inputs in [0, 1)): ~50 ms per call on an H200 against ~3 ms for
# torch.sigmoid, a speedup near 0.07, far from 0.5 and far from the 180 s timeout.
SLOW_WORK = """
        float acc = 0.f;
        for (int k = 0; k < 1000; ++k) acc = fmaf(acc, 0.999f, v);"""


def _kernel(name: str, expr: str, work: str = "") -> str:
  grid = "(n + threads - 1) / threads < 1048560 ? (n + threads - 1) / threads : 1048560"
  return _ELEMENTWISE.format(name=name, expr=expr, work=work, blocks=grid)


HAND_WRITTEN = {  # problem id -> (verdict, candidate source or None)
  19: ("OK", _kernel("relu", "v > 0.f ? v : 0.f;")),
  20: ("WRONG_OUTPUT", _kernel("half", "0.5f * v;")),
  21: ("SLOW", _kernel("sigmoid", "1.f / (1.f + expf(-v)) + acc * 0.f;", SLOW_WORK)),
  22: ("COMPILE_ERROR", _kernel("tanh", "tanhf(v)")),
  23: ("MISSING", None),
}


def _ids(spec: str) -> list[int]:
  lo, _, hi = spec.partition("-")
  return list(range(int(lo), int(hi or lo) + 1))


def _renamed(reference: str) -> str:
  """The reference as a candidate: class Model -> ModelNew (and its super() calls)."""
  return re.sub(r"\bModel\b", "ModelNew", reference)


def expected_metrics(ids: list[int]) -> dict:
  n = len(ids)
  verdicts = {i: HAND_WRITTEN.get(i, ("OK",))[0] for i in ids}
  ok = [i for i, v in verdicts.items() if v in ("OK", "SLOW")]
  kinds: dict[str, int] = {}
  for v in verdicts.values():
    k = "OK" if v == "SLOW" else v
    kinds[k] = kinds.get(k, 0) + 1
  return {
    "problems": n,
    "with_results": n - kinds.get("MISSING", 0),
    "compile_rate": sum(v not in ("COMPILE_ERROR", "MISSING") for v in verdicts.values()) / n,
    "exec_accuracy": len(ok) / n,
    "fast_p": {"0": len(ok) / n, "0.5": (len(ok) - (21 in ids)) / n, "1.5": 0.0, "2": 0.0},
    "deceptive_rate": 0.0,
    "failure_kinds": kinds,
    "flagged": 0,
  }


def write(kernelbench: str, ids: list[int], out: str) -> None:
  path = kernelbench
  if os.path.isdir(path):
    path = os.path.join(path, "level1.jsonl")
  refs = {}
  with open(path, encoding="utf-8") as f:
    for line in f:
      row = json.loads(line)
      refs[row["problem_id"]] = row["code"]
  missing = [i for i in ids if i not in refs]
  if missing or not set(HAND_WRITTEN) <= set(ids):
    sys.exit(
      f"eval_known: error: --problems must be level-1 ids including 19-23 (missing {missing})"
    )
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w", encoding="utf-8") as f:
    for i in ids:
      verdict, source = HAND_WRITTEN.get(i, ("OK", _renamed(refs[i])))
      if source is not None:
        f.write(json.dumps({"level": 1, "problem_id": i, "candidate": source}) + "\n")
  with open(_expected_path(out), "w", encoding="utf-8") as f:
    json.dump(expected_metrics(ids), f, indent=2)
  print(f"wrote {out} and {_expected_path(out)}")


def _expected_path(out: str) -> str:
  return os.path.splitext(out)[0] + ".expected.json"


def check(run_dir: str, expected_path: str) -> bool:
  with open(expected_path) as f:
    want = json.load(f)
  with open(os.path.join(run_dir, "metrics.json")) as f:
    got = json.load(f)["eager"]["1"]
  ok = True
  for key, value in want.items():
    if key == "fast_p":
      for p, v in value.items():
        match = abs(got["fast_p"][p] - v) < 1e-12
        ok &= match
        print(f"{'ok ' if match else 'BAD'} fast_{p}: got {got['fast_p'][p]:.4f}, expected {v:.4f}")
      continue
    match = got[key] == value if not isinstance(value, float) else abs(got[key] - value) < 1e-12
    ok &= match
    print(f"{'ok ' if match else 'BAD'} {key}: got {got[key]}, expected {value}")
  for p in ("0.8", "1"):
    print(f"--  fast_{p}: {got['fast_p'][p]:.4f} (speedups near 1: not checked)")
  print(f"--  geomean speedup: {got['geomean_speedup']:.4f}")
  print("all expected metrics match" if ok else "MISMATCH")
  return ok


def main(argv):
  del argv
  if FLAGS.check:
    if not FLAGS.expected:
      raise app.UsageError("--check needs --expected")
    sys.exit(0 if check(FLAGS.check, FLAGS.expected) else 1)
  if not (FLAGS.kernelbench and FLAGS.out):
    raise app.UsageError("pass --kernelbench and --out (or --check and --expected)")
  write(FLAGS.kernelbench, _ids(FLAGS.problems), FLAGS.out)


if __name__ == "__main__":
  from experiments import _cli

  _cli.run(main)
