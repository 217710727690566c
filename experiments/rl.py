r"""BiC-RL launcher (TraceRL on block diffusion; reference §1.7).

  python -m experiments.rl --config=rl_dice_infill --phase=infill --verifier=HOST:PORT[,HOST:PORT] \
      --workdir=RUN [--init_hf=DIR | --init_checkpoint=SFT_OR_RL_RUN] [--set=key=value ...]
  python -m experiments.rl --config=rl_tiny --verifier=local --workdir=/tmp/rl_tiny   # CPU

`--config` names a module of experiments/configs with `get_config()` (or a .py path);
`--phase` overrides its phase; `--verifier=local` starts `python -m verifier serve` on 127.0.0.1
as a child (CPU backend on a machine without a GPU) with its build cache in RUN/verifier.
Re-running with the same workdir resumes from its last checkpoint (exact: same tasks, samples and
losses). Outputs: RUN/metrics.jsonl, RUN/tb/, RUN/samples.jsonl, RUN/rl.png, RUN/checkpoints/.
A bad flag, config value or input file is one line on stderr and exit status 2.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging as std_logging
import os
import sys

from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "rl_tiny", "config module under experiments/configs, or a .py path")
flags.DEFINE_enum("phase", None, ["infill", "e2e"], "BiC-RL phase (default: the config's)")
flags.DEFINE_string("verifier", None, "HOST:PORT[,HOST:PORT...] or 'local' (a child service)")
flags.DEFINE_string("workdir", None, "run directory (checkpoints, metrics, samples)")
flags.DEFINE_string("init_hf", None, "initialise from this HF checkpoint directory")
flags.DEFINE_string("init_checkpoint", None, "initialise from an SFT or RL run directory")
flags.DEFINE_multi_string("set", [], "config override key=value (dotted keys), repeatable")
flags.DEFINE_integer("max_steps", None, "stop after this many RL steps (the run can resume)")


class UsageError(ValueError):
  pass


def load_config(name: str):
  if name.endswith(".py"):
    if not os.path.exists(name):
      raise UsageError(f"--config: no such file {name}")
    spec = importlib.util.spec_from_file_location("rl_config", name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  else:
    try:
      module = importlib.import_module(f"experiments.configs.{name}")
    except ModuleNotFoundError:
      here = os.path.join(os.path.dirname(__file__), "configs")
      known = sorted(f[:-3] for f in os.listdir(here) if f.startswith("rl_") and f.endswith(".py"))
      raise UsageError(f"--config: unknown config {name!r}; known: {known}") from None
  if not hasattr(module, "get_config"):
    raise UsageError(f"--config {name}: module defines no get_config()")
  return module.get_config()


def resolve_config():
  import dataclasses

  from dice_jax.rl.config import RLConfig
  from dice_jax.train.config import apply_overrides

  cfg = load_config(FLAGS.config)
  if not isinstance(cfg, RLConfig):
    raise UsageError(f"--config {FLAGS.config}: get_config() returned a {type(cfg).__name__}")
  cfg = apply_overrides(cfg, FLAGS.set)
  if FLAGS.phase:
    cfg = dataclasses.replace(cfg, phase=FLAGS.phase)
  if FLAGS.init_hf and FLAGS.init_checkpoint:
    raise UsageError("pass at most one of --init_hf and --init_checkpoint")
  for flag in ("init_hf", "init_checkpoint"):
    path = getattr(FLAGS, flag)
    if path and not os.path.isdir(path):
      raise UsageError(f"--{flag}: no such directory {path}")
  key = "infill_tasks" if cfg.phase == "infill" else "e2e_tasks"
  if cfg.tasks_path and not os.path.exists(cfg.tasks_path):
    raise UsageError(f"task file of phase {cfg.phase!r} not found: {cfg.tasks_path} (set {key})")
  from dice_jax.rl.loop import load_tasks

  load_tasks(cfg)  # a malformed file fails here, before anything is written
  if cfg.judge == "verifier" and not FLAGS.verifier:
    raise UsageError("--verifier is required (HOST:PORT[,HOST:PORT] or local)")
  return cfg


def _local_device(cfg) -> str:
  if cfg.verifier.local_device:
    return cfg.verifier.local_device
  import shutil

  return "cuda" if shutil.which("nvidia-smi") else "cpu"


class _QuietOrbax(std_logging.Filter):
  def filter(self, record):
    return record.levelno >= std_logging.WARNING or "/orbax/" not in record.pathname


def run(cfg) -> dict:
  from dice_jax.rl.loop import run_rl
  from dice_jax.verifier_client import parse_endpoints

  kwargs = dict(
    init_hf=FLAGS.init_hf, init_checkpoint=FLAGS.init_checkpoint, max_steps=FLAGS.max_steps
  )
  if cfg.judge != "verifier" or FLAGS.verifier != "local":
    endpoints = parse_endpoints(FLAGS.verifier) if cfg.judge == "verifier" else None
    return run_rl(cfg, FLAGS.workdir, endpoints=endpoints, **kwargs)
  from verifier.local import LocalVerifier

  args = ()
  if cfg.verifier.local_compile_workers:
    args = ("--compile-workers", str(cfg.verifier.local_compile_workers))
  device = _local_device(cfg)
  logging.info(
    "starting a local %s verifier (log: %s/verifier/verifier.log)", device, FLAGS.workdir
  )
  with LocalVerifier(
    os.path.join(FLAGS.workdir, "verifier"), device=device, extra_args=args
  ) as server:
    logging.info("local verifier at %s", server.address)
    return run_rl(cfg, FLAGS.workdir, endpoints=[server.address], **kwargs)


def main(argv):
  del argv
  logging.get_absl_handler().addFilter(_QuietOrbax())
  from dice_jax.data.tasks import DataError
  from dice_jax.verifier_client import VerifierUnavailable

  try:
    cfg = resolve_config()  # bad flags, config values and task files
  except (ValueError, FileNotFoundError, DataError) as e:
    _fail(e)
  logging.info("config: %s", json.dumps(cfg.to_json(), default=str))
  try:
    summary = run(cfg)
  except VerifierUnavailable as e:  # endpoints that never answer
    _fail(e)
  except Exception as e:
    if type(e).__name__ == "VerifierStartError":  # the local verifier did not start
      _fail(e)
    raise
  logging.info("done: %s", summary)


def _fail(e: Exception):
  print(f"experiments.rl: error: {str(e).splitlines()[0]}", file=sys.stderr)
  sys.exit(2)


if __name__ == "__main__":
  flags.mark_flag_as_required("workdir")
  app.run(main)
