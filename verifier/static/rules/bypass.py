"""Bypass: no fallback path around the kernel.

KernelBench's STRICT ``code_bypass`` (from the Kevin RL paper, arXiv:2507.11948): a try/except that
runs the reference when the kernel fails, or a ModelNew that inherits the reference ``Model``.
"""

from __future__ import annotations

import ast

from verifier.api.contract import FailureKind, Strictness
from verifier.static.rules.base import Findings, Rejection, Rule
from verifier.static.source import Candidate
from verifier.static.syntax import dotted


def fallback_rule(c: Candidate, strictness: Strictness) -> Findings:
  """No try/except (a fallback path around the kernel) and ModelNew subclasses nn.Module only (not the
  reference Model)."""
  for node in ast.walk(c.tree):
    if isinstance(node, ast.Try) or (hasattr(ast, "TryStar") and isinstance(node, ast.TryStar)):
      return [
        Rejection(
          FailureKind.FALLBACK, f"try/except at line {node.lineno}: no fallback paths allowed"
        )
      ]
  for base in c.cls.bases:
    if dotted(base) not in ("nn.Module", "torch.nn.Module", "Module"):
      return [
        Rejection(
          FailureKind.FALLBACK,
          f"ModelNew must subclass nn.Module only, not {dotted(base) or '?'} (line {c.cls.lineno})",
        )
      ]
  return []


RULES = (Rule("fallback", fallback_rule, "forbid_fallback"),)
