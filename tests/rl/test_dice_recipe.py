"""`recipe=dice` (docs/dice_recipe.md): each RL item against a hand-built construction."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dice_jax import recipe as recipe_lib
from dice_jax.rl import tracerl
from dice_jax.rl.config import RLConfig
from dice_jax.rl.trajectory import Trajectory
from dice_jax.train.config import recipe_then_overrides
from dice_jax.train.optimizer import OptimizerConfig, make_optimizer

from .test_loop import PAIRS, small_config

B = 4  # block size


def test_recipes_fill_their_fields_and_an_explicit_set_wins():
  dice = recipe_lib.apply_recipe(RLConfig(), "dice")
  assert (dice.recipe, dice.tracerl.batch_units, dice.shuffle, dice.reset_optimizer) == (
    "dice",
    "rounds",
    False,
    True,
  )
  assert dice.tracerl.layout == "packed"  # DICE's steps, on packed rows
  assert (dice.optim.grad_scale, dice.optim.clip_norm, dice.tail_rows) == (1 / 32, 1.0, "drop")
  assert (dice.stop_tokens, dice.train_stop_token, dice.eval_every, dice.snapshot_every) == (
    "eos",
    False,
    10,
    10,
  )
  ours = recipe_lib.apply_recipe(dice, "ours")
  assert ours == dataclasses.replace(RLConfig(), recipe="ours")
  # DICE's recipe with our strict reward: the explicit --set wins whatever its place in the list
  cfg = recipe_then_overrides(
    RLConfig(), ["verifier.options.strictness=strict", "recipe=dice", "shuffle=True"]
  )
  assert cfg.recipe == "dice" and cfg.shuffle and cfg.reset_optimizer
  assert cfg.verifier.options == {**recipe_lib.DICE_VERIFY_OPTIONS, "strictness": "strict"}
  with pytest.raises(ValueError, match="recipe must be one of"):
    recipe_then_overrides(RLConfig(), ["recipe=DICE"])
  for bad, needle in ((dict(tail_rows="keep"), "tail_rows"), (dict(stop_tokens="eot"), "stop")):
    with pytest.raises(ValueError, match=needle):
      RLConfig(**bad)


def test_dice_presets_say_recipe_dice():
  from experiments.configs import rl_dice_e2e, rl_dice_infill

  for c in (rl_dice_infill.get_config(), rl_dice_e2e.get_config()):
    assert c.recipe == "dice" and c.verifier.options == recipe_lib.DICE_VERIFY_OPTIONS
    assert c == recipe_lib.apply_recipe(c, "dice")


def test_reward_options_reach_the_verifier_request():
  from dice_jax.verifier_client import ThreadedVerifier

  cfg = recipe_lib.apply_recipe(RLConfig(), "dice")
  client = ThreadedVerifier(["127.0.0.1:1"], options=cfg.verifier.options)
  try:
    opts = client.client.make_request("t", "ref", "cand").options  # what goes over the wire
  finally:
    client.close()
  assert (opts.num_correct_trials, opts.strictness, opts.seed, opts.timeout_s) == (
    1,
    "off",
    42,
    300.0,
  )
  assert not opts.HasField("atol") and not opts.HasField("measure_performance")  # 1e-2, untimed


def _traj(rounds_per_block, index):
  """A response of len(rounds_per_block) blocks; block k's tokens unmask over its given rounds."""
  steps, at = [], 0
  for r in rounds_per_block:
    steps += [at + min(i, r - 1) for i in range(B)]
    at += r
  n = len(steps)
  return Trajectory(
    prompt_ids=np.arange(1, 6),
    response_ids=np.full(n, 7 + index),
    step_map=np.asarray(steps),
    loss_mask=np.ones(n, bool),
    sampler_logp=np.zeros(n),
    advantage=1.0,
  )


