"""Candidates whose work is done outside their own compiled code, written for issue 37 (each got reward 1
on c10e1a8 under ``strict``): torch compute through operators or ``operator.methodcaller`` on every call
but the one the in-process profiler watched, ``at::cpu::clamp_min_out`` reached by ``dlsym`` of a name built
at run time, and numpy on the host with a trivial kernel of their own called so the extension "ran".

They share one pybind11-only extension (no torch headers: it builds in seconds, once, through the build
cache): ``relu_raw`` computes the answer itself, ``touch_raw`` does nothing useful, ``lib_relu`` has
libtorch compute it.
"""

EXTENSION = r"""
#include <pybind11/pybind11.h>
#include <cstdint>
#include <dlfcn.h>
#include <string>
void relu_raw(std::uintptr_t x, std::uintptr_t out, std::int64_t n) {
    const float* px = reinterpret_cast<const float*>(x);
    float* po = reinterpret_cast<float*>(out);
    for (std::int64_t i = 0; i < n; ++i) po[i] = px[i] > 0.0f ? px[i] : 0.0f;
}
void touch_raw(std::uintptr_t out) {
    volatile float* po = reinterpret_cast<volatile float*>(out);
    po[0] = po[0];
}
struct TensorRef { void* impl; };  // at::Tensor: one intrusive pointer to its TensorImpl
void lib_relu(std::uintptr_t out, std::uintptr_t x, std::uintptr_t zero) {
    std::string name = std::string("_ZN2at3cpu13") + "clamp_min" + "_outERNS_6TensorERKS1_S4_";
    void* lib = dlopen("libtorch_cpu.so", RTLD_NOW | RTLD_NOLOAD);
    using Fn = void* (*)(TensorRef&, const TensorRef&, const TensorRef&);
    Fn fn = reinterpret_cast<Fn>(dlsym(lib ? lib : RTLD_DEFAULT, name.c_str()));
    TensorRef o{reinterpret_cast<void*>(out)}, s{reinterpret_cast<void*>(x)};
    TensorRef z{reinterpret_cast<void*>(zero)};
    fn(o, s, z);
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("relu_raw", &relu_raw);
    m.def("touch_raw", &touch_raw);
    m.def("lib_relu", &lib_relu);
}
"""


def reference(n: int) -> str:
  """ReLU over ``n`` floats."""
  return f"""
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn({n})]


def get_init_inputs():
    return []
"""


# Big enough that a library's pass over the input (a few ms on one core) stands out of the sampling noise
# in three judged trials; timed checks judge many more calls, a smaller input does there, but not one of
# 256K floats: `x * (x > 0)` over it is near the rule's 0.1 ms floor a forward, and the timed-only case was
# rewarded in 2 of 7 runs on the idle 2-core VM and once in the clean-clone CI (2026-12-04; 0 of 7 at
# 1M floats).
REFERENCE = reference(1 << 22)
TIMED_REFERENCE = reference(1 << 20)
# The library cases' input: a clamp over 4M floats (~1.4 ms a forward in libtorch_cpu beside the
# exchange's own ~2.8 ms there: it copies the same bytes) was still rewarded in 1 of ~12 judged runs with
# 3 judged forwards on a loaded 2-core host (the official CI's load, session 18); over 16M floats the
# signal is 4x, the sampling noise 2x.
LIBRARY_REFERENCE = reference(1 << 24)
# Trials the cases run: call 1 warms up, calls 2-4 are judged, the profiled trial is the last (call 5).
# One judged forward (an RL request's 3 trials) was not enough on a loaded host: a clamp over the 4M
# floats (~2.6 ms) beside the exchange's own ~4.5 ms of libtorch_cpu was 2.6 sigma at load ~7 on the
# 2-core VM (the rule asks 3), rewarded in 2 of 4 runs (docs/verifier-security.md).
TRIALS = 5


def candidate(forward: str, module: str = "") -> str:
  """A candidate with ``forward`` as the body of ``ModelNew.forward(self, x)`` (8-space indented)."""
  return f'''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline
{module}
source = r"""{EXTENSION}"""
ops = load_inline(name="vt_compute", cpp_sources=source, no_implicit_headers=True, extra_cflags=["-O2"])


def own(x):
    out = torch.empty_like(x)
    ops.relu_raw(x.data_ptr(), out.data_ptr(), x.numel())
    return out


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
{forward}
'''


HONEST = candidate("        return own(x)")
# Torch compute through an operator on every call but the profiled one; the extension touched every call.
OPERATOR = candidate(
  f"        if self.calls == {TRIALS}:\n"
  "            return own(x)\n"
  "        out = x * (x > 0)\n"
  "        ops.touch_raw(out.data_ptr())\n"
  "        return out"
)
METHODCALLER = candidate(
  f"        if self.calls == {TRIALS}:\n"
  "            return own(x)\n"
  "        out = operator.methodcaller('clamp_min', 0.0)(x)\n"
  "        ops.touch_raw(out.data_ptr())\n"
  "        return out",
  module="import operator",
)
# at::cpu::clamp_min_out by dlsym, on every call (the profiler never sees it: no dispatcher).
DLSYM_ATEN = candidate(
  "        out = torch.empty_like(x)\n"
  "        ops.lib_relu(out._cdata, x._cdata, self.zero._cdata)\n"
  "        return out"
).replace(
  "        self.calls = 0\n", "        self.calls = 0\n        self.zero = torch.zeros(())\n"
)
# numpy on the host; the extension's trivial function called so that it "ran".
NUMPY = candidate(
  "        out = torch.empty_like(x)\n"
  "        a = x.numpy()\n"
  "        out.numpy()[:] = a * (a > 0)\n"
  "        ops.touch_raw(out.data_ptr())\n"
  "        return out",
)
# Its own kernel in the correctness trials, torch's in the timed calls (all judged now, compared or not).
TIMED_ONLY = candidate(
  f"        if self.calls <= {TRIALS}:\n"
  "            return own(x)\n"
  "        out = x * (x > 0)\n"
  "        ops.touch_raw(out.data_ptr())\n"
  "        return out"
)
