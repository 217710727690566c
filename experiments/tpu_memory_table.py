r"""docs/tpu.md's memory table, from the TPU compiler: every program compiled for each slice.

  python -m experiments.tpu_memory_table --out=docs/tpu.md     # rewrites the marked table
  python -m experiments.tpu_memory_table --targets=sdar_1p7b@v5e-8 --programs=sft,decode

Needs libtpu (`pip install -e '.[tpu-compile]'`); runs on a CPU host. For each target
(`MODEL@SLICE`) the SFT step, the TraceRL update and the sampler's prefill and decode step
(`dice_jax.tpu_memory`) at the recipe's settings (the flags) are compiled ahead of time for the
slice's topology (`jax.experimental.topologies`), parameters and optimizer state over every chip.
One row per program: the compiler's peak per chip, its arguments and temporaries, the chip's HBM,
the project's own estimate (RL planner, sampler check) and its ratio to the compiled peak, the
Pallas kernels, and whether the HLO holds a `[T, S]` attention score tensor. A program the compiler
refuses is a row with its message. With --out, the table replaces the lines between
`<!-- tpu-memory-table -->` and `<!-- /tpu-memory-table -->` of that file; with --merge too, only
the rows compiled now (same model, slice and program) are replaced, the others kept, and the
command is added to the table's note:

  python -m experiments.tpu_memory_table --out=docs/tpu.md --merge --targets=sdar_8b@v5p-8:rl
"""

import os
import sys

if "jax" not in sys.modules:  # compile-only: no TPU, libtpu's per-process lock is not needed
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import datetime  # noqa: E402

import jax  # noqa: E402
from absl import flags  # noqa: E402

from dice_jax import tpu_memory, tpu_topology  # noqa: E402
from dice_jax.errors import UserError  # noqa: E402
from experiments import _cli  # noqa: E402
from experiments.tpu_memory_markdown import (  # noqa: E402
  HEADER,
  block_of,
  merge_block,
  replace_block,
  row_key,
)

FLAGS = flags.FLAGS
TARGETS = [
  "sdar_1p7b@v5e-8",
  "sdar_1p7b@v5p-8",
  "sdar_8b@v5p-8",
  "sdar_8b@v5p-16",
  "sdar_1p7b@v5p-chip:prefill+decode",
]
flags.DEFINE_list(
  "targets",
  TARGETS,
  "MODEL@SLICE[:PROGRAM+PROGRAM] (slices: v5e-8, v5p-8, v5p-16, v5p-chip; default programs: "
  "--programs).",
)
flags.DEFINE_list("programs", list(tpu_memory.PROGRAMS), "Programs: sft, rl, prefill, decode.")
flags.DEFINE_integer("rows_per_chip", 1, "SFT and RL rows per chip.")
flags.DEFINE_integer("sft_seq_len", 4096, "SFT tokens per row (the 2L input is twice that).")
flags.DEFINE_integer("rl_row_len", 24576, "TraceRL row length.")
flags.DEFINE_integer("slots", 64, "Sampler slots.")
flags.DEFINE_integer("prompt_width", 2048, "Sampler prompt width.")
flags.DEFINE_integer("max_new_tokens", 4096, "Sampler budget.")
flags.DEFINE_integer("prefill_rows", 16, "Prompts per prefill call.")
flags.DEFINE_string("out", None, "Write the table between the markers of this file.")
flags.DEFINE_bool(
  "merge", False, "With --out: replace only the rows compiled now, keep the others and the note."
)
flags.DEFINE_integer(
  "jobs", 1, "Programs compiled at once, each in its own process (~2-4 GB of memory each)."
)


def _g(x) -> str:
  return "" if x is None else f"{x / tpu_topology.GIB:.2f}"


def markdown_row(row: tpu_memory.Row) -> str:
  s = row.slice
  where = s.describe()
  m = row.memory
  if m is None:
    cells = [f"**{row.refusal}**", "", ""]
    ratio = ""
  else:
    cells = [f"**{_g(m.peak)}**", _g(m.arguments), _g(m.temps)]
    ratio = "" if row.estimate is None else f"{row.estimate / m.peak:.2f}"
  kernels = ", ".join(f"{k} x{v}" for k, v in row.kernels.items()) or "-"
  scores = ", ".join(row.scores) or "none"
  return (
    f"| {row.model} | {where} | {row.program} | {row.shape} | {' | '.join(cells)} | "
    f"{s.hbm_gib:.2f} | {_g(row.estimate)} | {ratio} | {kernels} | {scores} | "
    f"{row.compile_cpu_s:.0f} |"
  )


