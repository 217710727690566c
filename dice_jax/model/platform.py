"""Which attention kernel `attention_impl` means on the platform a program is lowered for.

`attention_impl='flash'` is a mask-aware kernel on every platform that has one: Triton on GPU
(`flash_bd`, `flash_decode`), Mosaic on TPU (`flash_tpu`), and the GPU kernels in the Pallas
interpreter on CPU (tests). The platform is JAX's default backend, or the one named by
`lowering_for` while tracing (a TPU export from a CPU host, or the TPU kernels in interpret mode
on CPU). An impl a platform has no kernel for is refused with a clear error, and on TPU the
dense paths are refused at lengths where their `[B, N, T, S]` scores would not fit: there is no
silent fallback. The target is read at trace time: jit a fresh function under `lowering_for`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading

import jax

IMPLS = ("dense", "xla", "cudnn", "flash")
FLASH_PLATFORMS = ("gpu", "tpu", "cpu")
# Largest q_len * k_len the dense paths may take on TPU (2,048^2 score entries per row and head):
# SFT's 8,192-token 2L rows would make 32x that, several GB per layer.
TPU_DENSE_LIMIT = 2048 * 2048


@dataclasses.dataclass(frozen=True)
class Target:
  platform: str  # 'gpu' | 'tpu' | 'cpu'
  interpret: bool  # run the platform's Pallas kernels in the interpreter


_state = threading.local()


def _platform_name(backend: str) -> str:
  return {"cuda": "gpu", "rocm": "gpu"}.get(backend, backend)


@contextlib.contextmanager
def lowering_for(platform: str, *, interpret: bool = False):
  """Trace attention for `platform` ('tpu', 'gpu', 'cpu'), its kernels interpreted if asked."""
  platform = _platform_name(platform)
  if platform not in FLASH_PLATFORMS:
    raise ValueError(f"lowering_for: platform must be one of {FLASH_PLATFORMS}, got {platform!r}")
  old = getattr(_state, "target", None)
  _state.target = Target(platform, interpret)
  try:
    yield _state.target
  finally:
    _state.target = old


def target() -> Target:
  """The platform attention is traced for (`lowering_for`, else JAX's default backend)."""
  override = getattr(_state, "target", None)
  if override is not None:
    return override
  platform = _platform_name(jax.default_backend())
  return Target(platform, platform == "cpu")


def check(impl: str, q_len: int, k_len: int) -> Target:
  """The target, after refusing an `impl` it has no kernel for (or dense at a length TPU cannot
  hold). Raises ValueError naming the impl, the platform and what to use instead."""
  tgt = target()
  if impl not in IMPLS:
    raise ValueError(f"attention_impl must be one of {IMPLS}, got {impl!r}")
  if impl == "cudnn" and tgt.platform != "gpu":
    raise ValueError(
      f"attention_impl='cudnn' is an NVIDIA GPU kernel; there is none on {tgt.platform!r} "
      "(use 'flash': the Pallas TPU kernel on TPU, the interpreter on CPU)"
    )
  if impl == "flash" and tgt.platform not in FLASH_PLATFORMS:
    raise ValueError(f"attention_impl='flash' has no kernel for platform {tgt.platform!r}")
  if impl in ("dense", "xla") and tgt.platform == "tpu" and q_len * k_len > TPU_DENSE_LIMIT:
    raise ValueError(
      f"attention_impl={impl!r} on TPU would materialise [B, N, {q_len}, {k_len}] scores "
      f"(over the {TPU_DENSE_LIMIT:,}-entry limit); use attention_impl='flash' (Pallas TPU kernel)"
    )
  return tgt


def cache_multiple(block_k: int) -> int:
  """What a flash KV cache's length must be a multiple of: the GPU kernel's `block_k`, and on TPU
  also the 128-lane width of the TPU kernel's key tiles."""
  return math.lcm(block_k, 128) if target().platform == "tpu" else block_k


def on_gpu_stream(fn, stream: int):
  """`fn` (arrays in, arrays out, positional) as one call XLA runs on GPU stream `stream`, beside
  the main stream; other backends ignore the annotation. It is `jax.experimental.compute_on` with
  compute type ``gpu_stream:N``: a primitive whose call carries ``_xla_stream_annotation`` and
  whose outputs stay in device memory (``out_memory_spaces``). That function form is
  ``compute_on2`` in jax 0.10 (where ``compute_on(compute_type)`` is still a context manager) and
  ``compute_on`` from jax 0.11 (jax-ml/jax 3a440c764b and ad1df344b0, 2026-07/08)."""
  from jax.experimental import compute_on as api

  wrap = getattr(api, "compute_on2", None) or api.compute_on
  return wrap(
    inline_jits(fn), compute_type=f"gpu_stream:{stream}", out_memory_spaces=jax.memory.Space.Device
  )


def inline_jits(fn):
  """`fn` with every `jit` it calls (``jnp.clip``, ``jnp.pad``, ``jnp.where`` are jitted
  functions) traced inline instead of as nested calls. A stream-annotated call may hold no nested
  call: XLA gives each one the annotation, makes it an async call of its own inside the stream
  call, and then fails to schedule it ("No ExecutionStreamId found for %call-start ... only
  reachable through embedded calls", jax 0.11.2 on an H200, 2026-12-04)."""

  def inlined(*args):
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    outs = _eval_inlined(closed.jaxpr, closed.consts, jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

  return inlined


def _eval_inlined(jaxpr, consts, args) -> list:
  """`jax.core.eval_jaxpr` that enters `jit` equations instead of binding them."""
  from jax.extend import core

  env = {}
  read = lambda v: v.val if isinstance(v, core.Literal) else env[v]
  env.update(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    if eqn.primitive.name in ("pjit", "jit"):
      inner = eqn.params["jaxpr"]
      outs = _eval_inlined(inner.jaxpr, inner.consts, ins)
    else:
      params = eqn.primitive.get_bind_params(eqn.params)  # jax < 0.5: (subfuns, params)
      subfuns, params = params if isinstance(params, tuple) else ((), params)
      outs = eqn.primitive.bind(*subfuns, *ins, **params)
      outs = outs if eqn.primitive.multiple_results else [outs]
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]
