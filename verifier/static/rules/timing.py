"""Timing: no assignment into torch, timers, builtins or os under any alias.

KernelBench's STRICT ``timing_event_patch``: a candidate that rebinds ``time.perf_counter`` or
``torch.cuda.Event.elapsed_time`` (or ``torch.allclose``) fakes its speed or its correctness.
"""

from __future__ import annotations

import ast

from verifier.api.contract import FailureKind, Strictness
from verifier.static.aliases import Bound, resolve
from verifier.static.rules.base import Findings, Rejection, Rule
from verifier.static.source import Candidate
from verifier.static.syntax import dotted, node_line

# Roots whose attributes a candidate may not assign: timers, builtins, numpy, os. Names bound to anything
# imported from torch (whatever the alias) are added per candidate.
PATCH_ROOTS = frozenset({"time", "builtins", "np", "numpy", "os", "sys", "math", "random"})


def patch_rejection(tree: ast.AST, bound: Bound) -> Rejection | None:
  """Assignment to (or deletion of) an attribute of anything imported from torch / timers / os, under any
  alias, or of an expression that is not a plain name (``type(x).sum = ...``)."""
  for node in ast.walk(tree):
    if isinstance(node, ast.Assign):
      targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
      targets = [node.target]
    elif isinstance(node, ast.Delete):
      targets = node.targets
    else:
      continue
    flat = []
    for t in targets:
      flat += list(t.elts) if isinstance(t, (ast.Tuple, ast.List)) else [t]
    for t in flat:
      if isinstance(t, ast.Subscript):
        t = t.value
      if not isinstance(t, ast.Attribute):
        continue
      name = dotted(t)
      if not name:
        return Rejection(
          FailureKind.MONKEY_PATCH,
          f"assigns to attribute .{t.attr} of an expression (line {node_line(node)})",
        )
      owner = name.rsplit(".", 1)[0]  # the object whose attribute changes
      roots = {"torch"} | PATCH_ROOTS
      sources = [s for s in resolve(owner, bound) if s.split(".")[0] in roots]
      if owner.split(".")[0] in PATCH_ROOTS or sources:
        source = sources[0] if sources else ""
        shown = name if source in ("", owner) else f"{name} ({owner} may be {source})"
        return Rejection(FailureKind.MONKEY_PATCH, f"assigns to {shown} (line {node_line(node)})")
  return None


def monkey_patch_rule(c: Candidate, strictness: Strictness) -> Findings:
  """No assignment into torch, timers or builtins under any alias: it fakes results or timings."""
  return [r for r in [patch_rejection(c.tree, c.bound)] if r]


RULES = (Rule("monkey_patch", monkey_patch_rule, "forbid_monkey_patch"),)
