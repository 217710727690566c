"""The split build: text transformation rules (and, where nvcc exists, that the torch-free
device half compiles). That the rewritten launches run correctly is shown on a GPU: tests/verifier/test_verifier_gpu.py
and ``python -m verifier bench --phases compile,gpu_dice`` run with the split build by default."""

import json
import re
import shutil
import subprocess

import pytest

from verifier.build.split_build import split_sources, split_variant, top_level_chunks

CUDA = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>
#define BLOCK 256
struct Pair { float a; float b; };
__device__ __forceinline__ float twice(float x) { return 2.f * x; }
static __global__ void scale_kernel(const float* __restrict__ x, float* y, int n, Pair p) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = twice(x[i]) * p.a + p.b;   // a comment with <<< in it
}
int blocks_for(int n) { return (n + BLOCK - 1) / BLOCK; }
torch::Tensor scale(torch::Tensor x) {
    auto y = torch::empty_like(x);
    int n = x.numel();
    Pair p{1.f, 0.5f};
    scale_kernel<<<blocks_for(n), BLOCK, 0, at::cuda::getCurrentCUDAStream()>>>(x.data_ptr<float>(), y.data_ptr<float>(), n, p);
    return y;
}
"""
CPP = "torch::Tensor scale(torch::Tensor x);"


def test_split_moves_torch_out_of_the_cu_and_rewrites_launches():
  host, device = split_sources(CPP, CUDA)
  assert "torch" not in device and "Tensor" not in device and "<<<" not in device
  assert "static __global__" not in device and "__global__ void scale_kernel" in device
  assert (
    "__device__ __forceinline__ float twice" in device
    and "struct Pair" in device
    and "#define BLOCK 256" in device
  )
  assert "<<<" not in host and "#include <torch/extension.h>" in host
  assert re.search(
    r"void scale_kernel\(const float\* __restrict__ x, float\* y, int n, Pair p\);", host
  )
  assert (
    "dice_launch(scale_kernel, dim3(blocks_for(n)), dim3(BLOCK), (size_t)(0), "
    "(cudaStream_t)(at::cuda::getCurrentCUDAStream()), x.data_ptr<float>()" in host
  )
  assert (
    host.count("int blocks_for(int n)") == 1 and "blocks_for" not in device
  )  # host function: host side only
  assert host.count("struct Pair") == 1


@pytest.mark.parametrize(
  "extra",
  [
    "template <typename T> __global__ void k(T* x) {}",
    "namespace { __global__ void k2(float* x) {} }",
    "#ifdef FOO\n#endif",
    "__constant__ float table[16];",
    'void f(torch::Tensor t) { AT_DISPATCH_FLOATING_TYPES(t.scalar_type(), "f", ([&] {})); }',
  ],
)
def test_split_refuses_what_it_does_not_understand(extra):
  assert split_sources(CPP, CUDA + "\n" + extra + "\n") is None


def test_split_variant_sets_load_inline_arguments():
  v = split_variant({"name": "x", "cpp_sources": CPP, "cuda_sources": CUDA, "functions": ["scale"]})
  assert v["no_implicit_headers"] is True and v["functions"] == ["scale"]
  assert split_variant({"name": "x", "cpp_sources": "int f() { return 0; }"}) is None
  assert top_level_chunks("int a; }") is None  # unbalanced braces


def test_split_on_dice_known_good_solutions(shared_data):
  tasks = json.loads((shared_data / "dice_rl" / "kernel_infilling_evaluation.json").read_text())
  n_split = 0
  for t in tasks:
    ns = {}
    src = t["cuda_code"]
    # the sources are module-level string constants in every DICE solution
    for m in re.finditer(r'^(\w+)\s*=\s*(r?"""[\s\S]*?""")', src, re.M):
      ns[m.group(1)] = eval(m.group(2))  # noqa: S307 - a string literal from the data file
    cuda = [v for v in ns.values() if "__global__" in v]
    if cuda and split_sources("", cuda[0]) is not None:
      n_split += 1
      assert "torch/" not in split_sources("", cuda[0])[1]
  assert n_split >= 85, n_split


@pytest.mark.skipif(
  shutil.which("nvcc") is None, reason="needs nvcc (dev machines and GPU hosts have it)"
)
def test_device_half_compiles_without_torch_headers(tmp_path):
  _, device = split_sources(CPP, CUDA)
  (tmp_path / "k.cu").write_text(device)
  p = subprocess.run(
    ["nvcc", "-c", "-arch=sm_90", str(tmp_path / "k.cu"), "-o", str(tmp_path / "k.o")],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert p.returncode == 0, p.stderr[-2000:]


def test_split_host_code_keeps_the_optimisation_level_nvcc_would_give_it():
  from verifier.build.split_build import host_opt_level

  assert host_opt_level(None) == "-O0"
  assert host_opt_level(["--use_fast_math"]) == "-O0"
  assert host_opt_level(["-O3", "--use_fast_math"]) == "-O3"
  assert host_opt_level(["-O2", "-O1"]) == "-O1"
  params = {
    "name": "e",
    "cpp_sources": "torch::Tensor f(torch::Tensor x);",
    "cuda_sources": "#include <torch/extension.h>\n__global__ void k(float* p) { p[0] = 1; }\n"
    "torch::Tensor f(torch::Tensor x) { k<<<1, 1>>>(x.data_ptr<float>()); return x; }\n",
    "functions": ["f"],
    "extra_cflags": None,
    "extra_cuda_cflags": ["-O3", "--use_fast_math"],
  }
  out = split_variant(params)
  assert out["extra_cflags"] == ["-O3"] and out["extra_cuda_cflags"] == ["-O3", "--use_fast_math"]


def test_lean_split_includes_the_lean_torch_headers_wherever_extension_h_was():
  from verifier.build.split_build import LEAN_TORCH_INCLUDES

  cpp = "#include <torch/extension.h>\n" + CPP
  full_host, full_device = split_sources(cpp, CUDA)
  lean_host, lean_device = split_sources(cpp, CUDA, lean=True)
  assert (
    full_host.count("#include <torch/extension.h>") == 3
  )  # main.cpp's, the candidate's, the .cu's
  assert "torch/extension.h" not in lean_host
  assert (
    lean_host.startswith(LEAN_TORCH_INCLUDES + "\n") and lean_host.count(LEAN_TORCH_INCLUDES) == 3
  )
  assert lean_device == full_device  # only the host half changes
  assert lean_host.replace(LEAN_TORCH_INCLUDES, "#include <torch/extension.h>") == full_host
  v = split_variant({"name": "x", "cpp_sources": CPP, "cuda_sources": CUDA}, lean=True)
  assert v["cpp_sources"] == split_sources(CPP, CUDA, lean=True)[0]


def test_a_failed_lean_build_is_retried_with_extension_h_only_when_main_cpp_failed():
  from verifier.build.split_build import lean_may_have_failed

  ninja = "FAILED: main.o\nc++ -MMD ... -c /tmp/b/main.cpp -o main.o\n"
  assert lean_may_have_failed(
    ninja + "/tmp/b/main.cpp:40:12: error: 'torch::nn' has not been declared\n"
  )
  assert lean_may_have_failed(
    ninja + "/tmp/b/main.cpp:3:10: fatal error: torch/nn.h: No such file or directory\n"
  )
  assert not lean_may_have_failed(
    'FAILED: cuda.cuda.o\n/tmp/b/cuda.cu(12): error: identifier "y" is undefined\n'
  )
  assert not lean_may_have_failed("/tmp/b/main.cpp:40:12: warning: unused variable 'n'\n")


@pytest.mark.skipif(
  shutil.which("g++") is None, reason="needs g++ (the CPU verifier builds with it)"
)
def test_host_code_gets_cuda_min_max_with_nvcc_semantics(tmp_path):
  """A launch wrapper's ``min(256, n)`` compiled under nvcc before the split; g++ has no such overloads, so
  the host half carries CUDA's (crt/math_functions.hpp), which beat std::min as CUDA's do."""
  from verifier.build.split_build import CUDA_HOST_MIN_MAX

  host, _ = split_sources(CPP, CUDA)
  assert CUDA_HOST_MIN_MAX in host
  program = (
    CUDA_HOST_MIN_MAX
    + r"""
