"""The candidate's CPU time as the kernel counts it: the CPU backend's clock for timed calls.

On a shared CPU host, wall time around a round trip through two processes is mostly waiting (run
queues, wake-ups: 0.5-2.7 ms a call on the 2-core dev VM against a 0.02 ms axpy), and the correction
for it swamped the candidate (the same candidate timed at 56x and 129,690x, issue 37). The CPU time the
kernel charges to the candidate's tasks does not count waiting. Read from outside the candidate's
process, so it cannot be forged: the job's cgroup (``cpuacct.usage`` in ns, or v2 ``cpu.stat``
``usage_usec``), counting every task of the job, threads and children included; else the threads of the
candidate's process (``/proc/<pid>/task/*/schedstat``, ns): tasks that ended between two reads and
children are missed there.
"""

from __future__ import annotations

import os


class CpuClock:
  """``ns()``: the candidate's CPU time so far, in nanoseconds."""

  def __init__(self, spec: str):
    kind, _, where = spec.partition(":")
    if kind not in ("cpuacct", "cpu.stat", "threads") or not where:
      raise ValueError(f"unknown CPU clock {spec!r}")
    self.kind, self.where = kind, where
    self.ns()  # fails here if it cannot be read

  @property
  def sees_children(self) -> bool:
    return self.kind != "threads"

  def ns(self) -> int:
    if self.kind == "cpuacct":
      with open(self.where) as f:
        return int(f.read())
    if self.kind == "cpu.stat":
      with open(self.where) as f:
        for line in f:
          key, _, value = line.partition(" ")
          if key == "usage_usec":
            return int(value) * 1000
      raise ValueError(f"{self.where} has no usage_usec")
    total = 0
    for tid in os.listdir(f"/proc/{self.where}/task"):
      try:
        with open(f"/proc/{self.where}/task/{tid}/schedstat") as f:
          total += int(f.read().split()[0])
      except (OSError, ValueError, IndexError):
        pass  # the thread ended meanwhile
    return total

  def seconds(self) -> float:
    return self.ns() * 1e-9
