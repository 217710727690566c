"""Continuous batching: refilled slots decode each request exactly as it decodes alone; the KV cache
is never copied (compiled memory); settings that cannot fit fail before compiling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dice_jax.diffusion import engine, placement, sampler
from dice_jax.model import KVCache
from dice_jax.model.config import get_config
from dice_jax.model.transformer import Transformer

STOP = 238  # a token the sharpened tiny model emits often: rows stop at different blocks


@pytest.fixture(scope="module")
def model():
  m = Transformer(get_config("tiny", dtype="float32"), rngs=nnx.Rngs(0))
  m.lm_head[...] = m.lm_head[...] * 60.0
  return m


def _requests(n=7, seed=0):
  rs = np.random.RandomState(seed)
  return [
    engine.Request(
      id=f"r{i}",
      prompt_ids=rs.randint(2, 250, rs.randint(1, 12)).tolist(),
      key=jax.random.key(100 + i),
      max_new_tokens=int(rs.randint(1, 15)),
    )
    for i in range(n)
  ]


@pytest.mark.slow  # compiles the engine's two steps and two static decodes (~1 min on 2 cores)
@pytest.mark.parametrize(
  "alignment, ragged, commit_rows",
  [("response", True, 0), ("absolute", False, 0), ("response", True, 1)],
  ids=["ragged", "lockstep", "ragged-commit_rows"],
)
def test_continuous_batching_gives_each_request_what_it_gets_alone(
  model, alignment, ragged, commit_rows
):
  """(`commit_rows=1`: at most one of the 3 slots commits per forward; rows wait, decode alike.)"""
  cfg = sampler.SamplerConfig(
    strategy="low_confidence_dynamic",
    threshold=0.5,
    max_new_tokens=14,
    stop_ids=(STOP,),
    temperature=1.0,
    block_alignment=alignment,
    return_logprobs=True,
    ragged=ragged,
    commit_rows=commit_rows,
  )
  reqs = _requests()
  pulled = []

  def queue():
    for r in reqs:
      pulled.append(r.id)
      yield r

  eng = engine.ContinuousSampler(model, cfg, slots=3, max_prompt_len=12, prefill_rows=2)
  order, done = [], {}
  for c in eng.run(queue()):
    if not order:
      first_seen_after = len(pulled)
    order.append(c.id)
    done[c.id] = c
  assert sorted(order) == sorted(r.id for r in reqs)
  assert first_seen_after < len(reqs)  # returned as it finished, before the queue ran dry
  assert eng.stats["admitted"] == len(reqs) and eng.stats["prefill_calls"] >= 4  # slots refilled
  # Reference: the static sampler on every request at once, each row with its request's key.
  out = sampler.generate(
    model,
    [r.prompt_ids for r in reqs],
    cfg,
    max_new_tokens=[r.max_new_tokens for r in reqs],
    keys=jnp.stack([r.key for r in reqs]),
  )
  tokens, steps, logp = (np.asarray(x) for x in (out.tokens, out.step_map, out.logprobs))
  stopped = 0
  for i, r in enumerate(reqs):
    c, gen = done[r.id], steps[i] >= 0
    np.testing.assert_array_equal(c.response_ids, tokens[i, gen], err_msg=r.id)
    np.testing.assert_array_equal(c.step_map, steps[i, gen], err_msg=r.id)
    np.testing.assert_allclose(c.logprobs, logp[i, gen], rtol=1e-4, atol=1e-5, err_msg=r.id)
    assert c.response_length == int(out.response_lengths[i])
    assert c.steps_used == int(out.steps_used[i]) == c.step_map.max() + 1
    assert list(c.prompt_ids) == r.prompt_ids
    stopped += int(STOP in c.response.tolist())
  assert 0 < stopped < len(reqs)  # some rows stopped early on the stop id, others on budget
  # ... and alone: one request decoded by itself.
  r = reqs[1]
  alone = sampler.generate(
    model, [r.prompt_ids], cfg, max_new_tokens=[r.max_new_tokens], keys=jnp.stack([r.key])
  )
  gen = np.asarray(alone.step_map)[0] >= 0
  np.testing.assert_array_equal(done[r.id].response_ids, np.asarray(alone.tokens)[0, gen])
  np.testing.assert_array_equal(done[r.id].step_map, np.asarray(alone.step_map)[0, gen])


def _small_model(attention_impl="dense"):
  cfg = get_config(
    "tiny",
    dtype="float32",
    param_dtype="float32",
    num_layers=8,
    head_dim=64,
    vocab_size=512,
    mask_token_id=511,
    attention_impl=attention_impl,
  )
  return Transformer(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
  "ragged, commit_rows", [(False, 0), (True, 0), (True, 3)], ids=["lockstep", "ragged", "capped"]
)
def test_no_copy_of_the_kv_cache_in_compiled_samplers(ragged, commit_rows):
  """The compiled static sampler holds one K/V cache (XLA temp = cache + activations, among them the
  dense path's per-layer K/V slices: 1/8 of a K buffer each here), and the engine's block step
  updates the donated cache in place (no cache-sized temp). A copy of K or V would fail both.
  (The flash path's memory is checked on the GPU: `bench_sampler` records the compiled temp; the
  Pallas interpreter used on CPU copies its operands.)"""
  impl = "dense"
  m = _small_model(impl)
  mc = m.cfg
  cfg = sampler.SamplerConfig(
    max_new_tokens=2048, prefill_chunk=4, ragged=ragged, commit_rows=commit_rows
  )
  layout = sampler.layout_prompts([[5] * 60] * 8, cfg, mc.mask_token_id)
  layout = jax.tree.map(jnp.asarray, layout)
  graphdef, state = nnx.split(m)
  keys = sampler.row_keys(None, 8)
  assert cfg.splits_weights(mc) == (impl == "flash")
  decode = sampler.compiled_decode(graphdef, cfg, placement.Placement.of(state))
  weights = sampler.split_weights(graphdef, state) if impl == "flash" else None
  stats = decode.lower(state, weights, layout, keys).compile().memory_analysis()
  one_kv = KVCache.num_bytes(mc, 8, 2048) // 2  # K or V alone
  cache_len = sampler._cache_len(m, cfg, layout.tokens.shape[1], 64)
  cache_bytes = KVCache.num_bytes(mc, 8, cache_len)
  assert cache_bytes <= stats.temp_size_in_bytes < cache_bytes + one_kv // 2, stats

  eng = engine.ContinuousSampler(m, cfg, slots=8, max_prompt_len=64)
  sl, cache = eng._steps.init()
  step = eng._steps.advance.lower(eng._state, eng._weights, sl, cache).compile().memory_analysis()
  assert step.temp_size_in_bytes < one_kv // 2, step
  assert step.alias_size_in_bytes >= KVCache.num_bytes(mc, 8, eng.cache_len) - 8 * 4


def test_engines_on_one_model_graph_share_their_compiled_steps(model):
  """A new engine per RL step (new weights, the same graph and config) reuses the compiled steps."""
  cfg = sampler.SamplerConfig(max_new_tokens=8)
  a = engine.ContinuousSampler(model, cfg, slots=2, max_prompt_len=4)
  b = engine.ContinuousSampler(
    Transformer(model.cfg, rngs=nnx.Rngs(5)), cfg, slots=2, max_prompt_len=4
  )
  assert a._steps is b._steps
  other = engine.ContinuousSampler(
    model, sampler.SamplerConfig(max_new_tokens=16), slots=2, max_prompt_len=4
  )
  assert other._steps is not a._steps


def test_engine_refuses_a_setting_that_cannot_fit_and_a_wrong_block_size(model):
  cfg = sampler.SamplerConfig(max_new_tokens=4096)
  with pytest.raises(ValueError, match=r"ContinuousSampler\(slots=64\) does not fit"):
    engine.ContinuousSampler(model, cfg, slots=64, max_prompt_len=1024, device_bytes=2**20)
  with pytest.raises(ValueError, match="block size 8 differs"):
    engine.ContinuousSampler(model, sampler.SamplerConfig(block_size=8), slots=2, max_prompt_len=8)
  eng = engine.ContinuousSampler(
    model, sampler.SamplerConfig(max_new_tokens=8), slots=2, max_prompt_len=4
  )
  with pytest.raises(ValueError, match="prompt of 5 tokens, expected 1..4"):
    list(eng.run([engine.Request("long", [3] * 5)]))