def test_dice_optimizer_steps_count_response_round_rows_in_file_order_and_drop_the_tail():
  # responses with 3, 2 and 4 rounds -> 9 (response, round) rows; 4 rows per optimizer step
  trajs = [_traj([3, 1], 0), _traj([2], 1), _traj([4, 2, 1], 2)]
  kw = dict(block_size=B, mask_token_id=99, rows_per_batch=4, length_multiple=8)
  cfg = recipe_lib.apply_recipe(RLConfig(), "dice")
  batches = tracerl.build_batches(
    trajs,
    cfg.tracerl,
    **kw,
    rng=None if not cfg.shuffle else np.random.default_rng(0),
    drop_partial=cfg.tail_rows == "drop",
  )
  # (response, round) pairs: 0.1 0.2 0.3 1.1 | 1.2 2.1 2.2 2.3 | 2.4 dropped; 2 steps, file order,
  # packed: a response's pairs in one step share a row
  order = [b["traj_index"][:, 0].tolist() for b in batches]
  assert order == [[0, 1, -1, -1], [1, 2, -1, -1]]
  assert [b["norm_rounds"][:, 0].tolist() for b in batches] == [[3, 1, 0, 0], [1, 3, 0, 0]]
  rounds = [[sorted(set(r[r > 0].tolist())) for r in b["round_ids"][:2]] for b in batches]
  assert rounds == [[[1, 2, 3], [1]], [[2], [1, 2, 3]]]
  per_round = dataclasses.replace(cfg.tracerl, layout="per_round")  # DICE's own rows
  rows = tracerl.build_batches(trajs, per_round, **kw, drop_partial=True)
  assert [b["traj_index"][:, 0].tolist() for b in rows] == [[0, 0, 0, 1], [1, 2, 2, 2]]
  assert [b["round_ids"].max(axis=1).tolist() for b in rows] == [[1, 2, 3, 1], [2, 1, 2, 3]]
  # ours: one step per 4 responses with all their rounds, shuffled, every row used
  ours = recipe_lib.apply_recipe(RLConfig(), "ours")
  (b,) = tracerl.build_batches(trajs, ours.tracerl, **kw, rng=np.random.default_rng(0))
  assert sorted(b["traj_index"][:3, 0].tolist()) == [0, 1, 2] and b["norm_rounds"].sum() == 9


def test_gradient_reaching_adam_is_dices_one_over_gas_squared_then_clip_one():
  """Two optimizer steps of 256 rows each on 8 processes x GAS 32: each row's loss / GAS by hand
  and / GAS by DeepSpeed, summed over the accumulation, averaged over processes, clipped at 1.0,
  then AdamW by hand. Ours receives the mean gradient over the 256 rows (the `dice`
  normalisation). The first step's mean gradient has norm ~110 (DICE clips it: > 32), the
  second ~2 (not clipped), so Adam's second step sees their DICE-scaled ratio."""
  rng = np.random.default_rng(0)
  lr, b1, b2, eps = 1e-3, 0.9, 0.999, 1e-8
  offsets = (np.array([100.0, -50.0, 0, 0, 0, 0]), np.array([0.0, 0, 2.0, 0, 0, 0]))
  steps = [rng.normal(size=(256, 6)) + mu for mu in offsets]
  m = v = np.zeros(6)
  want = []
  for t, rows in enumerate(steps, 1):
    acc = rows.reshape(8, 32, 6).sum(axis=1) / 32 / 32  # each process's accumulated gradient
    g = acc.mean(axis=0)  # DeepSpeed's all-reduce mean
    g = g * min(1.0, 1.0 / np.linalg.norm(g))  # gradient_clipping: 1.0
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    want.append(-lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps))
  assert np.linalg.norm(steps[0].mean(0)) > 32 > np.linalg.norm(steps[1].mean(0))

  def ours(recipe):
    cfg = recipe_lib.apply_recipe(RLConfig(optim=OptimizerConfig(learning_rate=lr)), recipe)
    tx = make_optimizer(dataclasses.replace(cfg.optim, schedule="constant"), 2)
    params = {"w": jnp.zeros(6)}
    state, out = tx.init(params), []
    for rows in steps:
      upd, state = tx.update({"w": jnp.asarray(rows.mean(axis=0))}, state, params)
      out.append(np.asarray(upd["w"]))
    return out

  got = ours("dice")
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-12)
  # our recipe (clip at 1 on the mean gradient) takes another second step
  assert np.abs(ours("ours")[1] - want[1]).max() > 1e-2 * np.abs(want[1]).max()


