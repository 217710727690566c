"""`experiments.tpu_memory_table --merge`: the rows compiled now replace those of the same model,
slice and program; the other rows and the note are kept."""

import pytest

from dice_jax.errors import UserError
from experiments import tpu_memory_markdown as table


def _row(model, where, program, peak):
  return f"| {model} | {where} | {program} | shape | **{peak}** | 1 | 2 | 16 |  |  | - | none | 9 |"


def test_merge_replaces_the_rows_compiled_now_and_keeps_the_rest():
  old = [_row("m", "v5e-8 `v5e:2x4` (8)", p, "1.00") for p in ("sft", "rl", "decode")]
  block = f"\nCompiled once.\n\n{table.HEADER}\n" + "\n".join(old) + "\n"
  new_rl = _row("m", "v5e-8 `v5e:2x4` (8)", "rl", "2.00")
  other = _row("n", "v5p-8 `v5p:2x2x1` (4)", "rl", "3.00")
  out = table.merge_block(block, [new_rl, other], "Rows recompiled.")
  text = table.replace_block(f"a\n{table.BEGIN}{block}{table.END}\nb", out)
  assert "Compiled once. Rows recompiled." in text
  rows = [line for line in text.splitlines() if line.startswith(("| m |", "| n |"))]
  assert rows == [old[0], new_rl, old[2], other]
  with pytest.raises(UserError, match="no table"):
    table.merge_block("just a note", [new_rl], "x")
