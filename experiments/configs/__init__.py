"""Run configs: each module defines `get_config()` (an SFTConfig, or an RLConfig for `rl_*`)."""

from __future__ import annotations

import importlib
import importlib.util
import os

from dice_jax.errors import UserError

HERE = os.path.dirname(os.path.abspath(__file__))
# What each launcher takes: the config class's name and how its modules are named here.
KINDS = {"sft": ("SFTConfig", "experiments.sft"), "rl": ("RLConfig", "experiments.rl")}


def _kind_of_module(name: str) -> str:
  return "rl" if name.startswith("rl_") else "sft"


def known(kind: str | None = None) -> list[str]:
  """Names of the config modules here (those of `kind`, "sft" or "rl", if given)."""
  return sorted(
    f[:-3]
    for f in os.listdir(HERE)
    if f.endswith(".py")
    and not f.startswith("_")
    and (kind is None or _kind_of_module(f[:-3]) == kind)
  )


def load(name: str, kind: str | None = None):
  """`get_config()` of the module `name` here, or of a .py file. Bad names, and (with `kind`, "sft"
  or "rl") a config of the other kind, are a UserError naming the configs `kind` takes."""
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
      if e.name and not f"experiments.configs.{name}".startswith(e.name):
        raise  # the config module exists and imports something missing: a bug, not a typo
      raise UserError(f"--config: unknown config {name!r}; known: {known(kind)}") from e
  if not hasattr(module, "get_config"):
    raise UserError(f"--config {name}: module defines no get_config()")
  cfg = module.get_config()
  if kind is not None:
    _check_kind(name, cfg, kind)
  return cfg


def _check_kind(name: str, cfg, kind: str) -> None:
  want, launcher = KINDS[kind]
  got = type(cfg).__name__
  if got == want:
    return
  other = next((k for k, (cls, _) in KINDS.items() if cls == got), None)
  what = (
    f"is an {other.upper()} config (for `python -m {KINDS[other][1]}`)"
    if other
    else f"defines get_config() -> {got}, not {want}"
  )
  raise UserError(f"--config {name} {what}; {launcher} takes one of {known(kind)}")
