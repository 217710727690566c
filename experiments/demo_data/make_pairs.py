"""Writes pairs.jsonl: small element-wise PyTorch -> CUDA pairs in KernelBench format (our own code).

The embedded default data of `make demo` (users have no ../shared/data). Regenerate with
`python experiments/demo_data/make_pairs.py`.
"""

import json
import os

OPS = {  # name: (torch expression of x, CUDA expression of v)
  "relu": ("torch.relu(x)", "v > 0.f ? v : 0.f"),
  "sigmoid": ("torch.sigmoid(x)", "1.f / (1.f + expf(-v))"),
  "tanh": ("torch.tanh(x)", "tanhf(v)"),
  "square": ("x * x", "v * v"),
  "double": ("x * 2.0", "v * 2.f"),
  "abs": ("torch.abs(x)", "fabsf(v)"),
  "softplus": ("torch.nn.functional.softplus(x)", "log1pf(expf(v))"),
  "silu": ("x * torch.sigmoid(x)", "v / (1.f + expf(-v))"),
}

REFERENCE = '''import torch
import torch.nn as nn


class Model(nn.Module):
    """Applies {name} element-wise."""

    def __init__(self):
        super().__init__()

    def forward(self, x):
        return {expr}


def get_inputs():
    return [torch.randn(4096, 1024)]


def get_init_inputs():
    return []
'''

CANDIDATE = '''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

{name}_source = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>

__global__ void {name}_kernel(const float* x, float* out, int n) {{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {{
        float v = x[i];
        out[i] = {cuda};
    }}
}}

torch::Tensor {name}_cuda(torch::Tensor x) {{
    auto out = torch::empty_like(x);
    int n = x.numel();
    const int threads = 256;
    {name}_kernel<<<(n + threads - 1) / threads, threads>>>(x.data_ptr<float>(), out.data_ptr<float>(), n);
    return out;
}}
"""

{name}_cpp_source = "torch::Tensor {name}_cuda(torch::Tensor x);"

{name}_ext = load_inline(
    name="{name}_ext",
    cpp_sources={name}_cpp_source,
    cuda_sources={name}_source,
    functions=["{name}_cuda"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.op = {name}_ext

    def forward(self, x):
        return self.op.{name}_cuda(x.contiguous())
'''


def main():
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pairs.jsonl")
  with open(path, "w") as f:
    for i, (name, (expr, cuda)) in enumerate(OPS.items()):
      row = {
        "id": name,
        "level": 1,
        "pytorch_code": REFERENCE.format(name=name, expr=expr),
        "cuda_code": CANDIDATE.format(name=name, cuda=cuda),
      }
      f.write(json.dumps(row) + "\n")
  print(f"wrote {len(OPS)} pairs to {path}")


if __name__ == "__main__":
  main()
