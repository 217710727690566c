"""Conversions between the protobuf messages and ``contract`` dataclasses."""

from __future__ import annotations

import dataclasses

from verifier.api.contract import FailureKind, Runtime, VerifyOptions, VerifyRequest, VerifyResult
from verifier.api.proto import verifier_pb2 as pb

_PREFIX = "FAILURE_KIND_"
_OPTION_FIELDS = [f.name for f in dataclasses.fields(VerifyOptions)]


def options_from_proto(msg: pb.VerifyOptions, default_device: str) -> VerifyOptions:
  """Unset fields take defaults; raises ValueError naming the bad field."""
  kw = {name: getattr(msg, name) for name in _OPTION_FIELDS if msg.HasField(name)}
  kw.setdefault("device", default_device)
  return VerifyOptions(**kw)


def options_to_proto(o: VerifyOptions) -> pb.VerifyOptions:
  return pb.VerifyOptions(**dataclasses.asdict(o))


def request_to_proto(r: VerifyRequest) -> pb.VerifyRequest:
  return pb.VerifyRequest(
    request_id=r.request_id,
    task_id=r.task_id,
    reference_source=r.reference_source,
    candidate_source=r.candidate_source,
    options=options_to_proto(r.options),
  )


def request_from_proto(msg: pb.VerifyRequest, default_device: str) -> VerifyRequest:
  return VerifyRequest(
    msg.request_id,
    msg.task_id,
    msg.reference_source,
    msg.candidate_source,
    options_from_proto(msg.options, default_device),
  )


def _runtime_to_proto(r: Runtime) -> pb.Runtime:
  return pb.Runtime(median_ms=r.median_ms, mean_ms=r.mean_ms, num_trials=r.num_trials)


def result_to_proto(r: VerifyResult) -> pb.VerifyResult:
  d = r.to_dict()
  d["failure_kind"] = pb.FailureKind.Value(_PREFIX + r.failure_kind.value)
  d["candidate"], d["baseline"] = _runtime_to_proto(r.candidate), _runtime_to_proto(r.baseline)
  return pb.VerifyResult(**d)


def result_from_proto(msg: pb.VerifyResult) -> VerifyResult:
  kind = FailureKind(pb.FailureKind.Name(msg.failure_kind)[len(_PREFIX) :])
  rt = lambda m: Runtime(m.median_ms, m.mean_ms, m.num_trials)  # noqa: E731
  return VerifyResult(
    request_id=msg.request_id,
    task_id=msg.task_id,
    compiled=msg.compiled,
    correct=msg.correct,
    deceptive=msg.deceptive,
    reward=msg.reward,
    shaped_reward=msg.shaped_reward,
    speedup=msg.speedup,
    candidate=rt(msg.candidate),
    baseline=rt(msg.baseline),
    failure_kind=kind,
    reason=msg.reason,
    logs=msg.logs,
    strict_correct=msg.strict_correct,
    max_abs_diff=msg.max_abs_diff,
    warnings=tuple(msg.warnings),
    compile_s=msg.compile_s,
    run_s=msg.run_s,
    build_cached=msg.build_cached,
    device_name=msg.device_name,
  )
