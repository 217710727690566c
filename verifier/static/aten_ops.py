"""Names of ATen operators, read from the installed torch's headers (no ``import torch``).

Used by the static check to recognise C++ that calls a kernel directly (``at::cpu::clamp_min``,
``at::native::add_out``, ``at::_ops::sum::call``): such calls skip the dispatcher, so the profiler behind
the runtime check never sees them. ``include/ATen/ops`` has one header family per operator
(``<op>.h``, ``<op>_ops.h``, ``<op>_native.h``, ``<op>_<backend>_dispatch.h``); the operator names are the
file stems.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re

_STEM = re.compile(
  r"^(\w+?)(?:_ops|_native|_meta|_(?:cpu|cuda|meta|mps|compositeexplicitautograd"
  r"|compositeexplicitautogradnonfunctional|compositeimplicitautograd"
  r"|compositeimplicitautogradnestedtensor)_dispatch)?\.h$"
)
# Operators that only allocate, view or copy: calling them directly is not computing with torch.
ALLOCATION_OPS = frozenset(
  {
    "empty",
    "empty_like",
    "empty_strided",
    "zeros",
    "zeros_like",
    "ones",
    "ones_like",
    "full",
    "full_like",
    "resize",
    "as_strided",
    "view",
    "reshape",
    "contiguous",
    "copy",
    "fill",
    "zero",
    "set",
    "detach",
    "alias",
    "squeeze",
    "unsqueeze",
    "permute",
    "transpose",
    "expand",
    "select",
    "slice",
    "narrow",
  }
)

# Operators a profiled forward may run (the runtime check) and a built extension may call (the artefact
# check): allocation, views, shape queries and copies.
ALLOWED_ATEN = frozenset(
  {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "zeros",
    "zeros_like",
    "new_zeros",
    "ones",
    "ones_like",
    "new_ones",
    "full",
    "full_like",
    "new_full",
    "fill_",
    "zero_",
    "resize_",
    "set_",
    "view",
    "_reshape_alias",
    "reshape",
    "_unsafe_view",
    "as_strided",
    "contiguous",
    "clone",
    "copy_",
    "to",
    "_to_copy",
    "detach",
    "detach_",
    "alias",
    "lift_fresh",
    "squeeze",
    "unsqueeze",
    "permute",
    "transpose",
    "t",
    "expand",
    "expand_as",
    "flatten",
    "unflatten",
    "select",
    "slice",
    "narrow",
    "split",
    "split_with_sizes",
    "chunk",
    "unbind",
    "view_as",
    "movedim",
    "size",
    "stride",
    "numel",
    "dim",
    "is_contiguous",
    "item",
    "_local_scalar_dense",
    "result_type",
    "_has_compatible_shallow_copy_type",
    "empty_cache",
    "record_stream",
    "scalar_tensor",
    "arange",
    "resolve_conj",
    "resolve_neg",
    "_copy_from",
    "_copy_from_and_resize",
    "is_nonzero",
    "set_grad_enabled",
    "cat",
    "stack",
  }
)


def torch_include_dir() -> str:
  spec = importlib.util.find_spec("torch")
  if spec is None or not spec.origin:
    return ""
  return os.path.join(os.path.dirname(spec.origin), "include", "ATen", "ops")


@functools.lru_cache(maxsize=1)
def operator_names() -> frozenset[str]:
  """Every ATen operator name of the installed torch (empty if its headers are not installed)."""
  d = torch_include_dir()
  try:
    files = os.listdir(d)
  except OSError:
    return frozenset()
  return frozenset(m.group(1) for f in files if (m := _STEM.match(f)))


def base_operator(name: str) -> str:
  """``clamp_min_outf`` -> ``clamp_min``; ``add_`` -> ``add``: the operator a function variant belongs to."""
  for suffix in ("_outf", "_out", "_symint", "_"):
    if name.endswith(suffix) and name[: -len(suffix)]:
      name = name[: -len(suffix)]
  return name


def is_compute_operator(name: str, ops: frozenset[str] | None = None) -> bool:
  """Whether ``name`` (a function in an ``at::<backend>::`` namespace) is an ATen operator that computes."""
  ops = operator_names() if ops is None else ops
  base = base_operator(name)
  return (name in ops or base in ops) and base not in ALLOCATION_OPS and name not in ALLOCATION_OPS
