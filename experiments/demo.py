r"""The tiny end-to-end pipeline on CPU (`make demo`).

  python -m experiments.demo --workdir=/tmp/dice_jax_demo

Steps, each printing what it did:
  1. hf      random `tiny` model -> HF export -> import -> parity with `transformers`
"""

import json
import os
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", "/tmp/dice_jax_demo", "Where the demo writes everything.")
flags.DEFINE_list("steps", ["hf"], "Steps to run, in order.")
flags.DEFINE_integer("seed", 0, "Seed of the random tiny model.")


def step_hf(workdir):
  """Random tiny model -> HF directory -> import -> logit parity with transformers."""
  from flax import nnx

  from dice_jax.hf import checkpoint as hf_ckpt
  from dice_jax.hf.parity import check_parity
  from dice_jax.model import Transformer, get_config

  cfg = get_config("tiny")
  model = Transformer(cfg, rngs=nnx.Rngs(FLAGS.seed))
  out = hf_ckpt.export_hf(model, os.path.join(workdir, "tiny_hf"), dtype="float32",
                          overwrite=True)
  print(f"  exported random tiny model ({cfg.num_params():,} parameters) to {out}")
  results = check_parity(out)
  for r in results:
    print(f"  parity vs transformers, {r.mask:>12} mask: max |dlogit| = {r.max_abs_diff:.2e}")
  worst = max(r.max_abs_diff for r in results)
  if worst > 1e-4:
    raise SystemExit(f"parity check failed: {worst:.2e} > 1e-4")
  return {"hf_dir": out, "parity_max_abs_diff": worst}


STEPS = {"hf": step_hf}


def main(argv):
  del argv
  os.makedirs(FLAGS.workdir, exist_ok=True)
  summary = {}
  for i, name in enumerate(FLAGS.steps, 1):
    if name not in STEPS:
      raise app.UsageError(f"unknown step {name!r}; known: {list(STEPS)}")
    print(f"[{i}/{len(FLAGS.steps)}] {name}: {STEPS[name].__doc__.strip()}", flush=True)
    t0 = time.time()
    summary[name] = STEPS[name](FLAGS.workdir)
    print(f"  done in {time.time() - t0:.1f} s", flush=True)
  with open(os.path.join(FLAGS.workdir, "demo_summary.json"), "w") as f:
    json.dump(summary, f, indent=2, default=str)
  print(f"demo finished; summary in {os.path.join(FLAGS.workdir, 'demo_summary.json')}")


if __name__ == "__main__":
  app.run(main)
