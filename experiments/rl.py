r"""BiC-RL launcher (TraceRL on block diffusion as in DICE `training/RL/`; docs/running.md).

  python -m experiments.rl --config=rl_dice_infill --phase=infill --verifier=HOST:PORT[,HOST:PORT] \
      --workdir=RUN [--init_hf=DIR | --init_checkpoint=SFT_OR_RL_RUN] [--set=key=value ...]
  python -m experiments.rl --config=rl_tiny --verifier=local --workdir=/tmp/rl_tiny   # CPU

`--config` names a module of experiments/configs with `get_config()` (or a .py path);
`--phase` overrides its phase; `--verifier=local` starts `python -m verifier serve` on 127.0.0.1
as a child (CPU backend on a machine without a GPU) with its log and build cache in RUN/verifier.
The run waits up to `--verifier_wait_s` for the verifier to answer, with a progress
line every 10 s, before it writes anything to RUN (with `--verifier=local`, RUN/verifier/ only).
Re-running with the same workdir resumes from its newest intact checkpoint (exact: same tasks,
samples and losses). The config may change in its step count, logging, checkpoint and evaluation
cadence; other changed fields need `--allow_config_change`, and a few (group size, tasks per step,
the seeds, the model's shapes) cannot change at all (dice_jax/train/resume.py).
Outputs: RUN/metrics.jsonl, RUN/tb/, RUN/samples.jsonl, RUN/rl.png, RUN/checkpoints/.
Ctrl-C (SIGINT) or SIGTERM finishes the current RL step, saves it and exits 0 (a second one
stops at once); rerun the command to resume.
A bad flag, config value or input file is one line on stderr and exit status 2.

Several processes (hosts, or processes on one machine): start the same command once per process
with `--distributed` (the cluster from the environment, e.g. SLURM) or with
`--coordinator_address=HOST:PORT --num_processes=N --process_id=I`, as for `experiments.sft`. One
mesh spans every process's devices; every process samples the whole step, judges every N-th
request and trains on its devices' rows; checkpoints are written by all, metrics, samples and
logs by process 0. `--verifier=local` starts one service per process (RUN/verifier/process_I).
On one machine:
`python -m experiments.local_cluster --num_processes=2 -- python -m experiments.rl ...`.
"""

from __future__ import annotations

import json
import os

from absl import flags, logging

from dice_jax.errors import UserError
from experiments import _cli

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "rl_tiny", "config module under experiments/configs, or a .py path")
flags.DEFINE_enum("phase", None, ["infill", "e2e"], "BiC-RL phase (default: the config's)")
flags.DEFINE_string("verifier", None, "HOST:PORT[,HOST:PORT...] or 'local' (a child service)")
flags.DEFINE_string("workdir", None, "run directory (checkpoints, metrics, samples)")
flags.DEFINE_string("init_hf", None, "initialise from this HF checkpoint directory")
flags.DEFINE_string("init_checkpoint", None, "initialise from an SFT or RL run directory")
flags.DEFINE_multi_string(
  "set", [], "config override key=value (dotted keys, e.g. run.seed=1), repeatable"
)
flags.DEFINE_integer("max_steps", None, "stop after this many RL steps (the run can resume)")
flags.DEFINE_bool(
  "allow_config_change", False, "resume a run whose saved config differs from this one"
)
_cli.define_multiprocess_flags()
_cli.define_verifier_wait_flag()
_cli.define_compile_cache_flag()


def load_config(name: str):
  from experiments import configs

  return configs.load(name, "rl")


