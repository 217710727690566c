"""The launcher end to end (subprocesses): kill -9 + restart is exact; SIGTERM and Ctrl-C (SIGINT)
save the current step and stop cleanly, also during the first compile; damaged newest checkpoints
are named, moved aside and the run resumes exactly from the newest intact one; training longer is
a plain rerun, another learning rate is refused on resume unless allowed."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from dice_jax.train.metrics import read_metrics

from ._helpers import write_cuke_file

pytestmark = pytest.mark.slow  # launcher processes (start-up + compile each)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUM_STEPS = 30


def _cmd(workdir, data):
  return [
    sys.executable,
    "-m",
    "experiments.sft",
    "--config=tiny",
    f"--workdir={workdir}",
    "--set=data_source=cuke",
    f"--set=data_path={data}",
    "--set=seq_len=256",
    "--set=batch_size=4",
    f"--set=num_steps={NUM_STEPS}",
    "--set=run.checkpoint_every=4",
    "--set=log_every=10",
  ]


def _env():
  env = dict(
    os.environ,
    XLA_FLAGS="--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0",
    JAX_PLATFORMS="cpu",
  )
  env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
  return env


def _metrics(workdir):
  """{step: record} so far (none before the run wrote any)."""
  path = os.path.join(workdir, "metrics.jsonl")
  return read_metrics(path) if os.path.exists(path) else {}


def _start(workdir, data):
  return subprocess.Popen(
    _cmd(workdir, data),
    cwd=REPO,
    env=_env(),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )


def _wait_for_step(proc, workdir, step, timeout=240):
  t0 = time.time()
  while time.time() - t0 < timeout:
    done = _metrics(workdir)
    if done and max(done) >= step:
      return max(done)
    if proc.poll() is not None:
      pytest.fail(f"launcher exited early ({proc.returncode}):\n{proc.stdout.read()[-3000:]}")
    time.sleep(0.02)
  pytest.fail("launcher made no progress")


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
  return write_cuke_file(tmp_path_factory.mktemp("data") / "cuke.jsonl")


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, data_file):
  workdir = str(tmp_path_factory.mktemp("uninterrupted"))
  subprocess.run(
    _cmd(workdir, data_file), cwd=REPO, env=_env(), check=True, capture_output=True, timeout=600
  )
  return workdir


@pytest.fixture(scope="module")
def reference(reference_run):
  return _metrics(reference_run)


def test_kill_9_then_restart_resumes_with_identical_losses_and_data(tmp_path, data_file, reference):
  assert sorted(reference) == list(range(1, NUM_STEPS + 1))
  workdir = str(tmp_path / "run")
  proc = _start(workdir, data_file)
  killed_at = _wait_for_step(proc, workdir, 6)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert killed_at < NUM_STEPS, "the run finished before it could be killed"

  again = subprocess.run(
    _cmd(workdir, data_file), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600
  )
  assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
  log = again.stdout + again.stderr
  assert "restored step" in log  # it resumed rather than starting over
  resumed = _metrics(workdir)
  assert sorted(resumed) == sorted(reference)
  for step, ref in reference.items():
    got = resumed[step]
    assert got["data_fingerprint"] == ref["data_fingerprint"], f"data order differs at {step}"
    assert got["loss"] == ref["loss"], f"loss differs at step {step}"
  assert len({r["data_fingerprint"] for r in reference.values()}) > NUM_STEPS // 2


def _saved_steps(workdir):
  return sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_or_ctrl_c_saves_the_current_step_then_exits(tmp_path, data_file, reference, sig):
  workdir = str(tmp_path / "run")
  proc = _start(workdir, data_file)
  _wait_for_step(proc, workdir, 2)
  proc.send_signal(sig)
  out = proc.communicate(timeout=120)[0]
  assert proc.returncode == 0, out[-3000:]
  assert "Traceback" not in out and "KeyboardInterrupt" not in out
  last = max(_metrics(workdir))
  assert last < NUM_STEPS
  assert f"{sig.name}: stopped at step {last}, checkpoint saved; rerun the same command" in out
  assert _saved_steps(workdir)[-1] == last  # the interrupted step itself, not an interval one
  assert _metrics(workdir)[last]["loss"] == reference[last]["loss"]


def test_sigterm_during_the_first_compile_saves_step_one_and_exits_cleanly(tmp_path, data_file):
  workdir = str(tmp_path / "run")
  proc = _start(workdir, data_file)
  lines = []
  for line in proc.stdout:  # the launcher logs this line right before the first (compiling) call
    lines.append(line)
    if "compiling the train step" in line:
      proc.send_signal(signal.SIGTERM)
      break
  out = "".join(lines) + proc.communicate(timeout=180)[0]
  assert proc.returncode == 0, out[-3000:]  # was 143
  assert "Traceback" not in out
  assert "SIGTERM: stopped at step 1, checkpoint saved; rerun the same command to resume" in out
  assert _saved_steps(workdir) == [1] and max(_metrics(workdir)) == 1


def test_damaged_newest_checkpoints_are_skipped_and_the_run_resumes_exactly(
  tmp_path, reference_run, reference, data_file
):
  """Step 30's metadata overwritten, step 28's array data cut short: the rerun names both in one
  line each, moves them aside and trains steps 25-30 again from step 24, with the same losses."""
  workdir = tmp_path / "run"
  shutil.copytree(reference_run, workdir)
  ckpts = workdir / "checkpoints"
  assert _saved_steps(str(workdir)) == [24, 28, 30]
  (ckpts / "30" / "state" / "_METADATA").write_text('{"tree_metadata": {"params"')
  for f in (ckpts / "28" / "state" / "ocdbt.process_0" / "d").iterdir():
    with open(f, "r+b") as fh:
      fh.truncate(f.stat().st_size // 2)
  again = subprocess.run(
    _cmd(str(workdir), data_file),
    cwd=REPO,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert again.returncode == 0, again.stderr[-3000:]
  log = again.stderr
  assert "Traceback" not in log and "Event loop is closed" not in log
  for bad, what in ((30, "state/_METADATA is unreadable: JSONDecodeError"), (28, "state: ")):
    assert f"checkpoint step {bad} in {ckpts} is damaged ({what}" in log, log[-3000:]
    assert f"moved the damaged checkpoint step {bad} to {ckpts}.damaged/{bad}" in log
  assert "); using step 24" in log and "restored step 24" in log
  assert sorted(os.listdir(f"{ckpts}.damaged")) == ["28", "30"]
  assert _saved_steps(str(workdir))[-1] == NUM_STEPS
  resumed = _metrics(str(workdir))
  for step in range(25, NUM_STEPS + 1):
    assert resumed[step]["loss"] == reference[step]["loss"], f"loss differs at step {step}"
    assert resumed[step]["data_fingerprint"] == reference[step]["data_fingerprint"]


def test_training_longer_is_a_rerun_and_another_learning_rate_is_refused(
  tmp_path, reference_run, data_file
):
  """A copy of the uninterrupted run is extended by two steps (was: num_steps 30 -> 32 needed
  --allow_config_change)."""
  workdir = str(tmp_path / "run")
  shutil.copytree(reference_run, workdir)
  longer = [a for a in _cmd(workdir, data_file) if "num_steps" not in a]
  longer.append(f"--set=num_steps={NUM_STEPS + 2}")
  run = lambda cmd: subprocess.run(  # noqa: E731
    cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600
  )
  refused = run(longer + ["--set=optim.learning_rate=0.5"])
  assert refused.returncode == 2 and "Traceback" not in refused.stderr
  assert refused.stderr.strip().splitlines()[-1] == (
    f"sft: error: {workdir} holds a run (step {NUM_STEPS}) started with another config: "
    "optim.learning_rate 0.003 -> 0.5; pass --allow_config_change to continue it with "
    "the new values, or use a new --workdir"
  )
  assert _saved_steps(workdir)[-1] == NUM_STEPS
  longer_run = run(longer)
  assert longer_run.returncode == 0, longer_run.stderr[-3000:]
  assert (
    f"resuming step {NUM_STEPS} with config changes: num_steps {NUM_STEPS} -> {NUM_STEPS + 2}"
    in longer_run.stderr
  )
  assert max(_metrics(workdir)) == NUM_STEPS + 2
