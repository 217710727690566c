r"""A real BiC-RL learning signal on CPU: SFT a small model on correct AND incorrect C++ candidates
for a few CPU-backend problems, then BiC-RL against a local CPU verifier over gRPC.

  python -m experiments.rl_signal --workdir=/tmp/rl_signal [--steps=data,check,sft,rl,plot]

Steps (each prints what it did; later steps reuse earlier outputs in the workdir):
  data   element-wise problems (`--ops`, KernelBench format, CPU sizes) with one correct and two
         wrong C++ candidates each (a wrong formula: wrong_output; a missing ';': compile_error);
         tasks.jsonl for RL and sft.jsonl ({prompt, response}) for SFT. The prompt is the last
         characters of the KernelBench end-to-end user message (`--prompt_tail_chars`; by default
         64 for one problem, 390 for several, enough to name the operation), rendered as the RL
         config does (`prompt_tail_chars`). One problem by default: sequences stay ~450 bytes,
         which a loaded 2-core machine can train on in minutes per step.
  check  every candidate through the CPU verifier (also fills the build cache the RL run reuses).
  sft    `experiments.sft` on sft.jsonl until the model samples all variants.
  rl     `experiments.rl --config=rl_tiny --verifier=local` from the SFT checkpoint.
  plot   correct fraction per RL step (64 samples each) -> WORKDIR/rl_signal.png (`--png`; the
         committed run is docs/rl_signal.png, `make signal` reruns it: about 1-2 h on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
OPS_NAMES = ("relu", "square", "triple")
flags.DEFINE_string("workdir", "/tmp/rl_signal", "where everything is written")
flags.DEFINE_list(
  "steps",
  ["data", "check", "sft", "eval_before", "rl", "eval_after", "plot"],
  "steps to run, in order",
)
flags.DEFINE_list("ops", ["relu"], f"problems (of {sorted(OPS_NAMES)})")
flags.DEFINE_integer(
  "prompt_tail_chars", 0, "characters of the user message kept (0: 64 for one problem, else 390)"
)
flags.DEFINE_integer("sft_steps", 400, "SFT optimizer steps")
flags.DEFINE_integer("rl_steps", 12, "BiC-RL steps")
flags.DEFINE_integer("rl_group_size", 16, "samples per task in an RL step")
flags.DEFINE_integer("rl_tasks_per_step", 1, "groups per RL step (CPU time: 1 x 16 samples)")
flags.DEFINE_float("rl_learning_rate", 1e-4, "BiC-RL learning rate (1e-3 collapsed the policy)")
flags.DEFINE_multi_string("rl_set", [], "extra --set overrides for the RL launcher")
flags.DEFINE_string(
  "rl_name", "rl", "the RL run's directory under the workdir (e.g. one per --rl_set=recipe=...)"
)
flags.DEFINE_list(
  "compare", ["rl_ours", "rl_dice"], "RL run directories (under the workdir) the compare step plots"
)
flags.DEFINE_string(
  "compare_title", "BiC-RL on CPU against the real verifier, by recipe", "the compare plot's title"
)
flags.DEFINE_string("png", "", "where the plot goes (default: WORKDIR/rl_signal.png)")

OPS = {  # name: (torch expression, correct C++ expression of a[i], wrong C++ expression of a[i])
  "relu": ("torch.relu(x)", "a[i] > 0 ? a[i] : 0", "a[i] < 0 ? a[i] : 0"),
  "square": ("x * x", "a[i] * a[i]", "a[i] + a[i]"),
  "triple": ("x * 3.0", "a[i] * 3", "a[i] * 2"),
}

# KernelBench format with the forward last, so that a short prompt tail still names the operation.
REFERENCE = """import torch
import torch.nn as nn


def get_inputs():
    return [torch.randn(256, 256)]


def get_init_inputs():
    return []


class Model(nn.Module):
    def forward(self, x):
        return {expr}
