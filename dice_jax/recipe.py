"""`recipe=dice | ours`: the defaults of every field where DICE's recipe and ours differ.

Each row is one item of docs/dice_recipe.md: a dotted config field and its value under each
recipe. `apply_recipe(cfg, name)` sets them all (and `cfg.recipe`); the launchers apply the recipe
named by `--set=recipe=NAME` (or the config's own) *before* the other `--set` overrides, so an
explicit `--set` of any of these fields wins (e.g. DICE's recipe with our strict reward:
`--set=recipe=dice --set=verifier.options.strictness=strict`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

RECIPES = ("ours", "dice")

# DICE's RL runs 8 processes x batch 1 x GAS 32 = 256 rows per optimizer step; its loss is divided
# by GAS by hand and again by DeepSpeed, so 1/32 of the mean gradient reaches the clip at 1.0.
DICE_RL_GAS = 32
DICE_VERIFY_OPTIONS = {"num_correct_trials": 1, "strictness": "off", "seed": 42, "timeout_s": 300.0}

# field -> (ours, dice); the comment is the item of docs/dice_recipe.md
RL_FIELDS: dict[str, tuple[Any, Any]] = {
  "tracerl.batch_units": ("rows", "rounds"),  # 1: rows_per_update counts (response, round) rows
  "shuffle": (True, False),  # 1: DICE's rows in file order
  "reset_optimizer": (False, True),  # 2: a new AdamW every RL step
  "optim.grad_scale": (1.0, 1.0 / DICE_RL_GAS),  # 3: 1/GAS^2 per row, then clip at 1.0
  "optim.clip_norm": (1.0, 1.0),  # 3
  "tail_rows": ("apply", "even_batches"),  # 3: accelerate's even_batches, DeepSpeed's boundaries
  "stop_tokens": ("chat", "im_end"),  # 4: DICE stops at its SFT tokenizer's eos, <|im_end|>
  "train_pad_tokens": (True, False),  # 4: DICE never trains a pad (<|endoftext|>) token
  "verifier.options": ({"num_correct_trials": 1}, DICE_VERIFY_OPTIONS),  # 5
  "eval_every": (0, 10),  # 7: DICE evaluates every 10 RL steps
  "snapshot_every": (0, 10),  # 8: DICE's save_every permanent snapshots
}
SFT_FIELDS: dict[str, tuple[Any, Any]] = {
  "objective.grid.alignment": ("response", "absolute"),  # 10: SDAR's block = index // 4
  "objective.at_least_one": ("segment", "row"),  # 11: redraw the row, then force one
  "objective.normalization": ("batch", "device"),  # 12: per device micro-batch, then mean
}


def fields_for(cfg) -> dict[str, tuple[Any, Any]]:
  name = type(cfg).__name__
  if name == "RLConfig":
    return RL_FIELDS
  if name == "SFTConfig":
    return SFT_FIELDS
  raise TypeError(f"no recipe fields for a {name}")


def _replace(obj, path: list[str], value):
  head, rest = path[0], path[1:]
  if rest:
    value = _replace(getattr(obj, head), rest, value)
  elif isinstance(value, dict):
    value = dict(value)
  return dataclasses.replace(obj, **{head: value})


def apply_recipe(cfg, name: str):
  """`cfg` with every recipe field (`RL_FIELDS` / `SFT_FIELDS`) set to recipe `name`'s value."""
  if name not in RECIPES:
    raise ValueError(f"recipe must be one of {RECIPES}, got {name!r}")
  which = RECIPES.index(name)
  for key, values in fields_for(cfg).items():
    cfg = _replace(cfg, key.split("."), values[which])
  return dataclasses.replace(cfg, recipe=name)
