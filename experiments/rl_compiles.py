r"""How often an RL run compiles its sampler again: a few tiny RL steps on CPU whose prompts differ in
length from step to step, once per `--multiples` value of `prompt_width_multiple`, each in a fresh
process; a table of each step's compile seconds (rollout, whole step) and sampling seconds.

  JAX_PLATFORMS=cpu python -m experiments.rl_compiles --steps=4 --multiples=0,128

The prompts are the demo pairs' whole end-to-end prompts (byte tokenizer: 280-460 tokens), so a step's
longest prompt moves by a few tokens to ~100 between steps. A judge that rewards nothing drops every
group, so no update runs and the steps measure the rollout alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile

from absl import app, flags

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The flags (defined when run, not on import: the RL loop imports this module for its judge)."""
  flags.DEFINE_integer("steps", 4, "RL steps per run")
  flags.DEFINE_list("multiples", ["0", "128"], "prompt_width_multiple of each run (0: unrounded)")
  flags.DEFINE_integer("multiple", -1, "internal: run one multiple in this process, print JSON")


PAIRS = os.path.join(os.path.dirname(__file__), "demo_data", "pairs.jsonl")


def no_reward(task_id: str, reference: str, candidate: str) -> bool:
  """The judge (`python:experiments.rl_compiles:no_reward`): nothing passes, every group is dropped."""
  return False


def one_run(multiple: int, steps: int) -> list[dict]:
  from dice_jax.data.rl_stream import RLStreamConfig
  from dice_jax.rl.config import DICE_SAMPLER, RLConfig
  from dice_jax.rl.loop import run_rl
  from dice_jax.train.metrics import read_metrics
  from dice_jax.train.run_config import RunConfig

  cfg = RLConfig(
    run=RunConfig(model="tiny", model_overrides={"dtype": "float32"}, seed=1, checkpoint_every=1),
    e2e_tasks=PAIRS,
    stream=RLStreamConfig(group_size=4, tasks_per_step=2, num_steps=steps, prompt_style="chat"),
    max_prompt_len=4096,
    sampler=dataclasses.replace(DICE_SAMPLER, max_new_tokens=16),
    groups_per_batch=2,
    code_extraction="whole_response",
    judge="python:experiments.rl_compiles:no_reward",
    rows_per_update=8,
    prompt_width_multiple=multiple,
  )
  with tempfile.TemporaryDirectory() as workdir:
    run_rl(cfg, workdir)
    recs = read_metrics(os.path.join(workdir, "metrics.jsonl"))
  keys = ("time/rollout_compile_s", "time/compile_s", "time/sample_s", "time/step_s")
  return [{"step": s, **{k: round(r[k], 2) for k in keys}} for s, r in sorted(recs.items())]


def main(argv):
  del argv
  if FLAGS.multiple >= 0:
    print("ROWS " + json.dumps(one_run(FLAGS.multiple, FLAGS.steps)), flush=True)
    return
  print("| prompt_width_multiple | step | rollout compile s | step compile s | sample s | step s |")
  print("| --- | --- | --- | --- | --- | --- |")
  for m in FLAGS.multiples:
    run = subprocess.run(
      [
        sys.executable,
        "-m",
        "experiments.rl_compiles",
        f"--multiple={m}",
        f"--steps={FLAGS.steps}",
      ],
      capture_output=True,
      text=True,
    )
    if run.returncode:
      raise SystemExit(f"rl_compiles: the run with multiple {m} failed:\n{run.stderr[-2000:]}")
    rows = json.loads(next(ln[5:] for ln in run.stdout.splitlines() if ln.startswith("ROWS ")))
    for r in rows:
      print(
        f"| {m} | {r['step']} | {r['time/rollout_compile_s']} | {r['time/compile_s']} | "
        f"{r['time/sample_s']} | {r['time/step_s']} |",
        flush=True,
      )


if __name__ == "__main__":
  define_flags()
  app.run(main)
