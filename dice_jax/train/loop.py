"""The SFT loop: build mesh, model, optimizer and data; restore; step; log; checkpoint; export.

Resume is exact: the checkpoint holds params, optimizer state, step and the grain iterator state
taken right after the step's batch was drawn, and the step's noise key is `fold_in(seed, step)`,
so a resumed run draws the same batches and the same noise as an uninterrupted one.
SIGTERM (pre-emption) sets a flag; the loop then saves the current step and returns.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import zlib

import jax
import numpy as np
from absl import logging
from flax import nnx

from dice_jax.diffusion import objective as objective_lib
from dice_jax.model.config import ModelConfig, get_config
from dice_jax.model.transformer import Transformer
from dice_jax.train import checkpoint as ckpt_lib
from dice_jax.train import metrics as metrics_lib
from dice_jax.train import optimizer as optim_lib
from dice_jax.train import sft_data
from dice_jax.train import sharding as sharding_lib
from dice_jax.train import train_step as ts
from dice_jax.train.config import SFTConfig


class _StopFlag:
  """Set by SIGTERM; restores the previous handler on exit."""

  def __init__(self):
    self.set = False
    self._prev = None

  def __enter__(self):
    try:
      self._prev = signal.signal(signal.SIGTERM, self._handle)
    except ValueError:  # not the main thread
      self._prev = None
    return self

  def _handle(self, signum, frame):
    logging.warning("SIGTERM: saving a checkpoint at the end of this step, then stopping")
    self.set = True

  def __exit__(self, *exc):
    if self._prev is not None:
      signal.signal(signal.SIGTERM, self._prev)


def make_loss_fn(cfg: SFTConfig):
  from dice_jax.diffusion.objective import block_diffusion_loss

  return lambda model, batch, rng: block_diffusion_loss(model, batch, rng, cfg.objective)


def build_model(cfg: SFTConfig, mesh, init_hf: str | None, model_overrides: dict):
  if init_hf:
    from dice_jax.hf.checkpoint import import_hf

    return import_hf(init_hf, mesh, **model_overrides)
  mcfg = get_config(cfg.model, **model_overrides)
  model = sharding_lib.create_sharded(lambda: Transformer(mcfg, rngs=nnx.Rngs(cfg.seed)), mesh)
  return model, mcfg


def batch_fingerprint(batch: dict) -> float:
  """CRC32 of the batch's tokens (exact in float64): identifies the data order in metrics."""
  return float(zlib.crc32(np.ascontiguousarray(batch["tokens"]).tobytes()))