def resolve_config():
  import dataclasses

  from dice_jax.train.config import recipe_then_overrides

  cfg = recipe_then_overrides(load_config(FLAGS.config), FLAGS.set)
  if FLAGS.phase:
    cfg = dataclasses.replace(cfg, phase=FLAGS.phase)
  with_init = {k: getattr(FLAGS, k) for k in ("init_hf", "init_checkpoint") if getattr(FLAGS, k)}
  if with_init:  # the flags are shortcuts for --set=run.init_hf= / --set=run.init_checkpoint=
    if FLAGS.init_hf and FLAGS.init_checkpoint:
      raise UserError("pass at most one of --init_hf and --init_checkpoint")
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, **with_init))
  for field in ("init_hf", "init_checkpoint"):
    path = getattr(cfg.run, field)
    if path and not os.path.isdir(path):
      raise UserError(f"--{field}: no such directory {path}")
  key = "infill_tasks" if cfg.phase == "infill" else "e2e_tasks"
  if cfg.tasks_path and not os.path.exists(cfg.tasks_path):
    raise UserError(f"task file of phase {cfg.phase!r} not found: {cfg.tasks_path} (set {key})")
  from dice_jax.rl import evaluation
  from dice_jax.rl.loop import check_eval, load_tasks

  load_tasks(cfg)  # a malformed file fails here, before anything is written
  check_eval(cfg)
  if cfg.eval_every:
    if not os.path.exists(cfg.eval_tasks):
      raise UserError(f"eval_tasks not found: {cfg.eval_tasks} (set eval_tasks or eval_every=0)")
    evaluation.load_eval_tasks(cfg)
  if cfg.judge == "verifier" and not FLAGS.verifier:
    raise UserError("--verifier is required (HOST:PORT[,HOST:PORT] or local)")
  if cfg.judge == "verifier" and FLAGS.verifier != "local":
    _cli.verifier_endpoints(FLAGS.verifier)
  _cli.verifier_wait_s()
  return cfg


def _local_device(cfg) -> str:
  if cfg.verifier.local_device:
    return cfg.verifier.local_device
  import shutil

  return "cuda" if shutil.which("nvidia-smi") else "cpu"


def run(cfg) -> dict:
  from dice_jax.rl.loop import run_rl

  kwargs = dict(
    max_steps=FLAGS.max_steps,
    allow_config_change=FLAGS.allow_config_change,
    verifier_wait_s=_cli.verifier_wait_s(),
  )
  if cfg.judge != "verifier" or FLAGS.verifier != "local":
    endpoints = _cli.verifier_endpoints(FLAGS.verifier) if cfg.judge == "verifier" else None
    return run_rl(cfg, FLAGS.workdir, endpoints=endpoints, **kwargs)
  import jax

  from verifier.serve.local import LocalVerifier

  directory = os.path.join(FLAGS.workdir, "verifier")
  if jax.process_count() > 1:  # one service per process: its share of the requests
    directory = os.path.join(directory, f"process_{jax.process_index()}")
  args = ()
  if cfg.verifier.local_compile_workers:
    args = ("--compile-workers", str(cfg.verifier.local_compile_workers))
  device = _local_device(cfg)
  logging.info("starting a local %s verifier (log: %s/verifier.log)", device, directory)
  wait_s = kwargs["verifier_wait_s"]
  with LocalVerifier(
    directory, device=device, extra_args=args, start_timeout_s=wait_s, report=logging.info
  ) as server:
    logging.info("local verifier at %s", server.address)
    return run_rl(cfg, FLAGS.workdir, endpoints=[server.address], **kwargs)


def main(argv):
  del argv
  _cli.quiet_orbax()
  _cli.join_processes()
  cache = _cli.use_compile_cache(FLAGS.workdir)
  from verifier.api.client import VerifierUnavailable
  from verifier.serve.local import VerifierStartError

  with _cli.user_errors_from(ValueError):  # bad flags, config values and task files
    cfg = resolve_config()
  logging.info("config: %s", json.dumps(cfg.to_json(), default=str))
  # endpoints that never answer; a local verifier that did not start
  with _cli.user_errors_from(VerifierUnavailable, VerifierStartError):
    summary = run(cfg)
  logging.info("done: %s", summary)
  if cache:
    logging.info("%s", cache.summary())


if __name__ == "__main__":
  flags.mark_flag_as_required("workdir")
  _cli.run(main)
