"""Writes cpu_problems.jsonl and cpu_candidates.jsonl: KernelBench-style problems for the CPU verifier.

Seven small level-1 problems (KernelBench's JSONL schema: level, problem_id, name, code) and one known
candidate per problem (C++ through ``load_inline``: the verifier's CPU backend) whose verdicts are
fixed by construction, so an evaluation of them has exactly known metrics:

  1 ReLU            correct, deliberately slow (repeats its loop 8 times): speedup << 0.5
  2 Repeated_axpy   correct; the reference makes 20,000 tiny torch calls, the kernel one: speedup >> 10
                    (about 45x in CPU time on a 2-core VM: 41 ms against 0.9 ms, so timing noise cannot
                    bring it under 10; over 64 elements its 0.3 ms a call was too near what the CPU clock
                    resolves through the exchange), flagged for review
  3 Sigmoid         wrong: computes relu                        -> WRONG_OUTPUT
  4 Tanh            computes with torch in forward              -> TORCH_COMPUTE (deceptive)
  5 Square          not valid Python                            -> SYNTAX_ERROR
  6 Abs             a response without a fenced code block      -> NO_CODE_BLOCK (not verified)
  7 Softsign        no candidate at all                         -> MISSING

Every candidate loads the same extension source, so the verifier builds it once (build cache).

For BiC-RL on CPU (`make demo`'s RL phase, the `rl_tiny` config) it also writes cpu_rl_task.jsonl,
problem 1 (ReLU) as an end-to-end RL task, and cpu_rl_candidates.jsonl: two short candidates for it
that differ in one character, `correct` (OK) and `wrong_output` (`<` for `>`: WRONG_OUTPUT). The
demo's SFT teaches the tiny model both, so its samples are real candidates the verifier judges
both ways (two builds in all), and BiC-RL has groups of unequal rewards to learn from.
Our own code. Regenerate with ``python experiments/demo_data/make_cpu_problems.py``.
"""

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))

REFERENCE = '''import torch
import torch.nn as nn


class Model(nn.Module):
    """{doc}"""

    def __init__(self):
        super().__init__()

    def forward(self, x):
{body}


def get_inputs():
    return [torch.randn({shape})]


def get_init_inputs():
    return []
'''

PROBLEMS = [  # (name, doc, forward body, input shape)
  ("ReLU", "Applies ReLU element-wise.", "        return torch.relu(x)", "256, 256"),
  (
    "Repeated_axpy",
    "Adds 0.001 * x to y = x ten thousand times (many tiny torch calls).",
    "        y = x\n        for _ in range(10000):\n            y = y + x * 0.001\n        return y",
    "256",
  ),
  ("Sigmoid", "Applies sigmoid element-wise.", "        return torch.sigmoid(x)", "256, 256"),
  ("Tanh", "Applies tanh element-wise.", "        return torch.tanh(x)", "256, 256"),
  ("Square", "Squares x element-wise.", "        return x * x", "256, 256"),
  ("Abs", "Absolute value element-wise.", "        return torch.abs(x)", "256, 256"),
  (
    "Softsign",
    "Applies softsign element-wise.",
    "        return x / (1 + torch.abs(x))",
    "256, 256",
  ),
]

EXTENSION = r"""
#include <torch/extension.h>

torch::Tensor relu_repeated(torch::Tensor x, int64_t reps) {
    auto out = torch::empty_like(x);
    const float* px = x.data_ptr<float>();
    float* po = out.data_ptr<float>();
    for (int64_t r = 0; r < reps; ++r) {
        for (int64_t i = 0; i < x.numel(); ++i) po[i] = px[i] > 0.f ? px[i] : 0.f;
        asm volatile("" ::: "memory");  // keep every repetition
    }
    return out;
}

torch::Tensor axpy_repeated(torch::Tensor x, int64_t reps, double a) {
    auto out = torch::empty_like(x);
    const float* px = x.data_ptr<float>();
    float* po = out.data_ptr<float>();
    const int64_t n = x.numel();
    for (int64_t i = 0; i < n; ++i) po[i] = px[i];
    for (int64_t r = 0; r < reps; ++r)  // the same sums as the reference, elements independent
        for (int64_t i = 0; i < n; ++i) po[i] = po[i] + px[i] * (float)a;
    return out;
}
"""

