"""TraceRL layouts and steps: packed == per-round (loss and gradients), chunking, accumulation,
old log-probs on a sharded mesh. Trajectories are synthetic: random prompts and responses of
different lengths with random, valid step patterns (1 to 4 steps per block, several tokens per
step, stop ids inside the last block)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dice_jax import sharding
from dice_jax.model.config import get_config
from dice_jax.model.transformer import Transformer
from dice_jax.rl import tracerl
from dice_jax.rl.trajectory import Trajectory
from dice_jax.train import train_step as ts

B = 4
M = 255


def random_trajectory(rng, prompt_len, n_blocks, stop_at=None, advantage=None):
  step, steps = 0, []
  for _ in range(n_blocks):
    k = int(rng.integers(1, B + 1))  # steps this block used
    groups = rng.permutation(np.concatenate([np.arange(k), rng.integers(0, k, B - k)]))
    steps.append(step + groups)
    step += k
  n = n_blocks * B
  loss = np.arange(n) <= (n - 1 if stop_at is None else stop_at)
  return Trajectory(
    prompt_ids=rng.integers(1, 200, prompt_len),
    response_ids=rng.integers(1, 200, n),
    step_map=np.concatenate(steps),
    loss_mask=loss,
    sampler_logp=np.zeros(n),
    advantage=float(rng.normal()) if advantage is None else advantage,
  )


def trajectories(seed=0):
  rng = np.random.default_rng(seed)
  return [
    random_trajectory(rng, 5, 3),
    random_trajectory(rng, 9, 1, stop_at=1),
    random_trajectory(rng, 2, 4, stop_at=13),
    random_trajectory(rng, 12, 2),
  ]


@pytest.fixture(scope="module")
def models():
  cfg = get_config("tiny", dtype="float32")
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  old = Transformer(cfg, rngs=nnx.Rngs(0))  # the rollout policy: the same weights, perturbed
  graphdef, params = nnx.split(old, nnx.Param)
  keys = iter(jax.random.split(jax.random.key(3), 64))
  params = jax.tree.map(
    lambda x: x + 0.3 * x.std() * jax.random.normal(next(keys), x.shape), params
  )
  return model, nnx.merge(graphdef, params)


def _one_batch(trajs, layout, shrink, rows=16):
  cfg = tracerl.TraceRLConfig(layout=layout, shrink=shrink)
  (batch,) = tracerl.build_batches(
    trajs, cfg, block_size=B, mask_token_id=M, rows_per_batch=rows, length_multiple=16
  )
  return batch, cfg


@jax.jit
def _old_logp(model, batch):
  return tracerl.token_logprobs(model, batch)


def _loss_sum_and_grads(model, batch, cfg):
  graphdef, params = nnx.split(model, nnx.Param)

  @jax.jit
  def f(params, batch):
    loss = lambda p: tracerl.tracerl_loss(nnx.merge(graphdef, p), batch, None, cfg)
    return jax.value_and_grad(loss, has_aux=True)(params)

  (loss_sum, metrics), grads = f(params, batch)
  return float(loss_sum), metrics, grads


@pytest.mark.parametrize("shrink", [1, 2])
def test_packed_layout_equals_per_round_layout_in_loss_and_gradients(models, shrink):
  model, old_model = models
  trajs = trajectories()
  results, batches = {}, {}
  for layout in ("packed", "per_round"):
    batch, cfg = _one_batch(trajs, layout, shrink)
    batch["old_logp"] = np.asarray(_old_logp(old_model, batch))
    results[layout], batches[layout] = _loss_sum_and_grads(model, batch, cfg), batch
  # the packed rows are shorter than the per-round rows they replace
  assert batches["packed"]["segment_ids"].sum() < batches["per_round"]["segment_ids"].sum()
  (lp, mp, gp), (lr, mr, gr) = results["packed"], results["per_round"]
  for k in ("denominator", "trained_tokens", "rounds", "clipped_tokens"):
    assert float(mp[k]) == float(mr[k]), k
  for k in ("kl_sum", "entropy_sum", "ratio_sum", "ratio_max", "pg_sum"):
    np.testing.assert_allclose(float(mp[k]), float(mr[k]), rtol=1e-5)
  # Both normalisers are the same for both layouts, so loss = loss_sum / D and its gradient
  # grad(loss_sum) / D agree under either normalisation when loss_sum and grad(loss_sum) agree.
  tokens = [float(tracerl.normalizer(b, "tokens")) for b in batches.values()]
  assert tokens[0] == tokens[1] == float(mp["trained_tokens"])
  np.testing.assert_allclose(lp, lr, rtol=1e-5)
  scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(gr))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale), gp, gr)
  # the old policy differs: some tokens clipped, some not, and a real KL
  assert 0 < float(mp["clipped_tokens"]) < float(mp["trained_tokens"]) and float(mp["kl_sum"]) > 0
  # DICE's normaliser: L1 (longest response, 16 tokens) x (response, round) pairs
  rounds = float(mp["rounds"])
  assert float(mp["denominator"]) == 16 * rounds and rounds == len(per_round_rows_of(trajs, shrink))


def per_round_rows_of(trajs, shrink):
  cfg = tracerl.TraceRLConfig(layout="per_round", shrink=shrink)
  return [r for t in trajs for r in tracerl.trajectory_rows(t, cfg, block_size=B, mask_token_id=M)]


def test_chunked_log_probs_equal_one_pass_in_value_and_gradient(models):
  model, _ = models
  batch, _ = _one_batch(trajectories(1), "packed", 1)
  hidden = jax.random.normal(jax.random.key(0), batch["tokens"].shape + (64,))
  targets, p_mask = jnp.asarray(batch["targets"]), jnp.asarray(batch["p_mask"])
  assert batch["tokens"].shape[1] > 40

  def f(h, chunk):
    logp, ent = tracerl.chunked_target_logprobs(model, h, targets, p_mask, chunk)
    return jnp.sum(logp * jnp.arange(logp.shape[1])), (logp, ent)

  (v1, (lp1, e1)), g1 = jax.value_and_grad(f, has_aux=True)(hidden, 10**6)
  (v2, (lp2, e2)), g2 = jax.value_and_grad(f, has_aux=True)(hidden, 7)  # not a divisor of T
  np.testing.assert_allclose(lp2, lp1, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(e2, e1, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(g2, g1, rtol=1e-5, atol=1e-7)
  assert (np.asarray(lp1)[~batch["p_mask"]] == 0).all() and (
    np.asarray(e1)[batch["p_mask"]] > 0
  ).all()


def _rl_step(cfg, mesh, model, accum, lr=0.1):
  model = sharding.create_sharded(lambda: model, mesh)
  tx = optax.sgd(lr)
  graphdef, state, shardings = ts.init_train_state(model, tx, mesh)
  loss_fn = lambda m, b, r: tracerl.tracerl_loss(m, b, r, cfg)
  step = ts.make_train_step(
    graphdef,
    tx,
    loss_fn,
    accum_steps=accum,
    means=tracerl.METRIC_MEANS,
    is_empty=tracerl.is_empty,
  )
  return ts.jit_train_step(step, shardings, mesh, accum), state


def test_accumulation_over_micro_batches_with_different_rounds_is_exact(models):
  """4 rows and 4 empty ones: one pass over all 8 == 4 micro-batches of 2, the last two (empty)
  skipped."""
  model, old_model = models
  batch, cfg = _one_batch(trajectories(2), "packed", 1, rows=8)
  assert (batch["traj_index"][:4, 0] >= 0).all() and (batch["traj_index"][4:, 0] < 0).all()
  assert len(set(batch["norm_rounds"][:4].ravel().tolist())) > 1  # micro-batches weigh differently
  batch["old_logp"] = np.asarray(_old_logp(old_model, batch))
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  out = {}
  for accum in (1, 4):
    step, state = _rl_step(cfg, mesh, nnx.clone(model), accum)
    state, m = step(state, ts.shard_batch(batch, mesh, accum), jax.random.key(0))
    out[accum] = (jax.device_get(state["params"]), {k: float(v) for k, v in m.items()})
  (p1, m1), (p2, m2) = out[1], out[4]
  for k in ("loss", "denominator", "trained_tokens", "kl", "clip_fraction", "ratio_max", "pg_loss"):
    np.testing.assert_allclose(m2[k], m1[k], rtol=1e-5, err_msg=k)
  assert m1["ratio_max"] > 1.0 and m1["kl"] > 0 and m1["grad_norm"] > 0
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), p1, p2)
  # the mean of per-micro-batch losses would differ
  halves = [{k: v[i * 2 : i * 2 + 2] for k, v in batch.items()} for i in range(2)]
  per_half = []
  for h in halves:
    s, hm = tracerl.tracerl_loss(old_model, h, None, cfg)
    per_half.append(float(hm["denominator"]))
  assert per_half[0] != per_half[1]


def _pairs(batch):
  """The (response, round) pairs a batch trains, from its rows."""
  out = []
  for row, i in enumerate(batch["traj_index"][:, 0]):
    rounds = np.unique(batch["round_ids"][row][batch["p_mask"][row]])
    out += [(int(i), int(r)) for r in rounds]
  return sorted(out)


def test_dices_round_units_on_packed_rows_give_the_per_round_optimizer_steps(models):
  """batch_units='rounds': mini-batches of 7 (response, round) pairs in file order (DICE's rows).
  Packed rows (a response's pairs in one batch share a row; a response is split across two
  batches) train the same pairs with the same loss and gradients as per-round rows, batch by
  batch, on fewer tokens. The old log-probs are the rollout's (old_logp='sampler')."""
  model, _ = models
  rng = np.random.default_rng(7)
  trajs = []
  for t in trajectories(4):
    t.sampler_logp = -np.abs(rng.normal(size=t.response_ids.size)).astype(np.float32)
    trajs.append(t)
  out = {}
  for layout in ("packed", "per_round"):
    cfg = tracerl.TraceRLConfig(layout=layout, batch_units="rounds", old_logp="sampler")
    batches = tracerl.build_batches(
      trajs, cfg, block_size=B, mask_token_id=M, rows_per_batch=7, length_multiple=16
    )
    out[layout] = batches, [_loss_sum_and_grads(model, b, cfg) for b in batches]
  (packed, rp), (per_round, rr) = out["packed"], out["per_round"]
  assert len(packed) == len(per_round) == -(-len(per_round_rows_of(trajs, 1)) // 7) == 2
  for bp, br, (lp, mp, gp), (lr, mr, gr) in zip(packed, per_round, rp, rr):
    assert _pairs(bp) == _pairs(br)
    assert (bp["traj_index"] >= 0).sum() <= (br["traj_index"] >= 0).sum()  # no more rows ...
    assert bp["segment_ids"].sum() < br["segment_ids"].sum()  # ... and fewer tokens
    for k in ("denominator", "trained_tokens", "rounds", "clipped_tokens"):
      assert float(mp[k]) == float(mr[k]), k
    np.testing.assert_allclose(lp, lr, rtol=1e-5)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(gr))
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale), gp, gr
    )
  firsts = [set(b["traj_index"][:, 0].tolist()) - {-1} for b in packed]
  assert firsts[0] & firsts[1]  # a response whose rounds straddle two optimizer steps


