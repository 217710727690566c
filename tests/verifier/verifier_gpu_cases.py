"""GPU candidates: a good one and adversarial ones modelled on KernelBench's adversarial unit tests
(result reuse, input zeroing, non-default stream; reference doc section 1.8) plus an illegal memory
access, a kernel that is never launched, and a forward that calls torch.matmul. Written for this project.
"""

MATMUL_REFERENCE = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, B):
        return torch.matmul(A, B)


N = 1024


def get_inputs():
    return [torch.rand(N, N), torch.rand(N, N)]


def get_init_inputs():
    return []
"""

_MATMUL_KERNEL = r"""
__global__ void tiled_matmul_kernel(const float* A, const float* B, float* C, int n) {
    __shared__ float As[16][16];
    __shared__ float Bs[16][16];
    int row = blockIdx.y * 16 + threadIdx.y, col = blockIdx.x * 16 + threadIdx.x;
    float acc = 0.f;
    for (int t = 0; t < (n + 15) / 16; ++t) {
        As[threadIdx.y][threadIdx.x] = (row < n && t * 16 + threadIdx.x < n) ? A[row * n + t * 16 + threadIdx.x] : 0.f;
        Bs[threadIdx.y][threadIdx.x] = (col < n && t * 16 + threadIdx.y < n) ? B[(t * 16 + threadIdx.y) * n + col] : 0.f;
        __syncthreads();
        for (int k = 0; k < 16; ++k) acc += As[threadIdx.y][k] * Bs[k][threadIdx.x];
        __syncthreads();
    }
    if (row < n && col < n) C[row * n + col] = acc;
}
"""


def _candidate(name: str, cuda_body: str, forward: str = "return ext.run(A, B)") -> str:
  return f'''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cuda_src = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>
{_MATMUL_KERNEL}
{cuda_body}
"""
ext = load_inline(name="{name}", cpp_sources="torch::Tensor run(torch::Tensor A, torch::Tensor B);",
                  cuda_sources=cuda_src, functions=["run"])


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, B):
        {forward}
'''


GOOD_MATMUL = _candidate(
  "good_mm",
  r"""
torch::Tensor run(torch::Tensor A, torch::Tensor B) {
    int n = A.size(0);
    auto C = torch::empty({n, n}, A.options());
    dim3 block(16, 16), grid((n + 15) / 16, (n + 15) / 16);
    tiled_matmul_kernel<<<grid, block>>>(A.data_ptr<float>(), B.data_ptr<float>(), C.data_ptr<float>(), n);
    return C;
}
""",
)

# Returns uninitialised memory after a launch that does nothing: passes only if it sees a stale result.
RESULT_REUSE = _candidate(
  "reuse_mm",
  r"""
__global__ void touch_kernel(float* c) {}
torch::Tensor run(torch::Tensor A, torch::Tensor B) {
    int n = A.size(0);
    auto C = torch::empty({n, n}, A.options());
    touch_kernel<<<1, 1>>>(C.data_ptr<float>());
    return C;
}
""",
)

# Zeroes its inputs and returns zeros: passes only if the reference then runs on the same (zeroed) inputs.
INPUT_ZEROING = _candidate(
  "zero_mm",
  r"""
__global__ void zero_kernel(float* p, int64_t n) { int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; if (i < n) p[i] = 0.f; }
torch::Tensor run(torch::Tensor A, torch::Tensor B) {
    int64_t n = A.numel();
    zero_kernel<<<(n + 255) / 256, 256>>>(A.data_ptr<float>(), n);
    zero_kernel<<<(n + 255) / 256, 256>>>(B.data_ptr<float>(), n);
    auto C = torch::empty_like(A);
    zero_kernel<<<(n + 255) / 256, 256>>>(C.data_ptr<float>(), n);
    return C;
}
""",
)

# Computes on a private non-blocking stream so a current-stream timer would miss the work.
NON_DEFAULT_STREAM = _candidate(
  "stream_mm",
  r"""
torch::Tensor run(torch::Tensor A, torch::Tensor B) {
    int n = A.size(0);
    auto C = torch::empty({n, n}, A.options());
    cudaStream_t side;
    cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);
    dim3 block(16, 16), grid((n + 15) / 16, (n + 15) / 16);
    tiled_matmul_kernel<<<grid, block, 0, side>>>(A.data_ptr<float>(), B.data_ptr<float>(), C.data_ptr<float>(), n);
    return C;
}
""",
)

ILLEGAL_ADDRESS = _candidate(
  "oob_mm",
  r"""
__global__ void wild_write_kernel(float* c) { c[(size_t)1 << 40] = 1.f; }
torch::Tensor run(torch::Tensor A, torch::Tensor B) {
    auto C = torch::empty_like(A);
    wild_write_kernel<<<1, 1>>>(C.data_ptr<float>());
    cudaDeviceSynchronize();
    return C;
}
""",
)

# Defines the matmul kernel and never launches it; computes with a host loop on a CPU copy instead.
NEVER_LAUNCHED = _candidate(
  "idle_mm",
  r"""
torch::Tensor run(torch::Tensor A, torch::Tensor B) {
    int n = A.size(0);
    auto a = A.to(torch::kCPU), b = B.to(torch::kCPU);
    auto c = torch::zeros({n, n}, a.options());
    const float* pa = a.data_ptr<float>(); const float* pb = b.data_ptr<float>(); float* pc = c.data_ptr<float>();
    for (int i = 0; i < n; ++i) for (int k = 0; k < n; ++k) { float v = pa[i * n + k]; for (int j = 0; j < n; ++j) pc[i * n + j] += v * pb[k * n + j]; }
    if (n < 0) tiled_matmul_kernel<<<1, 1>>>(pa, pb, pc, n);  // dead launch keeps the static check quiet
    return c.to(A.device());
}
""",
)

DEFINED_NOT_LAUNCHED_STATIC = _candidate(
  "unused_mm",
  r"""
torch::Tensor run(torch::Tensor A, torch::Tensor B) { return A; }
""",
)

TORCH_MATMUL_FORWARD = GOOD_MATMUL.replace("return ext.run(A, B)", "return torch.matmul(A, B)")

ADD_REFERENCE = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        return a + b


def get_inputs():
    return [torch.randn(4096, 4096), torch.randn(4096, 4096)]


def get_init_inputs():
    return []
"""

GOOD_ADD = '''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

