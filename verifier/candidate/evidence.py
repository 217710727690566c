"""Runtime evidence, collected in the candidate's process: profile one forward and report what ran
(calls into the candidate's own extension, GPU kernels with their device time, aten operators). The
checker judges it (``verifier.check.runtime_check.judge``) and never believes it as proof: native code
could forge it."""

from __future__ import annotations

import torch

from verifier.ipc.records import ProfileEvidence


def _device_time_us(e) -> float:
  for attr in ("device_time", "cuda_time"):
    v = getattr(e, attr, None)
    if v:
      return float(v)
  try:
    return float(e.time_range.elapsed_us())
  except AttributeError:
    return 0.0


MAX_EVIDENCE_NAMES = 4096


def collect_evidence(
  run_forward, device: torch.device, extension_calls: dict[str, int]
) -> tuple[ProfileEvidence, object]:
  """Profile one forward (``run_forward()``) in the candidate's process and report what ran: calls into the
  candidate's own extension, GPU kernels with their device time, and aten operators. The verdict is the
  checker's (``judge``)."""
  from torch.profiler import ProfilerActivity, profile

  activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
  calls_before = sum(extension_calls.values())
  with torch.no_grad(), profile(activities=activities) as prof:
    out = run_forward()
    if device.type == "cuda":
      torch.cuda.synchronize()
  kernels: dict[str, float] = {}
  ops: set[str] = set()
  for e in prof.events():
    if str(getattr(e, "device_type", "")).endswith("CUDA"):
      if len(kernels) < MAX_EVIDENCE_NAMES or e.name in kernels:
        kernels[e.name] = kernels.get(e.name, 0.0) + _device_time_us(e)
    elif e.name.startswith("aten::") and len(ops) < MAX_EVIDENCE_NAMES:
      ops.add(e.name)
  evidence = ProfileEvidence(
    extension_calls=sum(extension_calls.values()) - calls_before,
    gpu_kernels=kernels,
    aten_ops=tuple(sorted(ops)),
  )
  return evidence, out
