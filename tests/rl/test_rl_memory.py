"""The TraceRL update's memory: remat policies change nothing but memory, the estimate against
XLA's own analysis of the compiled update, and a setting that does not fit is refused before the
rollout."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dice_jax.model.config import get_config
from dice_jax.model.transformer import Transformer
from dice_jax.rl import memory, tracerl
from dice_jax.train import optimizer as optim_lib
from dice_jax.train import train_step as ts
from tests.rl.test_loop import small_config
from tests.rl.test_tracerl_layouts import _one_batch, trajectories

GIB = 1024**3


def _models(remat):
  cfg = get_config("tiny", dtype="float32", remat=remat)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  keys = iter(jax.random.split(jax.random.key(3), 64))
  old = jax.tree.map(lambda x: x + 0.3 * x.std() * jax.random.normal(next(keys), x.shape), params)
  return graphdef, params, old


def test_remat_true_and_false_still_mean_full_and_none():
  assert get_config("tiny", remat=True).remat_policy == "full"
  assert get_config("tiny", remat=False).remat_policy == "none"
  assert get_config("tiny", remat="dots").remat_policy == "dots"
  with pytest.raises(ValueError, match="remat must be True, False or one of"):
    get_config("tiny", remat="some")


@pytest.mark.parametrize("layout", ["packed", "per_round"])
def test_every_remat_policy_gives_the_same_loss_and_gradients(layout):
  graphdef0, params, old = _models(False)
  batch, cfg = _one_batch(trajectories(), layout, 1)
  batch["old_logp"] = np.asarray(
    jax.jit(lambda p, b: tracerl.token_logprobs(nnx.merge(graphdef0, p), b))(old, batch)
  )
  out = {}
  for policy in (False, "full", "dots", "dots_attn", "full_attn"):  # "none" is remat=False's
    graphdef = nnx.split(
      Transformer(get_config("tiny", dtype="float32", remat=policy), rngs=nnx.Rngs(0)), nnx.Param
    )[0]

    @jax.jit
    def f(p, b):
      loss = lambda q: tracerl.tracerl_loss(nnx.merge(graphdef, q), b, None, cfg)  # noqa: E731
      return jax.value_and_grad(loss, has_aux=True)(p)

    (loss_sum, m), g = f(params, batch)
    out[policy] = (float(loss_sum), g)
  want_loss, want_g = out[False]  # today's path: remat off
  assert want_loss != 0.0
  scale = max(float(jnp.abs(x).max()) for x in jax.tree.leaves(want_g))
  for policy in ("full", "dots", "dots_attn", "full_attn"):
    loss, g = out[policy]
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=policy)
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale), g, want_g
    )


def _xla_bytes(mcfg, rows, row_len, accum, chunk):
  """argument + output - aliased + temp bytes of the compiled, donated TraceRL train step."""
  model = nnx.eval_shape(lambda: Transformer(mcfg, rngs=nnx.Rngs(0)))
  graphdef, abs_params = nnx.split(model, nnx.Param)
  params = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), abs_params.to_pure_dict())
  tx = optim_lib.make_optimizer(
    optim_lib.OptimizerConfig(learning_rate=1e-6, schedule="constant", warmup_ratio=0.0), 10
  )
  state = dict(
    params=params,
    opt_state=jax.eval_shape(tx.init, params),
    step=jax.ShapeDtypeStruct((), jnp.int32),
  )
  cfg = tracerl.TraceRLConfig(layout="packed", logit_chunk=chunk)
  loss_fn = lambda m, b, r: tracerl.tracerl_loss(m, b, r, cfg)  # noqa: E731
  step = ts.make_train_step(  # as the RL loop's (loop.make_update): empty micro-batches skipped
    graphdef,
    tx,
    loss_fn,
    accum_steps=accum,
    means=tracerl.METRIC_MEANS,
    is_empty=tracerl.is_empty,
  )
  lead = (rows,) if accum == 1 else (accum, rows)
  tok = lambda dt: jax.ShapeDtypeStruct(lead + (row_len,), dt)  # noqa: E731
  batch = {
    k: tok(jnp.int32)
    for k in ("tokens", "positions", "segment_ids", "block_ids", "round_ids", "targets")
  }
  batch.update(
    p_mask=tok(jnp.bool_),
    advantages=tok(jnp.float32),
    sampler_logp=tok(jnp.float32),
    old_logp=tok(jnp.float32),
  )
  row = lambda dt: jax.ShapeDtypeStruct(lead + (1,), dt)  # noqa: E731
  batch.update(
    norm_rounds=row(jnp.float32), norm_length=row(jnp.float32), traj_index=row(jnp.int32)
  )
  compiled = jax.jit(step, donate_argnums=0).lower(state, batch, jax.random.key(0)).compile()
  m = compiled.memory_analysis()
  return (
    m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
  )


# Shapes where the activations dominate (the parameters are 0.9M: 15 MB with Adam) with the
# dense attention of CPU: (remat, micro rows, row length, accumulation, logit chunk, dtype).
XLA_SHAPES = [
  ("none", 2, 512, 1, 2048, "bfloat16"),
  ("full", 2, 1024, 2, 256, "bfloat16"),
  ("dots", 2, 512, 1, 2048, "bfloat16"),
  ("dots_attn", 2, 512, 1, 2048, "bfloat16"),
  ("full_attn", 2, 1024, 2, 256, "bfloat16"),
  ("none", 2, 512, 1, 2048, "float32"),
]


@pytest.mark.parametrize("remat,rows,row_len,accum,chunk,dtype", XLA_SHAPES)
def test_the_estimate_is_within_15_percent_of_xla_memory_analysis(
  remat, rows, row_len, accum, chunk, dtype
):
  mcfg = get_config(
    "tiny",
    hidden_size=128,
    intermediate_size=384,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    vocab_size=512,
    mask_token_id=511,
    dtype=dtype,
    remat=remat,
  )
  est = memory.update_estimate(
    mcfg, micro_rows=rows, row_len=row_len, accum_steps=accum, logit_chunk=chunk
  )
  got = _xla_bytes(mcfg, rows, row_len, accum, chunk)
  params_and_adam = 3 * 4 * mcfg.num_params()
  assert got > 2.5 * params_and_adam  # activations dominate
  assert abs(est["total"] / got - 1) < 0.15, (est, got)


# The TPU compiler's peaks per chip of the RL update (tpu_memory.Recipe: rows of 24,576 tokens,
# fsdp over every chip; jax 0.10.2, libtpu 0.0.42.1, compiled on the 2-core dev VM): docs/tpu.md's
# table (remat `full`, one row per chip), and three compiles of 2026-12-04 the planner's TPU
# constants were not read from (`tpu_memory.compile_rows('sdar_1p7b', 'v5p-8', Recipe(...),
# ('rl',), remat=...)`; all seven recompiled after issue 38, where the TPU kernel names its output
# and keeps one lane of its log-sum-exp: 9.21, 39.18 and 44.96 before, the others the same):
# (model, chips, rows per chip, row length, remat, GiB).
TPU_PEAKS = [
  ("sdar_1p7b", 8, 1, 24576, "full", 9.14),
  ("sdar_1p7b", 4, 1, 24576, "full", 13.10),
  ("sdar_8b", 4, 1, 24576, "full", 45.53),
  ("sdar_8b", 8, 1, 24576, "full", 28.22),
  ("sdar_1p7b", 4, 2, 24576, "full", 18.25),
  ("sdar_1p7b", 4, 1, 24576, "dots_attn", 39.32),
  ("sdar_1p7b", 4, 1, 8192, "none", 42.35),
]


@pytest.mark.parametrize("model,chips,rows,row_len,remat,peak_gib", TPU_PEAKS)
def test_the_tpu_estimate_is_above_the_tpu_compilers_peak_by_under_15_percent(
  model, chips, rows, row_len, remat, peak_gib
):
  from dice_jax import tpu_memory

  mcfg = tpu_memory.model_config(model, remat=remat)
  kw = dict(micro_rows=rows * chips, row_len=row_len, accum_steps=1, param_shards=chips)
  est = memory.update_estimate(mcfg, row_shards=chips, platform="tpu", **kw)["total"] / GIB
  assert peak_gib <= est <= 1.15 * peak_gib, (est, peak_gib)
  if (model, rows, remat) == ("sdar_1p7b", 2, "full"):  # the CPU parts alone were 1.18x
    cpu = memory.update_estimate(mcfg, row_shards=chips, platform="cpu", **kw)["total"] / GIB
    assert cpu > 1.15 * peak_gib


def test_the_platform_is_the_one_traced_for_and_checked():
  mcfg = get_config("sdar_1p7b", dtype="bfloat16", attention_impl="flash", remat=True)
  kw = dict(micro_rows=1, row_len=4096, accum_steps=1, param_shards=4)
  default = memory.update_estimate(mcfg, **kw)
  assert default == memory.update_estimate(mcfg, platform="cpu", **kw)  # tests run on CPU
  assert default["compute_copy"] == 0
  assert memory.update_estimate(mcfg, platform="tpu", **kw)["compute_copy"] > 0
  with pytest.raises(ValueError, match="platform must be one of"):
    memory.update_estimate(mcfg, platform="metal", **kw)


def test_row_lengths_and_plans_at_dices_shape():
  # 896 + 4,096 packed: 896 + 5 x 4,096 = 21,376 (bucketed to 24,576 before rows were capped at
  # the longest there can be); per round 896 + 2 x 4,096 = 9,088 (then 12,288)
  assert memory.row_length("packed", prompt_len=896, new_tokens=4096, steps=4) == 21376
  assert memory.row_length("per_round", prompt_len=896, new_tokens=4096, steps=4) == 9088
  mcfg = get_config("sdar_1p7b", dtype="bfloat16", attention_impl="flash")
  kw = dict(rows_per_update=256, prompt_len=896, steps=4)
  # issue 30: rows of 12,288 (896 + 2,048 bucketed) with 2 rows OOMed without remat, 1 row
  # fitted (peak 90.8 GiB) and rows of 24,576 (896 + 4,096) with full remat peaked at 43.7 GiB on
  # an H200 (139.8 GiB)
  h200 = int(139.8 * GIB)
  est = lambda m, rm, n: memory.update_estimate(  # noqa: E731
    mcfg, micro_rows=m, remat=rm, row_len={2048: 12288, 4096: 24576}[n], accum_steps=256 // m
  )["total"]
  assert est(2, "none", 2048) > h200 > est(1, "none", 2048)
  assert 0.9 < est(1, "none", 2048) / (90.8 * GIB) < 1.15
  assert 0.9 < est(1, "full", 4096) / (43.7 * GIB) < 1.15
  # the BiC-RL step on an H200 (docs/performance.md, 2026-12-03): sdar_4b packed, 2 rows of 22,016
  # per micro-batch, `full_attn`, 2 micro-batches, peak 120.1 GiB (the estimate 5 % under it)
  sdar_4b = get_config("sdar_4b", dtype="bfloat16", attention_impl="flash")
  gpu = memory.update_estimate(
    sdar_4b, micro_rows=2, remat="full_attn", row_len=22016, accum_steps=2, platform="gpu"
  )
  assert 0.85 < gpu["total"] / (120.1 * GIB) < 1.15
  limit = 0.9 * h200  # XLA_PYTHON_CLIENT_MEM_FRACTION=0.90 of the GPU scripts
  plan, _ = memory.choose_plan(
    mcfg,
    limit,
    layouts=["packed"],
    micro_rows=memory.micro_row_options(256),
    remats=memory.REMAT_ORDER,
    new_tokens=4096,
    **kw,
  )
  assert (plan.remat, plan.micro_rows) == ("dots_attn", 2) and plan.estimate["total"] <= limit


def test_auto_settings_keep_todays_defaults_where_the_limit_is_unknown():
  cfg = small_config(tracerl=tracerl.TraceRLConfig(layout="auto"))
  assert cfg.accum_steps == 0 and cfg.update_remat == "auto"
  resolved, plan = memory.resolve_update(cfg, get_config("tiny"), None)
  assert (resolved.tracerl.layout, resolved.accum_steps, resolved.update_remat) == (
    "packed",
    1,
    "none",
  )
  # with a limit, the fastest setting that fits: less remat before more rows per micro-batch
  big, _ = memory.resolve_update(cfg, get_config("tiny"), 10 * GIB)
  assert (big.tracerl.layout, big.accum_steps, big.update_remat) == ("packed", 1, "none")


def test_a_setting_that_does_not_fit_is_refused_before_the_rollout(tmp_path, monkeypatch):
  from dice_jax.rl import loop, rollout

  sampled = []
  monkeypatch.setattr(rollout, "collect", lambda *a, **k: sampled.append(1))
  explicit = small_config(accum_steps=1, update_remat="none", memory_limit_gb=0.001)
  with pytest.raises(ValueError) as e:
    loop.run_rl(explicit, str(tmp_path / "a"))
  msg = str(e.value)
  assert "does not fit" in msg and "layout=packed micro_rows=8 remat=none" in msg, msg
  assert "GiB" in msg and "(0.0 GiB)" in msg
  assert not sampled
  # written once the plan fits: no tokenizer or model config (the checkpoint folder is empty)
  assert os.listdir(tmp_path / "a") == ["checkpoints"] and not os.listdir(
    tmp_path / "a/checkpoints"
  )
  auto = small_config(memory_limit_gb=0.001)  # the same check, every setting tried
  with pytest.raises(ValueError, match="no setting of the update fits") as e:
    loop.plan_update(
      auto, get_config("tiny"), jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
    )
  assert "remat=full" in str(e.value)  # the smallest setting tried


def test_on_cpu_the_plan_is_made_against_the_hosts_memory_and_says_so(caplog):
  """Was: `~64.2 GiB (limit unknown)` for rl_tiny, and no plan was chosen by memory on CPU."""
  import dataclasses
  import logging
  import os

  from dice_jax.diffusion import memory as device_memory
  from dice_jax.rl import loop
  from experiments.configs import rl_tiny

  host = device_memory.host_memory()
  assert host and host <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  assert device_memory.device_limit() == host and device_memory.limit_name() == "host memory"
  assert 0 < device_memory.peak_bytes() < host  # this process's peak resident memory
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
  cfg = rl_tiny.get_config()
  with caplog.at_level(logging.INFO):
    resolved, plan = loop.plan_update(cfg, get_config("tiny", dtype="float32"), mesh)
  line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("RL update:"))
  assert line.endswith(f"(of {host / GIB:.1f} GiB host memory)"), line
  assert plan.estimate["total"] <= host and f"~{plan.estimate['total'] / GIB:.1f} GiB" in line
  # a host a quarter the size: smaller micro-batches, the same rows per optimizer step
  small, small_plan = memory.resolve_update(cfg, get_config("tiny", dtype="float32"), host // 4)
  assert small_plan.estimate["total"] <= host // 4
  assert small.accum_steps * small_plan.micro_rows == cfg.rows_per_update
  explicit = dataclasses.replace(cfg, memory_limit_gb=100.0)
  with caplog.at_level(logging.INFO):
    loop.plan_update(explicit, get_config("tiny", dtype="float32"), mesh)
  assert caplog.records[-1].getMessage().endswith("(of 100.0 GiB memory_limit_gb)")


@pytest.mark.parametrize("layout", ["packed", "per_round"])
def test_gathering_trained_positions_before_the_lm_head_changes_no_value_or_gradient(layout):
  graphdef, params, old = _models(False)
  trajs = trajectories()
  out = {}
  for gather in (False, True):
    cfg = tracerl.TraceRLConfig(layout=layout, gather_trained=gather, logit_chunk=16)
    (batch,) = tracerl.build_batches(
      trajs, cfg, block_size=4, mask_token_id=255, rows_per_batch=16, length_multiple=16
    )
    assert ("trained_index" in batch) == gather
    logp = jax.jit(lambda p, b: tracerl.token_logprobs(nnx.merge(graphdef, p), b, chunk=16))
    batch["old_logp"] = np.asarray(logp(old, batch))

    @jax.jit
    def f(p, b):
      loss = lambda q: tracerl.tracerl_loss(nnx.merge(graphdef, q), b, None, cfg)  # noqa: E731
      return jax.value_and_grad(loss, has_aux=True)(p)

    (loss_sum, m), g = f(params, batch)
    out[gather] = (batch, float(loss_sum), m, g)
  (b0, l0, m0, g0), (b1, l1, m1, g1) = out[False], out[True]
  index = b1["trained_index"]
  # the LM head sees K positions per row instead of T; every trained position is among them
  assert index.shape[1] < b1["tokens"].shape[1]
  assert (b1["p_mask"].sum(axis=1) == (index >= 0).sum(axis=1)).all()
  np.testing.assert_allclose(b1["old_logp"], b0["old_logp"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(l1, l0, rtol=1e-5)
  for k in ("entropy_sum", "kl_sum", "ratio_max"):
    np.testing.assert_allclose(float(m1[k]), float(m0[k]), rtol=1e-5, err_msg=k)
  scale = max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g0))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale), g1, g0)


def test_an_explicit_long_micro_batch_is_estimated_not_skipped():
  mcfg = get_config("sdar_1p7b", dtype="bfloat16", attention_impl="flash")
  shape = dict(rows_per_update=256, prompt_len=896, new_tokens=4096, steps=4)
  plan, tried = memory.choose_plan(
    mcfg, 10**15, layouts=["packed"], micro_rows=[8], remats=["full"], **shape
  )
  assert plan.micro_rows == 8 and plan.row_len * 8 > memory.MAX_MICRO_TOKENS
  plan, tried = memory.choose_plan(
    mcfg, 1, layouts=["packed"], micro_rows=[8], remats=["full"], **shape
  )
  assert plan is None and len(tried) == 1


def test_gathered_old_log_probs_on_a_sharded_mesh_with_accumulation_equal_one_device():
  from dice_jax import sharding

  graphdef, params, _ = _models(False)
  model = nnx.merge(graphdef, params)
  cfg = tracerl.TraceRLConfig(layout="packed", gather_trained=True)
  (batch,) = tracerl.build_batches(
    trajectories(3), cfg, block_size=4, mask_token_id=255, rows_per_batch=8, length_multiple=16
  )
  plain = {k: v for k, v in batch.items() if k != "trained_index"}
  want = np.asarray(jax.jit(tracerl.token_logprobs)(model, plain))
  mesh = sharding.make_mesh(1, 4, 2)
  sharded = sharding.create_sharded(lambda: nnx.clone(model), mesh)
  gdef, abs_params = nnx.split(sharded, nnx.Param)
  run = tracerl.jit_token_logprobs(gdef, ts.param_shardings(abs_params, mesh), mesh, 2)
  got = run(abs_params.to_pure_dict(), ts.shard_batch(batch, mesh, 2))
  np.testing.assert_allclose(np.asarray(got).reshape(want.shape), want, atol=1e-5)
  assert (want[batch["p_mask"]] != 0).all()
