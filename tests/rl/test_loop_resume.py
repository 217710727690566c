"""The RL launcher end to end (subprocesses): kill -9 mid-run and restart gives the same tasks,
samples and losses as an uninterrupted run; bad input is one line and exit status 2."""

import os
import signal
import subprocess
import sys
import time

import pytest

from dice_jax.train.metrics import read_metrics

from .launch import REPO, rl_cmd

NUM_STEPS = 4
SAME = ("loss", "loss_first", "loss_last", "reward_mean", "optimizer_step", "kl", "grad_norm")
SAME += ("data_fingerprint", "sample_fingerprint", "groups_dropped", "updates")


def _cmd(workdir, *extra):
  return rl_cmd(workdir, NUM_STEPS, *extra)


def _env():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  # one device; XLA's CPU constant folding of the sampler's prefill takes minutes otherwise
  env["XLA_FLAGS"] = (
    "--xla_force_host_platform_device_count=1 --xla_disable_hlo_passes=constant_folding"
    " --xla_backend_optimization_level=0"
  )
  env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
  return env


def _metrics(workdir):
  """{step: record} so far (none before the run wrote any)."""
  path = os.path.join(workdir, "metrics.jsonl")
  return read_metrics(path) if os.path.exists(path) else {}


def _saved_steps(workdir):
  """Steps whose checkpoint orbax has finished (it renames a step's temporary folder to the bare
  step number only once every file is written)."""
  path = os.path.join(workdir, "checkpoints")
  return [int(n) for n in os.listdir(path) if n.isdigit()] if os.path.isdir(path) else []


def _run(cmd):
  p = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
  assert p.returncode == 0, p.stderr[-4000:]
  return p


@pytest.mark.slow
def test_kill_9_mid_run_then_restart_gives_identical_losses_and_data_order(tmp_path):
  ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "run")
  _run(_cmd(ref_dir))
  proc = subprocess.Popen(
    _cmd(run_dir), cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
  )
  try:
    deadline = time.time() + 600
    # killed once a step's checkpoint is whole and a later step has run: under load step 1's async
    # save can still be writing when step 2's metrics appear, and a kill then starts over instead
    while max(_metrics(run_dir), default=0) < 2 or not _saved_steps(run_dir):
      assert proc.poll() is None, "the run ended before it could be killed"
      assert time.time() < deadline, "no second RL step and saved checkpoint within 600 s"
      time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)  # during step 3's rollout, maybe during step 2's save
  finally:
    proc.wait(30)
  killed_at = max(_metrics(run_dir))
  assert killed_at < NUM_STEPS
  restarted = _run(_cmd(run_dir))
  assert "restored step" in restarted.stderr
  ref, run = _metrics(ref_dir), _metrics(run_dir)
  assert list(ref) == list(run) == list(range(1, NUM_STEPS + 1))
  for step in ref:
    for k in SAME:
      assert run[step].get(k) == ref[step].get(k), (step, k, run[step].get(k), ref[step].get(k))
  assert any(ref[s]["updates"] for s in ref)  # the comparison covers real updates
  assert len({ref[s]["data_fingerprint"] for s in ref}) == NUM_STEPS  # steps differ in data


@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_status_2(tmp_path):
  cases = {
    "unknown field 'num_step'": ["--set=stream.num_step=3"],
    "task file of phase 'e2e' not found": ["--set=e2e_tasks=/no/such/file.json"],
    "--init_checkpoint: no such directory": ["--init_checkpoint=/no/such/run"],
    "advantage must be one of": ["--set=advantage=zscore"],
  }
  for needle, extra in cases.items():
    p = subprocess.run(
      _cmd(str(tmp_path / "w"), *extra),
      cwd=REPO,
      env=_env(),
      capture_output=True,
      text=True,
      timeout=300,
    )
    assert p.returncode == 2, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("rl: error:") and needle in last, last
    assert "Traceback" not in p.stderr
  assert not os.path.exists(tmp_path / "w")  # nothing written
  p = subprocess.run(
    [sys.executable, "-m", "experiments.rl", "--config=rl_tiny", f"--workdir={tmp_path / 'v'}"],
    cwd=REPO,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert p.returncode == 2 and "--verifier is required" in p.stderr.strip().splitlines()[-1]
