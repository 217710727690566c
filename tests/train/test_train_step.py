import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dice_jax.diffusion.objective import ObjectiveConfig, block_diffusion_loss
from dice_jax.model import masks
from dice_jax.model.transformer import Transformer
from dice_jax.train import optimizer, sharding
from dice_jax.train import train_step as ts

from ._helpers import packed_batch


def _loss(model, batch, rng):
  return block_diffusion_loss(model, batch, rng, ObjectiveConfig())


def _run(cfg, mesh, batches, loss_fn=_loss, accum=1, lr=1e-3):
  model = sharding.create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
  tx = optimizer.make_optimizer(optimizer.OptimizerConfig(learning_rate=lr, warmup_steps=1), 10)
  graphdef, state, shardings = ts.init_train_state(model, tx, mesh)
  step = ts.jit_train_step(
    ts.make_train_step(graphdef, tx, loss_fn, accum_steps=accum), shardings, mesh, accum
  )
  losses = []
  for b in batches:
    state, m = step(state, ts.shard_batch(b, mesh, accum), jax.random.key(7))
    losses.append(float(m["loss"]))
  return np.array(losses), state


def test_fsdp4_tensor2_matches_one_device_over_five_steps(tiny_cfg):
  batches = [packed_batch(8, 32, 250, seed=s) for s in range(5)]
  one, s1 = _run(tiny_cfg, sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]), batches)
  mesh = sharding.make_mesh(1, 4, 2)
  eight, s8 = _run(tiny_cfg, mesh, batches)
  assert np.all(np.isfinite(one))
  np.testing.assert_allclose(eight, one, rtol=2e-5, atol=2e-5)
  # parameters really are sharded over both axes, and end up equal
  spec = s8["params"]["layers"]["gate_proj"].sharding.spec
  assert spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5),
    s1["params"],
    s8["params"],
  )


def _same_position_ce(model, batch, rng):
  """Deterministic token-mean CE (no noise), with the objective's metrics contract."""
  del rng
  spec = masks.AttentionSpec.block_causal(4, batch["segment_ids"])
  logits = model(batch["tokens"], batch["positions"], spec)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"])
  w = batch["loss_mask"].astype(jnp.float32)
  total, n = jnp.sum(ce * w), jnp.sum(w)
  return total, {"denominator": n}


def test_accumulation_equals_the_token_weighted_full_batch(tiny_cfg):
  b = packed_batch(8, 32, 250, seed=3)
  b["loss_mask"][:4, :] &= np.arange(32) < 6  # micro-batches with very different token counts
  mesh = sharding.make_mesh(1, 2, 1, devices=jax.devices()[:2])
  full, s_full = _run(tiny_cfg, mesh, [b, b], _same_position_ce, accum=1)
  acc, s_acc = _run(tiny_cfg, mesh, [b, b], _same_position_ce, accum=2)
  np.testing.assert_allclose(acc, full, rtol=1e-5)
  # Adam turns near-zero gradients into full-size steps, so compare at a fraction of one update
  jax.tree.map(
    lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=5e-5),
    s_full["params"],
    s_acc["params"],
  )
  # the mean of per-micro-batch means would differ: the test would notice
  halves = [{k: v[i * 4 : (i + 1) * 4] for k, v in b.items()} for i in range(2)]
  model = Transformer(tiny_cfg, rngs=nnx.Rngs(0))
  means = [float(_same_position_ce(model, h, None)[0] / h["loss_mask"].sum()) for h in halves]
  assert abs(np.mean(means) - full[0]) > 1e-3


def test_the_step_donates_its_input_state(tiny_cfg):
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  model = sharding.create_sharded(lambda: Transformer(tiny_cfg, rngs=nnx.Rngs(0)), mesh)
  tx = optax.adamw(1e-3)
  graphdef, state, shardings = ts.init_train_state(model, tx, mesh)
  step = ts.jit_train_step(ts.make_train_step(graphdef, tx, _loss), shardings, mesh)
  old = state["params"]["embed"]
  new, m = step(state, ts.shard_batch(packed_batch(2, 32, 250, 0), mesh), jax.random.key(0))
  assert old.is_deleted() and int(new["step"]) == 1 and np.isfinite(float(m["loss"]))


def test_unsharded_parameters_are_refused_on_a_multi_device_mesh(tiny_cfg):
  mesh = sharding.make_mesh(1, 4, 2)
  model = Transformer(tiny_cfg, rngs=nnx.Rngs(0))
  _, params = nnx.split(model, nnx.Param)
  no_rules = {k: () for k in sharding.RULES}
  with pytest.raises(ValueError, match="unsharded"):
    sharding.assert_sufficiently_sharded(params, mesh, rules=no_rules)
  assert sharding.unsharded_fraction(params, mesh) < 0.02
