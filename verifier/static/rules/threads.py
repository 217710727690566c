"""Threads and streams: all work on the timed stream, in the timed thread.

KernelBench's STRICT ``thread_injection`` and WARNING ``stream_injection``: work on another stream
or thread escapes the clock (the timed stream looks idle while the work goes on).
"""

from __future__ import annotations

import re

from verifier.api.contract import FailureKind, Strictness
from verifier.static.rules.base import Findings, Rejection, Rule
from verifier.static.source import Candidate, search_cpp

# OpenMP by any route: pragmas, its header and runtime calls, the compiler and linker flags that enable it.
OPENMP = re.compile(
  r"#\s*pragma\s+omp\b|<omp\.h>|\bomp_\w+\s*\(|-f?openmp\b|-qopenmp\b|-l\s*gomp\b|-l\s*iomp5\b|"
  r"\bkmp_\w+\s*\(|\bat\s*::\s*(?:parallel_for|parallel_reduce|set_num_threads|launch|intraop_launch)\b"
)

CPP_STREAM_OR_THREAD = re.compile(
  r"cudaStreamCreate|cudaStreamCreateWithFlags|cudaStreamCreateWithPriority|getStreamFromPool|"
  r"std::thread|pthread_create|std::async|cudaGraphLaunch|#\s*include\s*<thread>"
)

PY_STREAM = re.compile(
  r"torch\.cuda\.Stream\s*\(|torch\.cuda\.stream\s*\(|\.wait_stream\s*\(|\.record_stream\s*\("
)


def _openmp_rules(source: str) -> Rejection | None:
  """OpenMP (pragmas, runtime calls, the flags that enable it) and ATen's thread pool: threads."""
  m = OPENMP.search(source)
  if m:
    line = source.count("\n", 0, m.start()) + 1
    return Rejection(
      FailureKind.THREAD_OR_STREAM,
      f"uses {m.group(0).strip()!r} (line {line}): OpenMP and other threads are not allowed",
    )
  return None


def openmp_rule(c: Candidate, strictness: Strictness) -> Findings:
  """No OpenMP pragmas or flags: extra threads beside the timed stream."""
  return [r for r in [_openmp_rules(c.source)] if r]


def streams_rule(c: Candidate, strictness: Strictness) -> Findings:
  """No extra CUDA streams or threads (Python or C++): work off the timed stream escapes the clock."""
  stream = PY_STREAM.search(c.source)
  stream_line = c.source.count("\n", 0, stream.start()) + 1 if stream else 0
  found = search_cpp(CPP_STREAM_OR_THREAD, c.texts)
  if not (stream or found):
    return []
  what, line = (stream.group(0), stream_line) if stream else (found[0].group(0), found[1])
  return [
    Rejection(
      FailureKind.THREAD_OR_STREAM,
      f"uses {what.strip()!r} (line {line}): extra streams/threads are not allowed",
      "uses extra CUDA streams or threads",
    )
  ]


RULES = (
  Rule("openmp", openmp_rule, "forbid_threads_streams"),
  Rule("streams", streams_rule, "forbid_threads_streams", warns=True),
)
