"""The sampler on a mesh (DESIGN "One mesh for everything", `diffusion/placement.py`): rows and their
KV cache split over the data axes, K/V heads over `tensor`, the weights and their decode copy as
training shards them. On 8 fake CPU devices every strategy decodes the tokens, step map and
log-probs of one device, each device holds 1/8 of the cache and of the weights, and the compiled
steps update the cache in place; with two processes each holds and decodes its half of the rows."""

import dataclasses
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dice_jax import sharding
from dice_jax.diffusion import engine, sampler
from dice_jax.model.config import get_config
from dice_jax.model.kv_cache import KVCache
from dice_jax.model.transformer import Transformer
from experiments import local_cluster

# STOP: a token the sharpened tiny model emits often (rows stop at different blocks); DYNAMIC: the RL
# rollout's decoding (dynamic strategy, ragged rows, log-probs) on the tiny model, as the two-process
# test decodes it
from tests.diffusion.sampler_processes import CFG as DYNAMIC
from tests.diffusion.sampler_processes import STOP

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MESH = dict(data=2, fsdp=2, tensor=2)  # rows split 4 ways, K/V heads 2 ways


def _models(**overrides):
  """(the tiny model on one device, the same parameters on the 8-device mesh), sharpened so that a
  float rounding of a sharded sum does not flip a near-tie."""
  mcfg = get_config("tiny", dtype="float32", **overrides)
  make = lambda: Transformer(mcfg, rngs=nnx.Rngs(0))
  pair = (make(), sharding.create_sharded(make, sharding.make_mesh(**MESH)))
  for m in pair:
    m.lm_head[...] = m.lm_head[...] * 60.0
  return pair


@pytest.fixture(scope="module")
def models():
  return _models()


def _prompts(n, seed=0):
  rs = np.random.RandomState(seed)
  return [rs.randint(2, 250, rs.randint(1, 12)).tolist() for _ in range(n)]


def _per_device_bytes(x) -> dict:
  out = {}
  for s in x.addressable_shards:
    out[s.device] = out.get(s.device, 0) + s.data.nbytes
  return out


def test_static_sampler_on_8_devices_decodes_the_tokens_of_one(models):
  """Lockstep decoding (the static strategy), sampled at temperature 1: equal tokens and step
  maps, log-probs to float rounding; the rows come back split 4 ways. (The ragged strategies: the
  engine test below.)"""
  cfg = sampler.SamplerConfig(
    temperature=1.0, max_new_tokens=10, stop_ids=(STOP,), return_logprobs=True
  )
  prompts = _prompts(8)
  want, got = (sampler.generate(m, prompts, cfg, jax.random.key(3)) for m in models)
  assert got.tokens.sharding.spec[0] == ("data", "fsdp")
  assert {s.data.shape[0] for s in got.tokens.addressable_shards} == {2}
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_array_equal(np.asarray(got.step_map), np.asarray(want.step_map))
  np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=2e-5)
  np.testing.assert_array_equal(np.asarray(got.response_lengths), np.asarray(want.response_lengths))
  assert 0 < int((np.asarray(want.tokens) == STOP).any(axis=1).sum()) < 8  # some rows stopped


def _memory(eng, sl, cache, host):
  """Compiled memory of the engine's decode and prefill steps (cached: the shapes it ran)."""
  with eng.placement.context():
    return [
      fn.lower(eng._state, eng._weights, sl, cache, *args).compile().memory_analysis()
      for fn, args in ((eng._steps.advance, ()), (eng._steps.admit, host))
    ]


