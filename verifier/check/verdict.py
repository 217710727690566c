"""How a check ends early: the exceptions raised deep inside the protocol and caught by ``Check.run``."""

from __future__ import annotations

from verifier.api.contract import FailureKind


class Verdict(Exception):
  """The check ends here with this kind (raised from deep inside the protocol)."""

  def __init__(self, kind: FailureKind, reason: str = ""):
    super().__init__(reason)
    self.kind, self.reason = kind, reason


class CandidateGone(Exception):
  pass
