"""Multi-process runs on one machine: `experiments.local_cluster` starts N processes of one JAX
cluster on 127.0.0.1; two SFT processes (2 fake CPU devices each, one mesh over the 4) train
like one process with 4 devices on the same global batches, survive a kill -9 of one of them
(the other exits instead of hanging; a restart of both resumes), stop together on a SIGTERM to
one of them, write one export, and leave a checkpoint that a single process restores."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

from dice_jax.train.metrics import read_metrics
from experiments import local_cluster

from ._helpers import write_cuke_file

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_ECHO = (
  "import json, os, sys; print(json.dumps({'argv': sys.argv[1:], "
  "'xla': os.environ.get('XLA_FLAGS'), 'platforms': os.environ.get('JAX_PLATFORMS'), "
  "'gpus': os.environ.get('CUDA_VISIBLE_DEVICES')}))"
)


def _env(**extra) -> dict:
  env = dict(os.environ, **extra)
  env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
  return env


def test_local_cluster_starts_each_process_with_its_id_address_and_devices(tmp_path):
  procs = local_cluster.start(
    [sys.executable, "-c", _ECHO], 3, cpu_devices=2, gpus=2, log_dir=str(tmp_path)
  )
  assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]
  seen = [json.loads((tmp_path / f"process_{i}.log").read_text()) for i in range(3)]
  addresses = {s["argv"][0] for s in seen}
  assert len(addresses) == 1 and addresses.pop().startswith("--coordinator_address=127.0.0.1:")
  for i, s in enumerate(seen):
    assert s["argv"][1:] == ["--num_processes=3", f"--process_id={i}"]
    assert s["xla"].split()[-1] == "--xla_force_host_platform_device_count=2"
    assert s["platforms"] == "cpu" and s["gpus"] == f"{2 * i},{2 * i + 1}"


def test_local_cluster_prefixes_output_and_stops_the_others_when_one_fails(record_property):
  code = (
    "import sys, time; i = int(sys.argv[-1].split('=')[1]); print('hello', i, flush=True); "
    "sys.exit(3) if i == 1 else time.sleep(3600)"
  )
  t0 = time.monotonic()
  out = subprocess.run(  # process 0 sleeps for an hour: ending before the timeout, it was killed
    [sys.executable, "-m", "experiments.local_cluster", "--num_processes=2", "--grace_s=1"]
    + ["--", sys.executable, "-c", code],
    cwd=REPO,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=600,  # a hang guard: the cluster ends in seconds
  )
  record_property("seconds", time.monotonic() - t0)  # experiments/bench_bounds.py reads it
  assert out.returncode == 3, out.stderr[-2000:]
  assert sorted(out.stdout.splitlines()) == ["[0] hello 0", "[1] hello 1"]
  assert "process 1 exited with status 3" in out.stderr


STEPS = 8


def _sft(workdir, data, export):
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
    "--set=data_shards=2",
    f"--set=num_steps={STEPS}",
    "--set=run.checkpoint_every=2",
    "--set=log_every=1",
    f"--export_hf={export}",
  ]


def _last_step(workdir) -> int:
  """The last step in metrics.jsonl (complete lines only: the run may be writing)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return 0
  return max((json.loads(line)["step"] for line in open(path) if line.endswith("\n")), default=0)


def _wait_for_step(proc, workdir, step, timeout=300):
  t0 = time.monotonic()
  while time.monotonic() - t0 < timeout:
    if _last_step(workdir) >= step:
      return _last_step(workdir)
    if proc.poll() is not None:
      pytest.fail(f"process 0 exited ({proc.returncode}) before step {step}")
    time.sleep(0.1)
  pytest.fail(f"no step {step} after {timeout} s")


def _files(directory) -> dict[str, bytes]:
  return {f: open(os.path.join(directory, f), "rb").read() for f in sorted(os.listdir(directory))}


def _data_state(workdir, step):
  mngr = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"), item_names=("data",))
  try:
    return mngr.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]
  finally:
    mngr.close()