"""

CANDIDATE = '''import torch.nn as nn
from torch.utils.cpp_extension import load_inline

e = load_inline(name="{name}", cpp_sources=r"""
#include <torch/extension.h>
torch::Tensor f(torch::Tensor x) {{
  auto y = torch::empty_like(x);
  float *a = x.data_ptr<float>(), *b = y.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) b[i] = {expr};
  return y{semi}
}}""", functions=["f"])


class ModelNew(nn.Module):
    def forward(self, x):
        return e.f(x.contiguous())
'''


def candidates(name: str) -> dict[str, str]:
  """variant -> candidate file: 'correct', 'wrong_output', 'compile_error' (a missing ';')."""
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
    "rl_dir": os.path.join(workdir, FLAGS.rl_name),
  }


def tail_chars() -> int:
  """The prompt: the user message's last characters (its fixed closing instruction is ~330)."""
  return FLAGS.prompt_tail_chars or (64 if len(FLAGS.ops) == 1 else 390)


def step_data(workdir: str) -> dict:
  from dice_jax.data import prompts

  p = paths(workdir)
  os.makedirs(os.path.dirname(p["tasks"]), exist_ok=True)
  tasks, sft = [], []
  for name in FLAGS.ops:
    ref = REFERENCE.format(expr=OPS[name][0])
    tasks.append({"id": name, "level": 1, "pytorch_code": ref})
    message = prompts.e2e_user_message(ref)[-tail_chars() :]
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
  from dice_jax.verifier_client import ThreadedVerifier
  from verifier.serve.local import LocalVerifier

  items = [
    (name, REFERENCE.format(expr=OPS[name][0]), code, variant)
    for name in FLAGS.ops
    for variant, code in candidates(name).items()
  ]
  out = {}
  with LocalVerifier(os.path.join(paths(workdir)["rl_dir"], "verifier"), device="cpu") as v:
    with ThreadedVerifier(v.address, options={"num_correct_trials": 1}, token="") as client:
      client.wait_ready()
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
  """Runs a launcher. On CPU, XLA's constant folding of the sampler's prefill (an empty-cache
  attention over the whole prompt) takes minutes per compile, so the children skip that pass."""
  env = dict(os.environ)
  if "constant_folding" not in env.get("XLA_FLAGS", ""):
    env["XLA_FLAGS"] = (
      env.get("XLA_FLAGS", "") + " --xla_disable_hlo_passes=constant_folding"
    ).strip()
  print("  $", " ".join(cmd), flush=True)
  subprocess.run(cmd, check=True, env=env)


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
      "--set=seq_len=768",
      f"--set=batch_size={3 * len(FLAGS.ops)}",
      f"--set=num_steps={FLAGS.sft_steps}",
      "--set=optim.learning_rate=2e-3",
      "--set=run.checkpoint_every=100",
      "--set=log_every=20",
      "--set=run.model_overrides.hidden_size=128",
      "--set=run.model_overrides.intermediate_size=384",
      "--set=run.model_overrides.num_layers=4",
      "--set=run.model_overrides.remat=True",
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
      f"--set=prompt_tail_chars={tail_chars()}",
      "--set=max_prompt_len=512",  # the 390-character tail of several problems: ~420 tokens
      f"--set=stream.num_steps={FLAGS.rl_steps}",
      f"--set=stream.group_size={FLAGS.rl_group_size}",
      f"--set=stream.tasks_per_step={FLAGS.rl_tasks_per_step}",
      # two optimizer steps per RL step, two micro-batches each
      f"--set=rows_per_update={FLAGS.rl_group_size * FLAGS.rl_tasks_per_step // 2}",
      "--set=accum_steps=2",
      f"--set=optim.learning_rate={FLAGS.rl_learning_rate}",
      *[f"--set={s}" for s in FLAGS.rl_set],
    ]
  )
  return step_plot(workdir, quiet=True)


