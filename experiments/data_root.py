"""Where the project's data lives (the SDAR tokenizer, DICE's task files, KernelBench, ...).

One setting: the `--data_root` flag of a launcher, else the `DICE_DATA_ROOT` environment
variable, else `../shared/data` next to the repository (dev and CI checkouts have it there).
Configs and launcher defaults name their files with `data_path(...)`, resolved when called.
"""

from __future__ import annotations

import os
import pathlib

ENV = "DICE_DATA_ROOT"
REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT = REPO.parent / "shared" / "data"
FLAG = "data_root"


def define_flag() -> None:
  """Defines `--data_root` (the launchers' shared flag; once per process)."""
  from absl import flags

  if FLAG not in flags.FLAGS:
    flags.DEFINE_string(FLAG, None, f"data directory (default: ${ENV}, else {DEFAULT})")


def data_root() -> pathlib.Path:
  """`--data_root` when given, else `$DICE_DATA_ROOT`, else the repo's sibling `shared/data`."""
  return pathlib.Path(_flag_value() or os.environ.get(ENV) or DEFAULT)


def data_path(*parts: str) -> str:
  """A path under the data root, e.g. `data_path("dice_rl", "kernelbench_level1.json")`."""
  return str(data_root().joinpath(*parts))


def _flag_value() -> str | None:
  from absl import flags

  if FLAG in flags.FLAGS and flags.FLAGS.is_parsed():
    return flags.FLAGS[FLAG].value
  return None
