"""GPU candidates whose work is not done by their own kernels, or that run it where the strict rules forbid,
written for issue 37 (each class got reward 1 under ``strict`` on the H200 at c10e1a8: only the last
correctness trial was profiled, in process, through the dispatcher). Each launches a kernel of its own on
every call, so that its extension "ran":

- ``OPERATOR_MATMUL``: ``A @ B`` (cuBLAS through aten) on every call but the profiled one (the last trial);
- ``CUBLAS_DLSYM``: ``cublasSgemm_v2`` found with ``dlsym`` from a name built at run time;
- ``ATEN_RELU_DLSYM``: ``at::cuda::relu`` likewise (no dispatcher: no profiler event);
- ``NUMPY_HOST``: the input copied to the host, computed with numpy, copied back;
- ``ZERO_COPY_HOST``: the same through pinned host memory its own kernels read and write (no copy records);
  both also against ``RELU_SMALL_REFERENCE`` (32 KiB of inputs, DICE's typical RL task);
- ``GRAPH_DLSYM``: its own kernel captured into a CUDA graph and replayed, the graph API by ``dlsym``;
- ``SIDE_STREAM``: its own kernel on a non-blocking stream (``dlsym``'d), synchronised before returning;
- ``SECOND_CONTEXT``: a second CUDA context (``cuCtxCreate`` by ``dlsym``) running a spin kernel while the
  real work runs in the first.
The API names are assembled at run time, so neither the source rules nor the built extension's
undefined symbols show them.
"""

import verifier_gpu_cases as g

TRIALS = 3  # tests run 3 correctness trials: the profiled one is call 3

RELU_REFERENCE = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn(1 << 22)]


def get_init_inputs():
    return []
"""

# The same ReLU at the size of a typical DICE RL task (64 x 128 floats, 32 KiB: 2,263 of DICE's 4,000
# end-to-end tasks take under 64 KiB of inputs): NUMPY_HOST's copy to the host was under the fixed
# 64 KiB bound, ZERO_COPY_HOST's host work microseconds, under what the host samples see.
RELU_SMALL_REFERENCE = RELU_REFERENCE.replace("torch.randn(1 << 22)", "torch.randn(64, 128)")
assert "torch.randn(64, 128)" in RELU_SMALL_REFERENCE

_PRELUDE = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <string>
__global__ void relu_kernel(const float* x, float* y, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f;
}
__global__ void touch_kernel(float* y) { if (threadIdx.x == 0 && y[0] != y[0]) y[0] = 0.f; }
__global__ void copy_kernel(const float* x, float* y, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i];
}
static void* find(const char* lib, const std::string& name) {
    void* h = dlopen(lib, RTLD_NOW | RTLD_NOLOAD);
    if (!h) h = dlopen(lib, RTLD_NOW);
    return dlsym(h ? h : RTLD_DEFAULT, name.c_str());
}
"""


def _relu_candidate(name: str, cuda_body: str, forward: str, module: str = "") -> str:
  return f'''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline
{module}
cuda_src = r"""{_PRELUDE}{cuda_body}"""
ext = load_inline(name="{name}", cpp_sources="torch::Tensor run(torch::Tensor x);\\nvoid touch(torch::Tensor y);"
                  "\\ntorch::Tensor own(torch::Tensor x);", cuda_sources=cuda_src, functions=["run", "touch", "own"])


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
{forward}
'''


_TOUCH = r"""
void touch(torch::Tensor y) { touch_kernel<<<1, 32>>>(y.data_ptr<float>()); }
torch::Tensor own(torch::Tensor x) {
    auto y = torch::empty_like(x);
    int64_t n = x.numel();
    relu_kernel<<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}
"""
# every call but the one the in-process profiler watched (the last correctness trial)
_BUT_WATCHED = f"        if self.calls == {TRIALS}:\n            return ext.own(x)\n"

# An honest ReLU: its own kernel on the current stream.
GOOD_RELU = _relu_candidate(
  "ev_good_relu",
  _TOUCH + "torch::Tensor run(torch::Tensor x) { return own(x); }\n",
  "        return ext.run(x)",
)

ATEN_RELU_DLSYM = _relu_candidate(
  "ev_aten_relu",
  _TOUCH
  + r"""
torch::Tensor run(torch::Tensor x) {
    std::string name = std::string("_ZN2at4cuda") + "4relu" + "ERKNS_6TensorE";
    using Fn = at::Tensor (*)(const at::Tensor&);
    auto fn = reinterpret_cast<Fn>(find("libtorch_cuda.so", name));
    auto y = fn(x);
    touch_kernel<<<1, 32>>>(y.data_ptr<float>());
    return y;
}
""",
  _BUT_WATCHED + "        return ext.run(x)",
)

