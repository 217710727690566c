"""The SFT loop: the run set-up (`run_setup.py`), optimizer, data; restore; step; log; save; export.

Resume is exact: the checkpoint holds params, optimizer state, step and the grain iterator state
taken right after the step's batch was drawn, and the step's noise key is `fold_in(seed, step)`,
so a resumed run draws the same batches and the same noise as an uninterrupted one.
Inputs are checked before anything is written (`prepare`): a resumed run refuses a changed config
(`resume.py`), the tokenizer must fit the model. SIGTERM (pre-emption) and SIGINT (Ctrl-C) save
the current step and return (`stop.py`).
"""

from __future__ import annotations

import os
import time
import zlib

import jax
import numpy as np
from absl import logging
from flax import nnx

from dice_jax import distributed
from dice_jax.data.tokenizer import check_compatible
from dice_jax.diffusion import objective as objective_lib
from dice_jax.errors import UserError
from dice_jax.train import checkpoint as ckpt_lib
from dice_jax.train import data_shards, resume, sft_data
from dice_jax.train import metrics as metrics_lib
from dice_jax.train import optimizer as optim_lib
from dice_jax.train import run_setup
from dice_jax.train import train_step as ts
from dice_jax.train.config import SFTConfig
from dice_jax.train.stop import run_stoppable


def make_loss_fn(cfg: SFTConfig):
  from dice_jax.diffusion.objective import block_diffusion_loss

  return lambda model, batch, rng: block_diffusion_loss(model, batch, rng, cfg.objective)


def batch_summary(host_batch: dict, rows, stop_requested: bool) -> tuple[float, float, bool]:
  """(fingerprint, real tokens, stop) of the global batch, from this process's `rows` of it.

  The fingerprint is a CRC32 over the CRC32s of the global batch's rows (exact in float64): it
  identifies the data order in metrics, whatever the process count. `stop` is True when a stop
  signal reached any process. Multi-process, a collective (every process calls it each step).
  """
  tokens = np.ascontiguousarray(host_batch["tokens"])
  local = np.stack(
    [
      np.asarray(rows, np.int64),
      [zlib.crc32(row.tobytes()) for row in tokens],
      (np.asarray(host_batch["segment_ids"]) > 0).sum(axis=1),
    ],
    axis=1,
  )
  parts = distributed.gather(np.concatenate([[int(stop_requested)], local.ravel()]))
  by_row = {}  # rows replicated on several processes count once
  for part in parts:
    for row, crc, real in part[1:].reshape(-1, 3):
      by_row[int(row)] = (crc, real)
  crcs = np.array([by_row[r][0] for r in sorted(by_row)], np.uint32)
  real = sum(int(v[1]) for v in by_row.values())
  return float(zlib.crc32(crcs.tobytes())), float(real), bool(parts[:, 0].any())


def _in_current_layout(saved: dict) -> dict:
  """A saved run config as today's code reads it (`SFTConfig.from_json`: fields added since take
  their defaults, the old flat objective fields move into `objective`); as saved if unreadable."""
  try:
    return SFTConfig.from_json(saved).to_json()
  except (TypeError, ValueError):
    return saved


def prepare(
  cfg: SFTConfig,
  workdir: str,
  *,
  export_hf: str | None = None,
  allow_config_change: bool = False,
):
  """Checks everything that can be checked before a file is written; (model config, tokenizer,
  samples). Raises a UserError naming the input: a changed config on resume, an existing
  export, bad data, a tokenizer that does not fit the model, samples longer than seq_len."""
  resume.check_run(
    workdir, cfg.to_json(), allow_change=allow_config_change, in_current_layout=_in_current_layout
  )
  if export_hf and os.path.exists(export_hf):
    raise UserError(
      f"export_hf {export_hf} already exists: remove it or choose another directory "
      f"(to re-export this run: python -m experiments.export_hf --init=checkpoint "
      f"--workdir={workdir} --out={export_hf} --overwrite)"
    )
  mcfg = run_setup.model_config(cfg.run)
  logging.info("loading SFT data (%s) from %s", cfg.data_source, cfg.data_path)
  samples = sft_data.load_samples(cfg)
  tok = run_setup.load_tokenizer(cfg.run.tokenizer)
  check_compatible(
    tok,
    mcfg,
    where=f"sft (tokenizer={cfg.run.tokenizer}, model={cfg.run.init_hf or cfg.run.model})",
  )
  cfg.objective.grid.check_model(mcfg, "SFTConfig.objective.grid")
  sft_data.check_some_fit(samples, tok, cfg.max_sample_len or cfg.seq_len, cfg.objective.grid)
  logging.info("%d SFT samples; tokenizer %s", len(samples), cfg.run.tokenizer)
  return mcfg, tok, samples


