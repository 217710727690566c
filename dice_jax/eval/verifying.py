"""The evaluation's one seam to the verifier service (docs/architecture.md: the learner talks to it only through the
generated stubs and one learner-side client).

``CandidateVerifier`` is what the evaluation loop needs; ``GrpcCandidateVerifier`` implements it with
the learner's face of the one client, ``dice_jax.verifier_client.ThreadedVerifier`` (the only module here
that knows it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from absl import logging

from verifier.api.contract import VerifyResult
from verifier.api.waiting import VERIFIER_WAIT_S

# KernelBench's evaluation settings (eval_from_generations.py: 5 correctness trials, 100 timing
# trials, 180 s timeout; 3 warm-ups) with DICE's tolerance (atol = rtol = 1e-2).
EVAL_OPTIONS = {
  "measure_performance": True,
  "num_correct_trials": 5,
  "num_perf_trials": 100,
  "num_warmup": 3,
  "atol": 1e-2,
  "rtol": 1e-2,
  "timeout_s": 180.0,
  "strictness": "strict",
}


@dataclasses.dataclass(frozen=True)
class Verdict:
  """The verifier's answer on one candidate, as the evaluation records it."""

  compiled: bool
  correct: bool
  deceptive: bool
  failure_kind: str  # upper case, as the service's FailureKind ("OK", "COMPILE_ERROR", ...)
  reason: str = ""
  speedup: float = 0.0
  candidate_ms: float = 0.0
  baseline_ms: float = 0.0
  strict_correct: bool = False
  device_name: str = ""
  compile_s: float = 0.0
  run_s: float = 0.0


Item = tuple[str, str, str]  # (task id, reference source, candidate source)


class CandidateVerifier(Protocol):
  def verify(self, item: Item, compile_baseline: bool = False) -> Verdict:
    """The verdict on one candidate (blocking; called from several threads at once);
    ``compile_baseline`` times ``torch.compile(reference)`` as the baseline instead of eager."""
    ...


def _verdict(o: VerifyResult) -> Verdict:
  return Verdict(
    compiled=o.compiled,
    correct=o.correct,
    deceptive=o.deceptive,
    failure_kind=o.failure_kind.value,
    reason=o.reason,
    speedup=o.speedup,
    candidate_ms=o.candidate.mean_ms,
    baseline_ms=o.baseline.mean_ms,
    strict_correct=o.strict_correct,
    device_name=o.device_name,
    compile_s=o.compile_s,
    run_s=o.run_s,
  )


class GrpcCandidateVerifier:
  """Verifies batches through ``dice_jax.verifier_client.ThreadedVerifier`` (several endpoints,
  retries, content-hash request ids), once the endpoints answer (up to ``ready_timeout_s``, with
  progress lines to ``report``, default the log; ``ConnectionError`` after that)."""

  def __init__(
    self,
    addresses: Sequence[str],
    options: Mapping[str, Any],
    token: str | None = None,
    ready_timeout_s: float = VERIFIER_WAIT_S,
    report: Callable[[str], None] = logging.info,
  ):
    from dice_jax.verifier_client import ThreadedVerifier
    from verifier.api.client import VerifierUnavailable

    if not addresses:
      raise ValueError("no verifier address given (HOST:PORT[,HOST:PORT...])")
    self.options = dict(options)
    self._clients: dict[bool, Any] = {}
    try:
      for compile_baseline in (False, True):
        opts = dict(self.options, compile_baseline=compile_baseline)
        self._clients[compile_baseline] = ThreadedVerifier(
          list(addresses), options=opts, token=token
        )
      self._clients[False].wait_ready(ready_timeout_s, report)
    except VerifierUnavailable as e:
      self.close()
      raise ConnectionError(str(e)) from None

  def verify(self, item: Item, compile_baseline: bool = False) -> Verdict:
    return _verdict(self._clients[compile_baseline].verify(*item))

  def close(self) -> None:
    for c in self._clients.values():
      c.close()
