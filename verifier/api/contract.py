"""Plain-Python request, options and result types (mirrors ``proto/verifier.proto``).

Defaults follow KernelBench's scripts (5 correctness trials, 100 timing trials, 3 warm-ups) and DICE's
reward tolerance (atol = rtol = 1e-2); the strict fp32 verdict uses KernelBench main's 1e-4
(KernelBench (github.com/ScalingIntelligence/KernelBench), ``eval_kernel_against_ref`` and its metrics).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any


class FailureKind(str, enum.Enum):
  OK = "OK"
  INVALID_REQUEST = "INVALID_REQUEST"
  SYNTAX_ERROR = "SYNTAX_ERROR"
  SOURCE_TOO_COMPLEX = "SOURCE_TOO_COMPLEX"  # beyond the static check's size/node/depth/time bounds
  MISSING_MODEL_NEW = "MISSING_MODEL_NEW"
  NO_KERNEL = "NO_KERNEL"
  KERNEL_NOT_LAUNCHED = "KERNEL_NOT_LAUNCHED"
  FALLBACK = "FALLBACK"
  THREAD_OR_STREAM = "THREAD_OR_STREAM"
  MONKEY_PATCH = "MONKEY_PATCH"
  FORBIDDEN_IMPORT = "FORBIDDEN_IMPORT"
  TORCH_COMPUTE = "TORCH_COMPUTE"
  FOREIGN_KERNELS = "FOREIGN_KERNELS"
  LAZY_OUTPUT = "LAZY_OUTPUT"
  REFERENCE_TAMPERED = "REFERENCE_TAMPERED"
  INPUT_MUTATION = "INPUT_MUTATION"
  FRAME_INTROSPECTION = "FRAME_INTROSPECTION"
  DIRECT_ATEN_CALL = "DIRECT_ATEN_CALL"
  TIMING_MISMATCH = "TIMING_MISMATCH"
  HOST_COMPUTE = (
    "HOST_COMPUTE"  # the work ran outside the candidate's own compiled code (library, host)
  )
  EVIDENCE_MISSING = "EVIDENCE_MISSING"  # records the verifier must see on every call did not come
  COMPILE_ERROR = "COMPILE_ERROR"
  IMPORT_ERROR = "IMPORT_ERROR"
  INIT_ERROR = "INIT_ERROR"
  RUNTIME_ERROR = "RUNTIME_ERROR"
  CUDA_ERROR = "CUDA_ERROR"
  CRASH = "CRASH"
  TIMEOUT = "TIMEOUT"
  OUT_OF_MEMORY = "OUT_OF_MEMORY"
  RESOURCE_LIMIT = "RESOURCE_LIMIT"  # process count or scratch quota
  SHAPE_MISMATCH = "SHAPE_MISMATCH"
  DTYPE_MISMATCH = "DTYPE_MISMATCH"
  WRONG_OUTPUT = "WRONG_OUTPUT"
  NONFINITE_OUTPUT = "NONFINITE_OUTPUT"
  BELOW_MIN_SPEEDUP = "BELOW_MIN_SPEEDUP"
  REFERENCE_ERROR = "REFERENCE_ERROR"
  INTERNAL_ERROR = "INTERNAL_ERROR"
  OVERLOADED = "OVERLOADED"
  NO_CODE = "NO_CODE"  # the learner found no code in a response: nothing was sent to a service

  @property
  def label(self) -> str:
    """The lower-case name the learner's metrics and logs show ("wrong_output")."""
    return self.value.lower()

  @property
  def deceptive(self) -> bool:
    return self in DECEPTIVE_KINDS

  @property
  def compiled(self) -> bool:
    """Whether a result of this kind means the candidate built and loaded."""
    return self not in NOT_COMPILED_KINDS


DECEPTIVE_KINDS = frozenset(
  {
    FailureKind.NO_KERNEL,
    FailureKind.KERNEL_NOT_LAUNCHED,
    FailureKind.FALLBACK,
    FailureKind.THREAD_OR_STREAM,
    FailureKind.MONKEY_PATCH,
    FailureKind.FORBIDDEN_IMPORT,
    FailureKind.TORCH_COMPUTE,
    FailureKind.FOREIGN_KERNELS,
    FailureKind.LAZY_OUTPUT,
    FailureKind.REFERENCE_TAMPERED,
    FailureKind.INPUT_MUTATION,
    FailureKind.FRAME_INTROSPECTION,
    FailureKind.DIRECT_ATEN_CALL,
    FailureKind.TIMING_MISMATCH,
    FailureKind.HOST_COMPUTE,
    FailureKind.EVIDENCE_MISSING,
  }
)

