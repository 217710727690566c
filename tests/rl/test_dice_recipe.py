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
  assert (dice.optim.grad_scale, dice.optim.clip_norm) == (1 / 32, 1.0)
  assert (dice.tail_rows, dice.even_batches_rows) == ("even_batches", 8)
  assert (dice.stop_tokens, dice.train_stop_token, dice.train_pad_tokens) == ("im_end", True, False)
  assert (dice.eval_every, dice.snapshot_every) == (10, 10)
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
  for bad, needle in (
    (dict(tail_rows="keep"), "tail_rows"),
    (dict(stop_tokens="eot"), "stop"),
    (dict(train_pad_tokens=0), "train_pad_tokens"),
    (dict(tail_rows="even_batches", even_batches_rows=3), "multiple of even_batches_rows"),
  ):
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


def test_dice_optimizer_steps_count_response_round_rows_in_file_order_and_pad_the_tail_evenly():
  # responses with 3, 2 and 4 rounds -> 9 (response, round) rows; 4 rows per optimizer step
  trajs = [_traj([3, 1], 0), _traj([2], 1), _traj([4, 2, 1], 2)]
  kw = dict(block_size=B, mask_token_id=99, rows_per_batch=4, length_multiple=8)
  cfg = recipe_lib.apply_recipe(RLConfig(), "dice")

  def steps(processes, layout="per_round"):  # DICE on `processes` x 1 row
    batches = tracerl.build_batches(
      trajs,
      dataclasses.replace(cfg.tracerl, layout=layout),
      **kw,
      rng=None if not cfg.shuffle else np.random.default_rng(0),
      tail=cfg.tail_rows,
      even_batches_rows=processes,
    )
    order = [b["traj_index"][:, 0].tolist() for b in batches]
    return order, [b["round_ids"].max(axis=1).tolist() for b in batches], batches

  # DICE's own (response, round) rows. 2 processes: 9 rows padded to 10 with row 1; 2 steps in
  # file order, rows 9-10 never applied
  assert steps(2)[:2] == ([[0, 0, 0, 1], [1, 2, 2, 2]], [[1, 2, 3, 1], [2, 1, 2, 3]])
  # 4 processes: padded to 12 with rows 1-3, which complete a third step
  order, rounds, _ = steps(4)
  assert order == [[0, 0, 0, 1], [1, 2, 2, 2], [2, 0, 0, 0]]
  assert rounds == [[1, 2, 3, 1], [2, 1, 2, 3], [4, 1, 2, 3]]  # each response's rounds in order
  # recipe=dice trains the same steps on packed rows: a response's pairs in one step share a row
  order, _, batches = steps(4, cfg.tracerl.layout)
  assert order == [[0, 1, -1, -1], [1, 2, -1, -1], [2, 0, -1, -1]]
  assert [b["norm_rounds"][:, 0].tolist() for b in batches] == [
    [3, 1, 0, 0],
    [1, 3, 0, 0],
    [1, 3, 0, 0],
  ]
  rounds = [[sorted(set(r[r > 0].tolist())) for r in b["round_ids"][:2]] for b in batches]
  assert rounds == [[[1, 2, 3], [1]], [[2], [1, 2, 3]], [[4], [1, 2, 3]]]
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


@pytest.fixture(scope="module")
def sdar_tokenizer(shared_data):
  from dice_jax.data.tokenizer import Tokenizer

  return Tokenizer.from_dir(shared_data / "sdar_chat")


def test_dice_stops_at_the_eos_of_its_sft_tokenizer(sdar_tokenizer, shared_data, tmp_path):
  """DICE's RL starts from its SFT output, whose tokenizer LLaMA-Factory's `qwen3` template
  (stop_words ["<|im_end|>"], replace_eos) saved with `add_special_tokens({"eos_token": ...})`;
  JetEngine stops at that tokenizer's eos only. Done here with transformers on sdar_chat."""
  from transformers import AutoTokenizer

  from dice_jax.data.tokenizer import Tokenizer
  from dice_jax.rl.loop import stop_ids

  hf = AutoTokenizer.from_pretrained(shared_data / "sdar_chat")
  assert (hf.eos_token, hf.pad_token) == ("<|endoftext|>", "<|endoftext|>")  # SDAR's own
  hf.add_special_tokens({"eos_token": "<|im_end|>"})  # template.py `_add_or_replace_eos_token`
  hf.save_pretrained(tmp_path)  # HF Trainer.save_model saves its processing_class
  sft = Tokenizer.from_dir(tmp_path)
  assert (sft.eos_token_id, sft.pad_token_id) == (IM_END, EOS)
  dice = recipe_lib.apply_recipe(RLConfig(), "dice")
  assert stop_ids(dice, sdar_tokenizer) == (sft.eos_token_id,) == (IM_END,)
  ours = recipe_lib.apply_recipe(RLConfig(), "ours")
  assert stop_ids(ours, sdar_tokenizer) == (IM_END, EOS)
  eos_only = dataclasses.replace(dice, stop_tokens="eos")  # the eos of the tokenizer given
  assert stop_ids(eos_only, sdar_tokenizer) == (EOS,) and stop_ids(eos_only, sft) == (IM_END,)


