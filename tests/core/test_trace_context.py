"""`trace_context.settle`: the trace context at its final size before the first trace."""

import subprocess
import sys
import textwrap

from dice_jax import trace_context


def test_settle_imports_nothing_off_the_gpu():
  assert trace_context.settle("cpu") == ()
  assert trace_context.settle("tpu") == ()


def test_after_settling_a_cuda_lowering_of_the_cache_kernel_adds_no_trace_context_state():
  """In a fresh interpreter: the GPU lowering modules imported as `settle` imports them on a GPU,
  then the flash-decode kernel lowered for cuda. The trace context's state
  names are the same before and after the lowering, so nothing traced before it is traced again
  (on jax 0.11.2 on the GPU host the first Pallas lowering added one: issue 39, session 27)."""
  code = textwrap.dedent(
    """
    import functools, json
    import jax, jax.numpy as jnp
    from dice_jax import trace_context
    from dice_jax.model import flash_decode
    trace_context.import_lowering_modules()
    before = trace_context.names()
    q = jnp.zeros((2, 2, 16, 64), jnp.bfloat16)
    kv = jnp.zeros((1, 2, 128, 128), jnp.bfloat16)
    rows, slots = jnp.ones((2, 16), jnp.int32), jnp.ones((2, 128), jnp.int32)
    fills = jnp.full((2,), 100, jnp.int32)
    tiles = flash_decode.DecodeTiles(split=128)
    f = functools.partial(flash_decode.cache_part, tiles=tiles, interpret=False)
    jax.jit(f).trace(q, kv, kv, 0, rows, rows, slots, slots, fills).lower(
      lowering_platforms=("cuda",)
    )
    print(json.dumps([before, trace_context.names()]))
    """
  )
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
  )
  before, after = __import__("json").loads(out.stdout.strip().splitlines()[-1])
  assert before == after
  assert len(before) > 10  # this JAX lists its trace context (else the test would prove nothing)


def test_the_one_kernel_runs_the_first_calls_path():
  """`run_one_kernel` on this backend (the Pallas interpreter off the GPU): a real result."""
  import jax

  assert trace_context.run_one_kernel(interpret=jax.default_backend() != "gpu") == 256.0


def test_a_state_registered_inside_a_watched_block_is_named():
  """A module registering a trace-context state during a call (what the GPU's first Pallas
  lowering did on jax 0.11.2) is reported by name; a block that registers none is silent. In a
  fresh interpreter: the registered state would stay in this one's trace context."""
  code = textwrap.dedent(
    """
    from absl import logging
    from jax._src import config
    from dice_jax import trace_context
    logging.use_absl_handler()
    with trace_context.watched("quiet block"):
      pass
    with trace_context.watched("the first call"):
      config.bool_state(
        name="dice_jax_test_trace_context_state",
        default=False,
        help="registered by a test",
        include_in_trace_context=True,
      )
    """
  )
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
  )
  assert "quiet block" not in out.stderr
  assert "the first call registered" in out.stderr, out.stderr
  assert "dice_jax_test_trace_context_state" in out.stderr