#include <algorithm>
#include <cstdio>
#include <limits>
using namespace std;
int main() {
  int n = 100;
  float nan = std::numeric_limits<float>::quiet_NaN();
  printf("%d %d %u %ld %.1f %.1f %.1f %lld\n", min(256, n), max(256, n), min(-1, 2u), max(3L, 7L),
         min(nan, 1.f), max(1.0f, 2.5), min(2.5, 1.0f), max(-5LL, -9LL));
  return 0;
}
"""
  )
  (tmp_path / "m.cpp").write_text(program)
  exe = tmp_path / "m"
  p = subprocess.run(["g++", "-O0", str(tmp_path / "m.cpp"), "-o", str(exe)], capture_output=True)
  assert p.returncode == 0, p.stderr.decode()[-2000:]
  out = subprocess.run([str(exe)], capture_output=True, text=True).stdout.split()
  # int, int, CUDA's umin(-1 -> 4294967295, 2), long, fminf ignores NaN, double, double, long long
  assert out == ["100", "256", "2", "7", "1.0", "2.5", "1.0", "-5"]


def _recording_load_inline(fail):
  """A stand-in for ``load_inline`` (same signature) that records each build's kind and raises
  ``fail(kind)`` when that is not None: 'lean' / 'full' split, 'fast' or 'stock'."""
  import functools

  from torch.utils.cpp_extension import load_inline

  from verifier.build.split_build import LEAN_TORCH_INCLUDES

  kinds = []

  @functools.wraps(load_inline)
  def fake(**params):
    if params.get("no_implicit_headers"):
      kind = "lean" if LEAN_TORCH_INCLUDES in params["cpp_sources"] else "full"
    elif "-O0" in (params.get("extra_cflags") or []):
      kind = "fast"
    else:
      kind = "stock"
    kinds.append(kind)
    error = fail(kind)
    if error:
      raise RuntimeError(error)
    return object()

  return fake, kinds


_KERNEL_ERROR = 'FAILED: cuda.cuda.o\n/tmp/b/cuda.cu(12): error: identifier "y" is undefined\n'
_MAIN_CPP_ERROR = (
  "FAILED: main.o\n/tmp/b/main.cpp:40:12: error: 'torch::nn' has not been declared\n"
)


@pytest.mark.parametrize(
  "fail, cuda, expected",
  [
    # the candidate's own error in its kernels: the lean split, then the stock build decides (no fast build)
    (lambda kind: _KERNEL_ERROR, CUDA, ["lean", "stock"]),
    # the lean headers lacked something main.cpp uses: the full split, and only then the stock build
    (lambda kind: _MAIN_CPP_ERROR, CUDA, ["lean", "full", "stock"]),
    # what the split's rewrite broke, the stock build still builds
    (lambda kind: _KERNEL_ERROR if kind == "lean" else None, CUDA, ["lean", "stock"]),
    (lambda kind: None, CUDA, ["lean"]),
    # no split (a template): the fast build first, the stock one when it fails
    (lambda kind: _KERNEL_ERROR, "template <int N> struct T {};\n" + CUDA, ["fast", "stock"]),
    (lambda kind: None, "template <int N> struct T {};\n" + CUDA, ["fast"]),
  ],
  ids=["broken", "main_cpp", "split_only", "good", "unsplit_broken", "unsplit_good"],
)
def test_builds_tried_for_each_failure(tmp_path, fail, cuda, expected):
  from verifier.build.build_cache import CachedLoadInline

  fake, kinds = _recording_load_inline(fail)
  cache = CachedLoadInline(fake, str(tmp_path), split=True, use_pch=False)
  call = dict(name="scale", cpp_sources=CPP, cuda_sources=cuda, functions=["scale"])
  if fail("stock"):
    with pytest.raises(RuntimeError, match="error"):
      cache(**call)
    assert cache.events[-1]["error"]
  else:
    cache(**call)
    assert not cache.events[-1]["error"]
  assert kinds == expected
