"""The static check's rules, by name and in order; one module per family of rules.

Like KernelBench's ``kernel_static_checker.py`` (a named list of STRICT checks that are errors and of
WARNING checks that only warn), every rule here has a name and its reason (the docstring of its
check). ``STRICT_RULES`` reject wherever they run; ``WARNING_RULES`` reject under a strictness that
sets their flag and are reported as warnings under one that does not. The first rule in ``RULES``
with a finding decides the verdict's kind.

  imports        imports                                  (modules that escape or inspect)
  introspection  introspection, builtin_aliases,          (frames, other scopes, the profiler)
                 sys_modules, profiler
  threads        openmp, streams                          (work off the timed stream)
  budget         alias_budget                             (aliases within their caps)
  bypass         fallback                                 (a path around the kernel)
  timing         monkey_patch                             (rebinding timers, torch, builtins)
  lazy           lazy_output                              (outputs computed when compared)
  kernel         own_kernel                               (an extension with a launched kernel)
  library        foreign_libraries, direct_aten           (cuBLAS/cuDNN, ATen kernels)
  compute        compute_references, compute_calls        (torch doing the arithmetic)
"""

from __future__ import annotations

from verifier.api.contract import FailureKind, Strictness
from verifier.static.rules import (
  budget,
  bypass,
  compute,
  imports,
  introspection,
  kernel,
  lazy,
  library,
  threads,
  timing,
)
from verifier.static.rules.base import Rule
from verifier.static.source import Candidate, StaticVerdict, too_complex

FAMILIES = (imports, introspection, threads, budget, bypass, timing, lazy, kernel, library, compute)
_BY_NAME = {rule.name: rule for family in FAMILIES for rule in family.RULES}
# In order: the first rule with a finding decides the kind.
ORDER = (
  "imports",
  "introspection",
  "builtin_aliases",
  "sys_modules",
  "profiler",
  "openmp",
  "alias_budget",
  "fallback",
  "monkey_patch",
  "lazy_output",
  "streams",
  "own_kernel",
  "foreign_libraries",
  "direct_aten",
  "compute_references",
  "compute_calls",
)
RULES: tuple[Rule, ...] = tuple(_BY_NAME[name] for name in ORDER)
STRICT_RULES = tuple(r.name for r in RULES if not r.warns)
WARNING_RULES = tuple(r.name for r in RULES if r.warns)


def rules_for(strictness: Strictness) -> list[str]:
  """The names of the rules that reject under ``strictness`` (the others run only to warn, or not)."""
  return [r.name for r in RULES if r.applies(strictness)]


def run_rules(c: Candidate, strictness: Strictness) -> StaticVerdict:
  """The verdict of ``RULES`` on ``c``: the first rule that applies and finds something decides
  the kind; rules that do not apply but warn add their findings as warnings."""
  warnings: list[str] = []
  for rule in RULES:
    if rule.applies(strictness):
      found = rule.check(c, strictness)
      if found and found[0].kind is FailureKind.SOURCE_TOO_COMPLEX:
        return too_complex(found[0].reason)
      if found:
        return StaticVerdict(
          found[0].kind, found[0].reason, tuple(warnings), c.kernels, tuple(c.functions)
        )
    elif rule.warns:
      warnings += [r.warning or r.reason for r in rule.check(c, strictness)]
  return StaticVerdict(FailureKind.OK, "", tuple(warnings), c.kernels, tuple(c.functions))
