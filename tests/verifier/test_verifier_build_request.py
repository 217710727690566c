"""The compile worker's allow-list for load_inline arguments (verifier.build.build_request): the flags real
kernels use pass, flags that run code or move the tools are refused with their name."""

import ast
import pathlib

import pytest

from verifier.build.build_request import BuildRefused, check

PROMPT_EXAMPLE = (
  pathlib.Path(__file__).parents[2] / "dice_jax" / "data" / "templates" / "model_new_ex_add.py.txt"
)

ALLOWED_HOST = [
  ["-O3", "--use_fast_math"],
  ["-O2", "-std=c++17", "-DNDEBUG", "-DBLOCK=256", "-UFOO", "-Wno-unused-variable", "-w"],
  ["-ffast-math", "-march=native", "-g", "-fopenmp", "-v"],
  ["", " ", "-O3 --use_fast_math"],
]
ALLOWED_NVCC = ALLOWED_HOST + [
  ["-arch=sm_90a", "-gencode=arch=compute_90a,code=sm_90a", "-lineinfo", "-Xptxas=-v,-O3"],
  ["-Xptxas", "-v", "--maxrregcount=64", "--expt-relaxed-constexpr", "-Xcompiler", "-fopenmp"],
  ["-Xcompiler=-O3,-fopenmp", "-ffast-math", "-march=native", "-g", "--threads=4"],
  ["", " ", "-Xptxas -v", "-gencode arch=compute_90a,code=sm_90a", "-O3 --use_fast_math"],
  ["-Xptxas -dlcm=ca", "-Xptxas", "-dlcm=cg", "-G", "--ftz=true"],
]
# nvcc's words, which g++ would take for others: -dlcm=ca is -d with "a" (every RTL dump into the build
# directory: red team 44 left 1.9 GB), a bare number an input file, -t a link trace, -lineinfo -l ineinfo
NVCC_ONLY = ["-dlcm=ca", "1234", "-t", "-lineinfo", "-Xptxas", "-G", "-arch=sm_90a"]
REFUSED = [
  "-fplugin=/tmp/x.so",
  "-wrapper",
  "-B/tmp/evil",
  "-specs=/tmp/evil.specs",
  "-ccbin=/tmp/sh",
  "--compiler-bindir=/tmp",
  "-Wl,-plugin=/tmp/x.so",
  "-Xcompiler=-O3,-fplugin=/tmp/x.so",
  "-L/tmp",
  "-lfoo",
  "@/tmp/response-file",
  "-o/tmp/elsewhere.so",
  "-include/etc/passwd",
  "-O3 -fplugin=/tmp/x.so",  # torch joins flags with spaces and the shell splits them again
  "-O3\u2003-fplugin=/tmp/x.so",  # not a separator for the shell: one word, refused as a whole
]


@pytest.mark.parametrize("flags", ALLOWED_NVCC, ids=lambda f: f[0])
def test_flags_real_kernels_use_pass_unchanged(flags):
  host = flags if flags in ALLOWED_HOST else ["-O3"]
  params = dict(name="ext", cpp_sources="int f();", cuda_sources=["__global__ void k(){}"])
  params.update(extra_cflags=host, extra_cuda_cflags=flags, extra_ldflags=["-lcublas"])
  out = check(params)
  assert out["extra_cflags"] == host and out["extra_cuda_cflags"] == flags
  assert out["cpp_sources"] == "int f();" and out["cuda_sources"] == ["__global__ void k(){}"]


@pytest.mark.parametrize("flag", NVCC_ONLY)
@pytest.mark.parametrize("arg", ["extra_cflags", "extra_ldflags", "-Xcompiler", "-Xcompiler="])
def test_nvcc_flags_given_to_g_plus_plus_are_refused_by_name(flag, arg):
  """g++ reads ``extra_cflags``, ``extra_ldflags`` and what ``-Xcompiler`` passes it from nvcc."""
  if arg.startswith("-X"):
    flags = [f"{arg}{flag}"] if arg.endswith("=") else [arg, flag]
    params = {"name": "ext", "cpp_sources": "", "extra_cuda_cflags": ["-O3", *flags]}
  else:
    params = {"name": "ext", "cpp_sources": "", arg: ["-O3", flag]}
  with pytest.raises(BuildRefused, match="is an nvcc flag") as e:
    check(params)
  assert repr(flag) in str(e.value)
  check({"name": "ext", "cpp_sources": "", "extra_cuda_cflags": ["-O3", "-Xptxas", flag]})


def test_the_load_inline_call_of_the_prompts_example_passes():
  """KernelBench's one-shot example, shown in every prompt, passes ``extra_cflags=[""]`` and
  ``extra_ldflags=[""]``: a model that copies it must not be refused (seen on the H200, 2026-12-01)."""
  tree = ast.parse(PROMPT_EXAMPLE.read_text())
  (call,) = [
    n
    for n in ast.walk(tree)
    if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "load_inline"
  ]
  params = {
    k.arg: ast.literal_eval(k.value)
    for k in call.keywords
    if isinstance(k.value, ast.Constant | ast.List)
  }
  assert params["extra_cflags"] == [""] and params["extra_ldflags"] == [""]
  out = check(params)
  assert out["extra_cflags"] == [""] and out["name"] == "elementwise_add"


@pytest.mark.parametrize("flag", REFUSED)
@pytest.mark.parametrize("arg", ["extra_cflags", "extra_cuda_cflags", "extra_ldflags"])
def test_flags_that_run_code_or_move_tools_are_refused_by_name(flag, arg):
  with pytest.raises(BuildRefused, match="not allowed") as e:
    check({"name": "ext", "cpp_sources": "", arg: ["-O3", flag]})
  assert arg in str(e.value)


@pytest.mark.parametrize(
  "params,match",
  [
    (dict(name="../../etc/x", cpp_sources=""), "identifier"),
    (dict(name="ext", cpp_sources=[1, 2]), "cpp_sources must be a string"),
    (dict(name="ext", cpp_sources="", extra_cflags="-O3; rm -rf /"), "not allowed"),
    (
      dict(name="ext", cpp_sources="", extra_cflags=["-O3\n-fplugin=/tmp/x.so"]),
      "control character",
    ),
    (dict(name="ext", cpp_sources="", extra_ldflags=["-O2\r"]), "control character"),
    (dict(name="ext", cpp_sources="", extra_include_paths=["-I/x"]), "plain path"),
    (dict(name="ext", cpp_sources="", with_cuda="yes"), "with_cuda"),
    (dict(name="ext", cpp_sources="", evil=1), "unknown arguments"),
    (dict(name="ext", cpp_sources="", sycl_sources="x"), "SYCL"),
    (dict(name="ext", cpp_sources="x" * 2_000_001), "limit"),
  ],
)
def test_malformed_arguments_are_refused_with_a_reason(params, match):
  with pytest.raises(BuildRefused, match=match):
    check(params)


def test_torch_defaults_of_a_bound_call_pass():
  import inspect

  cpp_extension = pytest.importorskip("torch.utils.cpp_extension")
  bound = inspect.signature(cpp_extension.load_inline).bind("ext", "int f();")
  bound.apply_defaults()
  out = check(dict(bound.arguments))
  assert out["name"] == "ext" and out["cpp_sources"] == "int f();"
