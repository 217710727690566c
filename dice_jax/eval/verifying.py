"""The evaluation's one seam to the verifier service (DESIGN.md: the learner talks to it only through the
generated stubs and one learner-side client).

``CandidateVerifier`` is what the evaluation loop needs; ``GrpcCandidateVerifier`` implements it with
the learner-side client ``dice_jax.rl.verifier_client.GrpcVerifierClient`` (one per endpoint; a batch
is split across endpoints). When the multi-endpoint client ``dice_jax/verifier_client.py`` lands, only
``GrpcCandidateVerifier`` changes.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

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
  def verify_batch(self, items: Sequence[Item], compile_baseline: bool = False) -> list[Verdict]:
    """Verdicts in item order; ``compile_baseline`` times ``torch.compile(reference)`` instead."""
    ...


def _verdict(o) -> Verdict:
  return Verdict(
    compiled=o.compiled,
    correct=o.correct,
    deceptive=o.deceptive,
    failure_kind=o.failure_kind.upper(),
    reason=o.reason,
    speedup=o.speedup,
    candidate_ms=o.candidate_ms,
    baseline_ms=o.baseline_ms,
    strict_correct=o.strict_correct,
    device_name=o.device_name,
    compile_s=o.compile_s,
    run_s=o.run_s,
  )


class GrpcCandidateVerifier:
  """Verifies batches on one or more verifier endpoints (``HOST:PORT``), splitting each batch evenly."""

  def __init__(
    self,
    addresses: Sequence[str],
    options: Mapping[str, Any],
    token: str | None = None,
    ready_timeout_s: float = 60.0,
  ):
    from dice_jax.rl.verifier_client import GrpcVerifierClient

    if not addresses:
      raise ValueError("no verifier address given (HOST:PORT[,HOST:PORT...])")
    self.addresses = list(addresses)
    self.options = dict(options)
    self._clients = {}
    for compile_baseline in (False, True):
      opts = dict(self.options, compile_baseline=compile_baseline)
      self._clients[compile_baseline] = [
        GrpcVerifierClient(a, opts, token=token) for a in self.addresses
      ]
    for c in self._clients[False]:
      try:
        c.wait_ready(ready_timeout_s)
      except Exception as e:  # grpc's FutureTimeoutError says nothing about the address
        self.close()
        raise ConnectionError(
          f"verifier at {c.address} not reachable within {ready_timeout_s:g} s"
        ) from e
    self._pool = concurrent.futures.ThreadPoolExecutor(len(self.addresses))

  def verify_batch(self, items: Sequence[Item], compile_baseline: bool = False) -> list[Verdict]:
    if not items:
      return []
    clients = self._clients[compile_baseline]
    chunks = [list(items[i :: len(clients)]) for i in range(len(clients))]
    futures = [self._pool.submit(c.verify_batch, ch) for c, ch in zip(clients, chunks) if ch]
    parts = [f.result() for f in futures]
    out: list[Verdict | None] = [None] * len(items)
    for i, part in enumerate(parts):
      for j, o in enumerate(part):
        out[i + j * len(clients)] = _verdict(o)
    return out  # type: ignore[return-value]

  def close(self) -> None:
    for cs in self._clients.values():
      for c in cs:
        c.close()
    if hasattr(self, "_pool"):
      self._pool.shutdown(wait=False)
