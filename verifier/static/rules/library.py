"""Libraries: the C++ side computes with its own kernels, not cuBLAS/cuDNN or ATen's.

Library compute is not an own kernel; ATen kernels called directly (``at::native::``,
``at::_ops::``) also skip the dispatcher, so the runtime check's profiler never sees them.
"""

from __future__ import annotations

import re

from verifier.api.contract import FailureKind, Strictness
from verifier.static import aten_ops
from verifier.static.rules.base import Findings, Rejection, Rule
from verifier.static.source import Candidate, CppText, search_cpp


CPP_FOREIGN_LIBS = re.compile(
  r"\bcublas\w*\s*\(|\bcudnn\w*\s*\(|\bat::(?:matmul|mm|bmm|addmm|conv\w*|linear)\s*\(|"
  r"\btorch::(?:matmul|mm|bmm|addmm|conv\w*|linear)\s*\("
)

# Kernels called without the dispatcher (no profiler event): at::cpu::clamp_min, at::native::add_out,
# at::_ops::sum::call, at::redispatch::..., and namespace aliases or using-directives for them.
CPP_BACKEND_CALL = re.compile(
  r"\bat\s*::\s*(cpu|cuda|native|meta|mps|compositeexplicitautograd|"
  r"compositeexplicitautogradnonfunctional|compositeimplicitautograd)\s*::\s*(\w+)"
)

CPP_ANY_OP_CALL = re.compile(r"\bat\s*::\s*(_ops|redispatch)\s*::\s*\w+")

CPP_NAMESPACE_ESCAPE = re.compile(
  r"\busing\s+namespace\s+(?:::)?at\s*::\s*(?:cpu|cuda|native|_ops|meta|redispatch)\b|"
  r"\bnamespace\s+\w+\s*=\s*(?:::)?at\s*::\s*(?:cpu|cuda|native|_ops|meta|redispatch)\b|"
  r"\busing\s+(?:::)?at\s*::\s*(?:cpu|native|_ops|meta)\s*::\s*\w+"
)


def _direct_aten(texts: list[CppText]) -> Rejection | None:
  for t in texts:
    for pattern in (CPP_ANY_OP_CALL, CPP_NAMESPACE_ESCAPE):
      m = pattern.search(t.text)
      if m:
        return Rejection(
          FailureKind.DIRECT_ATEN_CALL,
          f"C++ uses {' '.join(m.group(0).split())!r} (line {t.line_of(m.start())}): ATen kernels "
          "called directly skip the dispatcher and the runtime check",
        )
    for m in CPP_BACKEND_CALL.finditer(t.text):
      if aten_ops.is_compute_operator(m.group(2)):
        return Rejection(
          FailureKind.DIRECT_ATEN_CALL,
          f"C++ calls at::{m.group(1)}::{m.group(2)} (line {t.line_of(m.start())}): an ATen kernel "
          "called directly (no dispatcher, invisible to the runtime check) is not an own kernel",
        )
  return None


def foreign_libraries_rule(c: Candidate, strictness: Strictness) -> Findings:
  """No calls into cuBLAS/cuDNN/CUTLASS-style libraries from C++: library compute, not an own kernel."""
  found = search_cpp(CPP_FOREIGN_LIBS, c.texts)
  if not found:
    return []
  call = found[0].group(0).strip()
  return [
    Rejection(
      FailureKind.FOREIGN_KERNELS,
      f"C++ source calls {call!r} (line {found[1]}): library compute, not an own kernel",
      f"C++ calls {call!r}",
    )
  ]


def direct_aten_rule(c: Candidate, strictness: Strictness) -> Findings:
  """No direct ATen kernel calls from C++ (``at::cpu::``, ``at::native::``, ``at::_ops::``): they skip
  the dispatcher, so the runtime check's profiler never sees them."""
  return [r for r in [_direct_aten(c.texts)] if r]


RULES = (
  Rule("foreign_libraries", foreign_libraries_rule, "forbid_torch_compute", warns=True),
  Rule("direct_aten", direct_aten_rule, "forbid_torch_compute", warns=True),
)
