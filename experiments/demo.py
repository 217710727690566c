r"""The tiny end-to-end pipeline on CPU (`make demo`).

  python -m experiments.demo --workdir=/tmp/dice_jax_demo

Steps, each printing what it did (the data is embedded: experiments/demo_data/pairs.jsonl):
  1. hf        random `tiny` model -> HF export -> import -> parity with `transformers`
  2. sft       block-diffusion SFT of a tiny model (byte tokenizer) on the embedded pairs -> HF export
  3. generate  the KV-cached block sampler on one task prompt, with its step map
  4. verify    a CPU verifier service on 127.0.0.1: the sampled candidate and a known-good C++
               candidate are compiled, checked and rewarded over gRPC
"""

import json
import os
import shutil
import subprocess
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", "/tmp/dice_jax_demo", "Where the demo writes everything.")
flags.DEFINE_list("steps", ["hf", "sft", "generate", "verify"], "Steps to run, in order.")
flags.DEFINE_integer("seed", 0, "Seed of the random tiny model.")
flags.DEFINE_integer("sft_steps", 30, "SFT optimizer steps.")

DEMO_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_data")
PAIRS = os.path.join(DEMO_DATA, "pairs.jsonl")
MAX_PROMPT_CHARS = 192  # the tiny CPU run trains on truncated texts


def step_hf(workdir):
  """Random tiny model -> HF directory -> import -> logit parity with transformers."""
  from flax import nnx

  from dice_jax.hf import checkpoint as hf_ckpt
  from dice_jax.hf.parity import check_parity
  from dice_jax.model import Transformer, get_config

  cfg = get_config("tiny")
  model = Transformer(cfg, rngs=nnx.Rngs(FLAGS.seed))
  out = hf_ckpt.export_hf(model, os.path.join(workdir, "tiny_hf"), dtype="float32", overwrite=True)
  print(f"  exported random tiny model ({cfg.num_params():,} parameters) to {out}")
  results = check_parity(out)
  for r in results:
    print(f"  parity vs transformers, {r.mask:>12} mask: max |dlogit| = {r.max_abs_diff:.2e}")
  worst = max(r.max_abs_diff for r in results)
  if worst > 1e-4:
    raise SystemExit(f"parity check failed: {worst:.2e} > 1e-4")
  return {"hf_dir": out, "parity_max_abs_diff": worst}


def step_sft(workdir):
  """Block-diffusion SFT of the tiny model on the embedded pairs, then HF export."""
  out = os.path.join(workdir, "sft_hf")
  for old in (
    os.path.join(workdir, "sft"),
    out,
  ):  # a rerun trains afresh (not resuming the last run)
    shutil.rmtree(old, ignore_errors=True)
  cmd = [
    sys.executable,
    "-m",
    "experiments.sft",
    "--config=tiny",
    f"--workdir={os.path.join(workdir, 'sft')}",
    "--set=data_source=pairs",
    f"--set=data_path={PAIRS}",
    f"--set=num_steps={FLAGS.sft_steps}",
    "--set=seq_len=512",
    f"--set=max_prompt_chars={MAX_PROMPT_CHARS}",
    "--set=max_response_chars=256",
    "--set=batch_size=4",
    "--set=checkpoint_every=10",
    "--set=log_every=5",
    f"--export_hf={out}",
  ]
  subprocess.run(cmd, check=True)
  with open(os.path.join(workdir, "sft", "metrics.jsonl")) as f:
    losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
  print(
    f"  SFT loss {losses[0]:.3f} -> {losses[-1]:.3f} over {FLAGS.sft_steps} steps; exported {out}"
  )
  return {"hf_dir": out, "first_loss": losses[0], "last_loss": losses[-1]}


def _relu_pair():
  from dice_jax.data import tasks

  pairs, _ = tasks.load_pairs(PAIRS)
  return next(p for p in pairs if p.pair_id.endswith("/relu"))


def step_generate(workdir):
  """KV-cached block sampler on the relu task prompt (greedy, block 4, 4 steps)."""
  import jax
  import numpy as np

  from dice_jax.data import prompts
  from dice_jax.data.tokenizer import Tokenizer
  from dice_jax.diffusion import sampler
  from dice_jax.hf import checkpoint as hf_ckpt

  hf_dir = os.path.join(workdir, "sft_hf")
  tok = Tokenizer.from_dir(hf_dir)
  model, cfg = hf_ckpt.import_hf(hf_dir, param_dtype="float32", dtype="float32")
  message = prompts.e2e_user_message(_relu_pair().pytorch_code)[:MAX_PROMPT_CHARS]
  prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": message}]))
  scfg = sampler.SamplerConfig(
    block_size=cfg.block_size,
    steps=4,
    strategy="low_confidence_static",
    max_new_tokens=128,
    stop_ids=tuple(tok.stop_token_ids),
    pad_id=cfg.pad_token_id or 0,
  )
  t0 = time.time()
  out = sampler.generate(model, [prompt], scfg, jax.random.key(0))
  text = tok.decode(out.responses()[0])
  n = int(np.asarray(out.response_lengths).sum())
  step_map = np.asarray(out.step_map)[0]
  print(
    f"  prompt {len(prompt)} tokens -> {n} new tokens in {int(out.forwards)} decode forwards "
    f"({time.time() - t0:.1f} s incl. compile); first step map entries "
    f"{step_map[step_map >= 0][:12].tolist()}"
  )
  print("  sample (repr, first 200 chars):", repr(text[:200]))
  with open(os.path.join(workdir, "generated.txt"), "w") as f:
    f.write(text)
  return {"new_tokens": n, "forwards": int(out.forwards)}


def step_verify(workdir):
  """CPU verifier service: the sampled candidate and a known-good C++ candidate, over gRPC."""
  from dice_jax.data import prompts
  from dice_jax.verifier_client import VerifierClient
  from verifier.local import LocalVerifier

  with LocalVerifier(workdir, device="cpu") as server:
    reference = _relu_pair().pytorch_code
    generated = open(os.path.join(workdir, "generated.txt")).read()
    candidates = [
      ("tiny model's sample", prompts.extract_code(generated) or generated),
      ("known-good C++ relu", open(os.path.join(DEMO_DATA, "relu_cpu_candidate.py")).read()),
    ]
    with VerifierClient(
      server.address, options={"measure_performance": True, "num_perf_trials": 10}, token=""
    ) as client:
      client.wait_ready(60)
      results = client.verify_batch([("relu", reference, c) for _, c in candidates])
  print(f"  {'candidate':<22}{'reward':>7}{'correct':>9}{'speedup':>9}  failure kind: reason")
  for (name, _), r in zip(candidates, results):
    print(
      f"  {name:<22}{r.reward:>7.1f}{str(r.correct):>9}{r.speedup:>9.2f}  "
      f"{r.failure_kind}: {r.reason[:70]}"
    )
  return {
    name: {"reward": r.reward, "failure_kind": r.failure_kind}
    for (name, _), r in zip(candidates, results)
  }


STEPS = {"hf": step_hf, "sft": step_sft, "generate": step_generate, "verify": step_verify}


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