def run_sft(
  cfg: SFTConfig, workdir: str, *, init_hf: str | None = None, export_hf: str | None = None
) -> dict:
  """Trains to `cfg.num_steps` (resuming from `workdir/checkpoints`). Returns a summary dict."""
  mesh = sharding_lib.make_mesh(cfg.mesh_data, cfg.mesh_fsdp, cfg.mesh_tensor)
  logging.info(
    "mesh %s over %d devices (%s)", dict(mesh.shape), mesh.size, jax.devices()[0].device_kind
  )
  tok, tok_dir = sft_data.load_tokenizer(cfg, workdir)
  overrides = dict(cfg.model_overrides)
  if cfg.tokenizer == "byte" and not init_hf:
    overrides = {**sft_data.byte_model_overrides(), **overrides}
  model, mcfg = build_model(cfg, mesh, init_hf, overrides)
  cfg.objective.grid.check_model(mcfg, "SFTConfig.objective.grid")
  if jax.process_index() == 0:
    save_model_config(mcfg, workdir)
  logging.info(
    "model %s: %.2fM params, attention=%s remat=%s dtype=%s/%s",
    cfg.model,
    mcfg.num_params() / 1e6,
    mcfg.attention_impl,
    mcfg.remat,
    mcfg.dtype,
    mcfg.param_dtype,
  )

  schedule = optim_lib.make_schedule(cfg.optim, cfg.num_steps)
  tx = optim_lib.make_optimizer(cfg.optim, cfg.num_steps)
  graphdef, state, shardings = ts.init_train_state(model, tx, mesh, tolerance=cfg.shard_tolerance)
  del model

  samples = sft_data.load_samples(cfg)
  it = sft_data.make_iterator(cfg, samples, tok)
  ckpt = ckpt_lib.Checkpointer(
    f"{workdir}/checkpoints",
    save_every=cfg.checkpoint_every,
    keep=cfg.checkpoint_keep,
    async_save=cfg.async_checkpoint,
  )
  if ckpt.latest_step() is not None:
    state, data_state, _ = ckpt.restore(ts.abstract_state(state, shardings))
    it.set_state(data_state)
  start = int(jax.device_get(state["step"]))

  step_fn = ts.jit_train_step(
    ts.make_train_step(
      graphdef,
      tx,
      make_loss_fn(cfg),
      accum_steps=cfg.accum_steps,
      schedule=schedule,
      means=objective_lib.METRIC_MEANS,
    ),
    shardings,
    mesh,
    cfg.accum_steps,
  )
  writer = metrics_lib.MetricWriter(workdir)
  flops = cfg.batch_size * metrics_lib.sft_flops_per_row(mcfg, cfg.seq_len)
  rate = metrics_lib.Throughput(
    cfg.num_steps, flops, cfg.batch_size * cfg.seq_len, mesh.size, metrics_lib.peak_flops()
  )
  rng = jax.random.key(cfg.seed)
  config_json = cfg.to_json()
  logging.info("training steps %d -> %d", start, cfg.num_steps)
  last, preempted = {}, False
  with _StopFlag() as stop:
    for step in range(start, cfg.num_steps):
      host_batch = next(it)
      batch = ts.shard_batch(host_batch, mesh, cfg.accum_steps)
      state, m = step_fn(state, batch, rng)
      m = {k: float(v) for k, v in jax.device_get(m).items()}
      done = step + 1
      m.update(
        rate.tick(done),
        data_fingerprint=batch_fingerprint(host_batch),
        real_tokens=float((host_batch["segment_ids"] > 0).sum()),
      )
      if not np.isfinite(m["loss"]):
        raise FloatingPointError(f"non-finite loss {m['loss']} at step {done}")
      writer.write(done, m)
      if done % cfg.log_every == 0 or done == cfg.num_steps:
        metrics_lib.log_progress(done, cfg.num_steps, m, rate.eta_s(done))
      preempted = stop.set or ckpt.reached_preemption(done)
      ckpt.save(done, state, it.get_state(), config_json, force=preempted or done == cfg.num_steps)
      last = m
      if preempted:
        logging.warning("pre-empted at step %d: checkpoint saved, stopping", done)
        break
  ckpt.wait()
  ckpt.close()
  writer.close()
  if jax.process_index() == 0 and last:
    metrics_lib.plot_loss(
      f"{workdir}/metrics.jsonl", f"{workdir}/loss.png", title=f"SFT {cfg.model} ({workdir})"
    )
  if export_hf and not preempted:
    from dice_jax.hf.checkpoint import export_hf as export

    export(nnx.merge(graphdef, state["params"]), export_hf, tokenizer_dir=tok_dir)
    logging.info("exported HF checkpoint to %s", export_hf)
  return {"step": int(jax.device_get(state["step"])), "preempted": preempted, **last}


MODEL_CONFIG = "model_config.json"


def save_model_config(mcfg: ModelConfig, workdir: str) -> None:
  """Writes the run's resolved model config (what `restore_model` rebuilds), atomically."""
  os.makedirs(workdir, exist_ok=True)
  tmp = os.path.join(workdir, MODEL_CONFIG + ".tmp")
  with open(tmp, "w") as f:
    json.dump(dataclasses.asdict(mcfg), f, indent=2)
  os.replace(tmp, os.path.join(workdir, MODEL_CONFIG))


def restore_model(workdir: str, mesh=None, step: int | None = None):
  """(model, tokenizer_dir, step): the parameters of a run's checkpoint (default: latest).

  The train state is restored against an abstract target (no random init, no optimizer
  allocation before the restore), onto `mesh` (default: every device on the fsdp axis).
  """
  path = os.path.join(workdir, MODEL_CONFIG)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} not found: {workdir} is not an SFT run directory")
  with open(path) as f:
    raw = json.load(f)
  if isinstance(raw.get("eos_token_id"), list):
    raw["eos_token_id"] = tuple(raw["eos_token_id"])
  mcfg = ModelConfig(**raw)
  ckpt = ckpt_lib.Checkpointer(f"{workdir}/checkpoints", save_every=1, async_save=False)
  try:
    step = ckpt.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {workdir}/checkpoints")
    cfg = SFTConfig.from_json(ckpt.restore_config(step))
    mesh = mesh or sharding_lib.make_mesh()
    graphdef, abs_params = nnx.split(
      nnx.eval_shape(lambda: Transformer(mcfg, rngs=nnx.Rngs(0))), nnx.Param
    )
    p_sh = ts.param_shardings(abs_params, mesh)
    shapes = {
      "params": jax.tree.map(
        lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), abs_params.to_pure_dict()
      )
    }
    tx = optim_lib.make_optimizer(cfg.optim, cfg.num_steps)
    shardings = ts.state_shardings(tx, shapes["params"], p_sh, mesh)
    shapes["opt_state"] = jax.eval_shape(tx.init, shapes["params"])
    shapes["step"] = jax.ShapeDtypeStruct((), np.int32)
    state, _, _ = ckpt.restore(ts.abstract_state(shapes, shardings), step)
  finally:
    ckpt.close()
  tok_dir = os.path.join(workdir, "tokenizer") if cfg.tokenizer == "byte" else cfg.tokenizer
  return nnx.merge(graphdef, state["params"]), tok_dir, step