def _parse_targets(targets, default_programs):
  """[(model, slice, program)] of `MODEL@SLICE[:PROGRAM+PROGRAM]` items."""
  out = []
  for t in targets:
    model, _, rest = t.partition("@")
    slice_, _, progs = rest.partition(":")
    progs = progs.split("+") if progs else list(default_programs)
    if slice_ not in tpu_topology.SLICES:
      raise UserError(
        f"--targets {t!r}: want MODEL@SLICE with a slice of {sorted(tpu_topology.SLICES)}"
      )
    bad = set(progs) - set(tpu_memory.PROGRAMS)
    if bad:
      raise UserError(f"--targets {t!r}: unknown programs {sorted(bad)}")
    out += [(model, slice_, p) for p in progs]
  return out


def main(argv):
  del argv
  reason = tpu_topology.libtpu_missing()
  if reason:
    raise UserError(reason)
  bad = set(FLAGS.programs) - set(tpu_memory.PROGRAMS)
  if bad:
    raise UserError(f"--programs: unknown {sorted(bad)}; known: {list(tpu_memory.PROGRAMS)}")
  targets = _parse_targets(FLAGS.targets, FLAGS.programs)
  if FLAGS.merge and not FLAGS.out:
    raise UserError("--merge needs --out")
  if FLAGS.out:  # before half an hour of compiling
    with open(FLAGS.out) as f:
      text = f.read()
    replace_block(text, "")
    if FLAGS.merge:
      merge_block(block_of(text), [], "")
  recipe = tpu_memory.Recipe(
    rows_per_chip=FLAGS.rows_per_chip,
    sft_seq_len=FLAGS.sft_seq_len,
    rl_row_len=FLAGS.rl_row_len,
    slots=FLAGS.slots,
    prompt_width=FLAGS.prompt_width,
    max_new_tokens=FLAGS.max_new_tokens,
    prefill_rows=FLAGS.prefill_rows,
  )
  print(HEADER, flush=True)
  work = [(m, s, p, recipe) for m, s, p in targets]
  lines = [markdown_row(row) for row in _compile_all(work, FLAGS.jobs)]
  command = f"`python -m experiments.tpu_memory_table {' '.join(sys.argv[1:])}`"
  when = f"{datetime.date.today().isoformat()} with jax {jax.__version__} and libtpu "
  when += _libtpu_version()
  if FLAGS.merge:
    note = (
      f"Rows recompiled {when} by {command}: "
      + "; ".join(" ".join(row_key(line)) for line in lines)
      + "."
    )
  else:
    note = f"Compiled {when} by {command}; GiB per chip."
  table = f"{note}\n\n{HEADER}\n" + "\n".join(lines)
  if FLAGS.out:
    with open(FLAGS.out) as f:
      text = f.read()
    if FLAGS.merge:
      table = merge_block(block_of(text), lines, note)
    new = replace_block(text, table)
    tmp = FLAGS.out + ".tmp"
    with open(tmp, "w") as f:
      f.write(new)
    os.replace(tmp, FLAGS.out)
    print(f"wrote the table into {FLAGS.out}")


def _compile_all(work, jobs: int):
  """Rows of `work` ((model, slice, program, recipe) each) in order, printed as they come."""
  if jobs <= 1:
    rows = (tpu_memory.compile_one(*w) for w in work)
  else:
    import concurrent.futures
    import multiprocessing

    pool = concurrent.futures.ProcessPoolExecutor(
      jobs, mp_context=multiprocessing.get_context("spawn")
    )
    rows = pool.map(tpu_memory.compile_one, *zip(*work))
  out = []
  for row in rows:
    out.append(row)
    print(markdown_row(row), flush=True)
  return out


def _libtpu_version() -> str:
  from importlib import metadata

  try:
    return metadata.version("libtpu")
  except metadata.PackageNotFoundError:
    return "(unknown)"


if __name__ == "__main__":
  _cli.run(main)
