"""A child process sampled from outside by the host sampler (``host_sampler.HostSampler``), as the checker
samples a candidate's worker; shared by the tests of the sampler's records and of what it attributes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from verifier.check import host_sampler


def run_sampled(setup: str, work: str, env: dict | None = None, timeout_s: float = 120):
  """Run the Python ``setup`` in a child, attach the host sampler once it is done (to an idle process, as
  to a worker), then let the child run ``work`` to its end (it must exit 0). Returns the samples per
  module from the go to that end, and the closed sampler (its table kept, every record applied). Skips
  where the host refuses ``perf_event_open``."""
  go_r, go_w = os.pipe()
  ready_r, ready_w = os.pipe()
  code = f"import os\n{setup}\nos.write({ready_w}, b'r')\nos.read({go_r}, 1)\n{work}\n"
  child = subprocess.Popen([sys.executable, "-c", code], pass_fds=(go_r, ready_w), env=env)
  try:
    os.read(ready_r, 1)
    try:
      sampler = host_sampler.HostSampler.attach(child.pid)
    except host_sampler.SamplerUnavailable as e:
      pytest.skip(f"this host refuses perf_event_open: {e}")
    t0 = time.monotonic_ns()
    os.write(go_w, b"x")
    assert child.wait(timeout_s) == 0
    counts = sampler.count(t0, time.monotonic_ns())
    sampler.drain(final=True)
    sampler.close()
  finally:
    child.kill()
    for fd in (go_r, go_w, ready_r, ready_w):
      os.close(fd)
  return counts, sampler