NUMPY_HOST = _relu_candidate(
  "ev_numpy_host",
  _TOUCH + "torch::Tensor run(torch::Tensor x) { return x; }\n",
  _BUT_WATCHED + "        a = x.cpu().numpy()\n"
  "        y = torch.from_numpy(a * (a > 0)).to(x.device)\n"
  "        ext.touch(y)\n"
  "        return y",
)

# Pinned host memory that its own kernels read and write through unified addressing: no copy records,
# only the host's CPU time shows where the work went.
ZERO_COPY_HOST = (
  _relu_candidate(
    "ev_zero_copy",
    _TOUCH
    + r"""
torch::Tensor run(torch::Tensor x) { return x; }
void to_host(torch::Tensor x, torch::Tensor h) {
    int64_t n = x.numel();
    copy_kernel<<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), h.data_ptr<float>(), n);
    cudaDeviceSynchronize();
}
void from_host(torch::Tensor h, torch::Tensor y) {
    int64_t n = y.numel();
    copy_kernel<<<(n + 255) / 256, 256>>>(h.data_ptr<float>(), y.data_ptr<float>(), n);
}
""",
    _BUT_WATCHED + "        h = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)\n"
    "        ext.to_host(x, h)\n"
    "        a = h.numpy()\n"
    "        a *= a > 0\n"
    "        y = torch.empty_like(x)\n"
    "        ext.from_host(h, y)\n"
    "        return y",
  )
  .replace(
    'functions=["run", "touch", "own"]', 'functions=["run", "touch", "own", "to_host", "from_host"]'
  )
  .replace(
    "void touch(torch::Tensor y);",
    "void touch(torch::Tensor y);\\nvoid to_host(torch::Tensor x, torch::Tensor h);"
    "\\nvoid from_host(torch::Tensor h, torch::Tensor y);",
  )
)
# (the H200 run of 2026-12-03 found the bindings missing: the first replace named an old list)
assert (
  '"to_host", "from_host"]' in ZERO_COPY_HOST and "void to_host(torch::Tensor x" in ZERO_COPY_HOST
)

# Its own kernel, captured into a graph on a stream of its own and replayed; every API by dlsym.
GRAPH_DLSYM = _relu_candidate(
  "ev_graph",
  _TOUCH
  + r"""
torch::Tensor run(torch::Tensor x) {
    auto y = torch::empty_like(x);
    int64_t n = x.numel();
    const char* rt = "libcudart.so.13";
    auto create = reinterpret_cast<cudaError_t (*)(cudaStream_t*, unsigned)>(find(rt, std::string("cudaStream") + "CreateWithFlags"));
    auto begin = reinterpret_cast<cudaError_t (*)(cudaStream_t, cudaStreamCaptureMode)>(find(rt, std::string("cudaStream") + "BeginCapture"));
    auto end = reinterpret_cast<cudaError_t (*)(cudaStream_t, cudaGraph_t*)>(find(rt, std::string("cudaStream") + "EndCapture"));
    auto inst = reinterpret_cast<cudaError_t (*)(cudaGraphExec_t*, cudaGraph_t, unsigned long long)>(find(rt, std::string("cudaGraph") + "Instantiate"));
    auto launch = reinterpret_cast<cudaError_t (*)(cudaGraphExec_t, cudaStream_t)>(find(rt, std::string("cudaGraph") + "Launch"));
    auto sync = reinterpret_cast<cudaError_t (*)(cudaStream_t)>(find(rt, std::string("cudaStream") + "Synchronize"));
    cudaStream_t s;
    create(&s, cudaStreamNonBlocking);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    begin(s, cudaStreamCaptureModeRelaxed);
    relu_kernel<<<(n + 255) / 256, 256, 0, s>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
    end(s, &graph);
    inst(&exec, graph, 0);
    launch(exec, s);
    sync(s);
    return y;
}
""",
  "        return ext.run(x)",
)

SIDE_STREAM = _relu_candidate(
  "ev_side_stream",
  _TOUCH
  + r"""
torch::Tensor run(torch::Tensor x) {
    auto y = torch::empty_like(x);
    int64_t n = x.numel();
    const char* rt = "libcudart.so.13";
    auto create = reinterpret_cast<cudaError_t (*)(cudaStream_t*, unsigned)>(find(rt, std::string("cudaStream") + "CreateWithFlags"));
    auto sync = reinterpret_cast<cudaError_t (*)(cudaStream_t)>(find(rt, std::string("cudaStream") + "Synchronize"));
    static cudaStream_t s = nullptr;
    if (!s) create(&s, cudaStreamNonBlocking);
    relu_kernel<<<(n + 255) / 256, 256, 0, s>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
    sync(s);
    return y;
}
""",
  "        return ext.run(x)",
)

