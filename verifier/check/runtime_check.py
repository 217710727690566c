"""Runtime anti-cheating from one profiled forward: see where the work went.

The forward runs in the candidate's process, so the evidence is collected there (``collect_evidence``) and
judged in the checker (``judge``). Native code could forge that evidence; docs/verifier-security.md, "Evidence the candidate cannot forge", says so.
Since issue 37 every call is also judged from evidence below the dispatcher (``call_evidence``: host samples
taken from outside the process, CUPTI device records); on a GPU with device records only the extension-call
count of this profile is used.

The candidate must call its own extension; on GPU, at least one of its own ``__global__`` kernels must
run, and GPU time in other kernels (aten, cuBLAS, cuDNN) beyond allocation/copy/fill kernels must stay
under ``max_foreign_fraction``. Under ``forbid_torch_compute`` any aten operator outside the
allocation/view/shape allow-list is rejected (this catches torch compute called from C++ too). The GPU
analogue of KernelGYM's Triton decoy detector.
"""

from __future__ import annotations

import dataclasses
import re

from verifier.api.contract import FailureKind, Strictness
from verifier.ipc.records import ProfileEvidence
from verifier.static.aten_ops import ALLOWED_ATEN

ALLOWED_KERNEL = re.compile(r"fill|Fill|copy|Copy|memset|Memset|Memcpy|memcpy|zero|CatArray", re.I)


@dataclasses.dataclass
class RuntimeVerdict:
  kind: FailureKind
  reason: str = ""
  own_gpu_us: float = 0.0
  foreign_gpu_us: float = 0.0
  foreign_ops: tuple[str, ...] = ()


def judge(
  evidence: ProfileEvidence,
  device_type: str,
  kernel_names: tuple[str, ...],
  strictness: Strictness,
  device_records: bool = False,
) -> RuntimeVerdict:
  """The runtime verdict from a profiled forward's evidence (rules in the module docstring). With
  ``device_records`` (a GPU whose every call is judged from CUPTI records, ``device_evidence``) the
  forward was not profiled: only its calls into the candidate's extension are judged here."""
  if evidence.extension_calls <= 0:
    return RuntimeVerdict(
      FailureKind.KERNEL_NOT_LAUNCHED,
      "forward never called a function of the candidate's own extension",
    )
  if device_records:
    return RuntimeVerdict(FailureKind.OK)
  own_patterns = [re.compile(rf"\b{re.escape(k)}\b") for k in kernel_names]
  own_us = foreign_us = 0.0
  for name, t in evidence.gpu_kernels.items():
    if any(p.search(name) for p in own_patterns):
      own_us += t
    elif not ALLOWED_KERNEL.search(name):
      foreign_us += t
  ops = tuple(sorted(o for o in evidence.aten_ops if o[6:] not in ALLOWED_ATEN))
  if device_type == "cuda" and own_us <= 0:
    return RuntimeVerdict(
      FailureKind.KERNEL_NOT_LAUNCHED,
      f"none of the candidate's kernels ({', '.join(kernel_names) or 'none found'}) ran on the GPU",
      own_us,
      foreign_us,
      ops,
    )
  total = own_us + foreign_us
  if total > 0 and foreign_us / total > strictness.max_foreign_fraction:
    return RuntimeVerdict(
      FailureKind.FOREIGN_KERNELS,
      f"{100 * foreign_us / total:.0f}% of GPU time in kernels not built from the candidate "
      f"(allowed {100 * strictness.max_foreign_fraction:.0f}%); aten ops: {', '.join(ops) or '-'}",
      own_us,
      foreign_us,
      ops,
    )
  if ops and strictness.forbid_torch_compute:
    return RuntimeVerdict(
      FailureKind.TORCH_COMPUTE,
      f"forward ran torch compute ops: {', '.join(ops)}",
      own_us,
      foreign_us,
      ops,
    )
  return RuntimeVerdict(FailureKind.OK, "", own_us, foreign_us, ops)
