"""Torch compute: the forward path allocates, views and launches; torch does none of its arithmetic.

KernelBench's WARNING ``torch_computation_ops`` (and ``pytorch_wrap``), on the AST and through
aliases: a call by another name (``f = torch.relu``) is a call.
"""

from __future__ import annotations

import ast

from verifier.api.contract import FailureKind, Strictness
from verifier.static import aten_ops
from verifier.static.aliases import Bound, resolve
from verifier.static.rules.base import Findings, Rejection, Rule
from verifier.static.source import LOAD_CALLS, Candidate
from verifier.static.syntax import dotted, node_line

# Calls under torch.* / F.* that only allocate, view or describe shape (no arithmetic on data).
ALLOWED_TORCH_CALLS = frozenset(
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
    "tensor",
    "as_tensor",
    "from_numpy",
    "arange",
    "Size",
    "no_grad",
    "inference_mode",
    "device",
    "dtype",
    "is_tensor",
    "numel",
    "reshape",
    "flatten",
    "unflatten",
    "squeeze",
    "unsqueeze",
    "permute",
    "transpose",
    "t",
    "narrow",
    "split",
    "chunk",
    "unbind",
    "select",
    "movedim",
    "broadcast_to",
    "view_as_real",
    "view_as_complex",
    "contiguous_format",
    "channels_last",
    "get_default_dtype",
    "is_grad_enabled",
    "current_stream",
    "current_device",
    "get_device_properties",
    "synchronize",
    "is_available",
    "set_grad_enabled",
    "manual_seed",
    "empty_cache",
    "finfo",
    "iinfo",
  }
)

# Tensor methods that compute on data; calling them in the forward path is using torch, not a kernel.
COMPUTE_METHODS = frozenset(
  {
    "matmul",
    "mm",
    "bmm",
    "addmm",
    "baddbmm",
    "einsum",
    "sum",
    "mean",
    "prod",
    "max",
    "min",
    "amax",
    "amin",
    "argmax",
    "argmin",
    "relu",
    "relu_",
    "sigmoid",
    "tanh",
    "softmax",
    "log_softmax",
    "exp",
    "log",
    "pow",
    "sqrt",
    "rsqrt",
    "abs",
    "clamp",
    "clamp_",
    "clip",
    "add",
    "add_",
    "sub",
    "sub_",
    "mul",
    "mul_",
    "div",
    "div_",
    "norm",
    "var",
    "std",
    "cumsum",
    "cumprod",
    "sort",
    "topk",
    "softplus",
    "gelu",
    "conv2d",
    "logsumexp",
    "masked_fill",
    "where",
    "gather",
    "scatter",
    "scatter_add",
    "index_select",
    "tril",
    "triu",
    "diag",
    "outer",
    "dot",
    "mv",
    "neg",
    "reciprocal",
    "sin",
    "cos",
    "erf",
    "any",
    "all",
    "logical_and",
    "logical_or",
    "logical_xor",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "floor",
    "ceil",
    "round",
    "sign",
    "square",
    "minimum",
    "maximum",
    "lerp",
    "addcmul",
    "addcdiv",
    "kthvalue",
    "median",
    "mode",
    "nonzero",
  }
)

TASK_FUNCTIONS = frozenset({"get_inputs", "get_init_inputs"})


def _extension_names(tree: ast.AST) -> set[str]:
  """Names bound to extension modules: ``ext = load_inline(...)`` and ``self.ext = ext``."""
  names: set[str] = set()
  assigns = [n for n in ast.walk(tree) if isinstance(n, ast.Assign)]
  for n in assigns:
    if isinstance(n.value, ast.Call) and dotted(n.value.func).split(".")[-1] in LOAD_CALLS:
      names.update(dotted(t) for t in n.targets if dotted(t))
  for n in assigns:  # one level of aliasing, e.g. self.ops = ops
    if dotted(n.value) in names:
      names.update(dotted(t) for t in n.targets if dotted(t))
  return names


def _skipped_scopes(tree: ast.Module, cls: ast.ClassDef) -> list[ast.AST]:
  """``ModelNew.__init__`` (builds the model once) and ``get_inputs``/``get_init_inputs`` when nothing of
  the candidate names them (the verifier never calls the candidate's)."""
  named = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
  return [
    item
    for item in cls.body
    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == "__init__"
  ] + [
    item
    for item in tree.body
    if isinstance(item, ast.FunctionDef) and item.name in TASK_FUNCTIONS and item.name not in named
  ]