HEADER = f'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = r"""{EXTENSION}"""

ops = load_inline(
    name="dj_eval_cpu_ops",
    cpp_sources=source,
    functions=["relu_repeated", "axpy_repeated"],
    extra_cflags=["-O2"],
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
'''

CANDIDATES = {  # problem id -> {"candidate": code} | {"response": text}
  1: {"candidate": HEADER + "        return ops.relu_repeated(x.contiguous(), 8)\n"},
  2: {"candidate": HEADER + "        return ops.axpy_repeated(x.contiguous(), 10000, 0.001)\n"},
  3: {"candidate": HEADER + "        return ops.relu_repeated(x.contiguous(), 1)\n"},
  4: {"candidate": HEADER + "        return torch.tanh(ops.relu_repeated(x, 1) * 0 + x)\n"},
  5: {"candidate": HEADER + "        return ops.relu_repeated(x.contiguous(), 1\n"},
  6: {"response": "I would use fabsf over every element, but here is no code block."},
}

# Short, so that the demo's tiny model learns them in a few hundred SFT steps (~400 characters).
RL_CANDIDATE = '''from torch.nn import Module
from torch.utils.cpp_extension import load_inline
m = load_inline(name="relu", cpp_sources="""
torch::Tensor f(torch::Tensor x) {
  auto y = x.clone();
  float *p = y.data_ptr<float>();
  for (int i = 0; i < y.numel(); i++) p[i] = {expr};
  return y;
}""", functions=["f"])
class ModelNew(Module):
    def forward(self, x):
        return m.f(x)
'''
RL_CANDIDATES = {  # variant -> (C++ expression of p[i], the verdict it gets)
  "correct": ("p[i] > 0 ? p[i] : 0", "OK"),
  "wrong_output": ("p[i] < 0 ? p[i] : 0", "WRONG_OUTPUT"),
}

# The verdicts these candidates get (what tests and the demo expect).
EXPECTED_KINDS = {
  1: "OK",
  2: "OK",
  3: "WRONG_OUTPUT",
  4: "TORCH_COMPUTE",
  5: "SYNTAX_ERROR",
  6: "NO_CODE_BLOCK",
  7: "MISSING",
}


def main():
  with open(os.path.join(HERE, "cpu_problems.jsonl"), "w") as f:
    for pid, (name, doc, body, shape) in enumerate(PROBLEMS, 1):
      code = REFERENCE.format(doc=doc, body=body, shape=shape)
      f.write(json.dumps({"level": 1, "problem_id": pid, "name": f"{pid}_{name}", "code": code}))
      f.write("\n")
  with open(os.path.join(HERE, "cpu_candidates.jsonl"), "w") as f:
    for pid, row in CANDIDATES.items():
      f.write(json.dumps({"level": 1, "problem_id": pid, **row}) + "\n")
  name, doc, body, shape = PROBLEMS[0]
  with open(os.path.join(HERE, "cpu_rl_task.jsonl"), "w") as f:
    code = REFERENCE.format(doc=doc, body=body, shape=shape)
    f.write(json.dumps({"id": f"1_{name}", "level": 1, "pytorch_code": code}) + "\n")
  with open(os.path.join(HERE, "cpu_rl_candidates.jsonl"), "w") as f:
    for variant, (expr, kind) in RL_CANDIDATES.items():
      code = RL_CANDIDATE.replace("{expr}", expr)
      f.write(json.dumps({"variant": variant, "candidate": code, "expected": kind}) + "\n")
  print(f"wrote {len(PROBLEMS)} problems and {len(CANDIDATES)} candidates to {HERE}")
  print(f"wrote the RL task {name} and its {len(RL_CANDIDATES)} SFT candidates to {HERE}")


if __name__ == "__main__":
  main()