@pytest.mark.slow  # three launcher runs (one of them two processes twice): ~2-3 min on 2 cores
def test_two_processes_train_like_one_survive_a_kill_and_export_once(
  tmp_path, record_property, reaped
):
  data = write_cuke_file(tmp_path / "cuke.jsonl")
  one, two = str(tmp_path / "one"), str(tmp_path / "two")
  env = _env(  # a restart reuses the first start's compiled programs
    JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
  )
  with open(tmp_path / "one.log", "w") as log:  # one process with the four devices
    reference = subprocess.Popen(
      _sft(one, data, one + "_hf"),
      cwd=REPO,
      env=local_cluster.process_env(0, cpu_devices=4, base=env),
      stdout=log,
      stderr=subprocess.STDOUT,
    )
  reaped.append(reference)
  cmd = _sft(two, data, two + "_hf") + ["--heartbeat_timeout_s=10"]

  def start(logs):
    procs = local_cluster.start(
      cmd, 2, cpu_devices=2, env=env, log_dir=str(tmp_path / logs), cwd=REPO
    )
    reaped.extend(procs)
    return procs

  procs = start("logs_killed")
  killed_at = _wait_for_step(procs[0], two, 3)
  procs[1].kill()  # kill -9 of process 1 while process 0 trains
  t0 = time.monotonic()
  survivor = procs[0].wait(timeout=300)  # a hang guard: it exits after --heartbeat_timeout_s=10
  record_property("seconds", time.monotonic() - t0)  # experiments/bench_bounds.py reads it
  assert survivor != 0, "process 0 finished its run instead of stopping with its peer"
  procs[1].wait(timeout=60)
  assert killed_at < STEPS and not os.path.exists(two + "_hf")

  assert reference.wait(timeout=300) == 0, (tmp_path / "one.log").read_text()[-3000:]
  # restart both; a SIGTERM to process 1 alone stops both at the same step, saved
  procs = start("logs_stopped")
  _wait_for_step(procs[0], two, killed_at + 2)
  procs[1].send_signal(signal.SIGTERM)
  codes = [p.wait(timeout=120) for p in procs]
  log0, log1 = ((tmp_path / "logs_stopped" / f"process_{i}.log").read_text() for i in range(2))
  assert codes == [0, 0], log0[-3000:]
  assert "checkpoint: restored step" in log0
  stopped = _last_step(two)
  assert stopped < STEPS
  assert f"SIGTERM: stopped at step {stopped}, checkpoint saved" in log1
  assert f"another process or pre-emption notice: stopped at step {stopped}" in log0

  procs = start("logs")
  codes = [p.wait(timeout=300) for p in procs]
  log0, log1 = ((tmp_path / "logs" / f"process_{i}.log").read_text() for i in range(2))
  assert codes == [0, 0], log0[-3000:]
  assert f"checkpoint: restored step {stopped}" in log0  # resumed, not started over
  assert f"step {STEPS}/{STEPS} | loss" in log0 and "| loss" not in log1  # process 0 logs

  # the same global batches, and the losses of one process
  want, got = read_metrics(f"{one}/metrics.jsonl"), read_metrics(f"{two}/metrics.jsonl")
  assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
  assert len({r["data_fingerprint"] for r in want.values()}) == STEPS
  for step in want:
    for key in ("data_fingerprint", "real_tokens", "answer_tokens", "masked_tokens"):
      assert got[step][key] == want[step][key], f"{key} differs at step {step}"
    for key in ("loss", "masked_ce", "grad_norm", "param_norm"):
      np.testing.assert_allclose(got[step][key], want[step][key], rtol=1e-5, err_msg=key)
  assert _data_state(two, STEPS) == _data_state(one, STEPS)

  # one process restores the two processes' checkpoint; its export is byte for byte theirs
  from dice_jax.hf.checkpoint import export_hf
  from dice_jax.hf.safetensors_io import SafetensorsFile
  from dice_jax.train.checkpoint import restore_model

  model, tok_dir, step = restore_model(two)
  assert step == STEPS
  export_hf(model, str(tmp_path / "two_by_one_hf"), tokenizer_dir=tok_dir)
  written = _files(two + "_hf")
  assert {"model.safetensors", "config.json", "vocab.json"} <= set(written)
  assert written == _files(tmp_path / "two_by_one_hf")
  # against the one-process run: equal up to the last bit of bfloat16 (float sums across
  # devices run in another order in gloo than in one process)
  a = SafetensorsFile(f"{one}_hf/model.safetensors")
  b = SafetensorsFile(f"{two}_hf/model.safetensors")
  assert a.keys() == b.keys()
  for name in a.keys():
    x, y = (np.asarray(f.get(name), np.float32) for f in (a, b))
    np.testing.assert_allclose(y, x, rtol=2**-7, atol=1e-6, err_msg=name)
