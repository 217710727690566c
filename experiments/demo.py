r"""The whole pipeline, tiny and on CPU: the main job (`make demo`).

  python -m experiments.demo --workdir=/tmp/dice_jax_demo

Steps, each printing what it did (all data is embedded in experiments/demo_data/):
  1. sft       block-diffusion SFT of the tiny model (byte tokenizer) on pairs.jsonl -> HF export
  2. rl        BiC-RL against the local CPU verifier over gRPC -- NOT WIRED YET: it needs the RL
               launcher (experiments/rl.py, branch rl-loop); until then it says so and the later
               steps use the SFT model
  3. generate  the KV-cached block sampler on one task prompt, with its step map
  4. eval      KernelBench-style evaluation on the seven CPU problems (cpu_problems.jsonl) through a
               local CPU verifier over gRPC: the model's own candidates, then the known candidates
               (cpu_candidates.jsonl, verdicts fixed by construction) -> two reports
  5. export    the final model's HF export loaded by `transformers`: logits equal ours
Finally the path of the evaluation report is printed.
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
flags.DEFINE_list("steps", ["sft", "rl", "generate", "eval", "export"], "Steps to run, in order.")
flags.DEFINE_integer("sft_steps", 30, "SFT optimizer steps.")

DEMO_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_data")
PAIRS = os.path.join(DEMO_DATA, "pairs.jsonl")
MAX_PROMPT_CHARS = 192  # the tiny CPU run trains on truncated texts
EVAL_NEW_TOKENS = 128  # the tiny model's evaluation budget (DICE: 4,096)


def step_sft(workdir, summary):
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


def step_generate(workdir, summary):
  """KV-cached block sampler on the relu task prompt (greedy, block 4, 4 steps)."""
  import jax
  import numpy as np

  from dice_jax.data import prompts
  from dice_jax.data.tokenizer import Tokenizer
  from dice_jax.diffusion import sampler
  from dice_jax.hf import checkpoint as hf_ckpt

  hf_dir = _final_hf(workdir, summary)
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


def step_rl(workdir, summary):
  """BiC-RL against a local CPU verifier over gRPC (needs experiments/rl.py, branch rl-loop)."""
  # >>> RL STEP: wire `python -m experiments.rl` here once the rl-loop branch is merged: start from
  # >>> workdir/sft_hf, reward against the demo's LocalVerifier (CPU), export to workdir/rl_hf, and
  # >>> return {"hf_dir": workdir/rl_hf, ...} so that the eval and export steps use the RL model.
  print("  skipped: the BiC-RL launcher (experiments/rl.py) is not on this branch yet")
  return {"skipped": True, "hf_dir": os.path.join(workdir, "sft_hf")}


def _final_hf(workdir, summary):
  return summary.get("rl", {}).get("hf_dir") or os.path.join(workdir, "sft_hf")


def _run_eval(workdir, verifier_address, out, *source):
  cmd = [
    sys.executable,
    "-m",
    "experiments.eval",
    *source,
    f"--kernelbench={os.path.join(DEMO_DATA, 'cpu_problems.jsonl')}",
    "--levels=1",
    f"--verifier={verifier_address}",
    f"--out={out}",
    "--num_perf_trials=20",
    "--param_dtype=float32",
    f"--max_new_tokens={EVAL_NEW_TOKENS}",
    "--batch_size=7",
  ]
  shutil.rmtree(out, ignore_errors=True)  # a rerun of the demo evaluates afresh
  subprocess.run(cmd, check=True, env={**os.environ, "VERIFIER_TOKEN": ""})
  with open(os.path.join(out, "metrics.json")) as f:
    return json.load(f)["eager"]["1"]


def step_eval(workdir, summary):
  """KernelBench-style evaluation on CPU problems through a local CPU verifier over gRPC."""
  from verifier.local import LocalVerifier

  hf_dir = _final_hf(workdir, summary)
  with LocalVerifier(os.path.join(workdir, "verifier"), device="cpu") as server:
    model = _run_eval(workdir, server.address, os.path.join(workdir, "eval"), f"--hf_dir={hf_dir}")
    known = _run_eval(
      workdir,
      server.address,
      os.path.join(workdir, "eval_known"),
      f"--candidates={os.path.join(DEMO_DATA, 'cpu_candidates.jsonl')}",
    )
  for name, m in (("tiny model", model), ("known candidates", known)):
    print(
      f"  {name:<17} compiled {100 * m['compile_rate']:5.1f}%  exec {100 * m['exec_accuracy']:5.1f}%"
      f"  fast_1 {100 * m['fast_p']['1']:5.1f}%  flagged {m['flagged']}  kinds {m['failure_kinds']}"
    )
  return {
    "report": os.path.join(workdir, "eval", "report.md"),
    "known_candidates_report": os.path.join(workdir, "eval_known", "report.md"),
    "model": model,
    "known_candidates": known,
  }


def step_export(workdir, summary):
  """The final model's HF export loaded by `transformers`: logit parity with our model."""
  from dice_jax.hf.parity import check_parity

  hf_dir = _final_hf(workdir, summary)
  results = check_parity(hf_dir)
  for r in results:
    print(
      f"  {hf_dir}: transformers vs ours, {r.mask:>12} mask: max |dlogit| = {r.max_abs_diff:.2e}"
    )
  worst = max(r.max_abs_diff for r in results)
  if worst > 1e-4:
    raise SystemExit(f"parity check failed: {worst:.2e} > 1e-4")
  return {"hf_dir": hf_dir, "parity_max_abs_diff": worst}


STEPS = {
  "sft": step_sft,
  "rl": step_rl,
  "generate": step_generate,
  "eval": step_eval,
  "export": step_export,
}


def main(argv):
  del argv
  unknown = [n for n in FLAGS.steps if n not in STEPS]
  if unknown:
    raise app.UsageError(f"unknown steps {unknown}; known: {list(STEPS)}")
  os.makedirs(FLAGS.workdir, exist_ok=True)
  summary = {}
  t_all = time.time()
  for i, name in enumerate(FLAGS.steps, 1):
    print(f"[{i}/{len(FLAGS.steps)}] {name}: {STEPS[name].__doc__.strip()}", flush=True)
    t0 = time.time()
    summary[name] = STEPS[name](FLAGS.workdir, summary)
    print(f"  done in {time.time() - t0:.1f} s", flush=True)
  with open(os.path.join(FLAGS.workdir, "demo_summary.json"), "w") as f:
    json.dump(summary, f, indent=2, default=str)
  print(
    f"demo finished in {time.time() - t_all:.0f} s; summary in {FLAGS.workdir}/demo_summary.json"
  )
  if "eval" in summary:
    print(f"evaluation report: {summary['eval']['report']}")
    print(f"known-candidates report: {summary['eval']['known_candidates_report']}")


if __name__ == "__main__":
  app.run(main)