IM_END, EOS = 151645, 151643  # SDAR: <|im_end|>, <|endoftext|> (= pad)


def test_trained_tokens_around_im_end_and_endoftext(sdar_tokenizer):
  """Sampler length rule -> loss mask -> the update's view -> TraceRL rows, under each recipe,
  with sdar_chat's ids: a stray <|endoftext|> mid-response, then <|im_end|>, then more blocks."""
  from dice_jax.diffusion import slots as slots_lib
  from dice_jax.rl.loop import stop_ids, training_view

  tok = sdar_tokenizer
  head, mid, tail = tok.encode("x = 1"), tok.encode(" y"), tok.encode("\nz w v")
  resp = np.asarray(head + [EOS] + mid + [IM_END] + tail)
  resp = np.concatenate([resp, tok.encode(" ." * (-resp.size % B + B))[: -resp.size % B + B]])
  n_all = resp.size
  eos_at, im_end_at = len(head), len(head) + 1 + len(mid)
  assert n_all % B == 0 and im_end_at // B < n_all // B - 1  # whole blocks after <|im_end|>'s
  trained = {}
  for name in ("ours", "dice"):
    cfg = recipe_lib.apply_recipe(RLConfig(), name)
    ids = stop_ids(cfg, tok)
    zeros = lambda *shape, dt=jnp.int32: jnp.zeros(shape, dt)  # noqa: E731
    sl = slots_lib.Slots(
      block=zeros(1, B),
      block_steps=zeros(1, B),
      block_logp=zeros(1, B, dt=jnp.float32),
      prev=zeros(1, B),
      block_pos=zeros(1),
      prompt_len=jnp.asarray([4]),
      first_pos=jnp.asarray([4]),
      max_new=jnp.asarray([64]),
      steps_used=zeros(1),
      forwards=zeros(1),
      done=zeros(1, dt=bool),
      fresh=zeros(1, dt=bool),
      block_step=zeros(1),
      waited=zeros(1),
      key=jax.random.split(jax.random.key(0), 1),
      out_tokens=jnp.asarray(resp)[None],
      out_steps=jnp.arange(n_all)[None],
      out_logp=zeros(1, 0, dt=jnp.float32),
    )
    n = int(slots_lib.response_lengths(sl, ids)[0])
    t = Trajectory(
      np.arange(1, 5), resp, np.arange(n_all), np.arange(n_all) < n, np.zeros(n_all), advantage=1.0
    )
    t = training_view(t, cfg, ids, tok.pad_token_id)
    (b,) = tracerl.build_batches(
      [t], cfg.tracerl, block_size=B, mask_token_id=99, rows_per_batch=64, length_multiple=8
    )
    trained[name] = sorted(b["targets"][b["p_mask"]].tolist())
  # ours: stops at the first stop id, the stray <|endoftext|>, and trains it
  assert trained["ours"] == sorted(resp[: eos_at + 1].tolist())
  # DICE: runs on to <|im_end|> and trains it; the <|endoftext|> (its pad id) is never trained
  want = [int(x) for i, x in enumerate(resp[: im_end_at + 1]) if i != eos_at]
  assert trained["dice"] == sorted(want) and IM_END in want and EOS not in want


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