src = r"""
#include <torch/extension.h>
__global__ void add_kernel(const float* a, const float* b, float* o, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) o[i] = a[i] + b[i];
}
torch::Tensor add(torch::Tensor a, torch::Tensor b) {
    auto o = torch::empty_like(a);
    int64_t n = a.numel();
    add_kernel<<<(n + 255) / 256, 256>>>(a.data_ptr<float>(), b.data_ptr<float>(), o.data_ptr<float>(), n);
    return o;
}
"""
ext = load_inline(name="good_add", cpp_sources="torch::Tensor add(torch::Tensor a, torch::Tensor b);",
                  cuda_sources=src, functions=["add"])


class ModelNew(nn.Module):
    def forward(self, a, b):
        return ext.add(a, b)
'''


# KernelBench's earlier level-3 VanillaRNN: the hidden state lives on the module and every forward
# updates it (the current version takes it as an input). A correct candidate is stepped in lock-step.
VANILLA_RNN_REFERENCE = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, input_size: int, hidden_size: int, output_size: int):
        super(Model, self).__init__()
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.output_size = output_size
        self.hidden = torch.randn((batch_size, hidden_size))
        self.i2h = nn.Linear(input_size + hidden_size, hidden_size)
        self.h2o = nn.Linear(hidden_size, output_size)
        self.tanh = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.hidden = self.hidden.to(x.device)
        combined = torch.cat((x, self.hidden), dim=1)
        self.hidden = self.tanh(self.i2h(combined))
        output = self.h2o(self.hidden)
        return output


batch_size = 8
input_size = 1024
hidden_size = 256
output_size = 128


def get_inputs():
    return [torch.randn(batch_size, input_size)]


def get_init_inputs():
    return [input_size, hidden_size, output_size]
"""
VANILLA_RNN_IDENTITY = VANILLA_RNN_REFERENCE.replace("Model(", "ModelNew(").replace(
  "super(Model,", "super(ModelNew,"
)


# Issue 37, item 9: a ReLU over 32M floats, float4 loads (~0.07 ms on an H200, as fast as aten's).
RELU_REFERENCE = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn(4096, 8192)]


def get_init_inputs():
    return []
"""

_RELU_SOURCE = r"""
#include <torch/extension.h>
__global__ void relu4_kernel(const float4* x, float4* y, int64_t n4) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n4) {
        float4 v = x[i];
        y[i] = make_float4(fmaxf(v.x, 0.f), fmaxf(v.y, 0.f), fmaxf(v.z, 0.f), fmaxf(v.w, 0.f));
    }
}
torch::Tensor relu(torch::Tensor x) {
    auto y = torch::empty_like(x);
    int64_t n4 = x.numel() / 4;
    relu4_kernel<<<(n4 + 255) / 256, 256>>>(reinterpret_cast<const float4*>(x.data_ptr<float>()),
                                            reinterpret_cast<float4*>(y.data_ptr<float>()), n4);
    return y;
}
"""


def relu_candidate(extra_cuda: str = "", init: str = "", name: str = "relu4") -> str:
  return f'''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

src = r"""{_RELU_SOURCE}
{extra_cuda}"""
ext = load_inline(name="{name}", cpp_sources="torch::Tensor relu(torch::Tensor x);{"void spin_on_the_side(long long cycles);" if extra_cuda else ""}",
                  cuda_sources=src, functions=["relu"{', "spin_on_the_side"' if extra_cuda else ""}])


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
{init}
    def forward(self, x):
        return ext.relu(x)
'''


GOOD_RELU4 = relu_candidate()

# Issue 37, item 3: leaves a kernel spinning for a minute on a stream of its own, and names its process
# (COMM_GPU) so the test can look for it once the verdict is out.
COMM_GPU = "vt-gpu-spin-37"
SPINS_AFTER_ITS_VERDICT = relu_candidate(
  r"""
__global__ void spin_kernel(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}
void spin_on_the_side(long long cycles) {
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    spin_kernel<<<1, 1, 0, s>>>(cycles);
}
""",
  init=f"""        with open("/proc/self/comm", "w") as f:
            f.write({COMM_GPU!r})
        ext.spin_on_the_side(60 * 2_000_000_000)
""",
  name="relu4_spin",
)
