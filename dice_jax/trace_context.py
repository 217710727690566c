"""JAX's trace context at its final size before the first trace.

A jitted function's traces are keyed on the trace context: the values of every configuration
state that says it belongs there. A module that registers such a state when it is first imported
makes the context longer, and every function traced before that no longer matches its cache: its
next call traces and compiles it again. On the GPU host (jax 0.11.2) the first lowering of a Pallas
kernel does this: the RL rollout's first timed sampler call traced and compiled the whole sampler
again, ~20-35 s (explain-cache-misses: "number of tracing context values differs: now 51 and
before 50"; docs/performance.md, issue 39 session 27). `settle()` imports the modules a GPU Pallas
lowering imports before anything is traced. Which of them registers the state on 0.11.2 is not yet
named: `bench_rl` records the names the first call adds (`trace_context_added_by_first_call`).
"""

from __future__ import annotations

import functools
import importlib

import jax

# what lowering a Pallas call for cuda imports (jax 0.10.2: both registrations and Mosaic GPU)
GPU_LOWERING_MODULES = (
  "jax._src.pallas.triton.pallas_call_registration",
  "jax._src.pallas.mosaic_gpu.pallas_call_registration",
  "jax.experimental.mosaic.gpu",
)


def names() -> tuple[str, ...]:
  """The trace context's state names (empty where this JAX cannot list them)."""
  from jax._src import config

  try:
    return tuple(config.trace_context_names())
  except (AttributeError, NotImplementedError):
    return ()


@functools.cache
def settle(backend: str | None = None) -> tuple[str, ...]:
  """On GPU, imports `GPU_LOWERING_MODULES` (once a process); returns the state names that adds
  to the trace context. Elsewhere nothing is lowered for cuda and nothing is imported."""
  if (backend or jax.default_backend()) != "gpu":
    return ()
  before = names()
  for module in GPU_LOWERING_MODULES:
    try:
      importlib.import_module(module)
    except ImportError:  # another JAX version lays its Pallas GPU lowering out otherwise
      pass
  return tuple(n for n in names() if n not in before)
