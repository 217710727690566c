"""CPU test cases: one reference and candidates that share one C++ extension (built once via the cache).

Each candidate calls a different exported function of the same ``load_inline`` sources, so the
content-addressed build cache compiles the extension once for all of them.
"""

REFERENCE = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, a, b):
        return (a + b) * self.scale


def get_inputs():
    return [torch.randn(64, 256), torch.randn(64, 256)]


def get_init_inputs():
    return [2.0]
"""

EXTENSION = r"""
#include <torch/extension.h>
#include <cstring>
#include <vector>

torch::Tensor scaled_add(torch::Tensor a, torch::Tensor b, double scale) {
    auto out = torch::empty_like(a);
    const float* pa = a.data_ptr<float>(); const float* pb = b.data_ptr<float>(); float* po = out.data_ptr<float>();
    for (int64_t i = 0; i < a.numel(); ++i) po[i] = (pa[i] + pb[i]) * (float)scale;
    return out;
}
torch::Tensor scaled_sub(torch::Tensor a, torch::Tensor b, double scale) {
    auto out = torch::empty_like(a);
    const float* pa = a.data_ptr<float>(); const float* pb = b.data_ptr<float>(); float* po = out.data_ptr<float>();
    for (int64_t i = 0; i < a.numel(); ++i) po[i] = (pa[i] - pb[i]) * (float)scale;
    return out;
}
torch::Tensor segfault(torch::Tensor a, torch::Tensor b, double scale) {
    volatile float* p = nullptr; p[12345] = 1.0f;
    return a;
}
torch::Tensor spin(torch::Tensor a, torch::Tensor b, double scale) {
    volatile int64_t x = 0; while (true) { x = x + 1; }
    return a;
}
torch::Tensor raise_error(torch::Tensor a, torch::Tensor b, double scale) {
    TORCH_CHECK(false, "deliberate failure in the candidate");
    return a;
}
torch::Tensor huge_alloc(torch::Tensor a, torch::Tensor b, double scale) {
    std::vector<char> big((size_t)64 << 30);
    std::memset(big.data(), 1, big.size());
    return a;
}
torch::Tensor zero_inputs(torch::Tensor a, torch::Tensor b, double scale) {
    a.zero_(); b.zero_();
    return torch::zeros_like(a);
}
torch::Tensor nan_out(torch::Tensor a, torch::Tensor b, double scale) {
    auto out = scaled_add(a, b, scale);
    out.data_ptr<float>()[7] = std::nanf("");
    return out;
}
"""

FUNCTIONS = [
  "scaled_add",
  "scaled_sub",
  "segfault",
  "spin",
  "raise_error",
  "huge_alloc",
  "zero_inputs",
  "nan_out",
]


def candidate(
  function: str, extension: str = EXTENSION, name: str = "vt_ops", cflags: str = '["-O2"]'
) -> str:
  return f'''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = r"""{extension}"""
ops = load_inline(name="{name}", cpp_sources=source, functions={FUNCTIONS!r}, extra_cflags={cflags})


class ModelNew(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, a, b):
        return ops.{function}(a, b, self.scale)
'''


GOOD = candidate("scaled_add")
COMPILE_ERROR = candidate(
  "scaled_add",
  extension=EXTENSION.replace(
    "auto out = torch::empty_like(a);", "auto out = undefined_symbol_xyz(a);", 1
  ),
  name="vt_broken",
)
SYNTAX_ERROR = GOOD.replace("def forward(self, a, b):", "def forward(self, a, b)")
MISSING_MODEL_NEW = GOOD.replace("class ModelNew", "class ModelOld")
PY_RAISE = GOOD.replace(
  "return ops.scaled_add(a, b, self.scale)", "raise ValueError('python-side failure')"
)
TORCH_FORWARD = GOOD.replace(
  "return ops.scaled_add(a, b, self.scale)", "return torch.add(a, b) * self.scale"
)


# A light extension: pybind11 only (no torch headers), raw pointers from Python. It builds in seconds instead
# of the ~40 s a torch/extension.h build takes on a 2-core CI machine; used where a fresh build is the point.
LIGHT_EXTENSION = r"""
#include <pybind11/pybind11.h>
#include <cstdint>
void scaled_add_raw(std::uintptr_t a, std::uintptr_t b, std::uintptr_t out, std::int64_t n, double scale) {
    const float* pa = reinterpret_cast<const float*>(a);
    const float* pb = reinterpret_cast<const float*>(b);
    float* po = reinterpret_cast<float*>(out);
    for (std::int64_t i = 0; i < n; ++i) po[i] = (pa[i] + pb[i]) * (float)scale;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("scaled_add_raw", &scaled_add_raw); }
"""


def light_candidate(extension: str = LIGHT_EXTENSION, name: str = "vt_light") -> str:
  return f'''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = r"""{extension}"""
ops = load_inline(name="{name}", cpp_sources=source, no_implicit_headers=True, extra_cflags=["-O2"])


class ModelNew(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, a, b):
        out = torch.empty_like(a)
        ops.scaled_add_raw(a.data_ptr(), b.data_ptr(), out.data_ptr(), a.numel(), self.scale)
        return out
'''


LIGHT_COMPILE_ERROR = light_candidate(
  LIGHT_EXTENSION.replace("po[i] = ", "po[i] = undefined_symbol_xyz + "), "vt_light_broken"
)
