"""experiments/rl_step.py on CPU, tiny model: the whole step's record (what the H200 run writes)."""

import json
import os
import subprocess
import sys

from tests.rl.launch import REPO


def test_the_step_record_has_every_phase_and_the_extrapolation(tmp_path):
  out = tmp_path / "rl_step.json"
  env = dict(
    os.environ,
    PYTHONPATH=REPO,
    XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + (" --xla_disable_hlo_passes=constant_folding"),
  )
  cmd = [
    sys.executable,
    "-m",
    "experiments.rl_step",
    "--config=tiny",
    "--recipe=dice",
    "--tasks=2",
    "--group_size=4",
    "--prompt_len=16",
    "--new_tokens=16",
    "--groups_per_batch=2",
    "--rows_per_update=8",
    "--attention_impl=dense",
    "--verifier=none",
    "--dice_tasks=4",
    f"--compilation_cache={tmp_path / 'cache'}",
    f"--out={out}",
  ]
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(out.read_text())
  assert r["recipe"] == "dice" and r["tracerl"]["batch_units"] == "rounds"
  assert r["compilation_cache"]["warm"] is False
  ph = r["phases"]
  assert list(ph) == ["setup", "rollout", "update", "probe"]
  assert ph["rollout"]["generated_tokens"] == 2 * 4 * 16 and ph["rollout"]["compile_s"] > 0
  u = ph["update"]
  # 8 responses x 4 rounds (random weights: one token per forward) = 32 (response, round) pairs,
  # 8 per optimizer step (DICE's units), no tail
  assert u["optimizer_steps"] == 4 and u["responses_trained"] == 8
  assert u["real_tokens"] > 0 and 0 < u["useful_split"]["linear"] < 1
  assert u["compile_s"] > 0 and u["mfu"] is None  # no peak FLOP/s on CPU
  # bf16 sampler and trainer: the gap is small, and measured
  assert ph["probe"]["rows"] > 0 and ph["probe"]["gap_mean"] < 0.1
  d = r["dice_step"]
  assert d["formula"].startswith("T = N*L/r")
  assert d["at_measured_rate"]["responses"] == 4 * 4
  assert d["at_target_rate"]["rate_tok_s"] == 8000.0
  # the extrapolation adds up
  m = d["at_measured_rate"]
  assert (
    abs(m["step_s"] - (m["sample_s"] + m["verify_wait_s"] + m["update_s"] + m["other_s"])) < 0.5
  )
