"""Tensor helpers both processes of a check use: seed the generators alike, flatten nested outputs, copy or
move arguments, and poison freed outputs (NaN) so a no-op kernel cannot return a stale result (a hack pattern KernelBench v0.1 and robust-kbench describe)."""

from __future__ import annotations

import torch


def set_seed(seed: int) -> None:
  """``torch.manual_seed``'s streams for the CPU and CUDA generators alone: the same draws in the checker's
  reference and the candidate's forward, without its walk of every other backend (a formatted stack per
  backend not yet initialised: 0.07-0.3 ms, once per timed call in each process)."""
  torch.default_generator.manual_seed(seed)
  if torch.cuda.is_available():
    torch.cuda.manual_seed_all(seed)


def flatten(out) -> list:
  if isinstance(out, (tuple, list)):
    return [leaf for item in out for leaf in flatten(item)]
  if isinstance(out, dict):
    return [leaf for k in sorted(out) for leaf in flatten(out[k])]
  return [out]


def clone_args(args: list) -> list:
  return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def to_device(args: list, device: torch.device) -> list:
  return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def storages_of(*modules) -> set[int]:
  """Storage addresses of the modules' parameters and buffers (never poisoned)."""
  return {
    t.untyped_storage().data_ptr()
    for m in modules
    for t in list(m.parameters()) + list(m.buffers())
  }


def poison(values, keep: set[int] = frozenset()) -> None:
  """Overwrite tensors we are about to free so reused memory holds NaN, not a valid result. Outputs that
  alias a model's parameters or buffers (``keep``) are left alone; one that requires grad is poisoned
  through a detached view of it (it once was spared: red team 42, Hole E2 returned its output so)."""
  for t in flatten(values):
    if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in keep:
      t = t.detach()  # the same memory; an in-place fill of a leaf that requires grad raises
      try:
        if t.is_floating_point() or t.is_complex():
          t.fill_(float("nan"))
        elif t.dtype != torch.bool:
          t.fill_(-1)
      except RuntimeError:
        pass  # non-writable views (expanded) are left alone


def empty_caches(device: torch.device) -> None:
  if device.type == "cuda":
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
