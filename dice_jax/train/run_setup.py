"""One set-up for SFT and RL runs: mesh, model config and model, tokenizer and checkpointer from
the run section (`run_config.RunConfig`), or the parameters of an earlier run's checkpoint."""

from __future__ import annotations

import os

from absl import logging
from flax import nnx

from dice_jax import sharding as sharding_lib
from dice_jax.data import byte_tokenizer
from dice_jax.errors import UserError
from dice_jax.model.config import ModelConfig, get_config
from dice_jax.model.transformer import Transformer
from dice_jax.train import checkpoint as ckpt_lib
from dice_jax.train.run_config import RunConfig


def make_mesh(run: RunConfig):
  """The run's mesh; a UserError naming `run.mesh_*` when it does not fit this host's devices."""
  try:
    return sharding_lib.make_mesh(
      run.mesh_data, run.mesh_fsdp, run.mesh_tensor, slices=run.mesh_slices
    )
  except ValueError as e:
    raise UserError(
      f"run.mesh_data/mesh_fsdp/mesh_tensor/mesh_slices = {run.mesh_data}/{run.mesh_fsdp}/"
      f"{run.mesh_tensor}/{run.mesh_slices}: {e}"
    ) from None


def model_config(run: RunConfig) -> ModelConfig:
  """The run's model config (from `run.init_hf`'s config.json or the preset), without building
  it; the byte tokenizer's vocabulary and special ids for a preset with `tokenizer='byte'`."""
  init_hf = run.init_hf
  overrides = dict(run.model_overrides)
  if run.tokenizer == "byte" and not init_hf:
    overrides = {**byte_tokenizer.byte_model_overrides(), **overrides}
  try:
    if init_hf:
      from dice_jax.hf.checkpoint import read_config

      return read_config(init_hf, **overrides)
    return get_config(run.model, **overrides)
  except UserError:
    raise
  except (TypeError, ValueError) as e:
    raise UserError(f"model config ({init_hf or run.model}, {overrides}): {e}") from e


def build_model(run: RunConfig, mcfg: ModelConfig, mesh):
  """A freshly initialised model (seeded by `run.seed`), or `run.init_hf`'s weights, on `mesh`."""
  if run.init_hf:
    from dice_jax.hf.checkpoint import import_hf

    return import_hf(run.init_hf, mesh, **run.model_overrides)[0]
  return sharding_lib.create_sharded(lambda: Transformer(mcfg, rngs=nnx.Rngs(run.seed)), mesh)


def load_tokenizer(path: str, where: str = "run.tokenizer"):
  """'byte' or an HF tokenizer directory, read without writing anything."""
  from dice_jax.data.tokenizer import Tokenizer

  if path == "byte":
    return byte_tokenizer.load_byte_tokenizer()
  if not os.path.isdir(path):
    raise UserError(
      f"{where} {path}: no such directory (expected 'byte' or an HF tokenizer directory)"
    )
  return Tokenizer.from_dir(path)


def save_tokenizer(run: RunConfig, workdir: str, inherited: str | None = None) -> str:
  """Writes the byte tokenizer, or the one `inherited` from an init run, into `workdir/tokenizer`
  (a `run.tokenizer` directory stays where it is); returns `run.tokenizer_dir`."""
  from dice_jax.data.tokenizer import Tokenizer

  dest = run.tokenizer_dir(workdir, inherited)
  if inherited and os.path.abspath(inherited) != os.path.abspath(dest):
    Tokenizer.from_dir(inherited).save(dest)
  elif not inherited and run.tokenizer == "byte":
    byte_tokenizer.write_byte_tokenizer(dest)
  return dest


def make_checkpointer(run: RunConfig, workdir: str, keep_period: int | None = None):
  """The run's orbax checkpointer in `workdir/checkpoints` (`keep_period`: never-deleted steps)."""
  return ckpt_lib.Checkpointer(
    os.path.join(workdir, "checkpoints"),
    save_every=run.checkpoint_every,
    keep=run.checkpoint_keep,
    async_save=run.async_checkpoint,
    keep_period=keep_period,
  )


def restore_run_params(run_dir: str, mesh, step: int | None = None):
  """(model, model config, tokenizer dir or None) from an SFT or RL run's checkpoint (default: its
  newest intact step, `checkpoint.restore_params`): `--init_checkpoint` (RL phase 2 starts from
  phase 1; phase 1 from SFT)."""
  model, mcfg, saved, step = ckpt_lib.restore_params(run_dir, mesh, step)
  tok_dir = os.path.join(run_dir, "tokenizer")
  if not os.path.isdir(tok_dir):
    saved_tok = saved.get("run", {}).get("tokenizer", saved.get("tokenizer"))
    tok_dir = saved_tok if saved_tok not in (None, "", "byte") else None
  logging.info("initialised from %s step %d", run_dir, step)
  return model, mcfg, tok_dir
