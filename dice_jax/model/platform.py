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
  return wrap(fn, compute_type=f"gpu_stream:{stream}", out_memory_spaces=jax.memory.Space.Device)
