"""A damaged checkpoint step (metadata overwritten, data files cut short or removed) is named in
one line and skipped: restores fall back to the newest intact step, a resumed run moves the
damaged ones aside, and with no intact step the error is one line naming each."""

import dataclasses
import json
import logging
import os
import shutil

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from dice_jax import sharding
from dice_jax.model.config import get_config
from dice_jax.model.transformer import Transformer
from dice_jax.train import checkpoint as ckpt_lib
from dice_jax.train import train_step as ts
from dice_jax.train.checkpoint import (
  CheckpointMismatchError,
  Checkpointer,
  DamagedCheckpointError,
)
from dice_jax.train.optimizer import OptimizerConfig, make_optimizer

STEPS = (1, 2, 3)
CONFIG = {"optim": dataclasses.asdict(OptimizerConfig()), "run": {"tokenizer": "byte"}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A run directory with steps 1-3 of a tiny model's train state (params differ by step), and
  the abstract restore target."""
  cfg = get_config("tiny", dtype="float32")
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  model = sharding.create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
  tx = make_optimizer(OptimizerConfig(), 1)  # what restore_params builds from the saved config
  _, state, shardings = ts.init_train_state(model, tx, mesh)
  run = tmp_path_factory.mktemp("run")
  ckpt_lib.save_model_config(cfg, str(run))
  ck = Checkpointer(str(run / "checkpoints"), save_every=1, keep=5, async_save=False)
  embeds = {}
  for step in STEPS:
    state["params"]["embed"] = state["params"]["embed"] + 1.0
    state["step"] = state["step"] + 1
    embeds[step] = np.asarray(state["params"]["embed"])
    ck.save(step, state, {"next_index": 10 * step}, CONFIG, force=True)
  ck.close()
  return run, ts.abstract_state(state, shardings), embeds


def _data_files(step_dir):
  d = step_dir / "state" / "ocdbt.process_0" / "d"
  return sorted(d.iterdir(), key=lambda p: p.stat().st_size)


def corrupt_metadata(step_dir):
  (step_dir / "state" / "_METADATA").write_text('{"tree_metadata": {"par')
  return "state/_METADATA is unreadable: JSONDecodeError: Unterminated string"


def empty_config(step_dir):
  (step_dir / "config" / "metadata").write_text("")
  return "config/metadata is unreadable: JSONDecodeError: Expecting value"


def truncate_data(step_dir):
  for f in _data_files(step_dir):
    with open(f, "r+b") as fh:
      fh.truncate(f.stat().st_size // 2)
  return "is unreadable: ValueError: OUT_OF_RANGE: Requested byte range"


def remove_data_file(step_dir):
  _data_files(step_dir)[-1].unlink()
  return "is missing or empty"


def remove_state_d(step_dir):
  shutil.rmtree(step_dir / "state" / "d")  # the b-tree: ~200 lines of `Event loop is closed` before
  return "state (the OCDBT database) is unreadable: ValueError: NOT_FOUND"


def overwrite_inside_data(step_dir):  # the files look whole: found only when the arrays are read
  f = _data_files(step_dir)[-1]
  with open(f, "r+b") as fh:
    fh.seek(16)
    fh.write(b"\xff" * (f.stat().st_size - 32))
  return None


DAMAGES = [
  corrupt_metadata,
  empty_config,
  truncate_data,
  remove_data_file,
  remove_state_d,
  overwrite_inside_data,
]


@pytest.fixture
def run(saved, tmp_path):
  path = tmp_path / "run"
  shutil.copytree(saved[0], path)
  return path


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__)
def test_a_damaged_newest_step_is_named_and_the_resume_falls_back_and_moves_it_aside(
  saved, run, damage, caplog
):
  _, target, embeds = saved
  found = damage(run / "checkpoints" / "3")
  ck = Checkpointer(str(run / "checkpoints"), save_every=1, keep=5, async_save=False)
  problem = ck.damage(3)
  if found is None:
    assert problem is None
  else:
    assert found in problem, problem
  assert ck.damage(2) is None
  # what a resume checks before it builds anything: the files only (bytes overwritten inside an
  # array are found by the restore)
  newest = 3 if found is None else 2
  assert ckpt_lib.newest_saved_config(str(run)) == (newest, json.loads(json.dumps(CONFIG)))
  with caplog.at_level(logging.WARNING):
    step, state, data, config = ck.restore_intact(target, set_aside=True)
  assert (step, data) == (2, {"next_index": 20}) and int(state["step"]) == 2
  np.testing.assert_array_equal(np.asarray(state["params"]["embed"]), embeds[2])
  warned = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
  assert len(warned) == 1 and warned[0].startswith(
    f"checkpoint step 3 in {run}/checkpoints is damaged ("
  )
  assert warned[0].endswith("); using step 2") and "\n" not in warned[0]
  if found is None:
    assert "restore failed: " in warned[0]
  assert ck.all_steps() == [1, 2] and sorted(os.listdir(run / "checkpoints.damaged")) == ["3"]
  assert ck.save(3, state, {}, {}, force=True)  # the run saves step 3 again
  ck.close()


def test_every_step_damaged_is_one_error_naming_each_and_moves_nothing(saved, run):
  _, target, _ = saved
  corrupt_metadata(run / "checkpoints" / "3")
  remove_state_d(run / "checkpoints" / "2")
  truncate_data(run / "checkpoints" / "1")
  ck = Checkpointer(str(run / "checkpoints"), save_every=1, keep=5, async_save=False)
  with pytest.raises(DamagedCheckpointError) as e:
    ck.restore_intact(target, set_aside=True)
  msg = str(e.value)
  assert msg.startswith(f"no intact checkpoint in {run}/checkpoints: step 3: state/_METADATA ")
  assert "; step 2: state (the OCDBT database) is unreadable" in msg
  assert "; step 1: state: " in msg and "\n" not in msg
  with pytest.raises(DamagedCheckpointError) as config_error:
    ckpt_lib.newest_saved_config(str(run))  # what a resume checks first: the same one line
  assert str(config_error.value) == msg
  assert ck.all_steps() == [1, 2, 3] and not (run / "checkpoints.damaged").exists()
  ck.close()


def test_a_checkpoint_of_another_train_state_is_a_mismatch_not_damage(saved, run):
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  model = sharding.create_sharded(
    lambda: Transformer(get_config("tiny", dtype="float32"), rngs=nnx.Rngs(0)), mesh
  )
  _, state, shardings = ts.init_train_state(model, optax.sgd(0.1, momentum=0.9), mesh)
  ck = Checkpointer(str(run / "checkpoints"), save_every=1, keep=5, async_save=False)
  with pytest.raises(CheckpointMismatchError) as e:
    ck.restore_intact(ts.abstract_state(state, shardings), set_aside=True)
  assert str(e.value).startswith(
    f"checkpoint step 3 in {run}/checkpoints holds another train state than this run builds"
  )
  assert "only in this run ['opt_state.0.trace.embed'" in str(e.value) and ck.all_steps() == [
    1,
    2,
    3,
  ]
  ck.close()


def test_export_and_init_checkpoint_restore_the_newest_intact_step(saved, run):
  """`restore_model` (export_hf --init=checkpoint) and `restore_run_params` (--init_checkpoint)
  skip a damaged step without moving it; a damaged step asked for by number is an error."""
  from dice_jax.train.run_setup import restore_run_params

  _, _, embeds = saved
  remove_data_file(run / "checkpoints" / "3")
  model, tok_dir, step = ckpt_lib.restore_model(str(run))
  assert step == 2 and tok_dir == str(run / "tokenizer")
  np.testing.assert_array_equal(np.asarray(model.embed[...]), embeds[2])
  model, mcfg, _ = restore_run_params(str(run), sharding.make_mesh())
  np.testing.assert_array_equal(np.asarray(model.embed[...]), embeds[2])
  assert sorted(os.listdir(run / "checkpoints")) == ["1", "2", "3"]  # read-only users move nothing
  with pytest.raises(DamagedCheckpointError, match=r"checkpoint step 3 in .*: state: the data"):
    ckpt_lib.restore_model(str(run), step=3)
  json.loads((run / "model_config.json").read_text())  # untouched


def test_a_run_without_a_complete_step_has_no_saved_config_and_nothing_is_touched(tmp_path):
  """The check every process makes before a run starts: no orbax manager, so nothing is created
  and a step still being written (orbax's temporary directory) is neither counted nor removed."""
  assert ckpt_lib.newest_saved_config(str(tmp_path / "new")) is None
  assert not (tmp_path / "new").exists()
  writing = tmp_path / "run" / "checkpoints" / "4.orbax-checkpoint-tmp-1796293684"
  writing.mkdir(parents=True)
  assert ckpt_lib.newest_saved_config(str(tmp_path / "run")) is None and writing.is_dir()
