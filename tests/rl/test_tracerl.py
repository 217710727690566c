"""TraceRL: rounds and rows by hand, rows against real sampler states, exact log-probs, layouts.

The rollouts are real `sampler.generate` outputs of a tiny float32 model (LM head scaled so that
`low_confidence_dynamic` unmasks several tokens in some steps), temperature 1, with a stop id.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dice_jax import sharding
from dice_jax.diffusion import sampler, trace
from dice_jax.model.config import get_config
from dice_jax.model.transformer import Transformer
from dice_jax.rl import tracerl
from dice_jax.rl.trajectory import Trajectory, from_sample_output
from dice_jax.train import optimizer
from dice_jax.train import train_step as ts

B = 4
M = 255  # the tiny preset's mask token id
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]  # lengths 3 and 7: neither is a whole block
STRATEGIES = {"dynamic": ("low_confidence_dynamic", 4), "static": ("low_confidence_static", 2)}


def _model(seed=0, head_scale=40.0):
  model = Transformer(get_config("tiny", dtype="float32"), rngs=nnx.Rngs(seed))
  model.lm_head.set_value(model.lm_head[...] * head_scale)
  return model


_logprobs = jax.jit(lambda model, batch: tracerl.token_logprobs(model, batch))


def _generate(model, strategy, steps, stop_ids=()):
  cfg = sampler.SamplerConfig(
    max_new_tokens=24,
    temperature=1.0,
    strategy=strategy,
    steps=steps,
    threshold=0.5,
    return_logprobs=True,
    stop_ids=stop_ids,
  )
  return sampler.generate(model, PROMPTS, cfg, rng=jax.random.key(1)), cfg


def _stop_id(out):
  """A token first emitted by row 0 in block >= 1 and not at a block end, so that the row stops
  there with untrained tokens after it in the same block."""
  resp = np.asarray(out.tokens)[0, int(out.response_start[0]) :].tolist()
  for j in range(B, len(resp)):
    if j % B != B - 1 and resp[j] not in resp[:j]:
      return resp[j]
  pytest.fail(f"no usable stop id in {resp}")


@pytest.fixture(scope="module")
def model():
  return _model()


@pytest.fixture(scope="module", params=list(STRATEGIES))
def rollout(request, model):
  strategy, steps = STRATEGIES[request.param]
  first, _ = _generate(model, strategy, steps)
  out, cfg = _generate(model, strategy, steps, stop_ids=(_stop_id(first),))
  trajs = from_sample_output(out, PROMPTS, block_size=B)
  assert any(not t.loss_mask.all() for t in trajs), "no row stopped inside a block"
  return out, cfg, trajs


def _batch(trajs, layout, shrink=1, rows=8, **kw):
  cfg = tracerl.TraceRLConfig(layout=layout, shrink=shrink, **kw)
  (batch,) = tracerl.build_batches(
    trajs, cfg, block_size=B, mask_token_id=M, rows_per_batch=rows, length_multiple=32
  )
  return batch, cfg


# --- rounds and rows by hand ---------------------------------------------------------------------


def test_rounds_follow_each_blocks_distinct_steps_and_shrink():
  step_map = [1, 0, 1, 2, 4, 3, 3, 5, 6, 6, 6, 6]
  np.testing.assert_array_equal(
    trace.token_rounds(step_map, B), [2, 1, 2, 3, 2, 1, 1, 3, 1, 1, 1, 1]
  )
  # shrink 2: steps {0,1} -> round 1, {2} -> round 2 (state before step 2); same in block 1
  np.testing.assert_array_equal(
    trace.token_rounds(step_map, B, 2), [1, 1, 1, 2, 1, 1, 1, 2, 1, 1, 1, 1]
  )
  with pytest.raises(ValueError, match="multiple of block_size"):
    trace.token_rounds([0, 1, 2], B)


def _hand_trajectory(advantage=1.5):
  stop = 27
  return Trajectory(
    prompt_ids=[11, 12, 13],
    response_ids=[21, 22, 23, 24, 25, 26, stop, 28],
    step_map=[1, 0, 1, 2, 4, 3, 3, 5],
    loss_mask=[True] * 7 + [False],  # 28 follows the stop id: seen by the model, not trained
    sampler_logp=np.arange(1, 9) / -10,
    advantage=advantage,
  )


def test_packed_row_by_hand():
  t = _hand_trajectory()
  ((row, rounds),) = tracerl.trajectory_rows(
    t, tracerl.TraceRLConfig(), block_size=B, mask_token_id=M
  )
  assert rounds == 3
  # [prompt | x0 | b0 r1 | b0 r2 | b0 r3 | b1 r1 | b1 r2]; round 3 of block 1 trains nothing.
  want_tokens = [11, 12, 13, 21, 22, 23, 24, 25, 26, 27, 28]
  want_tokens += [M, M, M, M] + [M, 22, M, M] + [21, 22, 23, M] + [M, M, M, M] + [M, 26, 27, M]
  np.testing.assert_array_equal(row["tokens"], want_tokens)
  np.testing.assert_array_equal(
    row["positions"], list(range(11)) + [3, 4, 5, 6] * 3 + [7, 8, 9, 10] * 2
  )
  np.testing.assert_array_equal(row["block_ids"], [-1] * 3 + [0] * 4 + [1] * 4 + [0] * 12 + [1] * 8)
  np.testing.assert_array_equal(
    row["round_ids"], [0] * 11 + [1] * 4 + [2] * 4 + [3] * 4 + [1] * 4 + [2] * 4
  )
  p_mask = [0] * 11 + [0, 1, 0, 0] + [1, 0, 1, 0] + [0, 0, 0, 1] + [0, 1, 1, 0] + [1, 0, 0, 0]
  np.testing.assert_array_equal(row["p_mask"], np.array(p_mask, bool))
  np.testing.assert_array_equal(row["targets"][11:], [21, 22, 23, 24] * 3 + [25, 26, 27, 28] * 2)
  np.testing.assert_array_equal(row["advantages"], np.where(row["p_mask"], 1.5, 0.0))
  np.testing.assert_allclose(
    row["sampler_logp"][row["p_mask"]], [-0.2, -0.1, -0.3, -0.4, -0.6, -0.7, -0.5]
  )


def test_per_round_rows_by_hand():
  t = _hand_trajectory()
  rows = tracerl.trajectory_rows(
    t, tracerl.TraceRLConfig(layout="per_round"), block_size=B, mask_token_id=M
  )
  assert [r for _, r in rows] == [1, 1, 1]
  xt = [row["tokens"][11:].tolist() for row, _ in rows]
  assert xt[0] == [M] * 8
  assert xt[1] == [M, 22, M, M, M, 26, 27, M]
  assert xt[2] == [21, 22, 23, M, 25, 26, 27, M]  # block 1's 3rd group (28) is masked, untrained
  trained = [np.nonzero(row["p_mask"])[0].tolist() for row, _ in rows]
  assert trained == [[12, 16, 17], [11, 13, 15], [14]]
  for row, _ in rows:
    np.testing.assert_array_equal(row["positions"], list(range(11)) + list(range(3, 11)))


def test_shrink_2_trains_merged_steps_from_the_earliest_state():
  t = _hand_trajectory()
  ((row, rounds),) = tracerl.trajectory_rows(
    t, tracerl.TraceRLConfig(shrink=2), block_size=B, mask_token_id=M
  )
  assert rounds == 2  # block 1's round 2 holds only the untrained 28
  np.testing.assert_array_equal(row["tokens"][11:], [M] * 4 + [21, 22, 23, M] + [M] * 4)
  np.testing.assert_array_equal(np.nonzero(row["p_mask"])[0], [11, 12, 13, 18, 19, 20, 21])


def test_batches_are_bucketed_padded_and_carry_the_normalisers():
  trajs = [_hand_trajectory(a) for a in (1.0, -1.0, 0.5)]
  trajs[1].response_ids = trajs[1].response_ids[:4]  # a shorter response
  trajs[1].step_map, trajs[1].loss_mask = trajs[1].step_map[:4], trajs[1].loss_mask[:4]
  trajs[1].sampler_logp = trajs[1].sampler_logp[:4]
  cfg = tracerl.TraceRLConfig()
  batches = tracerl.build_batches(
    trajs, cfg, block_size=B, mask_token_id=M, rows_per_batch=2, pad_id=3, length_multiple=16
  )
  assert len(batches) == 2 and all(b["tokens"].shape[0] == 2 for b in batches)
  assert batches[0]["tokens"].shape[1] == 32  # 31 tokens -> 2 x 16
  last = batches[1]
  assert last["traj_index"].ravel().tolist() == [2, -1] and last["norm_rounds"][1, 0] == 0
  assert (last["tokens"][1] == 3).all() and not last["segment_ids"][1].any()
  assert batches[0]["norm_rounds"].ravel().tolist() == [3, 3]
  assert (batches[0]["norm_length"] == 8).all()  # L1: the longest response of the RL step
  shuffled = tracerl.build_batches(
    trajs, cfg, block_size=B, mask_token_id=M, rows_per_batch=3, rng=np.random.default_rng(0)
  )
  assert sorted(shuffled[0]["traj_index"].ravel().tolist()) == [0, 1, 2]
  assert [tracerl.bucket_length(n, 128) for n in (1, 129, 300, 385, 769, 1600)] == [
    128,
    256,
    384,
    512,
    1024,
    2048,
  ]
  # never past the longest row there can be (rounded up): 21,376 -> 21,376, not 24,576
  assert tracerl.bucket_length(21_376, 128) == 24_576
  assert tracerl.bucket_length(21_376, 128, cap=21_376) == 21_376
  assert tracerl.bucket_length(9_000, 128, cap=21_376) == 12_288  # below the cap: the bucket
  assert tracerl.bucket_length(300, 128, cap=200) == 384  # a row past the cap still fits
  capped = tracerl.build_batches(
    trajs, cfg, block_size=B, mask_token_id=M, rows_per_batch=2, length_multiple=16, max_length=31
  )
  assert capped[0]["tokens"].shape[1] == 32 and capped[1]["tokens"].shape[1] == 32


def test_policy_terms_by_hand():
  delta = jnp.array([[0.5, 0.0, -1.0, 12.0, 7.0]])
  adv = jnp.array([[1.0, -1.0, 1.0, -1.0, 1.0]])
  p_mask = jnp.array([[True, True, True, True, False]])
  old = jnp.full((1, 5), -2.0)
  got = tracerl.policy_terms(old + delta, old, adv, p_mask, clip_eps=0.2, ratio_clamp=10.0)
  e = math.exp
  np.testing.assert_allclose(got["pg"][0], [-1.2, 1.0, -e(-1), e(10), 0.0], rtol=1e-6)
  np.testing.assert_allclose(
    got["kl"][0], [e(-0.5) - 1 + 0.5, 0.0, e(1) - 2, e(-10) - 1 + 12, 0.0], rtol=1e-6
  )
  np.testing.assert_allclose(got["ratio"][0], [e(0.5), 1.0, e(-1), e(10), 1.0], rtol=1e-6)
  assert got["clipped"][0].tolist() == [True, False, False, False, False]


# --- against real rollouts -----------------------------------------------------------------------


def _find_noisy(batch, traj, block, round_):
  rows = np.nonzero(batch["traj_index"][:, 0] == traj)[0]
  for row in rows:
    sel = (batch["round_ids"][row] == round_) & (batch["block_ids"][row] == block)
    if sel.any():
      return row, sel
  return None, None


@pytest.mark.parametrize("layout", ["packed", "per_round"])
def test_rows_reproduce_every_state_the_sampler_saw(rollout, layout):
  out, _, trajs = rollout
  batch, _ = _batch(trajs, layout)
  tokens, step_map = jnp.asarray(out.tokens), jnp.asarray(out.step_map)
  checked = 0
  for i, t in enumerate(trajs):
    start, p = int(out.response_start[i]), t.prompt_ids.size
    rounds = trace.token_rounds(t.step_map, B)
    for s in np.unique(t.step_map):
      cols = np.nonzero(t.step_map == s)[0]
      block = cols[0] // B
      assert (cols // B == block).all()
      r = int(rounds[cols[0]])
      row, sel = _find_noisy(batch, i, block, r)
      if not t.loss_mask[cols].any():
        continue  # a step that decoded only tokens after the stop id is not trained
      assert row is not None, f"traj {i}: no row for step {s}"
      seen = np.asarray(trace.state_before_step(tokens[i : i + 1], step_map[i : i + 1], [s], M))[0]
      block_cols = start + block * B + np.arange(B)
      np.testing.assert_array_equal(batch["tokens"][row][sel], seen[block_cols], f"step {s}")
      np.testing.assert_array_equal(batch["positions"][row][sel], p + block * B + np.arange(B))
      # the visible context (prompt and final earlier blocks) is the sampler's canvas too
      clean = (batch["round_ids"][row] == 0) & (batch["segment_ids"][row] > 0)
      ctx = clean & (batch["block_ids"][row] < block)
      np.testing.assert_array_equal(
        batch["tokens"][row][ctx], seen[start - p : start + block * B], f"step {s}"
      )
      cut = slice(block * B, block * B + B)
      want_trained = (t.step_map[cut] == s) & t.loss_mask[cut]
      np.testing.assert_array_equal(batch["p_mask"][row][sel], want_trained, f"step {s}")
      checked += 1
  assert checked >= 10


def test_block_alignment_is_the_samplers(rollout):
  out, cfg, trajs = rollout
  layout = sampler.layout_prompts(PROMPTS, cfg, M)
  batch, _ = _batch(trajs, "packed")
  for i, t in enumerate(trajs):
    start, p, n = int(out.response_start[i]), t.prompt_ids.size, t.response_ids.size
    row = int(np.nonzero(batch["traj_index"][:, 0] == i)[0][0])
    np.testing.assert_array_equal(
      batch["block_ids"][row, : p + n], layout.block_ids[i, start - p : start + n]
    )
    np.testing.assert_array_equal(
      batch["positions"][row, : p + n], layout.positions[i, start - p : start + n]
    )


@pytest.mark.parametrize("layout", ["packed", "per_round"])
def test_trainer_logprobs_equal_the_samplers_at_decode_time(rollout, model, layout):
  _, _, trajs = rollout
  batch, _ = _batch(trajs, layout)
  got = np.asarray(_logprobs(model, batch))
  p_mask = batch["p_mask"]
  assert p_mask.sum() == sum(t.trained_tokens for t in trajs)  # every trained token once
  np.testing.assert_allclose(got[p_mask], batch["sampler_logp"][p_mask], atol=1e-5, rtol=0)
  assert (got[~p_mask] == 0).all()


def test_one_update_moves_the_sampled_tokens_log_probs_with_the_advantages_sign(rollout, model):
  """DICE's optimizer (AdamW, constant lr, clip 1) on the generic step: A > 0 raises the
  log-probs of the sampled tokens, A < 0 lowers them."""
  _, _, trajs = rollout
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  ocfg = optimizer.OptimizerConfig(learning_rate=1e-4, schedule="constant")
  tx = optimizer.make_optimizer(ocfg, 1)
  cfg = tracerl.TraceRLConfig()
  step = None
  for sign in (1.0, -1.0):
    signed = [dataclasses.replace(t, advantage=sign) for t in trajs]
    batch, _ = _batch(signed, "packed")
    old = np.asarray(_logprobs(model, batch))
    batch["old_logp"] = old
    fresh = sharding.create_sharded(lambda: nnx.clone(model), mesh)  # new buffers: donated
    graphdef, state, shardings = ts.init_train_state(fresh, tx, mesh)
    if step is None:
      loss_fn = lambda m, b, r: tracerl.tracerl_loss(m, b, r, cfg)
      step = ts.jit_train_step(
        ts.make_train_step(graphdef, tx, loss_fn, means=tracerl.METRIC_MEANS), shardings, mesh
      )
    state, metrics = step(state, ts.shard_batch(batch, mesh), jax.random.key(0))
    new = np.asarray(_logprobs(nnx.merge(graphdef, state["params"]), batch))
    p_mask = batch["p_mask"]
    change = float((new - old)[p_mask].sum())
    assert sign * change > 0, (sign, change)
    # before the update the policy is the rollout policy: ratio 1, no KL, no clipping
    assert float(metrics["ratio_max"]) == pytest.approx(1.0, abs=1e-5)  # same params, other compile
    assert float(metrics["kl"]) == pytest.approx(0.0, abs=1e-7)
    assert float(metrics["clip_fraction"]) == 0.0
    assert float(metrics["loss"]) == pytest.approx(-sign * p_mask.sum() / metrics["denominator"])


def test_the_rollouts_old_log_probs_give_the_trainers_loss_and_gradients(rollout, model):
  """tracerl.old_logp='sampler' (no second forward) == 'trainer' (token_logprobs with the rollout
  parameters), in fp32, on advantages of both signs and a policy moved off the rollout's."""
  _, _, trajs = rollout
  rng = np.random.default_rng(0)
  trajs = [dataclasses.replace(t, advantage=float(rng.normal())) for t in trajs]
  batch, trainer = _batch(trajs, "packed")
  batch["old_logp"] = np.asarray(_logprobs(model, batch))
  sampler_cfg = dataclasses.replace(trainer, old_logp="sampler")
  graphdef, params = nnx.split(model, nnx.Param)
  keys = iter(jax.random.split(jax.random.key(5), 64))
  moved = jax.tree.map(
    lambda x: x + 0.05 * x.std() * jax.random.normal(next(keys), x.shape), params
  )
  out = {}
  for name, cfg in (("trainer", trainer), ("sampler", sampler_cfg)):
    b = batch if name == "trainer" else {k: v for k, v in batch.items() if k != "old_logp"}
    loss = lambda p, b, cfg=cfg: tracerl.tracerl_loss(nnx.merge(graphdef, p), b, None, cfg)  # noqa: E731
    out[name] = jax.jit(jax.value_and_grad(loss, has_aux=True))(moved, b)
  (lt, mt), gt = out["trainer"]
  (ls, ms), gs = out["sampler"]
  assert float(mt["kl_sum"]) > 0 and float(mt["ratio_max"]) != 1.0  # the policy moved
  np.testing.assert_allclose(float(ls), float(lt), rtol=1e-5)
  for k in ("kl_sum", "ratio_sum", "ratio_max", "clipped_tokens", "denominator"):
    np.testing.assert_allclose(float(ms[k]), float(mt[k]), rtol=1e-5, err_msg=k)
  scale = max(float(jnp.abs(x).max()) for x in jax.tree.leaves(gt))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale), gs, gt)
  with pytest.raises(ValueError, match="shrink=1"):
    tracerl.TraceRLConfig(old_logp="sampler", shrink=2)