def test_old_log_probs_on_a_sharded_mesh_with_accumulation_equal_one_device(models):
  model, _ = models
  batch, _ = _one_batch(trajectories(3), "packed", 1, rows=8)
  want = np.asarray(_old_logp(model, batch))
  mesh = sharding.make_mesh(1, 4, 2)
  sharded = sharding.create_sharded(lambda: nnx.clone(model), mesh)
  graphdef, abs_params = nnx.split(sharded, nnx.Param)
  params = abs_params.to_pure_dict()
  run = tracerl.jit_token_logprobs(graphdef, ts.param_shardings(abs_params, mesh), mesh, 2)
  got = run(params, ts.shard_batch(batch, mesh, 2))
  assert got.shape == (2, 4, batch["tokens"].shape[1])
  np.testing.assert_allclose(np.asarray(got).reshape(want.shape), want, atol=1e-5)


def test_a_batch_without_old_log_probs_is_refused(models):
  batch, cfg = _one_batch(trajectories(), "packed", 1)
  with pytest.raises(KeyError, match="old_logp"):
    tracerl.tracerl_loss(models[0], batch, None, cfg)
  with pytest.raises(ValueError, match="layout must be one of"):
    tracerl.TraceRLConfig(layout="rows")
  with pytest.raises(ValueError, match="normalization must be one of"):
    tracerl.TraceRLConfig(normalization="length")
