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

A step damaged afterwards (a file removed, cut short or overwritten; `checkpoint_files.py`) is named
in one warning line and skipped: `restore_intact` and `newest_saved_config` fall back to the newest
intact step, and a resumed run moves the damaged newer steps aside (`<directory>.damaged/<step>`)
so that it can save those step numbers again. With no intact step they raise
`DamagedCheckpointError` (a UserError: one line, exit status 2 in the launchers).
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

from dice_jax import atomic, distributed
from dice_jax import sharding as sharding_lib
from dice_jax.errors import UserError
from dice_jax.model.config import ModelConfig
from dice_jax.model.transformer import Transformer
from dice_jax.train import checkpoint_files
from dice_jax.train import optimizer as optim_lib
from dice_jax.train import train_step as ts


class DamagedCheckpointError(UserError):
  """Every saved step of a checkpoint directory is damaged (the message names each problem)."""


class CheckpointMismatchError(UserError):
  """A checkpoint holds the arrays of another model or optimizer than the run restoring it."""


def _key_name(key) -> str:
  """A tree path entry as orbax names it on disk (dict key, sequence index, attribute)."""
  for attr in ("key", "idx", "name"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _none_intact(directory: str, problems) -> DamagedCheckpointError:
  listed = "; ".join(f"step {s}: {p}" for s, p in problems)
  return DamagedCheckpointError(f"no intact checkpoint in {directory}: {listed}")


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
    cleanup_tmp: bool = True,
  ):
    """`keep_period`: steps that are multiples of it are never deleted (permanent snapshots).
    `cleanup_tmp`: orbax deletes the unfinished saves of earlier runs, in a background thread
    that `close` does not wait for when nothing was saved (a reader passes False: it has nothing
    to clean up, and a process that exits right after its restore failed would have that thread
    print a traceback at interpreter shutdown)."""
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
      cleanup_tmp_directories=cleanup_tmp,
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

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def damage(self, step: int) -> str | None:
    """What is wrong with the files of `step` (`checkpoint_files.damage`), or None."""
    return checkpoint_files.damage(self.step_dir(step))

  def restore_intact(self, abstract_state: Any, *, set_aside: bool = False):
    """(step, state, data_state, config) of the newest step that restores, trying older steps when
    a step's files are damaged or its restore fails (each named in one warning line).

    `abstract_state`: the restore target, or a function of the step's saved config that returns
    it. `set_aside`: move the damaged newer steps to `<directory>.damaged/` (a resumed run, which
    saves those step numbers again). Raises DamagedCheckpointError when no step restores (nothing
    is moved then); FileNotFoundError when nothing is saved.
    """
    problems = []
    for step in sorted(self.all_steps(), reverse=True):
      restored, problem = self._try_restore(step, abstract_state)
      if problem is not None:
        problems.append((step, problem))
        continue
      self._warn_skipped(problems, step)
      if set_aside and problems:
        self._set_aside([s for s, _ in problems])
      return (step, *restored)
    if problems:
      raise _none_intact(self.directory, problems)
    raise FileNotFoundError(f"no checkpoint in {self.directory}")

  def restore_step(self, step: int, abstract_state: Any):
    """(state, data_state, config) of `step` (`abstract_state` as for `restore_intact`); raises
    DamagedCheckpointError naming what is wrong with it."""
    restored, problem = self._try_restore(step, abstract_state)
    if problem is not None:
      raise DamagedCheckpointError(f"checkpoint step {step} in {self.directory}: {problem}")
    return restored

  def _try_restore(self, step: int, abstract_state: Any):
    """((state, data_state, config), None), or (None, what is wrong with `step`); the same answer
    on every process."""
    if step not in self.all_steps():
      return None, "not saved"
    problem, restored = self.damage(step), None
    if problem is None:
      config = self.restore_config(step)
      target = abstract_state(config) if callable(abstract_state) else abstract_state
      self._check_same_arrays(step, target)
      try:
        restored = self.restore(target, step)
      except Exception as e:  # noqa: BLE001 -- any failure to read the step is its damage
        problem = f"restore failed: {checkpoint_files.one_line(e)}"
    if distributed.any_process(problem is not None):
      return None, problem or "its restore failed on another process"
    return restored, None

  def _check_same_arrays(self, step: int, target: Any) -> None:
    """Raises CheckpointMismatchError when `step` holds other arrays than `target` has (another
    model or optimizer than the one that saved it: not damage, and no older step would fit)."""
    with open(os.path.join(self.step_dir(step), "state", "_METADATA")) as f:
      saved = set(checkpoint_files.array_keys(json.load(f)["tree_metadata"]))
    paths = jax.tree_util.tree_flatten_with_path(target)[0]
    wanted = {".".join(_key_name(k) for k in path) for path, _ in paths}
    if saved != wanted:
      only_saved, only_wanted = sorted(saved - wanted), sorted(wanted - saved)
      raise CheckpointMismatchError(
        f"checkpoint step {step} in {self.directory} holds another train state than this run "
        f"builds (another model or optimizer): arrays only in the checkpoint {only_saved[:3]}, "
        f"only in this run {only_wanted[:3]}"
      )

  def _warn_skipped(self, problems, step: int) -> None:
    for bad, problem in problems:
      logging.warning(
        "checkpoint step %d in %s is damaged (%s); using step %d",
        bad,
        self.directory,
        problem,
        step,
      )

  def _set_aside(self, steps: list[int]) -> None:
    """Moves damaged `steps` to `<directory>.damaged/<step>` (process 0; all then re-read)."""
    aside = f"{self.directory}.damaged"
    if distributed.is_primary():
      os.makedirs(aside, exist_ok=True)
      for step in steps:
        dest = os.path.join(aside, str(step))
        if os.path.exists(dest):
          dest = f"{dest}.{int(os.path.getmtime(dest))}"
        os.replace(self.step_dir(step), dest)
        logging.warning("moved the damaged checkpoint step %d to %s", step, dest)
    distributed.barrier("checkpoint_set_aside")
    self._mngr.reload()

  def reached_preemption(self, step: int) -> bool:
    """True on every process once a pre-emption notice reached any (multi-host, via JAX's
    distributed preemption service)."""
    return self._mngr.reached_preemption(step)

  def wait(self):
    self._mngr.wait_until_finished()

  def close(self):
    self._mngr.close()


