r"""Runs a multi-process JAX command as N local processes (trying multi-host on one machine).

  python -m experiments.local_cluster --num_processes=2 --cpu_devices_per_process=2 -- \
      python -m experiments.sft --config=tiny --workdir=/tmp/sft2 --set=data_path=cuke.jsonl

Starts the command N times with `--coordinator_address=127.0.0.1:PORT --num_processes=N
--process_id=I` appended (a free port unless `--port`). `--cpu_devices_per_process=D` gives each
process D fake CPU devices (XLA_FLAGS, JAX_PLATFORMS=cpu); `--gpus_per_process=G` gives process
I the GPUs I*G .. I*G+G-1 (CUDA_VISIBLE_DEVICES). Output lines are prefixed with `[I]`, or
written to `--logs/process_I.log`. SIGINT/SIGTERM are passed on to every process (the SFT
launcher saves the step and stops); when one process fails the others get `--grace_s` seconds
to exit on their own, then are killed. Exit status: the first failure's, else 0.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import flags, logging

from dice_jax.errors import UserError
from experiments import _cli

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_processes", 2, "processes to start")
flags.DEFINE_integer("port", 0, "coordinator port on 127.0.0.1 (0: a free one)")
flags.DEFINE_integer("cpu_devices_per_process", 0, "fake CPU devices per process (0: no change)")
flags.DEFINE_integer("gpus_per_process", 0, "GPUs per process (0: no change)")
flags.DEFINE_string("logs", None, "write process I's output to LOGS/process_I.log")
flags.DEFINE_float("grace_s", 10.0, "after a process fails, wait this long before killing the rest")


def free_port() -> int:
  """A TCP port on 127.0.0.1 that was free a moment ago."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def process_env(
  i: int, *, cpu_devices: int = 0, gpus: int = 0, base: dict | None = None
) -> dict[str, str]:
  """Process `i`'s environment: `base` (default os.environ) with its devices set."""
  env = dict(os.environ if base is None else base)
  if cpu_devices:
    kept = [f for f in env.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(kept + [f"--xla_force_host_platform_device_count={cpu_devices}"])
    env["JAX_PLATFORMS"] = "cpu"
  if gpus:
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i * gpus + g) for g in range(gpus))
  return env


def start(
  command: list[str],
  num_processes: int,
  *,
  port: int = 0,
  cpu_devices: int = 0,
  gpus: int = 0,
  env: dict | None = None,
  log_dir: str | None = None,
  cwd: str | None = None,
) -> list[subprocess.Popen]:
  """Starts `command` as processes 0..num_processes-1 of one JAX cluster on 127.0.0.1.

  With `log_dir`, process I writes stdout and stderr to `log_dir/process_I.log`; otherwise its
  output is a pipe (text, stderr merged) for the caller to read."""
  if num_processes < 1:
    raise UserError(f"--num_processes must be >= 1, got {num_processes}")
  if not command:
    raise UserError("no command given: local_cluster [flags] -- COMMAND ...")
  address = f"127.0.0.1:{port or free_port()}"
  if log_dir:
    os.makedirs(log_dir, exist_ok=True)
  procs = []
  for i in range(num_processes):
    argv = list(command) + [
      f"--coordinator_address={address}",
      f"--num_processes={num_processes}",
      f"--process_id={i}",
    ]
    out = open(os.path.join(log_dir, f"process_{i}.log"), "w") if log_dir else subprocess.PIPE
    procs.append(
      subprocess.Popen(
        argv,
        env=process_env(i, cpu_devices=cpu_devices, gpus=gpus, base=env),
        cwd=cwd,
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a Ctrl-C reaches them once, through `supervise`
      )
    )
    if log_dir:
      out.close()
  return procs


def _relay(i: int, proc: subprocess.Popen) -> None:
  for line in proc.stdout:
    sys.stdout.write(f"[{i}] {line}")
    sys.stdout.flush()


def supervise(procs: list[subprocess.Popen], grace_s: float = 10.0) -> int:
  """Waits for every process; passes SIGINT/SIGTERM on; after a failure gives the others
  `grace_s` seconds, then kills them. Returns the first failure's exit status, else 0."""
  relays = [
    threading.Thread(target=_relay, args=(i, p), daemon=True)
    for i, p in enumerate(procs)
    if p.stdout is not None
  ]
  for t in relays:
    t.start()

  def forward(signum, frame):
    for p in procs:
      if p.poll() is None:
        p.send_signal(signum)

  previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    status, failed_at = 0, None
    while [p.poll() for p in procs].count(None):
      for i, p in enumerate(procs):
        if p.returncode not in (None, 0) and failed_at is None:
          status, failed_at = p.returncode, time.monotonic()
          logging.error("process %d exited with status %d", i, p.returncode)
      if failed_at is not None and time.monotonic() - failed_at > grace_s:
        for p in procs:
          if p.poll() is None:
            p.kill()
      time.sleep(0.2)
    if failed_at is None:
      status = next((p.returncode for p in procs if p.returncode), 0)
  finally:
    for s, h in previous.items():
      signal.signal(s, h)
  for t in relays:
    t.join(timeout=5)
  return status if status >= 0 else 128 - status  # killed by a signal: 128 + its number


def main(argv):
  command = argv[1:]
  procs = start(
    command,
    FLAGS.num_processes,
    port=FLAGS.port,
    cpu_devices=FLAGS.cpu_devices_per_process,
    gpus=FLAGS.gpus_per_process,
    log_dir=FLAGS.logs,
  )
  sys.exit(supervise(procs, FLAGS.grace_s))


if __name__ == "__main__":
  _cli.run(main)