@pytest.fixture(scope="module")
def absolute_rollout(model):
  """A rollout on SDAR's absolute grid (prompts of 3 and 7 tokens: the first block holds their
  last 3 tokens, fixed). Row 0 is cut as a stop id at its 6th response token would cut it: the
  rest of that block stays, visible and untrained; later blocks were never decoded."""
  cfg = sampler.SamplerConfig(
    max_new_tokens=24,
    temperature=1.0,
    strategy="low_confidence_dynamic",
    steps=4,
    threshold=0.5,
    return_logprobs=True,
    block_alignment="absolute",
  )
  out = sampler.generate(model, PROMPTS, cfg, rng=jax.random.key(1))
  trajs = from_sample_output(out, PROMPTS, block_size=B, block_alignment="absolute")
  t = trajs[0]
  stop, end = 5, 9  # response index 5 = block 2's 2nd slot (the first block holds 1 token)
  assert (len(PROMPTS[0]) + end) % B == 0
  trajs[0] = dataclasses.replace(
    t,
    response_ids=t.response_ids[:end],
    step_map=t.step_map[:end],
    loss_mask=np.arange(end) <= stop,
    sampler_logp=t.sampler_logp[:end],
  )
  return trajs


@pytest.mark.parametrize("layout", ["packed", "per_round"])
def test_trainer_logprobs_equal_the_samplers_on_the_absolute_grid(absolute_rollout, model, layout):
  trajs = absolute_rollout
  for t, prompt in zip(trajs, PROMPTS):
    assert (len(prompt) % B + t.response_ids.size) % B == 0 and t.response_ids.size % B != 0
  batch, _ = _batch(trajs, layout)
  got = np.asarray(_logprobs(model, batch))
  p_mask = batch["p_mask"]
  assert p_mask.sum() == sum(t.trained_tokens for t in trajs)  # the prompt's tail never trained
  np.testing.assert_allclose(got[p_mask], batch["sampler_logp"][p_mask], atol=1e-5, rtol=0)
  # the prompt's tail sits in the first noisy block, clean, in every round
  for row, i in enumerate(batch["traj_index"][:, 0]):
    if i < 0:
      continue
    prompt = PROMPTS[i]
    tail = len(prompt) % B
    first = (batch["round_ids"][row] > 0) & (batch["block_ids"][row] == 0)
    copies = batch["tokens"][row][first].reshape(-1, B)
    np.testing.assert_array_equal(copies[:, :tail], np.tile(prompt[-tail:], (len(copies), 1)))
    assert not (batch["p_mask"][row] & (batch["positions"][row] < len(prompt))).any()
