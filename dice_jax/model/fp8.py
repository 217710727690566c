"""Float8 (e4m3fn) weights and activations for the decode matmuls (`SamplerConfig.weights_dtype`).

Scheme (W8A8, "per-token activation / per-channel weight" scaling: FP8-LM, Peng et al. 2023, §2;
vLLM's fp8 `Fp8LinearMethod` with dynamic per-token activation scales): a weight `w [K, N]` is
stored once as `w8 = w / s_w` in e4m3fn with one float32 scale per output column,
`s_w[n] = max_k |w[k, n]| / 448` (448: e4m3fn's largest finite value); an activation `a [M, K]` is
quantised on the fly with one scale per token (row), `s_a[m] = max_k |a[m, k]| / 448`, and

  a @ w ~= (a8 @ w8) * s_a[:, None] * s_w[None, :]

with the float8 x float8 product accumulated in float32 on the tensor cores. Each token's scale
depends on that token alone, so rows stay independent (a row decodes the same alone or batched).

Layout: `w8` is stored transposed, `[N, K]` (the contracting dimension minor). XLA:GPU rewrites a
dot of two e4m3fn operands into cuBLASLt's fp8 GEMM (`__cublas$lt$matmul$f8`, Hopper and later),
which takes both operands with K minor ("TN"); given `[K, N]` it would transpose the weight on
every call (openxla/xla `gemm_rewriter_fp8_test.cc`, UnscaledABUnscaledDF8). Its scale operands are
scalars, so the per-row / per-column scales are applied after the GEMM (XLA fuses them into the
consumer). On CPU XLA runs the dot by widening the operands (tests).

Rounding: e4m3fn has 3 mantissa bits, so a quantised normal value is within 2^-4 of its value
relative (half an ulp); below 2^-6 (subnormal, of the scaled value) the error is at most 2^-10
absolute in the scaled domain, i.e. `2^-10 * s` (`ROUNDING_REL`, `SUBNORMAL_ABS`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
ROUNDING_REL = 2.0**-4  # half an ulp of a 3-mantissa-bit value, relative
SUBNORMAL_ABS = 2.0**-10  # half the subnormal spacing (2^-9), in the scaled domain
_TINY = 1e-30  # floor of an amax (an all-zero row or column gets a harmless scale)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
  """A float8 projection matrix: `w8` `[N, K]` e4m3fn (the `[K, N]` weight transposed, divided by
  `scale`) and `scale` `[N]` float32, one per output column."""

  w8: jax.Array
  scale: jax.Array

  @property
  def shape(self) -> tuple:
    """The `[K, N]` shape of the weight it stands for."""
    return self.w8.shape[::-1]


def _to_fp8(x):
  """`x` (already divided by its scale) as e4m3fn: clipped to +-448 first (a plain cast of a value
  past 464 is NaN)."""
  return jnp.clip(x, -FP8_MAX, FP8_MAX).astype(DTYPE)


def quantize_weight(w) -> Fp8Weight:
  """`w` `[K, N]` (any float dtype) as an `Fp8Weight`: per-output-column scales amax/448."""
  wf = w.astype(jnp.float32)
  scale = jnp.maximum(jnp.max(jnp.abs(wf), axis=0), _TINY) / FP8_MAX
  return Fp8Weight(w8=_to_fp8(wf / scale).T, scale=scale)


def dequantize_weight(q: Fp8Weight):
  """The float32 `[K, N]` weight `q` stands for."""
  return (q.w8.astype(jnp.float32) * q.scale[:, None]).T


def quantize_rows(a):
  """(`a8`, `scale`) of activations `a` `[..., K]`: e4m3fn `a / scale` and one float32 scale per
  row (token), amax/448 over K (dynamic: computed from `a` itself)."""
  af = a.astype(jnp.float32)
  scale = jnp.maximum(jnp.max(jnp.abs(af), axis=-1), _TINY) / FP8_MAX
  return _to_fp8(af / scale[..., None]), scale


def matmul(a, w: Fp8Weight, out_dtype):
  """`a [..., K] @ w [K, N]` as float8 x float8 (module docstring): the activations quantised per
  token, the e4m3fn product accumulated in float32 and written in `out_dtype` (the compute dtype:
  bfloat16 halves the bytes of an f32 product, whose rounding, 2^-9 relative, is far below fp8's),
  then scaled by `s_a[:, None] * s_w[None, :]` in float32 and cast to `out_dtype`."""
  lead = a.shape[:-1]
  a8, sa = quantize_rows(a.reshape(-1, a.shape[-1]))  # one 2-D GEMM whatever the leading dims
  y = jax.lax.dot_general(a8, w.w8, (((1,), (1,)), ((), ())), preferred_element_type=out_dtype)
  y = y.astype(jnp.float32) * sa[:, None] * w.scale[None, :]
  return y.astype(out_dtype).reshape(*lead, -1)


def matmul_error_bound(a, w):
  """Elementwise bound on `|matmul(a, quantize_weight(w), float32) - a @ w|` (float32 operands):
  each product a_k w_k carries at most (1 + e)^2 - 1 relative rounding (e = 2^-4) plus the
  subnormal terms, `(2e + e^2) |a| @ |w| + SUBNORMAL_ABS (s_a |w| + |a| s_w)` summed over k, plus
  their product term."""
  af, wf = jnp.abs(a.astype(jnp.float32)), jnp.abs(w.astype(jnp.float32))
  sa = jnp.max(af, axis=-1, keepdims=True) / FP8_MAX
  sw = jnp.max(wf, axis=0, keepdims=True) / FP8_MAX
  e, d = ROUNDING_REL, SUBNORMAL_ABS
  k = a.shape[-1]
  rel = (2 * e + e * e) * (af @ wf)
  sub = d * (1 + e) * (sa * wf.sum(0, keepdims=True) + af.sum(-1, keepdims=True) * sw)
  return rel + sub + d * d * k * sa * sw
