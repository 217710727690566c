"""Lazy outputs: no tensor subclasses whose values are computed when compared.

KernelBench's STRICT ``lazy_eval``: an output that is a ``torch.Tensor`` subclass (or hooks
``__torch_function__``) does its work, or fakes it, inside the correctness check, off the clock.
"""

from __future__ import annotations

import ast
import re

from verifier.api.contract import FailureKind, Strictness
from verifier.static.aliases import may_be, resolve
from verifier.static.rules.base import Findings, Rejection, Rule
from verifier.static.source import Candidate
from verifier.static.syntax import dotted


def lazy_output_rule(c: Candidate, strictness: Strictness) -> Findings:
  """No torch.Tensor subclasses or tensor-subclass hooks: a lazy output computes when compared."""
  for node in ast.walk(c.tree):
    if isinstance(node, ast.ClassDef):
      for b in node.bases:
        if any(may_be(v, "torch.Tensor") for v in resolve(dotted(b), c.bound)) or dotted(b) in (
          "torch.Tensor",
          "Tensor",
        ):
          return [
            Rejection(
              FailureKind.LAZY_OUTPUT,
              f"class {node.name} subclasses torch.Tensor (line {node.lineno})",
            )
          ]
  if re.search(r"_make_subclass|__torch_function__|__torch_dispatch__", c.source):
    return [
      Rejection(
        FailureKind.LAZY_OUTPUT, "uses tensor-subclass hooks (_make_subclass/__torch_function__)"
      )
    ]
  return []


RULES = (Rule("lazy_output", lazy_output_rule, "forbid_monkey_patch"),)
