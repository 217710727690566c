r"""Block-diffusion SFT launcher.

  python -m experiments.sft --config=tiny --workdir=/tmp/sft_tiny \
      [--set=num_steps=20 --set=optim.learning_rate=1e-3] [--init_hf=DIR] [--export_hf=DIR]

`--config` names a module of experiments/configs (or a path to a .py file) with `get_config()`.
Re-running with the same workdir resumes from its newest intact checkpoint (a damaged newer step
is named and moved aside). The config may change in its step count, logging and checkpoint
cadence; other changed fields are refused (the message lists each) unless `--allow_config_change`,
and a few (the seed, data_shards, the model's shapes) cannot change at all
(dice_jax/train/resume.py).
Ctrl-C (SIGINT) or SIGTERM saves the current step and exits 0; rerun the command to resume.
Bad input (data file, tokenizer, config field, existing export) is one line and exit status 2,
with nothing written.

Multi-process (several hosts, or several processes on one): start the same command once per
process with `--distributed` (jax.distributed.initialize reads the cluster from the environment,
e.g. SLURM) or with `--coordinator_address=HOST:PORT --num_processes=N --process_id=I`. One
mesh spans every process's devices; each process feeds its rows of the batch; checkpoints are
written by all, metrics, logs and the export by process 0. If a process dies, the others exit
after `--heartbeat_timeout_s`; rerun all of them to resume. On one machine:
`python -m experiments.local_cluster --num_processes=2 -- python -m experiments.sft ...`.
"""

from __future__ import annotations

import dataclasses
import json

from absl import flags, logging

from experiments import _cli

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "tiny", "config module under experiments/configs, or a .py path")
flags.DEFINE_string("workdir", None, "output directory (checkpoints, metrics, tokenizer)")
flags.DEFINE_multi_string("set", [], "config override key=value (dotted keys), repeatable")
flags.DEFINE_string("init_hf", None, "initialise from this HF checkpoint directory")
flags.DEFINE_string("export_hf", None, "write the final model as an HF directory here (new dir)")
flags.DEFINE_bool(
  "allow_config_change", False, "resume a run whose saved config differs from this one"
)
_cli.define_multiprocess_flags()
_cli.define_compile_cache_flag()
flags.mark_flag_as_required("workdir")


def load_config(name: str):
  from experiments import configs

  return configs.load(name, "sft")


def main(argv):
  del argv
  _cli.quiet_orbax()
  _cli.join_processes()
  cache = _cli.use_compile_cache(FLAGS.workdir)
  from dice_jax.train.config import recipe_then_overrides
  from dice_jax.train.loop import run_sft

  with _cli.user_errors_from(ValueError, TypeError):  # a bad --set key, value or field
    cfg = recipe_then_overrides(load_config(FLAGS.config), FLAGS.set)
    if FLAGS.init_hf:  # a shortcut for --set=run.init_hf=DIR
      cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, init_hf=FLAGS.init_hf))
  logging.info("config: %s", json.dumps(cfg.to_json(), default=str))
  summary = run_sft(
    cfg,
    FLAGS.workdir,
    export_hf=FLAGS.export_hf,
    allow_config_change=FLAGS.allow_config_change,
  )
  if not summary["preempted"]:  # a stopped run has said so in one line (train/loop.py)
    logging.info("done: %s", summary)
  if cache:
    logging.info("%s", cache.summary())


if __name__ == "__main__":
  _cli.run(main)
