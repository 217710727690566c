"""What the TPU compile tests share (`test_tpu_compile.py`, `test_tpu_compile_8b.py`): the recipe,
the training kernels' names, a program compiled for a slice, and the checks every program gets."""

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
