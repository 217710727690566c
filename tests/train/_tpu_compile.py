"""What the TPU compile tests share (`test_tpu_compile.py`, `test_tpu_compile_8b.py`): the recipe,
the training kernels' names, a program compiled for a slice, and the checks every program gets."""

import pytest

from dice_jax import tpu_memory

RECIPE = tpu_memory.Recipe()
# the mask-aware kernel's forward and its two backward kernels (counts vary with the compiler's
# loop peeling), nothing else
FLASH_TRAIN = {"bd_flash_tpu_dkv", "bd_flash_tpu_dq", "bd_flash_tpu_fwd"}


def compiled_row(model: str, slice_name: str, program: str, recipe=RECIPE):
  """The `tpu_memory.Row` of one program compiled for the slice (a minute of CPU or so)."""
  (row,) = tpu_memory.compile_rows(model, slice_name, recipe, (program,))
  return row


def assert_compiled_within_hbm(row):
  """Compiled, within the chip's HBM, and no dense `[T, S]` attention scores in its HLO."""
  assert row.memory is not None, f"{row.model} {row.program} on {row.slice.name}: {row.refusal}"
  assert 0 < row.memory.gib() <= row.slice.hbm_gib, (row.memory, row.slice)
  assert not row.scores, f"dense attention scores in the compiled HLO: {row.scores}"


def assert_sft_row(row, chips: int):
  """An SFT step: within HBM, the three training kernels only, and fp32 parameters and AdamW
  moments split over the `chips` and donated (in and out are one buffer)."""
  assert_compiled_within_hbm(row)
  assert set(row.kernels) == FLASH_TRAIN
  params = tpu_memory.model_config(row.model).num_params()
  assert row.memory.arguments == pytest.approx(3 * 4 * params / chips, rel=0.02)
  assert row.memory.aliased == pytest.approx(row.memory.arguments, rel=0.01)


def assert_rl_row(row):
  """An RL update: within HBM, the three training kernels only, and the RL planner's estimate
  above the compiled peak by under 15 % (issue 38, item 3)."""
  assert_compiled_within_hbm(row)
  assert set(row.kernels) == FLASH_TRAIN
  assert row.memory.peak <= row.estimate <= 1.15 * row.memory.peak
