"""Float8 decode weights (`model/fp8.py`): rounding bounds of the quantised weights and of the
float8 x float8 matmul, and a decode forward on them against the exact one."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dice_jax.model import fp8, masks, transformer
from dice_jax.model.config import get_config


def _random(seed, *shape, spread=True):
  """Gaussian values; with `spread`, columns and rows scaled over 4 decades (scales must adapt)."""
  r = np.random.RandomState(seed)
  x = r.randn(*shape)
  if spread:
    x = x * 10.0 ** r.uniform(-2, 2, shape[-1]) * 10.0 ** r.uniform(-2, 2, (*shape[:-1], 1))
  return jnp.asarray(x, jnp.float32)


def test_quantized_weight_rounds_each_element_within_half_an_e4m3_ulp():
  w = _random(0, 96, 160).at[3, 7].set(0.0)
  q = fp8.quantize_weight(w)
  assert q.w8.dtype == jnp.float8_e4m3fn and q.w8.shape == (160, 96) and q.shape == (96, 160)
  assert q.scale.shape == (160,) and q.scale.dtype == jnp.float32
  np.testing.assert_allclose(q.scale, np.abs(np.asarray(w)).max(0) / 448.0, rtol=1e-6)
  back = np.asarray(fp8.dequantize_weight(q))
  err, wa = np.abs(back - np.asarray(w)), np.abs(np.asarray(w))
  # Normal values: half an ulp (2^-4 relative); subnormal ones: 2^-10 of the column's scale.
  bound = fp8.ROUNDING_REL * wa + fp8.SUBNORMAL_ABS * np.asarray(q.scale)[None, :]
  assert (err <= bound * (1 + 1e-5)).all()
  assert back[3, 7] == 0.0
  # Each column's largest magnitude is exactly representable (448 * scale), and the bound is tight
  # in practice: the mean relative error of a uniform rounding is far below the bound.
  cols = np.abs(np.asarray(w)).argmax(0)
  np.testing.assert_allclose(back[cols, np.arange(160)], np.asarray(w)[cols, np.arange(160)], 1e-6)
  rel = err[wa > 0] / wa[wa > 0]
  assert 0.005 < rel.mean() < 0.03, rel.mean()
  # An all-zero column gets a finite scale and stays zero; NaN never appears.
  z = fp8.quantize_weight(jnp.zeros((8, 4)))
  assert (
    np.isfinite(np.asarray(z.scale)).all() and (np.asarray(fp8.dequantize_weight(z)) == 0).all()
  )


def test_quantize_rows_scales_each_token_and_never_overflows():
  a = _random(1, 3, 5, 64)
  a8, s = fp8.quantize_rows(a)
  assert a8.shape == a.shape and s.shape == (3, 5)
  x = np.asarray(a8.astype(jnp.float32))
  assert np.isfinite(x).all() and np.abs(x).max(-1).min() == 448.0  # each row's amax maps to 448


def test_fp8_matmul_is_within_the_rounding_bound_of_the_float32_product():
  a, w = _random(2, 4, 6, 128), _random(3, 128, 80, spread=False) * 0.02
  got = np.asarray(fp8.matmul(a, fp8.quantize_weight(w), jnp.float32))
  a2 = a.reshape(-1, 128)
  want = np.asarray(a2 @ w).reshape(4, 6, 80)
  bound = np.asarray(fp8.matmul_error_bound(a2, w)).reshape(4, 6, 80)
  assert got.shape == (4, 6, 80)
  assert (np.abs(got - want) <= bound * (1 + 1e-4) + 1e-6).all()
  # Measured: random signs cancel, the relative error is ~3.5 % (the bound's 2^-3 is a worst case).
  rel = np.linalg.norm(got - want) / np.linalg.norm(want)
  assert 0.01 < rel < 0.06, rel
  # Written in bf16 (the compute dtype), the product keeps the same error.
  got16 = np.asarray(fp8.matmul(a, fp8.quantize_weight(w), jnp.bfloat16).astype(jnp.float32))
  assert np.linalg.norm(got16 - want) / np.linalg.norm(want) < 0.06


def test_decode_forward_on_fp8_weights_agrees_with_the_exact_forward():
  """The split weights' projections as `Fp8Weight`s (norms, LM head as they are): the tiny model's
  logits within 7 % (measured 4.7 %) and its argmax at >= 85 % of 1,024 positions (measured 92.6 %;
  a random model's near-ties flip)."""
  cfg = get_config("tiny", dtype="bfloat16", attention_impl="flash")
  model = transformer.Transformer(cfg, rngs=nnx.Rngs(0))
  w, w8 = model.decode_weights(), model.decode_weights(weights_dtype="float8_e4m3fn")
  layer = w8.layers[0]
  assert set(layer) == set(w.layers[0])
  for name in transformer.FP8_PROJECTIONS:
    assert isinstance(layer[name], fp8.Fp8Weight) and layer[name].w8.dtype == jnp.float8_e4m3fn
  assert layer["o_proj"].shape == (cfg.num_heads * cfg.head_dim, cfg.hidden_size)
  assert w8.head.dtype == jnp.bfloat16 and (w8.head == w.head).all()
  r = np.random.RandomState(0)
  tok = jnp.asarray(r.randint(2, 250, (64, 16)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), tok.shape)
  spec = masks.AttentionSpec.block_causal(4, jnp.ones_like(pos), pos // 4)
  want = transformer.DecodeView(model, w)(tok, pos, spec)
  got = transformer.DecodeView(model, w8)(tok, pos, spec)
  rel = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
  agree = float((got.argmax(-1) == want.argmax(-1)).mean())
  assert 0.0 < rel < 0.07 and agree >= 0.85, (rel, agree)


def test_fp8_weights_are_refused_unfused_or_unknown():
  model = transformer.Transformer(get_config("tiny"), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="needs fused decode weights"):
    model.decode_weights(fuse=False, weights_dtype="float8_e4m3fn")
  with pytest.raises(ValueError, match="weights_dtype must be one of"):
    model.decode_weights(weights_dtype="int8")
