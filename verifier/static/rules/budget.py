"""The alias budget: the other rules are sound only on aliases resolved within their caps."""

from __future__ import annotations

from verifier.api.contract import FailureKind, Strictness
from verifier.static.rules.base import Findings, Rejection, Rule
from verifier.static.rules.timing import patch_rejection
from verifier.static.source import Candidate


def alias_budget_rule(c: Candidate, strictness: Strictness) -> Findings:
  """Alias resolution stays within its caps; a source that passes one is refused (by the patch rule when
  the values found so far show a patch, else as too complex): the rules below would be unsound on it."""
  if not c.overflow:
    return []
  r = patch_rejection(c.tree, c.bound) if strictness.forbid_monkey_patch else None
  return [r or Rejection(FailureKind.SOURCE_TOO_COMPLEX, c.overflow)]


RULES = (Rule("alias_budget", alias_budget_rule),)