MODEL_CONFIG = "model_config.json"


def newest_saved_config(run_dir: str) -> tuple[int, dict] | None:
  """(step, config) of the newest step of the SFT or RL run in `run_dir` whose files look whole
  (`checkpoint_files.damage`), or None when it has none. Reads files only, without an orbax manager:
  no collective among processes, nothing created or cleaned up (a run's other processes may be
  starting beside it). Raises DamagedCheckpointError when every saved step is damaged."""
  directory = os.path.abspath(os.path.join(run_dir, "checkpoints"))
  problems = []
  for step in reversed(checkpoint_files.saved_steps(directory)):
    step_dir = os.path.join(directory, str(step))
    problem = checkpoint_files.damage(step_dir)
    if problem is None:
      return step, checkpoint_files.read_config(step_dir)
    problems.append((step, problem))
  if problems:
    raise _none_intact(directory, problems)
  return None


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


def restore_params(run_dir: str, mesh=None, step: int | None = None):
  """(model, model config, saved run config, step): the parameters of an SFT or RL run's checkpoint
  (default: its newest intact step, warning about damaged newer ones), restored against an
  abstract target (no random init, no optimizer allocation before the restore) onto `mesh`
  (default: every device on the fsdp axis). Raises DamagedCheckpointError when no step is intact
  (or `step` is damaged)."""
  mcfg = read_model_config(run_dir)
  mesh = mesh or sharding_lib.make_mesh()
  graphdef = None

  def target(config: dict):
    nonlocal graphdef
    tx = optim_lib.make_optimizer(optim_lib.OptimizerConfig(**config["optim"]), 1)
    graphdef, abstract, _ = abstract_train_state(mcfg, tx, mesh)
    return abstract

  ckpt = Checkpointer(
    os.path.join(run_dir, "checkpoints"), save_every=1, async_save=False, cleanup_tmp=False
  )
  try:
    if step is None:
      step, state, _, config = ckpt.restore_intact(target)
    else:
      state, _, config = ckpt.restore_step(step, target)
  except FileNotFoundError:
    raise FileNotFoundError(f"no checkpoint under {run_dir}/checkpoints") from None
  finally:
    ckpt.close()
  return nnx.merge(graphdef, state["params"]), mcfg, config, step


def restore_model(workdir: str, mesh=None, step: int | None = None):
  """(model, tokenizer_dir, step): `restore_params` of a run directory, with the run's tokenizer."""
  from dice_jax.train.run_config import nest_flat_fields

  model, _, config, step = restore_params(workdir, mesh, step)
  return model, nest_flat_fields(config)["run"].tokenizer_dir(workdir), step