def test_engine_on_8_devices_decodes_as_one_device_with_an_eighth_of_the_memory(models):
  """The continuous engine (dynamic strategy, ragged, as the RL rollout runs it), with refills,
  on a cache of 8 slots x 2,320: every request's tokens, step map and log-probs equal the
  one-device engine's. Each device holds 1/8 of the cache (2 of 8 slots, 1 of 2 K/V heads), and
  the compiled steps' per-device arguments are 1/8 of the cache's K/V and 1/4 of the rest (its
  per-slot metadata, and the weights: split over fsdp x tensor, whole on each of the 2 data
  replicas); the cache is aliased in place, and the temporaries fall with the rows (no gathered
  cache; each device prefills its own prompts)."""
  cfg = DYNAMIC
  reqs = [
    engine.Request(i, p, jax.random.key(100 + i), max_new_tokens=4 + i % 7)
    for i, p in enumerate(_prompts(13, seed=1))
  ]
  done, memory = [], []
  for m in models:
    eng = engine.ContinuousSampler(m, cfg, slots=8, max_prompt_len=2200, prefill_rows=4)
    done.append({c.id: c for c in eng.run(reqs)})
    sl, cache = eng._steps.init()
    rows = np.arange(4, dtype=np.int32)
    host = (
      rows,
      np.ones((4, 128), np.int32),
      rows + 1,
      rows + 1,
      jax.random.split(jax.random.key(0), 4),
    )
    memory.append(_memory(eng, sl, cache, host))
  assert eng.stats["admitted"] == len(reqs) and eng.stats["prefill_calls"] >= 3
  for r in reqs:
    want, got = done[0][r.id], done[1][r.id]
    np.testing.assert_array_equal(got.response_ids, want.response_ids, err_msg=str(r.id))
    np.testing.assert_array_equal(got.step_map, want.step_map, err_msg=str(r.id))
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=2e-5, err_msg=str(r.id))
    assert got.response_length == want.response_length
  with eng.placement.context():
    sl, cache, *_ = eng._steps.advance(eng._state, eng._weights, sl, cache)
  # [L, B, S, K*H]: rows over data x fsdp, the fused heads over tensor (whole heads per device)
  assert cache.k.sharding.spec == jax.P(None, ("data", "fsdp"), None, "tensor")
  for x in (cache.k, cache.v):
    assert set(_per_device_bytes(x).values()) == {x.nbytes // 8}
  assert set(_per_device_bytes(sl.out_tokens).values()) == {sl.out_tokens.nbytes // 4}
  kv = KVCache.num_bytes(models[0].cfg, 8, eng.cache_len)
  heads = cache.k.nbytes + cache.v.nbytes  # split over rows and heads; the rest over rows
  for one, mesh in zip(*memory):  # (decode, prefill)
    assert one.argument_size_in_bytes > kv
    share = heads / 8 + (one.argument_size_in_bytes - heads) / 4
    assert kv / 8 < mesh.argument_size_in_bytes <= share * 1.02, (one, mesh)
    assert mesh.alias_size_in_bytes >= kv / 8 - 8 * 4  # the cache, donated and updated in place
    assert mesh.temp_size_in_bytes < min(kv, one.temp_size_in_bytes) / 4, (one, mesh)


def test_commit_rows_on_8_devices_pack_each_row_shard_and_decode_the_tokens_of_one(models):
  """`commit_rows` with rows split 4 ways: each row shard packs its own rows (4 / 4 commit places
  each, so rows wait) and every row decodes the tokens, step map and log-probs of one device
  uncapped; a cap that does not divide into the shards is refused."""
  cfg = DYNAMIC
  prompts = _prompts(8)
  want = sampler.generate(models[0], prompts, cfg, jax.random.key(3))
  capped = dataclasses.replace(cfg, commit_rows=4)
  got = sampler.generate(models[1], prompts, capped, jax.random.key(3))
  assert got.tokens.sharding.spec[0] == ("data", "fsdp")
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_array_equal(np.asarray(got.step_map), np.asarray(want.step_map))
  np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=2e-5)
  assert int(got.forwards) > int(want.forwards)  # rows were deferred
  with pytest.raises(ValueError, match="multiple of the 4 row shards"):
    sampler.generate(models[1], prompts, dataclasses.replace(cfg, commit_rows=2))
  with pytest.raises(ValueError, match="multiple of the 4 row shards"):
    engine.ContinuousSampler(
      models[1], dataclasses.replace(cfg, commit_rows=6), slots=8, max_prompt_len=12
    )


@pytest.mark.parametrize("mesh_shape", [dict(fsdp=8), dict(fsdp=4, tensor=2)], ids=str)
def test_decode_weights_are_laid_out_by_the_training_rules(mesh_shape):
  """The bf16 decode copy on a mesh: fused q/k/v and gate/up without a tensor axis, kept apart
  (each head/column-split) with one; embed over fsdp; the values those of one device; each
  device holds ~1/8 (norm scales are whole on every device)."""
  mcfg = get_config("tiny", dtype="bfloat16", param_dtype="float32", attention_impl="flash")
  make = lambda: Transformer(mcfg, rngs=nnx.Rngs(0))
  model = sharding.create_sharded(make, sharding.make_mesh(**mesh_shape))
  graphdef, state = nnx.split(model)
  weights = sampler.split_weights(graphdef, state)
  fused = mesh_shape.get("tensor", 1) == 1
  whole = jax.device_put(state, jax.devices()[0])  # the same parameters on one device
  want = nnx.merge(graphdef, whole).decode_weights(fuse=fused)
  layer = weights.layers[1]
  spec = lambda x: tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
  if fused:
    assert set(layer) >= {"qkv_proj", "gate_up_proj"}
    assert spec(layer["qkv_proj"]) == ("fsdp", None)
  else:
    assert "qkv_proj" not in layer
    assert spec(layer["q_proj"]) == ("fsdp", "tensor", None)
    assert spec(layer["down_proj"]) == ("tensor", "fsdp")
  assert spec(weights.head) == ("fsdp", "tensor" if not fused else None)
  leaves, want_leaves = jax.tree.leaves(weights), jax.tree.leaves(want)
  for a, b in zip(leaves, want_leaves):
    assert a.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  total = sum(x.nbytes for x in leaves)
  per_device = {}
  for x in leaves:
    for d, n in _per_device_bytes(x).items():
      per_device[d] = per_device.get(d, 0) + n
  assert len(per_device) == 8
  norms = sum(x.nbytes for x in leaves if x.ndim == 1)
  assert set(per_device.values()) == {(total - norms) // 8 + norms}


@pytest.mark.parametrize("tensor, heads", [(2, "tensor"), (4, None)])
def test_fused_cache_heads_split_whole_over_tensor_and_rows_write_in_place(tensor, heads):
  """K/V are stored `[L, B, S, K*H]` (tiny: K = 2 heads of H = 16): `tensor` splits the fused
  axis into whole heads where it divides K, else not at all (4 divides K*H = 32 but would cut
  heads in half). `Placement.write_rows` (each device its own rows) writes what one device's
  `write_rows` writes."""
  from dice_jax.diffusion import placement

  mcfg = get_config("tiny", dtype="float32")
  lay = placement.Placement(sharding.make_mesh(fsdp=-1, tensor=tensor))
  cache = KVCache.empty(mcfg, 8, 32)
  sh = lay.cache(cache)
  assert sh.k.spec == jax.P(None, ("data", "fsdp"), None, heads) and sh.v.spec == sh.k.spec
  placed = jax.device_put(cache, sh)
  L, K, H = mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim
  rows_per_device = 8 // (8 // tensor)  # over fsdp = 8 / tensor
  local = {s.data.shape for s in placed.k.addressable_shards}
  assert local == {(L, rows_per_device, 32, H if heads else K * H)}  # one head, or both
  r = np.random.RandomState(0)
  rows = jnp.asarray([0, 3, 8, 6], jnp.int32)  # 8: a padding row, written nowhere
  k, v = (jnp.asarray(r.randn(L, 4, 5, K, H), jnp.float32) for _ in range(2))
  meta = (jnp.ones((4, 32), jnp.int32),) * 3 + (jnp.full((4,), 5, jnp.int32),)
  with lay.context():
    got = jax.jit(lambda c, *a: lay.write_rows(c, *a[:3], 2, *a[3:]))(placed, rows, k, v, *meta)
  want = cache.write_rows(rows, k, v, 2, *meta)
  assert got.k.sharding.spec == sh.k.spec
  for a, b in ((got.k, want.k), (got.v, want.v)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(want.heads(want.k))[:, 3, 2:7], np.asarray(k[:, 1]))


def test_free_slots_give_every_row_shard_its_own_rows():
  """Admission rows by shard: the j-th block lies in shard j's slots, padding (= the slot count)
  where a shard has no free slot or no request is left; full calls of `prefill_rows` while they
  fill up, else one row per shard."""
  free = engine.FreeSlots(8, 4)  # shard j: slots 2j, 2j + 1
  assert free.take(8, prefill_rows=8) == list(range(8))
  for s in (1, 6, 7):
    free.release(s)
  assert len(free) == 3
  # 3 requests cannot fill a call of 2 per shard: one per shard, shards 1 and 2 padded
  assert free.take(3, prefill_rows=8) == [1, 8, 8, 6]
  assert free.take(5, prefill_rows=8) == [8, 8, 8, 7]
  free = engine.FreeSlots(8, 1)
  assert free.take(5, prefill_rows=4) == [0, 1, 2, 3] and free.take(1, prefill_rows=4) == [4]


def test_memory_estimate_divides_by_the_shards(models):
  """The check before compiling is per device: the cache over rows x heads, weights over
  fsdp x tensor, activations over rows."""
  cfg = sampler.SamplerConfig(max_new_tokens=64)
  layout = sampler.layout_prompts(_prompts(8), cfg.for_model(models[0].cfg), 255)
  one, mesh = (sampler.memory_estimate(m, layout, cfg.for_model(m.cfg)) for m in models)
  assert mesh["kv_cache"] == math.ceil(one["kv_cache"] / 8)
  assert mesh["weights"] == math.ceil(one["weights"] / 4)
  assert mesh["activations"] * 4 == one["activations"]


@pytest.mark.slow  # two processes compile the engine and the static sampler: ~1 min
def test_two_processes_each_decode_their_half_of_the_rows(tmp_path, reaped):
  """Two JAX processes (2 fake CPU devices each, rows over the 4) run the engine on one mesh:
  each holds the cache rows of its own devices only (its half), and both get every request's
  tokens, step map and log-probs, those of one device alone."""
  procs = local_cluster.start(
    [sys.executable, "-m", "tests.diffusion.sampler_processes", f"--out={tmp_path}"],
    2,
    cpu_devices=2,
    env=dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", "")),
    log_dir=str(tmp_path),
    cwd=REPO,
  )
  reaped.extend(procs)
  codes = [p.wait(timeout=600) for p in procs]
  logs = [(tmp_path / f"process_{i}.log").read_text()[-3000:] for i in range(2)]
  assert codes == [0, 0], logs
  seen = [json.loads((tmp_path / f"process_{i}.json").read_text()) for i in range(2)]
  flat = lambda rows: np.concatenate([np.ravel(r) for r in rows])
  for i, s in enumerate(seen):
    assert s["devices"] == 4
    assert s["cache rows held"] == [[2 * i, 2 * i + 1], [2 * i + 1, 2 * i + 2]]
    assert s["cache bytes per device"] == [s["cache bytes"] // 4] * 2
    (tokens, steps, logp), want = s["mesh"], s["alone"]  # a list per request each
    assert tokens == want[0] and steps == want[1]
    np.testing.assert_allclose(flat(logp), flat(want[2]), atol=2e-5)
  assert seen[0]["mesh"] == seen[1]["mesh"]  # every process has every row
