"""Orbax checkpoints of the train state, the data iterator state and the config; a run's model.

`save_model_config` writes the resolved model config beside the checkpoints, and `restore_model`
rebuilds the model of a run directory from both (export, evaluation).

One `Checkpointer` wraps an `ocp.CheckpointManager` with three items per step:
  state   params + optimizer state + step (sharded arrays; restored onto the *current* mesh, which
          may have another shape than the one that wrote it),
  data    the grain iterator state (JSON),
  config  the run config (JSON, for the record and for `experiments.sft` to compare).
Saves are asynchronous (the arrays are copied off-device, then written in the background), every
`save_every` steps and whenever forced (end of run, pre-emption); the last `keep` are kept. Orbax
writes each step to a temporary directory and renames it when complete, so a kill mid-save leaves
the previous checkpoint as the latest one.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx

from dice_jax import atomic
from dice_jax import sharding as sharding_lib
from dice_jax.model.config import ModelConfig
from dice_jax.model.transformer import Transformer
from dice_jax.train import optimizer as optim_lib
from dice_jax.train import train_step as ts
from dice_jax.train.config import SFTConfig


class Checkpointer:
  """Save/restore `(state, data_state, config)` under `directory`."""

  def __init__(
    self,
    directory: str,
    *,
    save_every: int,
    keep: int = 3,
    async_save: bool = True,
    keep_period: int | None = None,
  ):
    """`keep_period`: steps that are multiples of it are never deleted (permanent snapshots)."""
    if save_every < 1 or keep < 1:
      raise ValueError(f"checkpoint save_every ({save_every}) and keep ({keep}) must be >= 1")
    self.directory = os.path.abspath(directory)
    self.save_every = save_every
    options = ocp.CheckpointManagerOptions(
      max_to_keep=keep,
      keep_period=keep_period,
      save_interval_steps=save_every,
      create=True,
      enable_async_checkpointing=async_save,
      cleanup_tmp_directories=True,
    )
    self._mngr = ocp.CheckpointManager(
      self.directory, options=options, item_names=("state", "data", "config")
    )

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._mngr.all_steps())

  def should_save(self, step: int) -> bool:
    """Whether `save(step, ...)` without `force` saves (interval, first step, pre-emption); the
    same answer on every process."""
    return self._mngr.should_save(step)

  def save(
    self, step: int, state: Any, data_state: dict | None, config: dict, *, force: bool = False
  ) -> bool:
    """Saves when `step` is on the interval (or `force`); returns whether a save started."""
    args = ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      data=ocp.args.JsonSave(data_state or {}),
      config=ocp.args.JsonSave(config),
    )
    saved = self._mngr.save(step, args=args, force=force)
    if saved:
      logging.info("checkpoint: saving step %d to %s (async)", step, self.directory)
    return saved

  def restore(self, abstract_state: Any, step: int | None = None):
    """(state, data_state, config) at `step` (default: latest), arrays placed as `abstract_state`
    (a tree of `jax.ShapeDtypeStruct` with shardings) says."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    out = self._mngr.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=ocp.args.JsonRestore(),
        config=ocp.args.JsonRestore(),
      ),
    )
    logging.info("checkpoint: restored step %d from %s", step, self.directory)
    return out["state"], out["data"], out["config"]

  def restore_config(self, step: int | None = None) -> dict:
    """The run config saved with `step` (default: latest), without touching the arrays."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    out = self._mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    return out["config"]

  def reached_preemption(self, step: int) -> bool:
    """True on every process once a pre-emption notice reached any (multi-host, via JAX's
    distributed preemption service)."""
    return self._mngr.reached_preemption(step)

  def wait(self):
    self._mngr.wait_until_finished()

  def close(self):
    self._mngr.close()


MODEL_CONFIG = "model_config.json"


def save_model_config(mcfg: ModelConfig, workdir: str) -> None:
  """Writes the run's resolved model config (what `restore_model` rebuilds), atomically."""
  atomic.write_json(os.path.join(workdir, MODEL_CONFIG), dataclasses.asdict(mcfg), indent=2)


def read_model_config(run_dir: str) -> ModelConfig:
  """The model config an SFT or RL run saved (`save_model_config`)."""
  path = os.path.join(run_dir, MODEL_CONFIG)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} not found: {run_dir} is not an SFT or RL run directory")
  with open(path) as f:
    raw = json.load(f)
  if isinstance(raw.get("eos_token_id"), list):
    raw["eos_token_id"] = tuple(raw["eos_token_id"])
  return ModelConfig(**raw)


def abstract_train_state(mcfg: ModelConfig, tx, mesh):
  """(graphdef, train-state target of ShapeDtypeStructs with shardings, shardings), allocating
  nothing: what an orbax restore fills."""
  graphdef, abs_params = nnx.split(
    nnx.eval_shape(lambda: Transformer(mcfg, rngs=nnx.Rngs(0))), nnx.Param
  )
  p_sh = ts.param_shardings(abs_params, mesh)
  shapes = {
    "params": jax.tree.map(
      lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), abs_params.to_pure_dict()
    )
  }
  shardings = ts.state_shardings(tx, shapes["params"], p_sh, mesh)
  shapes["opt_state"] = jax.eval_shape(tx.init, shapes["params"])
  shapes["step"] = jax.ShapeDtypeStruct((), np.int32)
  return graphdef, ts.abstract_state(shapes, shardings), shardings


def restore_model(workdir: str, mesh=None, step: int | None = None):
  """(model, tokenizer_dir, step): the parameters of a run's checkpoint (default: latest).

  The train state is restored against an abstract target (no random init, no optimizer
  allocation before the restore), onto `mesh` (default: every device on the fsdp axis).
  """
  mcfg = read_model_config(workdir)
  ckpt = Checkpointer(f"{workdir}/checkpoints", save_every=1, async_save=False)
  try:
    step = ckpt.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {workdir}/checkpoints")
    cfg = SFTConfig.from_json(ckpt.restore_config(step))
    mesh = mesh or sharding_lib.make_mesh()
    tx = optim_lib.make_optimizer(cfg.optim, cfg.num_steps)
    graphdef, target, _ = abstract_train_state(mcfg, tx, mesh)
    state, _, _ = ckpt.restore(target, step)
  finally:
    ckpt.close()
  return nnx.merge(graphdef, state["params"]), cfg.run.tokenizer_dir(workdir), step
