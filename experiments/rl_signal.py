r"""A real BiC-RL learning signal on CPU: SFT a small model on correct AND incorrect C++ candidates
for a few CPU-backend problems, then BiC-RL against a local CPU verifier over gRPC.

  python -m experiments.rl_signal --workdir=/tmp/rl_signal [--steps=data,check,sft,rl,plot]

Steps (each prints what it did; later steps reuse earlier outputs in the workdir):
  data   4 element-wise problems (KernelBench format, CPU sizes) with one correct and two wrong
         C++ candidates each (a wrong formula: wrong_output; a missing ';': compile_error);
         tasks.jsonl for RL and sft.jsonl ({prompt, response}) for SFT. The prompt is the last
         `--prompt_tail_chars` characters of the KernelBench end-to-end user message (the part that
         names the architecture), as the RL config renders it (`prompt_tail_chars`).
  check  every candidate through the CPU verifier (also fills the build cache the RL run reuses).
  sft    `experiments.sft` on sft.jsonl until the model samples all variants.
  rl     `experiments.rl --config=rl_tiny --verifier=local` from the SFT checkpoint.
  plot   correct fraction per RL step (64 samples each) -> docs/rl_signal.png (`--png`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", "/tmp/rl_signal", "where everything is written")
flags.DEFINE_list("steps", ["data", "check", "sft", "rl", "plot"], "steps to run, in order")
flags.DEFINE_integer("prompt_tail_chars", 560, "characters of the user message kept")
flags.DEFINE_integer("sft_steps", 400, "SFT optimizer steps")
flags.DEFINE_integer("rl_steps", 12, "BiC-RL steps")
flags.DEFINE_multi_string("rl_set", [], "extra --set overrides for the RL launcher")
flags.DEFINE_string("png", "", "where the plot goes (default: WORKDIR/rl_signal.png)")

OPS = {  # name: (torch expression, correct C++ expression of v, wrong C++ expression of v)
  "relu": ("torch.relu(x)", "v > 0.f ? v : 0.f", "v < 0.f ? v : 0.f"),
  "square": ("x * x", "v * v", "v + v"),
  "triple": ("x * 3.0", "v * 3.f", "v * 2.f"),
  "halve": ("x * 0.5", "v * 0.5f", "v * 5.f"),
}

REFERENCE = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return {expr}


def get_inputs():
    return [torch.randn(256, 256)]


def get_init_inputs():
    return []
"""

CANDIDATE = '''import torch.nn as nn
from torch.utils.cpp_extension import load_inline

src = r"""
#include <torch/extension.h>
torch::Tensor f(torch::Tensor x) {{
    auto y = torch::empty_like(x);
    float* a = x.data_ptr<float>();
    float* b = y.data_ptr<float>();
    for (int64_t i = 0; i < x.numel(); ++i) {{ float v = a[i]; b[i] = {expr}{semi} }}
    return y;
}}
"""
ext = load_inline(name="{name}_ext", cpp_sources=src, functions=["f"])


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.f(x.contiguous())
'''


def candidates(name: str) -> dict[str, str]:
  """variant -> candidate file: 'correct', 'wrong_output', 'compile_error'."""
  _, good, bad = OPS[name]
  return {
    "correct": CANDIDATE.format(name=name, expr=good, semi=";"),
    "wrong_output": CANDIDATE.format(name=name, expr=bad, semi=";"),
    "compile_error": CANDIDATE.format(name=name, expr=good, semi=""),
  }


def paths(workdir: str) -> dict[str, str]:
  d = os.path.join(workdir, "data")
  return {
    "tasks": os.path.join(d, "tasks.jsonl"),
    "sft": os.path.join(d, "sft.jsonl"),
    "sft_dir": os.path.join(workdir, "sft"),
    "rl_dir": os.path.join(workdir, "rl"),
  }