def accelerate_shard(n: int, num_processes: int, process_index: int) -> list[int]:
  """The dataset indices process `process_index` reads, transcribed from accelerate v1.7.0
  `BatchSamplerShard._iter_with_no_split` for DICE's DataLoader (SequentialSampler, batch size 1,
  drop_last False) and accelerate's default `even_batches=True`."""
  initial_data, batch_to_yield, out = [], [], []
  for idx in range(n):
    batch = [idx]
    if idx < num_processes:
      initial_data += batch
    if idx % num_processes == process_index:
      batch_to_yield = batch
    if idx % num_processes == num_processes - 1:  # every process has a full batch: yield
      out.append(batch_to_yield)
      batch_to_yield = []
  if len(batch_to_yield) == 1:  # the last batch seen has the proper length
    out.append(batch_to_yield)
  while len(initial_data) < num_processes:
    initial_data += initial_data
  batch, idx, cycle_index = [], n, 0  # the last batch (size 1) was full: move to the next index
  while idx % num_processes != 0 or len(batch) > 0:  # a multiple of num_processes batches
    end_index = cycle_index + 1 - len(batch)
    batch += initial_data[cycle_index:end_index]
    if idx % num_processes == process_index:
      out.append(batch)
    cycle_index, batch, idx = end_index, [], idx + 1
  return [b[0] for b in out]