NOT_COMPILED_KINDS = frozenset(
  {
    FailureKind.INVALID_REQUEST,
    FailureKind.SYNTAX_ERROR,
    FailureKind.SOURCE_TOO_COMPLEX,
    FailureKind.MISSING_MODEL_NEW,
    FailureKind.NO_KERNEL,
    FailureKind.FALLBACK,
    FailureKind.THREAD_OR_STREAM,
    FailureKind.MONKEY_PATCH,
    FailureKind.FORBIDDEN_IMPORT,
    FailureKind.TORCH_COMPUTE,
    FailureKind.KERNEL_NOT_LAUNCHED,
    FailureKind.FRAME_INTROSPECTION,
    FailureKind.DIRECT_ATEN_CALL,
    FailureKind.COMPILE_ERROR,
    FailureKind.IMPORT_ERROR,
    FailureKind.REFERENCE_ERROR,
    FailureKind.INTERNAL_ERROR,
    FailureKind.OVERLOADED,
    FailureKind.NO_CODE,
  }
)


@dataclasses.dataclass(frozen=True)
class Strictness:
  """Which anti-cheating rules reject a candidate (KernelBench's static checker and the hacks kernel-RL projects reported).

  ``strict`` is this project's default; ``kernelbench`` mirrors KernelBench's STRICT static checks
  (torch ops and streams are only warnings there); ``off`` checks correctness only.
  """

  name: str
  require_kernel: bool = (
    True  # a __global__ kernel (GPU) / C++ function (CPU) built via load_inline
  )
  forbid_fallback: bool = True  # try/except, subclassing Model
  forbid_threads_streams: bool = (
    True  # threading/multiprocessing, torch.cuda.Stream, cudaStreamCreate
  )
  forbid_monkey_patch: bool = True  # assigning into torch / time / builtins
  forbid_imports: bool = True  # gc, inspect, ctypes, subprocess, socket, ...
  forbid_torch_compute: bool = True  # static: torch compute calls in ModelNew's forward path
  runtime_check: bool = True  # profiler: own extension ran; no aten compute ops / foreign kernels
  max_foreign_fraction: float = (
    0.1  # share of candidate GPU time allowed in non-allow-listed foreign kernels
  )

  @classmethod
  def preset(cls, name: str) -> "Strictness":
    try:
      return _PRESETS[name]
    except KeyError:
      raise ValueError(f"strictness must be one of {sorted(_PRESETS)}, got {name!r}") from None


_PRESETS = {
  "strict": Strictness("strict"),
  "kernelbench": Strictness(
    "kernelbench",
    forbid_threads_streams=True,
    forbid_imports=False,
    forbid_torch_compute=False,
    runtime_check=False,
    max_foreign_fraction=1.0,
  ),
  "off": Strictness(
    "off",
    require_kernel=False,
    forbid_fallback=False,
    forbid_threads_streams=False,
    forbid_monkey_patch=False,
    forbid_imports=False,
    forbid_torch_compute=False,
    runtime_check=False,
    max_foreign_fraction=1.0,
  ),
}

STRICT_TOLERANCE = 1e-4


