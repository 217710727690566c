"""Run configs: each module defines `get_config()` (an SFTConfig, or an RLConfig for `rl_*`)."""

from __future__ import annotations

import importlib
import importlib.util
import os

from dice_jax.errors import UserError

HERE = os.path.dirname(os.path.abspath(__file__))


def known(prefix: str = "") -> list[str]:
  """Names of the config modules here (those starting with `prefix`)."""
  return sorted(
    f[:-3]
    for f in os.listdir(HERE)
    if f.endswith(".py") and not f.startswith("_") and f.startswith(prefix)
  )


def load(name: str, prefix: str = ""):
  """`get_config()` of the module `name` here, or of a .py file; bad names are a UserError."""
  if name.endswith(".py"):
    if not os.path.exists(name):
      raise UserError(f"--config: no such file {name}")
    spec = importlib.util.spec_from_file_location("run_config", name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  else:
    try:
      module = importlib.import_module(f"experiments.configs.{name}")
    except ModuleNotFoundError as e:
      raise UserError(f"--config: unknown config {name!r}; known: {known(prefix)}") from e
  if not hasattr(module, "get_config"):
    raise UserError(f"--config {name}: module defines no get_config()")
  return module.get_config()