def _compute_scope_calls(tree: ast.Module, cls: ast.ClassDef) -> list[ast.Call]:
  """Calls in every function of the module (any of them may run in the forward: module-level helpers,
  other classes' methods, lambdas), except ``ModelNew.__init__``, which builds the model once, and the
  task's own ``get_inputs``/``get_init_inputs`` when nothing of the candidate names them (the verifier
  never calls the candidate's)."""
  init = {id(n) for item in _skipped_scopes(tree, cls) for n in ast.walk(item)}
  calls: list[ast.Call] = []
  for fn in ast.walk(tree):
    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and id(fn) not in init:
      body = fn.body if isinstance(fn.body, list) else [fn.body]
      for stmt in body:
        calls += [n for n in ast.walk(stmt) if isinstance(n, ast.Call) and id(n) not in init]
  return list({id(c): c for c in calls}.values())


def _compute_references(tree: ast.Module, cls: ast.ClassDef, bound: Bound) -> list[tuple]:
  """(node, name) for each torch compute function referenced without being called there
  (``forward = torch.relu`` in a class body, ``map(F.relu, xs)``): a call by another name the call rules
  cannot see. Outside ``ModelNew.__init__`` and the task's own input functions."""
  skipped = {id(n) for n in _skipped_scopes(tree, cls) for n in ast.walk(n)}
  called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
  found = []
  for node in ast.walk(tree):
    if id(node) in skipped or id(node) in called:
      continue
    if not isinstance(node, (ast.Attribute, ast.Name)) or not isinstance(node.ctx, ast.Load):
      continue
    name = dotted(node)
    for value in resolve(name, bound) or [name]:
      parts = value.split(".")
      if (
        parts[0] == "torch"
        and len(parts) >= 2
        and parts[1] != "cuda"
        and parts[-1] not in ALLOWED_TORCH_CALLS
        and aten_ops.is_compute_operator(parts[-1])
      ):
        found.append((node, name))
        break
  return found


def compute_references_rule(c: Candidate, strictness: Strictness) -> Findings:
  """No torch compute function referred to outside a call in the forward path: torch compute by another
  name."""
  return [
    Rejection(
      FailureKind.TORCH_COMPUTE,
      f"refers to {name} (line {node_line(node)}) outside a call: torch compute by another name",
    )
    for node, name in _compute_references(c.tree, c.cls, c.bound)
  ]


def compute_calls_rule(c: Candidate, strictness: Strictness) -> Findings:
  """The forward path calls only allocation/view/shape torch ops (``ALLOWED_TORCH_CALLS``) and the
  candidate's own extension (calls into it are fine)."""
  out = []
  exported, extensions = set(c.functions), _extension_names(c.tree)
  for call in _compute_scope_calls(c.tree, c.cls):
    name = dotted(call.func)
    parts = name.split(".")
    offending = ""
    if isinstance(call.func, ast.Attribute) and (
      call.func.attr in exported or dotted(call.func.value) in extensions
    ):
      continue
    # Every torch path it may stand for ("torch.*" may be any torch function, not only torch.cuda).
    resolved = [
      r.split(".") for r in resolve(name, c.bound) if r.startswith("torch.") and parts[0] != "self"
    ]
    if parts[0] in ("torch", "F") and len(parts) >= 2 or resolved:
      leaf = parts[-1]
      if parts[:2] == ["torch", "cuda"] or (
        resolved and all(r[:2] == ["torch", "cuda"] for r in resolved)
      ):
        continue
      if leaf in ALLOWED_TORCH_CALLS or leaf in LOAD_CALLS:
        continue
      offending = name
    elif (
      isinstance(call.func, ast.Attribute)
      and call.func.attr in COMPUTE_METHODS
      and parts[0] != "self"
    ):
      offending = f".{call.func.attr}()"
    elif (
      isinstance(call.func, ast.Attribute) and call.func.attr in COMPUTE_METHODS and len(parts) == 2
    ):
      offending = f".{call.func.attr}()"
    if offending:
      out.append(
        Rejection(
          FailureKind.TORCH_COMPUTE,
          f"forward path calls {offending} (line {call.lineno}); only allocation/view/shape torch "
          "ops are allowed",
          f"forward path calls {offending}",
        )
      )
  return out


RULES = (
  Rule("compute_references", compute_references_rule, "forbid_torch_compute", warns=True),
  Rule("compute_calls", compute_calls_rule, "forbid_torch_compute", warns=True),
)