def run_sft(
  cfg: SFTConfig,
  workdir: str,
  *,
  export_hf: str | None = None,
  allow_config_change: bool = False,
) -> dict:
  """Trains to `cfg.num_steps` (resuming from `workdir/checkpoints`). Returns a summary dict.

  Nothing is written before `prepare` has checked the inputs. SIGTERM or SIGINT during training
  saves the current step and returns with `preempted` True; during start-up it returns at once
  (`stop.py`).
  """
  return run_stoppable(
    lambda stop: _run(cfg, workdir, stop, export_hf, allow_config_change), step=None
  )


def _run(cfg, workdir, stop, export_hf, allow_config_change) -> dict:
  mcfg, tok, samples = prepare(
    cfg, workdir, export_hf=export_hf, allow_config_change=allow_config_change
  )
  mesh = run_setup.make_mesh(cfg.run)
  logging.info(
    "mesh %s over %d devices (%s)", dict(mesh.shape), mesh.size, jax.devices()[0].device_kind
  )
  os.makedirs(workdir, exist_ok=True)
  tok_dir = cfg.run.tokenizer_dir(workdir)
  if distributed.is_primary():
    run_setup.save_tokenizer(cfg.run, workdir)
    ckpt_lib.save_model_config(mcfg, workdir)
  logging.info(
    "building model %s: %.2fM params, attention=%s remat=%s dtype=%s/%s",
    cfg.run.init_hf or cfg.run.model,
    mcfg.num_params() / 1e6,
    mcfg.attention_impl,
    mcfg.remat,
    mcfg.dtype,
    mcfg.param_dtype,
  )
  t0 = time.perf_counter()
  model = run_setup.build_model(cfg.run, mcfg, mesh)

  schedule = optim_lib.make_schedule(cfg.optim, cfg.num_steps)
  tx = optim_lib.make_optimizer(cfg.optim, cfg.num_steps)
  graphdef, state, shardings = ts.init_train_state(
    model, tx, mesh, tolerance=cfg.run.shard_tolerance
  )
  del model
  logging.info("model and optimizer state built in %.1f s", time.perf_counter() - t0)

  rows = ts.local_rows(mesh, cfg.batch_size, cfg.accum_steps)
  it = sft_data.make_iterator(cfg, samples, tok, rows)
  if jax.process_count() > 1:
    logging.info(
      "%d processes; process 0 feeds %d of %d rows per step from data shards %s of %d",
      jax.process_count(),
      len(rows),
      cfg.batch_size,
      it.shards,
      cfg.data_shards,
    )
  ckpt = run_setup.make_checkpointer(cfg.run, workdir)
  if ckpt.latest_step() is not None:  # damaged newer steps are moved aside
    _, state, data_state, _ = ckpt.restore_intact(
      ts.abstract_state(state, shardings), set_aside=True
    )
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
  rng = jax.random.key(cfg.run.seed)
  config_json = cfg.to_json()
  logging.info("training steps %d -> %d", start, cfg.num_steps)
  last, preempted = {}, False
  stop.training = True
  for step in range(start, cfg.num_steps):
    host_batch = next(it)
    batch = ts.shard_batch(host_batch, mesh, cfg.accum_steps)
    if step == start:
      logging.info("compiling the train step (the first step waits for it)...")
      t0 = time.perf_counter()
    state, m = step_fn(state, batch, rng)
    m = {k: float(v) for k, v in jax.device_get(m).items()}
    done = step + 1
    if step == start:
      logging.info("train step compiled; first step took %.1f s", time.perf_counter() - t0)
    fingerprint, real_tokens, stop_any = batch_summary(host_batch, rows, stop.requested is not None)
    m.update(rate.tick(done), data_fingerprint=fingerprint, real_tokens=real_tokens)
    if not np.isfinite(m["loss"]):
      raise FloatingPointError(f"non-finite loss {m['loss']} at step {done}")
    writer.write(done, m)
    if done % cfg.log_every == 0 or done == cfg.num_steps:
      metrics_lib.log_progress(done, cfg.num_steps, m, rate.eta_s(done))
    preempted = stop_any or ckpt.reached_preemption(done)  # the same on every process
    force = preempted or done == cfg.num_steps
    if force or ckpt.should_save(done):
      ckpt.save(done, state, data_shards.global_state(it), config_json, force=force)
    last = m
    if preempted:
      logging.warning(
        "%s: stopped at step %d, checkpoint saved; rerun the same command to resume",
        stop.requested or "stop signal to another process or pre-emption notice",
        done,
      )
      break
  stop.training = False  # a signal from here on (saving, export) stops at once
  ckpt.wait()
  ckpt.close()
  writer.close()
  if distributed.is_primary() and last:
    metrics_lib.plot_loss(
      f"{workdir}/metrics.jsonl", f"{workdir}/loss.png", title=f"SFT {cfg.run.model} ({workdir})"
    )
  if export_hf and not preempted:
    from dice_jax.hf.checkpoint import export_hf as export

    export(nnx.merge(graphdef, state["params"]), export_hf, tokenizer_dir=tok_dir)  # collective
    logging.info("exported HF checkpoint to %s", export_hf)
  return {"step": int(jax.device_get(state["step"])), "preempted": preempted, **last}
