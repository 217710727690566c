r"""How many bytes of tensor inputs each task's `get_inputs()` makes, without allocating them (torch's
meta device): the sizes the verifier's small-task host-compute bounds are set for
(verifier/check/device_evidence.py, docs/verifier-security.md).

  python -m experiments.task_input_sizes [--file ../shared/data/dice_rl/end_to_end_kernel_generation_4000.json]

Prints the tasks under 4 KiB, 16 KiB, 64 KiB, 256 KiB and 1 MiB, and the median.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics

DEFAULT = "../shared/data/dice_rl/end_to_end_kernel_generation_4000.json"
LIMITS_KIB = (4, 16, 64, 256, 1024)


def input_bytes(source: str, timeout_s: int = 2) -> int | None:
  """Bytes of the tensors `get_inputs()` of a reference `source` returns (on the meta device: shapes
  only); None where the source does not run within `timeout_s`."""
  import torch

  def stop(*_):
    raise TimeoutError

  scope = {"__name__": "reference"}
  old = signal.signal(signal.SIGALRM, stop)
  signal.alarm(timeout_s)
  try:
    with torch.device("meta"):
      exec(compile(source, "reference", "exec"), scope)
      inputs = scope["get_inputs"]()
    return sum(t.numel() * t.element_size() for t in inputs if torch.is_tensor(t))
  except BaseException:  # noqa: BLE001 - a task that does not run is counted apart
    return None
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--file", default=DEFAULT, help="a JSON list of tasks with `pytorch_code`")
  a = p.parse_args()
  with open(a.file) as f:
    tasks = json.load(f)
  sizes = [input_bytes(t["pytorch_code"]) for t in tasks]
  ok = [n for n in sizes if n is not None]
  print(f"{len(tasks)} tasks, {len(ok)} sized; median {statistics.median(ok) / 1024:.1f} KiB")
  for kib in LIMITS_KIB:
    print(f"  under {kib} KiB: {sum(n < kib << 10 for n in ok)}")


if __name__ == "__main__":
  main()
