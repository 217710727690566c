from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FailureKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_KIND_OK: _ClassVar[FailureKind]
    FAILURE_KIND_INVALID_REQUEST: _ClassVar[FailureKind]
    FAILURE_KIND_SYNTAX_ERROR: _ClassVar[FailureKind]
    FAILURE_KIND_MISSING_MODEL_NEW: _ClassVar[FailureKind]
    FAILURE_KIND_NO_KERNEL: _ClassVar[FailureKind]
    FAILURE_KIND_KERNEL_NOT_LAUNCHED: _ClassVar[FailureKind]
    FAILURE_KIND_FALLBACK: _ClassVar[FailureKind]
    FAILURE_KIND_THREAD_OR_STREAM: _ClassVar[FailureKind]
    FAILURE_KIND_MONKEY_PATCH: _ClassVar[FailureKind]
    FAILURE_KIND_FORBIDDEN_IMPORT: _ClassVar[FailureKind]
    FAILURE_KIND_TORCH_COMPUTE: _ClassVar[FailureKind]
    FAILURE_KIND_FOREIGN_KERNELS: _ClassVar[FailureKind]
    FAILURE_KIND_LAZY_OUTPUT: _ClassVar[FailureKind]
    FAILURE_KIND_REFERENCE_TAMPERED: _ClassVar[FailureKind]
    FAILURE_KIND_INPUT_MUTATION: _ClassVar[FailureKind]
    FAILURE_KIND_FRAME_INTROSPECTION: _ClassVar[FailureKind]
    FAILURE_KIND_DIRECT_ATEN_CALL: _ClassVar[FailureKind]
    FAILURE_KIND_TIMING_MISMATCH: _ClassVar[FailureKind]
    FAILURE_KIND_SOURCE_TOO_COMPLEX: _ClassVar[FailureKind]
    FAILURE_KIND_HOST_COMPUTE: _ClassVar[FailureKind]
    FAILURE_KIND_COMPILE_ERROR: _ClassVar[FailureKind]
    FAILURE_KIND_IMPORT_ERROR: _ClassVar[FailureKind]
    FAILURE_KIND_INIT_ERROR: _ClassVar[FailureKind]
    FAILURE_KIND_RUNTIME_ERROR: _ClassVar[FailureKind]
    FAILURE_KIND_CUDA_ERROR: _ClassVar[FailureKind]
    FAILURE_KIND_CRASH: _ClassVar[FailureKind]
    FAILURE_KIND_TIMEOUT: _ClassVar[FailureKind]
    FAILURE_KIND_OUT_OF_MEMORY: _ClassVar[FailureKind]
    FAILURE_KIND_RESOURCE_LIMIT: _ClassVar[FailureKind]
    FAILURE_KIND_EVIDENCE_MISSING: _ClassVar[FailureKind]
    FAILURE_KIND_SHAPE_MISMATCH: _ClassVar[FailureKind]
    FAILURE_KIND_DTYPE_MISMATCH: _ClassVar[FailureKind]
    FAILURE_KIND_WRONG_OUTPUT: _ClassVar[FailureKind]
    FAILURE_KIND_NONFINITE_OUTPUT: _ClassVar[FailureKind]
    FAILURE_KIND_BELOW_MIN_SPEEDUP: _ClassVar[FailureKind]
    FAILURE_KIND_REFERENCE_ERROR: _ClassVar[FailureKind]
    FAILURE_KIND_INTERNAL_ERROR: _ClassVar[FailureKind]
    FAILURE_KIND_OVERLOADED: _ClassVar[FailureKind]
    FAILURE_KIND_NO_CODE: _ClassVar[FailureKind]