@dataclasses.dataclass(frozen=True)
class VerifyOptions:
  num_correct_trials: int = 5
  atol: float = 1e-2
  rtol: float = 1e-2
  measure_performance: bool = False
  # timed calls and warm-up calls; the checker times them in bursts of up to timed_calls.MAX_BURST forwards per
  # round trip and rounds both up to whole bursts
  num_perf_trials: int = 100
  num_warmup: int = 3
  device: str = "cuda"
  strictness: str = "strict"
  min_speedup: float = 0.0
  timeout_s: float = 180.0
  seed: int = 42
  compile_baseline: bool = False

  def __post_init__(self):
    def bad(field: str, expected: str):
      raise ValueError(f"VerifyOptions.{field} must be {expected}, got {getattr(self, field)!r}")

    if not 1 <= self.num_correct_trials <= 100:
      bad("num_correct_trials", "in [1, 100]")
    for f in ("atol", "rtol"):
      v = getattr(self, f)
      if not (isinstance(v, (int, float)) and math.isfinite(v) and 0 <= v <= 1):
        bad(f, "a finite number in [0, 1]")
    if not 1 <= self.num_perf_trials <= 10_000:
      bad("num_perf_trials", "in [1, 10000]")
    if not 0 <= self.num_warmup <= 1000:
      bad("num_warmup", "in [0, 1000]")
    if self.device not in ("cuda", "cpu"):
      bad("device", "'cuda' or 'cpu'")
    Strictness.preset(self.strictness)
    if not (math.isfinite(self.min_speedup) and self.min_speedup >= 0):
      bad("min_speedup", ">= 0")
    if not 1 <= self.timeout_s <= 3600:
      bad("timeout_s", "in [1, 3600] seconds")

  @property
  def strict(self) -> Strictness:
    return Strictness.preset(self.strictness)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class VerifyRequest:
  request_id: str
  task_id: str
  reference_source: str
  candidate_source: str
  options: VerifyOptions = dataclasses.field(default_factory=VerifyOptions)

  def validate(self) -> None:
    if not self.request_id or len(self.request_id) > 256:
      raise ValueError(
        "VerifyRequest.request_id must be a non-empty string of at most 256 characters"
      )
    for f in ("reference_source", "candidate_source"):
      v = getattr(self, f)
      if not isinstance(v, str) or not v.strip():
        raise ValueError(f"VerifyRequest.{f} must be non-empty Python source")
      if len(v) > 1_000_000:
        raise ValueError(f"VerifyRequest.{f} is {len(v)} characters; the limit is 1,000,000")


@dataclasses.dataclass(frozen=True)
class Runtime:
  median_ms: float = 0.0
  mean_ms: float = 0.0
  num_trials: int = 0


@dataclasses.dataclass(frozen=True)
class VerifyResult:
  request_id: str = ""
  task_id: str = ""
  compiled: bool = False
  correct: bool = False
  deceptive: bool = False
  reward: float = 0.0
  shaped_reward: float = 0.0
  speedup: float = 0.0
  candidate: Runtime = Runtime()
  baseline: Runtime = Runtime()
  failure_kind: FailureKind = FailureKind.INTERNAL_ERROR
  reason: str = ""
  logs: str = ""
  strict_correct: bool = False
  max_abs_diff: float = 0.0
  warnings: tuple[str, ...] = ()
  compile_s: float = 0.0
  run_s: float = 0.0
  build_cached: bool = False
  device_name: str = ""

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["failure_kind"] = self.failure_kind.value
    d["warnings"] = list(self.warnings)
    return d

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "VerifyResult":
    d = dict(d)
    d["failure_kind"] = FailureKind(d.get("failure_kind", "INTERNAL_ERROR"))
    d["candidate"] = Runtime(**d.get("candidate", {}))
    d["baseline"] = Runtime(**d.get("baseline", {}))
    d["warnings"] = tuple(d.get("warnings", ()))
    return cls(**{k: v for k, v in d.items() if k in _RESULT_FIELDS})


_RESULT_FIELDS = {f.name for f in dataclasses.fields(VerifyResult)}

LOG_LIMIT = 8000


CANDIDATE_TEXT_LIMIT = 2000
CANDIDATE_TEXT_LABEL = "[text from the candidate's process]"


def candidate_text(text: str, limit: int = CANDIDATE_TEXT_LIMIT) -> str:
  """Text the candidate's process wrote (the exception it raised, a failure it reported about itself)
  as a verdict carries it: cut to ``limit`` characters and labelled, so it is never read as the
  verifier's own words."""
  if len(text) > limit:
    text = text[:limit] + f" ... [{len(text) - limit} characters cut]"
  return f"{CANDIDATE_TEXT_LABEL} {text}"


def truncate_log(text: str, limit: int = LOG_LIMIT) -> str:
  """Keep the head and the tail of a long log (compiler errors are usually at the start)."""
  if len(text) <= limit:
    return text
  half = limit // 2
  return text[:half] + f"\n... [{len(text) - limit} characters cut] ...\n" + text[-half:]
