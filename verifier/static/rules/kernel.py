"""An own kernel: the candidate builds an extension and, on GPU, launches a ``__global__`` of its own.

KernelBench's STRICT ``cuda_impl`` (``__global__`` and ``load_inline``), and a defined kernel must
also be launched: a kernel that is only defined does none of the work.
"""

from __future__ import annotations

import re

from verifier.api.contract import FailureKind, Strictness
from verifier.static.rules.base import Findings, Rejection, Rule
from verifier.static.source import Candidate

# A triple-chevron launch and the name before it (``k<<<``, ``ns::k<float, 4><<<``).
CHEVRON_LAUNCH = re.compile(r"\b(\w+)\s*(?:<[^<>;]{0,512}>\s*)?<<<")

CUDA_LAUNCH_CALL = re.compile(r"cudaLaunch\w*\s*\(")

IDENTIFIER = re.compile(r"\b\w+\b")


def _launched_names(cpp: str) -> set[str]:
  """Names launched with ``<<<`` or named in a ``cudaLaunch*(...)`` call's statement (up to its ``;``).
  One pass over the text for each form (no per-kernel scans)."""
  names = set(CHEVRON_LAUNCH.findall(cpp))
  for statement in cpp.split(";"):
    m = CUDA_LAUNCH_CALL.search(statement)
    if m:
      names.update(IDENTIFIER.findall(statement, m.end()))
  return names


def own_kernel_rule(c: Candidate, strictness: Strictness) -> Findings:
  """An extension is built with load_inline/load; on GPU a __global__ kernel of its own is defined and
  launched, on CPU a C++ function is exported."""
  if c.n_loads == 0:
    return [
      Rejection(
        FailureKind.NO_KERNEL,
        "no torch.utils.cpp_extension.load_inline/load call builds an extension",
      )
    ]
  if c.device == "cuda":
    if not c.kernels:
      return [
        Rejection(
          FailureKind.NO_KERNEL, "no __global__ kernel is defined in the candidate's CUDA source"
        )
      ]
    launches = _launched_names(c.cpp)
    if not [k for k in c.kernels if k in launches]:
      return [
        Rejection(
          FailureKind.KERNEL_NOT_LAUNCHED,
          f"__global__ kernel(s) {', '.join(c.kernels)} defined but never launched with <<<...>>>",
        )
      ]
  elif not c.functions and not c.cpp.strip():
    return [
      Rejection(
        FailureKind.NO_KERNEL,
        "no C++ function is exported through load_inline(functions=[...])",
      )
    ]
  return []


RULES = (Rule("own_kernel", own_kernel_rule, "require_kernel"),)