def step_data(workdir: str) -> dict:
  from dice_jax.data import prompts

  p = paths(workdir)
  os.makedirs(os.path.dirname(p["tasks"]), exist_ok=True)
  tasks, sft = [], []
  for name, (expr, _, _) in OPS.items():
    ref = REFERENCE.format(expr=expr)
    tasks.append({"id": name, "level": 1, "pytorch_code": ref})
    message = prompts.e2e_user_message(ref)[-FLAGS.prompt_tail_chars :]
    for variant, code in candidates(name).items():
      sft.append(
        {"id": f"{name}/{variant}", "prompt": message, "response": prompts.code_response(code)}
      )
  for path, rows in ((p["tasks"], tasks), (p["sft"], sft)):
    with open(path + ".tmp", "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(path + ".tmp", path)
  print(f"  {len(tasks)} tasks -> {p['tasks']}; {len(sft)} SFT rows -> {p['sft']}")
  print(f"  response length {max(len(r['response']) for r in sft)} chars at most")
  return {"tasks": len(tasks), "sft_rows": len(sft)}


def step_check(workdir: str) -> dict:
  from dice_jax.verifier_client import VerifierClient
  from verifier.local import LocalVerifier

  items = [
    (name, REFERENCE.format(expr=OPS[name][0]), code, variant)
    for name in OPS
    for variant, code in candidates(name).items()
  ]
  out = {}
  with LocalVerifier(os.path.join(paths(workdir)["rl_dir"], "verifier"), device="cpu") as v:
    with VerifierClient(v.address, options={"num_correct_trials": 1}, token="") as client:
      client.wait_ready(120)
      results = client.verify_batch([it[:3] for it in items])
  for (name, _, _, variant), r in zip(items, results):
    print(
      f"  {name:<8}{variant:<15}correct={r.correct!s:<6}{r.failure_kind:<15}{r.compile_s:6.1f} s"
    )
    out[f"{name}/{variant}"] = r.failure_kind
    if (variant == "correct") != r.correct:
      raise SystemExit(f"candidate {name}/{variant} got {r.failure_kind}: {r.reason[:200]}")
  return out


def _run(cmd: list[str]) -> None:
  print("  $", " ".join(cmd), flush=True)
  subprocess.run(cmd, check=True)


def step_sft(workdir: str) -> dict:
  p = paths(workdir)
  _run(
    [
      sys.executable,
      "-m",
      "experiments.sft",
      "--config=tiny",
      f"--workdir={p['sft_dir']}",
      "--set=data_source=cuke",
      f"--set=data_path={p['sft']}",
      "--set=max_prompt_chars=None",
      "--set=max_response_chars=None",
      "--set=seq_len=1280",
      "--set=batch_size=9",
      f"--set=num_steps={FLAGS.sft_steps}",
      "--set=optim.learning_rate=2e-3",
      "--set=checkpoint_every=100",
      "--set=log_every=20",
      "--set=model_overrides.hidden_size=128",
      "--set=model_overrides.intermediate_size=384",
      "--set=model_overrides.num_layers=4",
    ]
  )
  with open(os.path.join(p["sft_dir"], "metrics.jsonl")) as f:
    losses = [r["loss"] for r in map(json.loads, f)]
  print(f"  SFT loss {losses[0]:.3f} -> {losses[-1]:.3f}")
  return {"first_loss": losses[0], "last_loss": losses[-1]}


def step_rl(workdir: str) -> dict:
  p = paths(workdir)
  _run(
    [
      sys.executable,
      "-m",
      "experiments.rl",
      "--config=rl_tiny",
      "--phase=e2e",
      "--verifier=local",
      f"--workdir={p['rl_dir']}",
      f"--init_checkpoint={p['sft_dir']}",
      f"--set=e2e_tasks={p['tasks']}",
      f"--set=prompt_tail_chars={FLAGS.prompt_tail_chars}",
      f"--set=stream.num_steps={FLAGS.rl_steps}",
      *[f"--set={s}" for s in FLAGS.rl_set],
    ]
  )
  return step_plot(workdir, quiet=True)


def step_plot(workdir: str, quiet: bool = False) -> dict:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from dice_jax.train.metrics import read_metrics

  recs = read_metrics(os.path.join(paths(workdir)["rl_dir"], "metrics.jsonl"))
  steps = list(recs)
  correct = [recs[s]["correct_rate"] for s in steps]
  fig, ax = plt.subplots(figsize=(6.5, 3.8))
  ax.plot(steps, correct, marker="o", label="correct (compiled, right output)")
  for key, label in (
    ("failure/wrong_output", "wrong output"),
    ("failure/compile_error", "compile error"),
  ):
    ax.plot(steps, [recs[s].get(key, 0.0) for s in steps], marker=".", alpha=0.7, label=label)
  ax.set_xlabel("RL step (64 samples each: 4 tasks x 16, sampled before that step's update)")
  ax.set_ylabel("fraction of samples")
  ax.set_ylim(-0.02, 1.02)
  ax.set_title("BiC-RL on CPU against the real verifier (tiny model after SFT)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  png = FLAGS.png or os.path.join(workdir, "rl_signal.png")
  fig.savefig(png + ".tmp.png", dpi=110)
  plt.close(fig)
  os.replace(png + ".tmp.png", png)
  if not quiet:
    print(f"  correct fraction per step: {[round(c, 3) for c in correct]} -> {png}")
  return {"correct_rate": correct, "png": png}


STEPS = {
  "data": step_data,
  "check": step_check,
  "sft": step_sft,
  "rl": step_rl,
  "plot": step_plot,
}


def main(argv):
  del argv
  os.makedirs(FLAGS.workdir, exist_ok=True)
  summary = {}
  for i, name in enumerate(FLAGS.steps, 1):
    if name not in STEPS:
      raise app.UsageError(f"unknown step {name!r}; known: {list(STEPS)}")
    print(f"[{i}/{len(FLAGS.steps)}] {name}", flush=True)
    t0 = time.time()
    summary[name] = STEPS[name](FLAGS.workdir)
    print(f"  done in {time.time() - t0:.1f} s", flush=True)
  with open(os.path.join(FLAGS.workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2, default=str)


if __name__ == "__main__":
  app.run(main)
