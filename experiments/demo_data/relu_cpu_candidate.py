# A known-good C++ (CPU) candidate for the "relu" pair of pairs.jsonl: what `make demo` sends to
# the verifier's CPU backend next to the tiny model's own (untrained, so failing) candidate.
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

relu_cpp_source = r"""
#include <torch/extension.h>

torch::Tensor relu_cpu(torch::Tensor x) {
    auto out = torch::empty_like(x);
    const float* px = x.data_ptr<float>();
    float* po = out.data_ptr<float>();
    for (int64_t i = 0; i < x.numel(); ++i) po[i] = px[i] > 0.f ? px[i] : 0.f;
    return out;
}
"""

relu_ext = load_inline(
  name="demo_relu_cpu", cpp_sources=relu_cpp_source, functions=["relu_cpu"], extra_cflags=["-O2"]
)


class ModelNew(nn.Module):
  def __init__(self):
    super().__init__()

  def forward(self, x):
    return relu_ext.relu_cpu(x.contiguous())