def test_trained_tokens_around_im_end_and_endoftext():
  """Sampler length rule -> loss mask -> TraceRL rows, under each recipe's stop ids."""
  from types import SimpleNamespace

  from dice_jax.diffusion import slots as slots_lib
  from dice_jax.rl.loop import stop_ids

  IM_END, EOS = 151645, 151643  # SDAR: <|im_end|>, <|endoftext|> (= pad)
  tok = SimpleNamespace(eos_token_id=EOS, stop_token_ids=(IM_END, EOS))
  resp = np.asarray([11, 12, IM_END, 13, EOS, 14, 15, 16])  # two blocks of 4
  trained = {}
  for name in ("ours", "dice"):
    cfg = recipe_lib.apply_recipe(RLConfig(), name)
    ids = stop_ids(cfg, tok)
    s = 1
    zeros = lambda *shape, dt=jnp.int32: jnp.zeros(shape, dt)  # noqa: E731
    sl = slots_lib.Slots(
      block=zeros(s, B),
      block_steps=zeros(s, B),
      block_logp=zeros(s, B, dt=jnp.float32),
      prev=zeros(s, B),
      block_pos=zeros(s),
      prompt_len=jnp.asarray([4]),
      first_pos=jnp.asarray([4]),
      max_new=jnp.asarray([64]),
      steps_used=zeros(s),
      forwards=zeros(s),
      done=zeros(s, dt=bool),
      fresh=zeros(s, dt=bool),
      block_step=zeros(s),
      key=jax.random.split(jax.random.key(0), 1),
      out_tokens=jnp.asarray(resp)[None],
      out_steps=jnp.arange(8)[None],
      out_logp=zeros(s, 0, dt=jnp.float32),
    )
    n = int(slots_lib.response_lengths(sl, ids)[0])
    t = Trajectory(np.arange(1, 5), resp, np.arange(8), np.arange(8) < n, np.zeros(8))
    if not cfg.train_stop_token:
      t = t.without_stop_token(ids)
    t.advantage = 1.0
    (b,) = tracerl.build_batches(
      [t], cfg.tracerl, block_size=B, mask_token_id=99, rows_per_batch=8, length_multiple=8
    )
    trained[name] = sorted(b["targets"][b["p_mask"]].tolist())
  assert trained["ours"] == sorted([11, 12, IM_END])  # stops at <|im_end|>, trains it
  assert trained["dice"] == sorted([11, 12, IM_END, 13])  # runs on to <|endoftext|>, not trained


def test_snapshots_are_kept_every_n_steps(tmp_path):
  from dice_jax.train.checkpoint import Checkpointer

  ckpt = Checkpointer(str(tmp_path), save_every=1, keep=2, async_save=False, keep_period=5)
  for s in range(1, 13):
    ckpt.save(s, {"x": jnp.zeros(2)}, {}, {})
  ckpt.wait()
  assert ckpt.all_steps() == [5, 10, 11, 12]
  ckpt.close()


def test_dice_recipe_run_resets_adam_each_rl_step_evaluates_and_snapshots(tmp_path):
  from dice_jax.rl.loop import run_rl
  from dice_jax.train.metrics import read_metrics

  cfg = recipe_lib.apply_recipe(small_config(), "dice")
  cfg = dataclasses.replace(
    cfg,
    rows_per_update=8,
    run=dataclasses.replace(cfg.run, checkpoint_every=5, checkpoint_keep=1),
    snapshot_every=2,
    eval_every=2,
    eval_tasks=PAIRS,
  )
  cfg = dataclasses.replace(cfg, stream=dataclasses.replace(cfg.stream, num_steps=3))
  run_rl(cfg, str(tmp_path))
  recs = read_metrics(str(tmp_path / "metrics.jsonl"))
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "3"]  # snapshot 2 + the last
  n_pairs = sum(1 for _ in open(PAIRS))
  assert [recs[s].get("eval/samples") for s in (1, 2, 3)] == [None, n_pairs, None]  # every 2
  assert 0 <= recs[2]["eval/correct_rate"] <= 1
  from dice_jax.train import checkpoint as ckpt_lib

  ck = ckpt_lib.Checkpointer(str(tmp_path / "checkpoints"), save_every=1, async_save=False)
  state, _, _ = ck.restore(None, 3)
  ck.close()
  counts = [int(x) for x in jax.tree.leaves(state["opt_state"]) if np.ndim(x) == 0]
  updates = [recs[s]["updates"] for s in (1, 2, 3)]
  assert int(state["step"]) == sum(updates) and recs[3]["optimizer_step"] == sum(updates)
  assert updates[-1] >= 1 and sum(updates) > updates[-1], updates  # persistent Adam would differ
  assert counts and set(counts) == {int(updates[-1])}, (counts, updates)  # Adam's count: last step
