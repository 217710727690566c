"""Each static rule on its own (verifier/static/rules): it finds what its reason names in a small
candidate, and nothing in a clean one; the registry names every rule once, in order, in families."""

import pytest

from verifier.api.contract import FailureKind, Strictness
from verifier.static import rules
from verifier.static.aliases import MAX_ALIAS_VALUES
from verifier.static.source import Candidate, read_candidate

STRICT = Strictness.preset("strict")
KERNEL = (
  "__global__ void k(float* x, int n) {\n"
  "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
  "  if (i < n) x[i] = x[i] > 0 ? x[i] : 0;\n"
  "}\n"
)
RUN = (
  "torch::Tensor run(torch::Tensor x) {\n"
  "  k<<<(x.numel() + 255) / 256, 256>>>(x.data_ptr<float>(), x.numel());\n"
  "  return x;\n"
  "}\n"
)


def candidate(kernel=KERNEL, run=RUN, module="", forward="return ext.run(x)", load=True):
  """A clean CUDA candidate, with `module` added at module scope and the parts replaced."""
  build = (
    'ext = load_inline(name="k", cpp_sources="torch::Tensor run(torch::Tensor x);", '
    'cuda_sources=SRC, functions=["run"])\n'
    if load
    else ""
  )
  return (
    "import torch\nimport torch.nn as nn\nfrom torch.utils.cpp_extension import load_inline\n"
    f'SRC = """\n{kernel}{run}"""\n{build}{module}\n'
    f"class ModelNew(nn.Module):\n  def forward(self, x):\n    {forward}\n"
  )


def read(source: str, device: str = "cuda") -> Candidate:
  c = read_candidate(source, device)
  assert isinstance(c, Candidate), c
  return c


# rule -> (the candidate, the kind it gives, words of its reason)
CASES = {
  "imports": (candidate(module="import ctypes\n"), FailureKind.FORBIDDEN_IMPORT, "'ctypes'"),
  "introspection": (
    candidate(module="def peek(f):\n  return f.f_back\n"),
    FailureKind.FRAME_INTROSPECTION,
    ".f_back",
  ),
  "builtin_aliases": (
    candidate(module="run_text = eval\n"),
    FailureKind.FORBIDDEN_IMPORT,
    "builtin eval",
  ),
  "sys_modules": (
    candidate(module="m = torch.sys\n"),
    FailureKind.FORBIDDEN_IMPORT,
    "module 'sys' through torch",
  ),
  "profiler": (
    candidate(module="p = torch.profiler\n"),
    FailureKind.FRAME_INTROSPECTION,
    "'profiler'",
  ),
  "openmp": (
    candidate(run="#pragma omp parallel for\n" + RUN),
    FailureKind.THREAD_OR_STREAM,
    "OpenMP",
  ),
  "alias_budget": (
    candidate(module="".join(f"x = torch.m{i}\n" for i in range(MAX_ALIAS_VALUES + 1))),
    FailureKind.SOURCE_TOO_COMPLEX,
    f"more than {MAX_ALIAS_VALUES} module paths",
  ),
  "fallback": (
    candidate(forward="try:\n      return ext.run(x)\n    except RuntimeError:\n      return x"),
    FailureKind.FALLBACK,
    "try/except",
  ),
  "monkey_patch": (
    candidate(module="import time\ntime.perf_counter = len\n"),
    FailureKind.MONKEY_PATCH,
    "time.perf_counter",
  ),
  "lazy_output": (
    candidate(module="class Lazy(torch.Tensor):\n  pass\n"),
    FailureKind.LAZY_OUTPUT,
    "subclasses torch.Tensor",
  ),
  "streams": (
    candidate(module="side = torch.cuda.Stream()\n"),
    FailureKind.THREAD_OR_STREAM,
    "torch.cuda.Stream(",
  ),
  "own_kernel": (
    candidate(run=RUN.replace("  k<<<(x.numel() + 255) / 256, 256>>>(", "  (")),
    FailureKind.KERNEL_NOT_LAUNCHED,
    "defined but never launched",
  ),
  "foreign_libraries": (
    candidate(run=RUN.replace("return x;", "cublasSgemm(h, x);\n  return x;")),
    FailureKind.FOREIGN_KERNELS,
    "cublasSgemm(",
  ),
  "direct_aten": (
    candidate(run=RUN.replace("return x;", "return at::_ops::relu::call(x);")),
    FailureKind.DIRECT_ATEN_CALL,
    "at::_ops::relu",
  ),
  "compute_references": (
    candidate(module="act = torch.relu\n"),
    FailureKind.TORCH_COMPUTE,
    "refers to torch.relu",
  ),
  "compute_calls": (
    candidate(forward="return torch.relu(ext.run(x))"),
    FailureKind.TORCH_COMPUTE,
    "forward path calls torch.relu",
  ),
}


def test_the_registry_names_each_rule_once_in_order_in_families():
  assert [r.name for r in rules.RULES] == list(rules.ORDER) and sorted(CASES) == sorted(rules.ORDER)
  assert set(rules.STRICT_RULES) | set(rules.WARNING_RULES) == set(rules.ORDER)
  assert rules.WARNING_RULES == (
    "streams",
    "foreign_libraries",
    "direct_aten",
    "compute_references",
    "compute_calls",
  )
  for family in rules.FAMILIES:
    assert family.__doc__ and all(
      r.family == family.__name__.rsplit(".", 1)[1] for r in family.RULES
    )


@pytest.mark.parametrize("rule", rules.RULES, ids=lambda r: r.name)
def test_each_rule_finds_what_its_reason_names_and_nothing_in_a_clean_candidate(rule):
  source, kind, needle = CASES[rule.name]
  (found, *_) = rule.check(read(source), STRICT)
  assert found.kind is kind and needle in found.reason, found
  assert rule.check(read(candidate()), STRICT) == []


@pytest.mark.parametrize("rule", [r for r in rules.RULES if r.warns], ids=lambda r: r.name)
def test_a_warning_rule_only_warns_where_its_flag_is_off(rule):
  off = Strictness("no_" + rule.flag, **{rule.flag: False})
  source = CASES[rule.name][0]
  verdict = rules.run_rules(read(source), off)
  assert not rule.applies(off) and verdict.kind is FailureKind.OK and verdict.warnings
  assert rules.run_rules(read(source), STRICT).kind is CASES[rule.name][1]


def test_a_cpu_candidate_needs_an_exported_function_not_a_kernel():
  own_kernel = next(r for r in rules.RULES if r.name == "own_kernel")
  cpu = candidate(kernel="", run="torch::Tensor run(torch::Tensor x) { return x; }\n")
  assert own_kernel.check(read(cpu, "cpu"), STRICT) == []
  (found,) = own_kernel.check(read(candidate(load=False), "cpu"), STRICT)
  assert found.kind is FailureKind.NO_KERNEL and "load_inline" in found.reason
