"""The Pallas cached-attention kernel (interpreted on CPU) equals the dense cached attention."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dice_jax.diffusion import sampler
from dice_jax.model import flash_decode, masks, transformer
from dice_jax.model.config import get_config
from dice_jax.model.kv_cache import KVCache


@pytest.mark.parametrize("kind", ["block_causal", "causal"])
def test_flash_cached_attention_matches_dense(kind, monkeypatch):
  b, t, s, n, k, h = 3, 8, 64, 4, 2, 16
  monkeypatch.setattr(flash_decode, "SPLIT", 16)  # 4 splits; some hold only padding or no slot
  r = np.random.RandomState(0)
  f = lambda *shape: jnp.asarray(r.randn(*shape), jnp.float32)
  q, kn, vn = f(b, t, n, h), f(b, t, k, h), f(b, t, k, h)
  ck, cv = f(2, b, s, k, h), f(2, b, s, k, h)  # two layers; layer 1 is attended
  cseg = np.ones((b, s), np.int32)
  cseg[0, :5] = 0  # left padding
  cseg[1, :20] = 0
  cpos = np.tile(np.arange(s) - 20, (b, 1)).astype(np.int32)
  cache = KVCache(k=ck, v=cv, positions=jnp.asarray(cpos),
                  segment_ids=jnp.asarray(cseg), block_ids=jnp.asarray(cpos // 4),
                  length=jnp.asarray(37))  # slots >= 37 hold garbage and must be ignored
  pos = jnp.asarray(np.tile(np.arange(17, 17 + t), (b, 1)), jnp.int32)
  seg = jnp.ones((b, t), jnp.int32)
  blk = pos // 4
  spec = masks.AttentionSpec(kind, 4, seg, blk)
  want = transformer.cached_attention(q, kn, vn, ck[1], cv[1], spec, pos, seg, blk, cache)
  got = flash_decode.cached_attention(q, kn, vn, 1, spec, pos, seg, blk, cache)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_sampler_with_flash_attention_matches_dense():
  prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]
  cfg = sampler.SamplerConfig(strategy="low_confidence_static", max_new_tokens=8)
  outs = []
  for impl in ("dense", "flash"):
    m = transformer.Transformer(get_config("tiny", dtype="float32", attention_impl=impl),
                                rngs=nnx.Rngs(0))
    m.lm_head[...] = m.lm_head[...] * 60.0
    outs.append(sampler.generate(m, prompts, cfg))
  np.testing.assert_array_equal(np.asarray(outs[0].tokens), np.asarray(outs[1].tokens))
  np.testing.assert_array_equal(np.asarray(outs[0].step_map), np.asarray(outs[1].step_map))