def evaluate(run_dir: str, workdir: str, label: str) -> dict:
  """The correct fraction over 64 samples (4 groups x 16 of the problems, fixed keys) of a run's
  latest checkpoint, judged by the CPU verifier; written to WORKDIR/eval_{label}.json."""
  import dataclasses

  from dice_jax import sharding
  from dice_jax.data import prompts
  from dice_jax.data.tokenizer import Tokenizer
  from dice_jax.rl import rewards, rollout
  from dice_jax.train.run_setup import restore_run_params
  from dice_jax.verifier_client import ThreadedVerifier
  from experiments.configs import rl_tiny
  from verifier.serve.local import LocalVerifier

  model, mcfg, tok_dir = restore_run_params(run_dir, sharding.make_mesh())
  tok = Tokenizer.from_dir(tok_dir)
  groups = []
  for g in range(4):
    name = FLAGS.ops[g % len(FLAGS.ops)]
    ref = REFERENCE.format(expr=OPS[name][0])
    text = prompts.render_user_turn(prompts.e2e_user_message(ref)[-tail_chars() :], tok)
    groups.append(rollout.GroupTask(g, name, np.asarray(tok.encode(text), np.int32), ref, 16))
  scfg = dataclasses.replace(
    rl_tiny.get_config().sampler, stop_ids=tuple(tok.stop_token_ids), pad_id=mcfg.pad_token_id
  )
  with LocalVerifier(os.path.join(paths(workdir)["rl_dir"], "verifier"), device="cpu") as v:
    with ThreadedVerifier(v.address, options={"num_correct_trials": 1}, token="") as client:
      client.wait_ready()
      ro = rollout.collect(
        model,
        groups,
        backend=rollout.StaticBatches(scfg, groups_per_batch=4, seed=20261130),
        judge=client,
        tokenizer=tok,
        reward_fn=rewards.make_reward("binary"),
        rl_step=0,
        extraction="dice",
      )
  kinds: dict[str, int] = {}
  for o in ro.outcomes:
    kinds[o.failure_kind] = kinds.get(o.failure_kind, 0) + 1
  res = {
    "run": run_dir,
    "samples": len(ro.outcomes),
    "correct": int(ro.rewards.sum()),
    "correct_rate": float(ro.rewards.mean()),
    "failure_kinds": kinds,
    "unique_candidates": ro.judge_requests,
  }
  with open(os.path.join(workdir, f"eval_{label}.json"), "w") as f:
    json.dump(res, f, indent=2)
  print(f"  {label}: {res['correct']}/{res['samples']} correct; outcomes {kinds}")
  return res


def step_eval_before(workdir: str) -> dict:
  return evaluate(paths(workdir)["sft_dir"], workdir, "before")


def step_eval_after(workdir: str) -> dict:
  return evaluate(paths(workdir)["rl_dir"], workdir, _after_label())


def _after_label() -> str:
  return "after" if FLAGS.rl_name == "rl" else f"after_{FLAGS.rl_name}"


