"""JAX's trace context at its final size before the first trace.

A jitted function's traces are keyed on the trace context: the values of every configuration
state that says it belongs there. A module that registers such a state when it is first imported
makes the context longer, and every function traced before that no longer matches its cache: its
next call traces and compiles it again. On the GPU host (jax 0.11.2) the first lowering of a Pallas
kernel does this: the RL rollout's first timed sampler call traced and compiled the whole sampler
again, ~20-35 s (explain-cache-misses: "number of tracing context values differs: now 51 and
before 50"; docs/performance.md, issue 39 session 27). `settle()` runs that path once before
anything else is traced: it imports the modules a GPU Pallas lowering imports and traces, lowers,
compiles and runs a one-tile Pallas kernel (~1 s, once a process). On 0.11.2 the state is
`pallas_fuser_disable_nested_fuse`, registered when `jax._src.pallas.fuser.jaxpr_fusion` is first
imported (H100, session 28: `bench_rl`'s `trace_context_added_by_first_call`); the kernel alone did not
import it, so it is imported by name.
"""

from __future__ import annotations

import contextlib
import functools
import importlib

import jax
import jax.numpy as jnp
from absl import logging

# what lowering a Pallas call for cuda imports (jax 0.10.2: both registrations and Mosaic GPU; 0.11.2:
# also the fuser, whose import registers `pallas_fuser_disable_nested_fuse`)
GPU_LOWERING_MODULES = (
  "jax._src.pallas.triton.pallas_call_registration",
  "jax._src.pallas.mosaic_gpu.pallas_call_registration",
  "jax.experimental.mosaic.gpu",
  "jax._src.pallas.fuser.jaxpr_fusion",
)


def names() -> tuple[str, ...]:
  """The trace context's state names (empty where this JAX cannot list them)."""
  from jax._src import config

  try:
    return tuple(config.trace_context_names())
  except (AttributeError, NotImplementedError):
    return ()


def import_lowering_modules() -> None:
  """Imports `GPU_LOWERING_MODULES` (those this JAX has)."""
  for module in GPU_LOWERING_MODULES:
    try:
      importlib.import_module(module)
    except ImportError:  # another JAX version lays its Pallas GPU lowering out otherwise
      pass


def _add_one(x_ref, o_ref):
  o_ref[...] = x_ref[...] + 1.0


def run_one_kernel(interpret: bool = False) -> float:
  """A one-tile Pallas kernel traced, lowered, compiled and run on the default backend (the Pallas
  interpreter with `interpret`): the first call's path, once. Returns its output's sum (256.0)."""
  from jax.experimental import pallas as pl

  add = pl.pallas_call(
    _add_one, out_shape=jax.ShapeDtypeStruct((16, 16), jnp.float32), interpret=interpret
  )
  return float(jax.jit(add)(jnp.zeros((16, 16), jnp.float32)).sum())


@functools.cache
def settle(backend: str | None = None) -> tuple[str, ...]:
  """On GPU, once a process: `import_lowering_modules` and `run_one_kernel`; returns the state names
  that added to the trace context. Elsewhere nothing is lowered for cuda and nothing is done. A
  failure is logged, not raised: the cost of not settling is one more compile, not a wrong result."""
  if (backend or jax.default_backend()) != "gpu":
    return ()
  before = names()
  try:
    import_lowering_modules()
    run_one_kernel()
  except Exception as e:  # noqa: BLE001 - best effort (docstring)
    logging.warning("trace_context.settle: %s: %s", type(e).__name__, e)
  return tuple(n for n in names() if n not in before)


@contextlib.contextmanager
def watched(what: str):
  """Logs a warning naming the trace-context states registered inside the block: every function
  traced before them will trace and compile once more on its next call (add the module that
  registers them to `GPU_LOWERING_MODULES`)."""
  before = names()
  yield
  added = [n for n in names() if n not in before]
  if added:
    logging.warning(
      "%s registered trace-context state(s) %s: what was traced before traces and compiles once "
      "more on its next call (dice_jax/trace_context.py)",
      what,
      added,
    )
