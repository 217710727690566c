"""experiments.task_input_sizes: a task's input bytes from its `get_inputs()`, nothing allocated."""

from experiments.task_input_sizes import input_bytes

SOURCE = """
import torch

def get_inputs():
    return [torch.randn(64, 128), torch.randn(1 << 30), 3]
"""


def test_the_bytes_of_every_tensor_input_without_allocating_them():
  assert input_bytes(SOURCE) == 64 * 128 * 4 + (1 << 30) * 4  # 4 GiB: shapes only, on meta


def test_a_task_that_does_not_run_is_none():
  assert input_bytes("def get_inputs():\n    raise ValueError") is None
  assert input_bytes("x = 1") is None  # no get_inputs
