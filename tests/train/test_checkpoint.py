import jax
import numpy as np
import optax
from flax import nnx

from dice_jax import sharding
from dice_jax.model.transformer import Transformer
from dice_jax.train import train_step as ts
from dice_jax.train.checkpoint import Checkpointer


def _state_on(cfg, mesh, seed=0):
  model = sharding.create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(seed)), mesh)
  tx = optax.adamw(1e-3)
  _, state, shardings = ts.init_train_state(model, tx, mesh)
  # make the optimizer state non-trivial
  state["opt_state"] = jax.tree.map(
    lambda x: x + 0.5 if x.dtype == np.float32 else x, state["opt_state"]
  )
  state["step"] = state["step"] + 41
  return state, shardings


def test_checkpoint_from_a_4_device_mesh_restores_onto_a_2_device_mesh(tiny_cfg, tmp_path):
  mesh4 = sharding.make_mesh(1, 4, 1, devices=jax.devices()[:4])
  state4, _ = _state_on(tiny_cfg, mesh4)
  ck = Checkpointer(str(tmp_path / "ck"), save_every=1, keep=2)
  data_state = {"parent": {"next_index": 17}, "next_row": 3}
  assert ck.save(41, state4, data_state, {"model": "tiny", "seq_len": 32})
  ck.wait()
  ck.close()

  mesh2 = sharding.make_mesh(1, 2, 1, devices=jax.devices()[4:6])
  template, shardings2 = _state_on(tiny_cfg, mesh2, seed=1)  # other values, same structure
  ck2 = Checkpointer(str(tmp_path / "ck"), save_every=1, keep=2)
  assert ck2.latest_step() == 41
  restored, got_data, got_config = ck2.restore(ts.abstract_state(template, shardings2))
  assert got_data == data_state and got_config == {"model": "tiny", "seq_len": 32}
  assert int(restored["step"]) == 41
  for a, b in zip(jax.tree.leaves(state4), jax.tree.leaves(restored)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  emb = restored["params"]["embed"]
  assert emb.sharding.mesh.shape == mesh2.shape and set(emb.devices()) == set(jax.devices()[4:6])
  assert emb.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")


def test_only_the_last_k_checkpoints_are_kept_and_interval_is_respected(tiny_cfg, tmp_path):
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  state, _ = _state_on(tiny_cfg, mesh)
  ck = Checkpointer(str(tmp_path / "ck"), save_every=2, keep=2)
  saved = [s for s in range(1, 8) if ck.save(s, state, {}, {})]
  ck.wait()
  assert saved == [1, 2, 4, 6]  # the first step, then every 2
  assert ck.save(7, state, {}, {}, force=False) is False
  assert ck.save(7, state, {}, {}, force=True) is True
  ck.wait()
  assert ck.all_steps() == [6, 7]
  ck.close()