def step_plot(workdir: str, quiet: bool = False) -> dict:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from dice_jax.train.metrics import read_metrics

  recs = read_metrics(os.path.join(paths(workdir)["rl_dir"], "metrics.jsonl"))
  steps = np.array(list(recs))
  correct = np.array([recs[s]["correct_rate"] for s in steps])
  fig, ax = plt.subplots(figsize=(7.5, 4.2))
  ax.plot(steps, correct, marker="o", alpha=0.45, label="correct, this step's rollout")
  k = min(5, len(steps))
  ax.plot(
    steps[k - 1 :],
    np.convolve(correct, np.ones(k) / k, "valid"),
    color="tab:blue",
    lw=2,
    label=f"correct, {k}-step mean",
  )
  for key, label in (
    ("failure/syntax_error", "syntax error"),
    ("failure/no_code", "no code block"),
    ("failure/wrong_output", "wrong output"),
    ("failure/compile_error", "compile error"),
  ):
    ax.plot(steps, [recs[s].get(key, 0.0) for s in steps], lw=1, alpha=0.7, label=label)
  for label, x, marker in (("before", 0, "s"), (_after_label(), int(steps[-1]), "D")):
    path = os.path.join(workdir, f"eval_{label}.json")
    if os.path.exists(path):
      ev = json.load(open(path))
      ax.scatter(
        [x],
        [ev["correct_rate"]],
        marker=marker,
        s=70,
        color="black",
        zorder=5,
        label=f"correct over 64 fixed-key samples, {label} RL: {ev['correct']}/64",
      )
  n = int(recs[steps[0]]["samples"])
  ax.set_xlabel(f"RL step ({n} samples per rollout, drawn before that step's update)")
  ax.set_ylabel("fraction of samples")
  ax.set_ylim(-0.02, 1.02)
  ax.set_title("BiC-RL on CPU against the real verifier (small model after SFT)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, loc="upper left")
  fig.tight_layout()
  png = FLAGS.png or os.path.join(workdir, "rl_signal.png")
  fig.savefig(png + ".tmp.png", dpi=110)
  plt.close(fig)
  os.replace(png + ".tmp.png", png)
  if not quiet:
    print(f"  correct fraction per step: {[round(float(c), 3) for c in correct]} -> {png}")
  return {"correct_rate": correct.tolist(), "png": png}


def step_compare(workdir: str) -> dict:
  """The rollouts' correct fraction and KL per RL step of several RL runs (e.g. one per recipe,
  `--rl_name=rl_ours --rl_set=recipe=ours` ...), side by side -> WORKDIR/rl_signal_compare.png."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from dice_jax.train.metrics import read_metrics

  runs = {n: read_metrics(os.path.join(workdir, n, "metrics.jsonl")) for n in FLAGS.compare}
  fig, axes = plt.subplots(1, len(runs), figsize=(5.2 * len(runs), 3.8), sharey=True)
  out = {}
  for ax, (name, recs) in zip(np.atleast_1d(axes), runs.items()):
    steps = np.array(list(recs))
    correct = np.array([recs[s]["correct_rate"] for s in steps])
    ax.plot(steps, correct, marker="o", label="correct, this step's rollout")
    ax.plot(steps, [recs[s].get("clip_fraction", np.nan) for s in steps], label="clip fraction")
    ax.plot(steps, [recs[s].get("updates", 0) / 10 for s in steps], ls=":", label="updates / 10")
    ev = os.path.join(workdir, f"eval_after_{name}.json")
    if os.path.exists(ev):
      e = json.load(open(ev))
      ax.scatter(
        [steps[-1]],
        [e["correct_rate"]],
        marker="D",
        color="k",
        zorder=5,
        label=f"64 fixed-key samples after: {e['correct']}/64",
      )
    before = os.path.join(workdir, "eval_before.json")
    if os.path.exists(before):
      e = json.load(open(before))
      ax.scatter(
        [0],
        [e["correct_rate"]],
        marker="s",
        color="k",
        zorder=5,
        label=f"64 fixed-key samples before: {e['correct']}/64",
      )
    ax.set_title(name)
    ax.set_xlabel("RL step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    out[name] = correct.round(3).tolist()
  fig.suptitle(FLAGS.compare_title)
  fig.tight_layout()
  png = FLAGS.png or os.path.join(workdir, "rl_signal_compare.png")
  fig.savefig(png + ".tmp.png", dpi=100)
  plt.close(fig)
  os.replace(png + ".tmp.png", png)
  print(f"  correct fraction per step: {out} -> {png}")
  return {"correct_rate": out, "png": png}


STEPS = {
  "data": step_data,
  "check": step_check,
  "sft": step_sft,
  "eval_before": step_eval_before,
  "rl": step_rl,
  "eval_after": step_eval_after,
  "plot": step_plot,
  "compare": step_compare,
}


def main(argv):
  del argv
  # This driver samples on CPU in process too (eval steps): skip XLA's constant folding of the
  # sampler's prefill, as its children do (set before JAX is first imported, in a step).
  if "constant_folding" not in os.environ.get("XLA_FLAGS", ""):
    flags_now = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags_now} --xla_disable_hlo_passes=constant_folding".strip()
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
  from experiments import _cli

  _cli.quiet_missing_tpu()
  app.run(main)
