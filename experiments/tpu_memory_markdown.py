"""docs/tpu.md's memory table as text: its markers, header and the merge of recompiled rows
(`experiments.tpu_memory_table` writes it). No flags here, so tests import it beside other
launchers."""

from dice_jax.errors import UserError

BEGIN, END = "<!-- tpu-memory-table -->", "<!-- /tpu-memory-table -->"
HEADER = (
  "| model | slice (chips) | program | shape | compiled peak | arguments | temporaries | HBM "
  "| estimate | est./peak | attention | [T, S] scores | compile CPU s |\n"
  "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|"
)


def replace_block(text: str, table: str) -> str:
  """`text` with the lines between the markers replaced by `table`."""
  if BEGIN not in text or END not in text:
    raise UserError(f"--out has no {BEGIN} ... {END} block to replace")
  head, rest = text.split(BEGIN, 1)
  _, tail = rest.split(END, 1)
  return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def row_key(line: str) -> tuple:
  """(model, slice, program) of a table line."""
  return tuple(c.strip() for c in line.strip().strip("|").split("|")[:3])


def merge_block(block: str, lines: list[str], note: str) -> str:
  """The marked `block` (a note, the header, rows) with `lines` replacing the rows of the same
  model, slice and program (the others kept, new ones appended) and `note` added to its note."""
  if HEADER not in block:
    raise UserError("--merge: the marked block holds no table with this command's header")
  old_note, rows = block.split(HEADER, 1)
  new = {row_key(line): line for line in lines}
  kept = []
  for line in rows.strip().splitlines():
    kept.append(new.pop(row_key(line), line))
  return f"{old_note.strip()} {note}\n\n{HEADER}\n" + "\n".join(kept + list(new.values()))


def block_of(text: str) -> str:
  """What stands between the markers of `text`."""
  return text.split(BEGIN, 1)[1].split(END, 1)[0]