FAILURE_KIND_OK: FailureKind
FAILURE_KIND_INVALID_REQUEST: FailureKind
FAILURE_KIND_SYNTAX_ERROR: FailureKind
FAILURE_KIND_MISSING_MODEL_NEW: FailureKind
FAILURE_KIND_NO_KERNEL: FailureKind
FAILURE_KIND_KERNEL_NOT_LAUNCHED: FailureKind
FAILURE_KIND_FALLBACK: FailureKind
FAILURE_KIND_THREAD_OR_STREAM: FailureKind
FAILURE_KIND_MONKEY_PATCH: FailureKind
FAILURE_KIND_FORBIDDEN_IMPORT: FailureKind
FAILURE_KIND_TORCH_COMPUTE: FailureKind
FAILURE_KIND_FOREIGN_KERNELS: FailureKind
FAILURE_KIND_LAZY_OUTPUT: FailureKind
FAILURE_KIND_REFERENCE_TAMPERED: FailureKind
FAILURE_KIND_INPUT_MUTATION: FailureKind
FAILURE_KIND_FRAME_INTROSPECTION: FailureKind
FAILURE_KIND_DIRECT_ATEN_CALL: FailureKind
FAILURE_KIND_TIMING_MISMATCH: FailureKind
FAILURE_KIND_SOURCE_TOO_COMPLEX: FailureKind
FAILURE_KIND_HOST_COMPUTE: FailureKind
FAILURE_KIND_COMPILE_ERROR: FailureKind
FAILURE_KIND_IMPORT_ERROR: FailureKind
FAILURE_KIND_INIT_ERROR: FailureKind
FAILURE_KIND_RUNTIME_ERROR: FailureKind
FAILURE_KIND_CUDA_ERROR: FailureKind
FAILURE_KIND_CRASH: FailureKind
FAILURE_KIND_TIMEOUT: FailureKind
FAILURE_KIND_OUT_OF_MEMORY: FailureKind
FAILURE_KIND_RESOURCE_LIMIT: FailureKind
FAILURE_KIND_EVIDENCE_MISSING: FailureKind
FAILURE_KIND_SHAPE_MISMATCH: FailureKind
FAILURE_KIND_DTYPE_MISMATCH: FailureKind
FAILURE_KIND_WRONG_OUTPUT: FailureKind
FAILURE_KIND_NONFINITE_OUTPUT: FailureKind
FAILURE_KIND_BELOW_MIN_SPEEDUP: FailureKind
FAILURE_KIND_REFERENCE_ERROR: FailureKind
FAILURE_KIND_INTERNAL_ERROR: FailureKind
FAILURE_KIND_OVERLOADED: FailureKind
FAILURE_KIND_NO_CODE: FailureKind

