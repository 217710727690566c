"""A resumed run continues with the config it was started with, unless told otherwise.

Every checkpoint stores the run config (JSON). On resume, `check_resume` compares it with the
config of the new invocation, field by field (dotted names for nested sections). Fields that do
not change what is trained (logging, checkpoint cadence, the mesh shape) may change freely; any
other difference is refused with a `ConfigChangedError` listing each field as `old -> new`,
unless the caller allows it (`experiments.sft --allow_config_change`).
"""

from __future__ import annotations

import json
from typing import Any

from dice_jax.errors import UserError

# May differ on resume: they change how a run is logged, saved or laid out, not what it trains.
FREE_TO_CHANGE = frozenset(
  {
    "log_every",
    "run.checkpoint_every",
    "run.checkpoint_keep",
    "run.async_checkpoint",
    "run.mesh_data",
    "run.mesh_fsdp",
    "run.mesh_tensor",
    "run.mesh_slices",
    "run.init_hf",  # where the weights started: a resumed run restores its own
    "run.init_checkpoint",
  }
)
_ABSENT = "(absent)"


class ConfigChangedError(UserError):
  """A resumed run was given a config that differs from the one it was started with."""


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
  """{'optim': {'learning_rate': 1e-3}} -> {'optim.learning_rate': 1e-3} (JSON-normalised)."""
  out = {}
  for key, value in json.loads(json.dumps(config, default=str)).items():
    name = f"{prefix}{key}"
    if isinstance(value, dict) and value:
      out.update(flatten(value, name + "."))
    else:
      out[name] = value
  return out


def config_changes(saved: dict, current: dict) -> list[tuple[str, Any, Any]]:
  """(field, old, new) for every field whose value differs, sorted by field name."""
  old, new = flatten(saved), flatten(current)
  return [
    (k, old.get(k, _ABSENT), new.get(k, _ABSENT))
    for k in sorted(set(old) | set(new))
    if old.get(k, _ABSENT) != new.get(k, _ABSENT)
  ]


def _show(value: Any) -> str:
  return value if value is _ABSENT else repr(value)


def describe(changes: list[tuple[str, Any, Any]]) -> str:
  return ", ".join(f"{k} {_show(a)} -> {_show(b)}" for k, a, b in changes)


def check_resume(
  saved: dict, current: dict, *, workdir: str, step: int, allow_change: bool = False
) -> list[tuple[str, Any, Any]]:
  """The changes of `current` against the `saved` config of the run in `workdir` (at `step`).

  Raises ConfigChangedError when a field outside FREE_TO_CHANGE differs and not `allow_change`.
  """
  changes = config_changes(saved, current)
  significant = [c for c in changes if c[0] not in FREE_TO_CHANGE]
  if significant and not allow_change:
    raise ConfigChangedError(
      f"{workdir} holds a run (step {step}) started with another config: {describe(significant)}; "
      "pass --allow_config_change to continue it with the new values, or use a new --workdir"
    )
  return changes
