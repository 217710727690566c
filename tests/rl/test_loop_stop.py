"""Ctrl-C (SIGINT) during an RL step: the launcher finishes that step, saves it, exits 0, and the
rerun resumes from it, reading its compiled programs back from the run's compilation cache
(subprocesses; the tiny config with a toy judge, no verifier)."""

import os
import re
import signal
import subprocess
import time

import pytest

from dice_jax import compile_cache
from dice_jax.train.checkpoint import Checkpointer

from .launch import REPO, rl_cmd
from .test_loop_resume import _env, _metrics

pytestmark = pytest.mark.slow  # two launcher processes (start-up + compile each)


def _latest_checkpoint(workdir) -> int | None:
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), save_every=1, async_save=False)
  try:
    return ckpt.latest_step()
  finally:
    ckpt.close()


def test_ctrl_c_during_an_rl_step_saves_that_step_and_the_rerun_resumes_from_it(tmp_path):
  workdir = str(tmp_path / "run")
  # checkpoint_every=100: any checkpoint before step 50 is the stop's
  cmd = rl_cmd(workdir, 50, "--set=run.checkpoint_every=100")
  proc = subprocess.Popen(
    cmd, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
  )
  try:
    deadline = time.time() + 600
    while max(_metrics(workdir), default=0) < 1:
      assert proc.poll() is None, "the run ended before it could be stopped"
      assert time.time() < deadline, "no RL step within 600 s"
      time.sleep(0.1)
    proc.send_signal(signal.SIGINT)  # step 2 is being sampled or learned from
    _, stderr = proc.communicate(timeout=300)
  finally:
    proc.kill()
  assert proc.returncode == 0, stderr[-4000:]
  stopped_at = max(_metrics(workdir))
  assert 1 <= stopped_at < 50
  assert f"SIGINT: stopped after RL step {stopped_at}, checkpoint saved" in stderr
  assert _latest_checkpoint(workdir) == stopped_at
  cache_dir = os.path.join(workdir, "compile_cache")
  stored = compile_cache.entries(cache_dir)
  assert f"compilation cache {cache_dir}: 0 programs stored" in stderr
  assert f"compilation cache {cache_dir}: 0 programs read back" in stderr
  assert stored >= 2  # at least the sampler and the update (each compiles for over a second)

  rerun = subprocess.run(
    cmd + ["--max_steps=1"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900
  )
  assert rerun.returncode == 0, rerun.stderr[-4000:]
  assert f"restored step {stopped_at}" in rerun.stderr
  assert f"RL steps {stopped_at} -> {stopped_at + 1}" in rerun.stderr
  assert max(_metrics(workdir)) == stopped_at + 1
  # the second start reads the programs the first compiled back (the sampler, the update, ...)
  assert f"compilation cache {cache_dir}: {stored} programs stored" in rerun.stderr
  hits = re.search(
    rf"compilation cache {re.escape(cache_dir)}: (\d+) programs read back", rerun.stderr
  )
  assert hits and int(hits.group(1)) >= 2, rerun.stderr[-4000:]
  assert "compilation cache hit 1: a compiled program read back" in rerun.stderr
