"""The RL launcher as two JAX processes (2 fake CPU devices each, one mesh over the 4) runs the
same RL steps as one process with 4 devices: same tasks, samples and verdicts (each process
judges half of the requests, all get every verdict), losses equal to rtol 1e-5 (atol 1e-7); metrics are
written once (process 0), and the checkpoint the two processes wrote is resumed by one."""

import json
import os
import subprocess

import numpy as np
import pytest

from experiments import local_cluster

from .launch import REPO, rl_cmd

NUM_STEPS = 3
EXACT = ("data_fingerprint", "sample_fingerprint", "reward_mean", "judge_requests", "updates")
EXACT += ("groups_dropped", "optimizer_step", "trained_tokens", "rows")
CLOSE = ("loss", "loss_first", "loss_last", "kl", "grad_norm", "ratio_mean", "entropy")


def _cmd(workdir, *extra):
  return rl_cmd(workdir, NUM_STEPS, *extra)


def _env():
  env = dict(os.environ)
  # XLA's CPU constant folding of the sampler's prefill takes minutes otherwise
  env["XLA_FLAGS"] = "--xla_disable_hlo_passes=constant_folding --xla_backend_optimization_level=0"
  env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
  return env


def _records(workdir) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _one_process(cmd, log):
  env = local_cluster.process_env(0, cpu_devices=4, base=_env())
  p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  log.write_text(p.stderr)
  assert p.returncode == 0, p.stderr[-4000:]
  return p.stderr


@pytest.mark.slow  # three launcher runs of a few seconds per step: ~1-2 min on 2 cores
def test_two_rl_processes_run_the_steps_of_one_and_one_process_resumes_them(tmp_path, reaped):
  one, two = str(tmp_path / "one"), str(tmp_path / "two")
  _one_process(_cmd(one), tmp_path / "one.log")

  procs = local_cluster.start(
    _cmd(two, f"--max_steps={NUM_STEPS - 1}"),
    2,
    cpu_devices=2,
    env=_env(),
    log_dir=str(tmp_path / "logs"),
    cwd=REPO,
  )
  reaped.extend(procs)
  codes = [p.wait(timeout=600) for p in procs]
  log0, log1 = ((tmp_path / "logs" / f"process_{i}.log").read_text() for i in range(2))
  assert codes == [0, 0], log0[-3000:] + log1[-3000:]
  assert "process 0 of 2: 2 local devices of 4" in log0
  assert f"rl step {NUM_STEPS - 1}/{NUM_STEPS}" in log0 and "rl step" not in log1  # logs once
  assert [r["step"] for r in _records(two)] == list(range(1, NUM_STEPS))  # metrics once

  # one process with the same four devices takes over the two processes' checkpoint
  resumed = _one_process(_cmd(two), tmp_path / "resume.log")
  assert f"restored step {NUM_STEPS - 1}" in resumed

  want, got = _records(one), _records(two)
  assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, NUM_STEPS + 1))
  assert len({r["data_fingerprint"] for r in want}) == NUM_STEPS  # steps differ in data
  assert sum(r["updates"] for r in want) > 0  # the comparison covers real updates
  for w, g in zip(want, got):
    for key in EXACT:
      assert g[key] == w[key], f"{key} differs at step {w['step']}: {g[key]} != {w[key]}"
    for key in CLOSE:  # atol: a mini-batch whose advantages sum to 0 has a loss of rounding only
      np.testing.assert_allclose(
        g[key], w[key], rtol=1e-5, atol=1e-7, err_msg=f"{key} step {w['step']}"
      )
