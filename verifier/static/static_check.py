"""Static anti-cheating checks on a candidate's source, before anything runs.

The rule set follows KernelBench's ``kernel_static_checker.py`` (STRICT: try/except bypass, timer
patching, thread injection, lazy tensor subclasses, "requires __global__ and load_inline"; WARNING:
torch compute ops, stream injection) (github.com/ScalingIntelligence/KernelBench,
``src/kernelbench/kernel_static_checker.py``), but works on the Python AST instead of regexes where it
can, and checks that a defined kernel is also launched. The rules are named, one module per family,
in ``verifier.static.rules`` (the registry: ``RULES``, ``STRICT_RULES``, ``WARNING_RULES``).

The check terminates by construction in bounded time and memory on any text (issue 24): the source,
its AST's node count and nesting depth have limits (``SourceLimits``, ``verifier.static.source``;
beyond them the verdict is SOURCE_TOO_COMPLEX), alias resolution has explicit caps (``MAX_ALIAS_*``,
``verifier.static.aliases``; passing one is that verdict too), and every regex is linear (bounded
repetitions; comments and launches are found by scanning, not by backtracking). The service runs it in
a separate process under a deadline besides (``static_worker``).
"""

from __future__ import annotations

from verifier.api.contract import Strictness
from verifier.static.aliases import MAX_ALIAS_PARTS, MAX_ALIAS_VALUES, MAX_ALIAS_WORK
from verifier.static.aliases import bindings as _bindings
from verifier.static.rules import RULES, STRICT_RULES, WARNING_RULES, rules_for, run_rules
from verifier.static.rules.base import Rejection, Rule
from verifier.static.source import LIMITS, Candidate, SourceLimits, StaticVerdict, read_candidate

__all__ = [
  "LIMITS",
  "MAX_ALIAS_PARTS",
  "MAX_ALIAS_VALUES",
  "MAX_ALIAS_WORK",
  "RULES",
  "STRICT_RULES",
  "WARNING_RULES",
  "Candidate",
  "Rejection",
  "Rule",
  "SourceLimits",
  "StaticVerdict",
  "_bindings",
  "check_candidate",
  "rules_for",
]


def check_candidate(source: str, strictness: Strictness, device: str) -> StaticVerdict:
  """Parse and statically check a candidate; the first rule (``RULES``) with a finding decides the kind."""
  read = read_candidate(source, device, LIMITS)
  return read if isinstance(read, StaticVerdict) else run_rules(read, strictness)