class VerifyOptions(_message.Message):
    __slots__ = ("num_correct_trials", "atol", "rtol", "measure_performance", "num_perf_trials", "num_warmup", "device", "strictness", "min_speedup", "timeout_s", "seed", "compile_baseline")
    NUM_CORRECT_TRIALS_FIELD_NUMBER: _ClassVar[int]
    ATOL_FIELD_NUMBER: _ClassVar[int]
    RTOL_FIELD_NUMBER: _ClassVar[int]
    MEASURE_PERFORMANCE_FIELD_NUMBER: _ClassVar[int]
    NUM_PERF_TRIALS_FIELD_NUMBER: _ClassVar[int]
    NUM_WARMUP_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STRICTNESS_FIELD_NUMBER: _ClassVar[int]
    MIN_SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    COMPILE_BASELINE_FIELD_NUMBER: _ClassVar[int]
    num_correct_trials: int
    atol: float
    rtol: float
    measure_performance: bool
    num_perf_trials: int
    num_warmup: int
    device: str
    strictness: str
    min_speedup: float
    timeout_s: float
    seed: int
    compile_baseline: bool
    def __init__(self, num_correct_trials: _Optional[int] = ..., atol: _Optional[float] = ..., rtol: _Optional[float] = ..., measure_performance: _Optional[bool] = ..., num_perf_trials: _Optional[int] = ..., num_warmup: _Optional[int] = ..., device: _Optional[str] = ..., strictness: _Optional[str] = ..., min_speedup: _Optional[float] = ..., timeout_s: _Optional[float] = ..., seed: _Optional[int] = ..., compile_baseline: _Optional[bool] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("request_id", "task_id", "reference_source", "candidate_source", "options")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    task_id: str
    reference_source: str
    candidate_source: str
    options: VerifyOptions
    def __init__(self, request_id: _Optional[str] = ..., task_id: _Optional[str] = ..., reference_source: _Optional[str] = ..., candidate_source: _Optional[str] = ..., options: _Optional[_Union[VerifyOptions, _Mapping]] = ...) -> None: ...

class Runtime(_message.Message):
    __slots__ = ("median_ms", "mean_ms", "num_trials")
    MEDIAN_MS_FIELD_NUMBER: _ClassVar[int]
    MEAN_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_TRIALS_FIELD_NUMBER: _ClassVar[int]
    median_ms: float
    mean_ms: float
    num_trials: int
    def __init__(self, median_ms: _Optional[float] = ..., mean_ms: _Optional[float] = ..., num_trials: _Optional[int] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("request_id", "task_id", "compiled", "correct", "deceptive", "reward", "shaped_reward", "speedup", "candidate", "baseline", "failure_kind", "reason", "logs", "strict_correct", "max_abs_diff", "warnings", "compile_s", "run_s", "build_cached", "device_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    COMPILED_FIELD_NUMBER: _ClassVar[int]
    CORRECT_FIELD_NUMBER: _ClassVar[int]
    DECEPTIVE_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    SHAPED_REWARD_FIELD_NUMBER: _ClassVar[int]
    SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_FIELD_NUMBER: _ClassVar[int]
    BASELINE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_KIND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LOGS_FIELD_NUMBER: _ClassVar[int]
    STRICT_CORRECT_FIELD_NUMBER: _ClassVar[int]
    MAX_ABS_DIFF_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    COMPILE_S_FIELD_NUMBER: _ClassVar[int]
    RUN_S_FIELD_NUMBER: _ClassVar[int]
    BUILD_CACHED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    task_id: str
    compiled: bool
    correct: bool
    deceptive: bool
    reward: float
    shaped_reward: float
    speedup: float
    candidate: Runtime
    baseline: Runtime
    failure_kind: FailureKind
    reason: str
    logs: str
    strict_correct: bool
    max_abs_diff: float
    warnings: _containers.RepeatedScalarFieldContainer[str]
    compile_s: float
    run_s: float
    build_cached: bool
    device_name: str
    def __init__(self, request_id: _Optional[str] = ..., task_id: _Optional[str] = ..., compiled: _Optional[bool] = ..., correct: _Optional[bool] = ..., deceptive: _Optional[bool] = ..., reward: _Optional[float] = ..., shaped_reward: _Optional[float] = ..., speedup: _Optional[float] = ..., candidate: _Optional[_Union[Runtime, _Mapping]] = ..., baseline: _Optional[_Union[Runtime, _Mapping]] = ..., failure_kind: _Optional[_Union[FailureKind, str]] = ..., reason: _Optional[str] = ..., logs: _Optional[str] = ..., strict_correct: _Optional[bool] = ..., max_abs_diff: _Optional[float] = ..., warnings: _Optional[_Iterable[str]] = ..., compile_s: _Optional[float] = ..., run_s: _Optional[float] = ..., build_cached: _Optional[bool] = ..., device_name: _Optional[str] = ...) -> None: ...

class MetricsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MetricsReply(_message.Message):
    __slots__ = ("queue_depth", "in_build", "in_run", "completed", "candidates_per_minute", "failure_kinds", "build_cache_hits", "deduplicated", "uptime_s", "run_phase_mean_s", "oom_retries", "baselines_measured", "cache_evicted")
    class FailureKindsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RunPhaseMeanSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    IN_BUILD_FIELD_NUMBER: _ClassVar[int]
    IN_RUN_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_KINDS_FIELD_NUMBER: _ClassVar[int]
    BUILD_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    DEDUPLICATED_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    RUN_PHASE_MEAN_S_FIELD_NUMBER: _ClassVar[int]
    OOM_RETRIES_FIELD_NUMBER: _ClassVar[int]
    BASELINES_MEASURED_FIELD_NUMBER: _ClassVar[int]
    CACHE_EVICTED_FIELD_NUMBER: _ClassVar[int]
    queue_depth: int
    in_build: int
    in_run: int
    completed: int
    candidates_per_minute: float
    failure_kinds: _containers.ScalarMap[str, int]
    build_cache_hits: int
    deduplicated: int
    uptime_s: float
    run_phase_mean_s: _containers.ScalarMap[str, float]
    oom_retries: int
    baselines_measured: int
    cache_evicted: int
    def __init__(self, queue_depth: _Optional[int] = ..., in_build: _Optional[int] = ..., in_run: _Optional[int] = ..., completed: _Optional[int] = ..., candidates_per_minute: _Optional[float] = ..., failure_kinds: _Optional[_Mapping[str, int]] = ..., build_cache_hits: _Optional[int] = ..., deduplicated: _Optional[int] = ..., uptime_s: _Optional[float] = ..., run_phase_mean_s: _Optional[_Mapping[str, float]] = ..., oom_retries: _Optional[int] = ..., baselines_measured: _Optional[int] = ..., cache_evicted: _Optional[int] = ...) -> None: ...
