"""What a static rule is: a named check of a ``Candidate`` whose docstring is its reason."""

from __future__ import annotations

import dataclasses
import typing

from verifier.api.contract import FailureKind, Strictness
from verifier.static.source import Candidate


@dataclasses.dataclass(frozen=True)
class Rejection:
  kind: FailureKind
  reason: str
  warning: str = ""  # what a strictness that only warns records ("": the reason)


Findings = list[Rejection]


@dataclasses.dataclass(frozen=True)
class Rule:
  """A named rule: ``check`` (its docstring is the reason) rejects a candidate when the strictness
  flag ``flag`` is set (under every strictness when None); when the flag is off and ``warns``, its
  findings become warnings instead (KernelBench's WARNING_CHECKS)."""

  name: str
  check: typing.Callable[[Candidate, Strictness], Findings]
  flag: str | None = None
  warns: bool = False

  def applies(self, strictness: Strictness) -> bool:
    """Whether the rule rejects under ``strictness``."""
    return self.flag is None or getattr(strictness, self.flag)

  @property
  def rationale(self) -> str:
    return " ".join((self.check.__doc__ or "").split())

  @property
  def family(self) -> str:
    """The module of ``verifier.static.rules`` it belongs to."""
    return self.check.__module__.rsplit(".", 1)[-1]
