"""Orbax checkpoints of the train state, the data iterator state and the config.

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

import os
from typing import Any

import orbax.checkpoint as ocp
from absl import logging


class Checkpointer:
  """Save/restore `(state, data_state, config)` under `directory`."""

  def __init__(self, directory: str, *, save_every: int, keep: int = 3, async_save: bool = True):
    if save_every < 1 or keep < 1:
      raise ValueError(f"checkpoint save_every ({save_every}) and keep ({keep}) must be >= 1")
    self.directory = os.path.abspath(directory)
    self.save_every = save_every
    options = ocp.CheckpointManagerOptions(
      max_to_keep=keep,
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
