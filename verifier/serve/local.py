"""Run `python -m verifier serve` as a child process on 127.0.0.1 (demos, tests, local runs).

    with LocalVerifier(device="cpu", workdir=tmp) as v:
        client = GrpcVerifierClient(v.address, token="")

The server binds port 0 and prints the port it got (`verifier listening on HOST:PORT`); this reads it
from the log (waiting up to ``start_timeout_s``, default ``waiting.VERIFIER_WAIT_S``, with a line to
``report`` every ``waiting.WAIT_PROGRESS_EVERY_S``), and on exit terminates the process (then kills it
if it does not stop). The service gets this process's import path with every entry absolute
(`sandbox/import_path.py`), as its workers do.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable

from verifier.api import waiting
from verifier.sandbox.import_path import child_pythonpath

_LISTENING = re.compile(r"listening on [\d.]+:(\d+)")


class VerifierStartError(RuntimeError):
  pass


class LocalVerifier:
  """A verifier service child process on 127.0.0.1 with an ephemeral port and no auth token."""

  def __init__(
    self,
    workdir: str,
    *,
    device: str = "cpu",
    compile_workers: int = 1,
    extra_args: tuple[str, ...] = (),
    start_timeout_s: float = waiting.VERIFIER_WAIT_S,
    report: Callable[[str], None] | None = None,
  ):
    self.workdir = workdir
    self.log_path = os.path.join(workdir, "verifier.log")
    self.cmd = [
      sys.executable,
      "-m",
      "verifier",
      "serve",
      "--device",
      device,
      "--host",
      "127.0.0.1",
      "--port",
      "0",
      "--compile-workers",
      str(compile_workers),
      "--cache-dir",
      os.path.join(workdir, "verifier_cache"),
      *extra_args,
    ]
    self.start_timeout_s = start_timeout_s
    self.report = report
    self.proc: subprocess.Popen | None = None
    self.address = ""

  def __enter__(self) -> "LocalVerifier":
    os.makedirs(self.workdir, exist_ok=True)
    with open(self.log_path, "w") as log:
      self.proc = subprocess.Popen(
        self.cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "VERIFIER_TOKEN": "", "PYTHONPATH": child_pythonpath()},
      )
    start = time.monotonic()
    due = start + waiting.WAIT_PROGRESS_EVERY_S
    while True:
      with open(self.log_path) as f:
        m = _LISTENING.search(f.read())
      if m:
        self.address = f"127.0.0.1:{m.group(1)}"
        return self
      now = time.monotonic()
      if self.report is not None and now >= due:
        self.report(
          f"waiting for the local verifier to start: {now - start:.0f} s of "
          f"{self.start_timeout_s:g} s ({waiting.WAIT_FLAG}); log {self.log_path}"
        )
        due = now + waiting.WAIT_PROGRESS_EVERY_S
      if self.proc.poll() is not None or now - start > self.start_timeout_s:
        why = "it exited" if self.proc.poll() is not None else "not listening"
        tail = open(self.log_path).read()[-2000:]
        self.__exit__(None, None, None)
        raise VerifierStartError(
          f"local verifier did not start ({why} after {now - start:.0f} s, {waiting.WAIT_FLAG} "
          f"{self.start_timeout_s:g}); log {self.log_path}:\n{tail}"
        )
      time.sleep(0.25)

  def __exit__(self, *exc):
    if self.proc is not None and self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(timeout=20)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