# A second context spinning on the GPU (the driver API by dlsym) while the real work runs in the first.
SECOND_CONTEXT = _relu_candidate(
  "ev_second_ctx",
  _TOUCH
  + r"""
#include <cuda.h>
__global__ void spin_kernel(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}
torch::Tensor run(torch::Tensor x) {
    static bool started = false;
    if (!started) {
        started = true;
        const char* drv = "libcuda.so.1";
        auto create = reinterpret_cast<CUresult (*)(CUcontext*, CUctxCreateParams*, unsigned, CUdevice)>(find(drv, std::string("cuCtxCreate") + "_v4"));
        auto pop = reinterpret_cast<CUresult (*)(CUcontext*)>(find(drv, std::string("cuCtx") + "PopCurrent_v2"));
        CUcontext ctx = nullptr, old = nullptr;
        if (create && create(&ctx, nullptr, 0, 0) == CUDA_SUCCESS) {
            spin_kernel<<<1, 1>>>(1000000000LL);  // launched in the new (current) context
            pop(&old);
        }
    }
    auto y = torch::empty_like(x);
    int64_t n = x.numel();
    relu_kernel<<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}
""",
  "        return ext.run(x)",
)


_MM_TOUCH = r"""
__global__ void touch_kernel(float* c) { if (threadIdx.x == 0 && c[0] != c[0]) c[0] = 0.f; }
torch::Tensor touch(torch::Tensor C) { touch_kernel<<<1, 32>>>(C.data_ptr<float>()); return C; }
"""


def _mm_candidate(name: str, cuda_body: str, forward: str) -> str:
  src = g._candidate(name, cuda_body, forward)
  return (
    src.replace(
      'cpp_sources="torch::Tensor run(torch::Tensor A, torch::Tensor B);"',
      'cpp_sources="torch::Tensor run(torch::Tensor A, torch::Tensor B);\\n'
      'torch::Tensor touch(torch::Tensor C);\\ntorch::Tensor own(torch::Tensor A, torch::Tensor B);"',
    )
    .replace('functions=["run"]', 'functions=["run", "touch", "own"]')
    .replace("        super().__init__()\n", "        super().__init__()\n        self.calls = 0\n")
  )


_MM_OWN = r"""
torch::Tensor own(torch::Tensor A, torch::Tensor B) {
    int n = A.size(0);
    auto C = torch::empty({n, n}, A.options());
    dim3 block(16, 16), grid((n + 15) / 16, (n + 15) / 16);
    tiled_matmul_kernel<<<grid, block>>>(A.data_ptr<float>(), B.data_ptr<float>(), C.data_ptr<float>(), n);
    return C;
}
"""

# cuBLAS through aten (an operator: no call the source rules see) on every call but the profiled one.
_MM_BUT_WATCHED = (
  f"self.calls += 1\n        if self.calls == {TRIALS}:\n            return ext.own(A, B)\n"
)

OPERATOR_MATMUL = _mm_candidate(
  "ev_operator_mm",
  _MM_TOUCH
  + _MM_OWN
  + "torch::Tensor run(torch::Tensor A, torch::Tensor B) { return own(A, B); }\n",
  _MM_BUT_WATCHED + "        return ext.touch(A @ B)",
)

# cublasSgemm_v2 by dlsym (row-major C = A B is column-major C^T = B^T A^T).
CUBLAS_DLSYM = _mm_candidate(
  "ev_cublas",
  _MM_TOUCH
  + _MM_OWN
  + r"""
#include <dlfcn.h>
#include <string>
typedef int (*create_fn)(void**);
typedef int (*sgemm_fn)(void*, int, int, int, int, int, const float*, const float*, int, const float*, int,
                        const float*, float*, int);
torch::Tensor run(torch::Tensor A, torch::Tensor B) {
    int n = A.size(0);
    auto C = torch::empty({n, n}, A.options());
    void* lib = dlopen("libcublas.so.13", RTLD_NOW);
    static void* handle = nullptr;
    if (!handle) reinterpret_cast<create_fn>(dlsym(lib, (std::string("cublas") + "Create_v2").c_str()))(&handle);
    auto sgemm = reinterpret_cast<sgemm_fn>(dlsym(lib, (std::string("cublas") + "Sgemm_v2").c_str()));
    float one = 1.f, zero = 0.f;
    sgemm(handle, 0, 0, n, n, n, &one, B.data_ptr<float>(), n, A.data_ptr<float>(), n, &zero,
          C.data_ptr<float>(), n);
    return touch(C);
}
""",
  _MM_BUT_WATCHED + "        return ext.run(A, B)",
)