def _dice_rl_step(rows, old_logp, params, graphdef, lr, *, l1, processes=8, gas=32):
  """DICE's update of one RL step (`train/rl_sdar.py` under accelerate 1.7 + DeepSpeed), plainly:
  each process reads its `accelerate_shard` rows one per micro-step; a row's loss is PPO-clip +
  0.01 k3 over its trained tokens / L1, divided by GAS by hand and by GAS again by DeepSpeed's
  backward; every GAS-th micro-step DeepSpeed averages the processes' summed gradients, clips
  them at 1.0 and takes a step of a new AdamW (wd 0); later micro-steps are never applied."""
  from flax import nnx

  rows = {k: jnp.asarray(v) for k, v in rows.items()}

  def row_losses(p, idx):
    batch = {k: v[idx] for k, v in rows.items()}
    new = tracerl.token_logprobs(nnx.merge(graphdef, p), batch)
    mask, adv = batch["p_mask"], batch["advantages"]
    delta = jnp.where(mask, new - old_logp[idx], 0.0)
    ratio = jnp.exp(jnp.clip(delta, -10.0, 10.0))
    surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 0.8, 1.2) * adv) * mask
    kl = (jnp.exp(jnp.clip(-delta, -10.0, 10.0)) - 1.0 + delta) * mask
    return -surrogate.sum(axis=1) / l1 + 0.01 * kl.sum(axis=1) / l1

  grad_fn = jax.jit(jax.grad(lambda p, idx: row_losses(p, idx).sum() / gas / gas / processes))
  shards = [accelerate_shard(len(old_logp), processes, r) for r in range(processes)]
  params = jax.tree.map(np.asarray, params)  # AdamW by hand on the host, in float64
  m = v = jax.tree.map(np.zeros_like, params)
  steps = []
  for k in range(len(shards[0]) // gas):
    idx = np.asarray([s[j] for s in shards for j in range(k * gas, (k + 1) * gas)])
    steps.append(idx)
    g = grad_fn(jax.tree.map(lambda p: p.astype(np.float32), params), idx)
    g = jax.tree.map(lambda x: np.asarray(x, np.float64), jax.device_get(g))
    norm = np.sqrt(sum(np.sum(x * x) for x in jax.tree.leaves(g)))
    g = jax.tree.map(lambda x: x * min(1.0, 1.0 / (norm + 1e-6)), g)
    t = k + 1
    m = jax.tree.map(lambda a, b: 0.9 * a + 0.1 * b, m, g)
    v = jax.tree.map(lambda a, b: 0.999 * a + 0.001 * b * b, v, g)
    params = jax.tree.map(
      lambda p, a, b: p - lr * (a / (1 - 0.9**t)) / (np.sqrt(b / (1 - 0.999**t)) + 1e-8),
      params,
      m,
      v,
    )
  return params, steps


def test_a_506_row_step_moves_the_parameters_as_dices_even_batches_rule():
  """506 (response, round) rows = 256 + 250: DICE pads the 250 with 6 copies of rows 0-5 (8
  processes x 1 row) into a second optimizer step; `recipe=dice` gives the same parameters."""
  from types import SimpleNamespace

  from flax import nnx

  from dice_jax import sharding
  from dice_jax.model.config import get_config
  from dice_jax.model.transformer import Transformer
  from dice_jax.rl import loop
  from dice_jax.train import train_step as ts

  lr = 1e-3
  mcfg = get_config("tiny", dtype="float32")
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  rng = np.random.default_rng(0)
  rounds = [4] * 122 + [3] * 6  # 128 responses of one block: 506 rows
  trajs = [_traj([r], 0) for r in rounds]
  for i, t in enumerate(trajs):
    t.prompt_ids = rng.integers(2, 200, 3).astype(np.int32)
    t.response_ids = rng.integers(2, 200, B).astype(np.int32)
    t.group = i // 2
  rewards = np.asarray([(i + i // 2) % 2 for i in range(128)], np.float32)  # every group 1 / 0

  # the project: the RL loop's update under recipe=dice (and with the tail dropped); the old
  # log-probs by a trainer forward, as DICE's (the trajectories here have no sampler log-probs)
  cfg = recipe_lib.apply_recipe(
    RLConfig(
      optim=OptimizerConfig(learning_rate=lr, schedule="constant", warmup_ratio=0.0),
      accum_steps=1,
      length_multiple=16,
      tracerl=tracerl.TraceRLConfig(layout="packed", old_logp="trainer"),
    ),
    "dice",
  )
  tx = make_optimizer(cfg.optim, 2)
  model = sharding.create_sharded(lambda: Transformer(mcfg, rngs=nnx.Rngs(0)), mesh)
  graphdef, state, shardings = ts.init_train_state(model, tx, mesh)
  start = jax.device_get(state)  # the train step donates its input state
  loss_fn = lambda m, b, r: tracerl.tracerl_loss(m, b, r, cfg.tracerl)  # noqa: E731
  trainer = SimpleNamespace(
    mcfg=mcfg,
    mesh=mesh,
    step_fn=ts.jit_train_step(
      ts.make_train_step(graphdef, tx, loss_fn, means=tracerl.METRIC_MEANS), shardings, mesh
    ),
    old_logp_fn=tracerl.jit_token_logprobs(graphdef, shardings["params"], mesh),
    init_opt=jax.jit(tx.init, out_shardings=shardings["opt_state"]),
    backend=SimpleNamespace(cfg=SimpleNamespace(stop_ids=(mcfg.eos_token_id,))),
    tokenizer=SimpleNamespace(pad_token_id=mcfg.pad_token_id),
    row_len=None,
  )

  def ours(**overrides):
    trainer.cfg = dataclasses.replace(cfg, **overrides)
    trainer.state = jax.device_put(start, shardings)
    rollout = SimpleNamespace(trajectories=trajs, rewards=rewards)
    state, m = loop.learn(trainer, rollout, 0)
    return jax.device_get(state["params"]), m

  got, m = ours()
  # 512 (response, round) pairs; on packed rows: 64 responses, then 64 + copies of responses 0-1
  assert (m["updates"], m["groups"], m["trace_rounds"], m["rows"]) == (2, 64, 512, 130)
  dropped, m_drop = ours(tail_rows="drop")
  assert m_drop["updates"] == 1

  # DICE, from the rows (the project's row construction, tested against DICE's elsewhere)
  per_round = tracerl.TraceRLConfig(layout="per_round")
  for t, r in zip(trajs, rewards):
    t.advantage = 1.0 if r else -1.0  # z-score of (1, 0) with the population std
  rows = [
    u
    for t in trajs
    for u, _ in tracerl.trajectory_rows(t, per_round, block_size=B, mask_token_id=255)
  ]
  assert len(rows) == 506 and len({r["tokens"].size for r in rows}) == 1  # equal lengths: stack
  stacked = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
  stacked["segment_ids"] = np.ones_like(stacked["tokens"])
  params0 = start["params"]
  old = jax.jit(lambda p, b: tracerl.token_logprobs(nnx.merge(graphdef, p), b))(params0, stacked)
  want, steps = _dice_rl_step(stacked, old, params0, graphdef, lr, l1=float(B))
  assert len(steps) == 2 and sorted(steps[1]) == list(range(6)) + list(range(256, 506))

  def change(p):  # the parameter change, flat
    return np.concatenate([np.ravel(x - y) for x, y in zip(jax.tree.leaves(p), leaves0)])

  def rel(a, b):  # relative L2 distance of two parameter changes
    return float(np.linalg.norm(change(a) - change(b)) / np.linalg.norm(change(b)))

  leaves0 = jax.tree.leaves(params0)

  assert rel(got, want) < 1e-4, rel(got, want)
  assert rel(dropped, want) > 0.1, rel(dropped, want)
