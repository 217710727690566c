"""One rule for resuming an SFT or RL run with the config of a new invocation.

Every checkpoint stores the run config (JSON). On resume, `check_resume` compares it with the new
one field by field (dotted names for nested sections) and sorts each difference into one of three
kinds:
  safe      changes how long the run goes, how it is logged, saved, evaluated, laid out on the
            devices or how the verifier is reached, not what a step trains (`SAFE`): accepted
            (the launchers log them). The number of steps may grow or shrink, not below the steps
            already done.
  fixed     cannot change at all (`FIXED`, each with its reason): the saved state depends on it
            (the model's shapes, the data order and the stream position, the seed). Refused with
            the reason, even with `--allow_config_change`: continuing would crash or silently
            train on other data.
  other     changes what is trained (learning rate, data, objective, sampler, ...): refused,
            naming each field `old -> new`, unless the caller allows it (`--allow_config_change`
            of `experiments.sft` and `experiments.rl`).
`check_run` applies the rule to a run directory (its newest intact checkpoint's config); both
loops call it before they build or write anything (RL: before it waits for the verifier).
"""

from __future__ import annotations

import json
from typing import Any, Callable

from absl import logging

from dice_jax.errors import UserError
from dice_jax.train import checkpoint as ckpt_lib

# May differ on resume (SFT and RL field names; a name only one config has never matches the other).
SAFE = frozenset(
  {
    "num_steps",  # SFT; RL's is stream.num_steps (both: not below the steps done)
    "stream.num_steps",
    "log_every",
    "samples_per_step",
    "eval_every",
    "eval_tasks",
    "snapshot_every",
    "run.checkpoint_every",
    "run.checkpoint_keep",
    "run.async_checkpoint",
    "run.mesh_data",
    "run.mesh_fsdp",
    "run.mesh_tensor",
    "run.mesh_slices",
    "run.shard_tolerance",
    "run.init_hf",  # where the weights started: a resumed run restores its own
    "run.init_checkpoint",
    "memory_limit_gb",  # the update's micro-batching, chosen by memory
    "prompt_width_multiple",  # RL: how sampler programs are shared, as the mesh (rounding only)
    "verifier.ready_timeout_s",
    "verifier.local_device",
    "verifier.local_compile_workers",
  }
)
SAFE_PREFIXES = ("verifier.retry.",)
STEP_FIELDS = ("num_steps", "stream.num_steps")

_STREAM = "the saved RL-stream position counts samples of this layout"
_SHAPE = "the checkpoint holds parameters of the saved shapes"
FIXED = {
  "run.seed": "the seed fixes the data order and the random keys of every step",
  "run.model": _SHAPE,
  "stream.group_size": _STREAM,
  "stream.tasks_per_step": _STREAM,
  "stream.seed": "it fixes the order of the tasks",
  "stream.process_count": _STREAM,
  "schedule": "it fixes the order of the tasks",
  "data_shards": "the saved data position holds one state per data shard",
}
SHAPE_FIELDS = frozenset(
  {
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "tie_word_embeddings",
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


def is_safe(field: str) -> bool:
  return field in SAFE or field.startswith(SAFE_PREFIXES)


def why_fixed(field: str, old: Any, new: Any, step: int) -> str | None:
  """Why `field` cannot change from `old` to `new` on a resume at `step`, or None when it can."""
  if field in STEP_FIELDS:
    if isinstance(new, int) and new < step:
      return f"the run has done {step} steps already"
    return None
  if field in FIXED:
    return FIXED[field]
  if field.startswith("run.model_overrides."):
    if field.removeprefix("run.model_overrides.") in SHAPE_FIELDS:
      return _SHAPE
  return None


def check_resume(
  saved: dict, current: dict, *, workdir: str, step: int, allow_change: bool = False
) -> list[tuple[str, Any, Any]]:
  """The changes of `current` against the `saved` config of the run in `workdir` (at `step`).

  Raises ConfigChangedError naming each field when a fixed field differs (always), or when
  another field outside `SAFE` differs and not `allow_change` (module docstring).
  """
  changes = config_changes(saved, current)
  fixed = [(c, why_fixed(*c, step)) for c in changes]
  fixed = [(c, why) for c, why in fixed if why]
  others = [c for c in changes if not is_safe(c[0]) and c[0] not in {f[0][0] for f in fixed}]
  if fixed:
    listed = "; ".join(f"{describe([c])} ({why})" for c, why in fixed)
    also = f"; also changed: {describe(others)}" if others else ""
    raise ConfigChangedError(
      f"{workdir} holds a run (step {step}) whose config cannot change in these fields, even "
      f"with --allow_config_change: {listed}{also}; use a new --workdir"
    )
  if others and not allow_change:
    raise ConfigChangedError(
      f"{workdir} holds a run (step {step}) started with another config: {describe(others)}; "
      "pass --allow_config_change to continue it with the new values, or use a new --workdir"
    )
  return changes


def check_run(
  workdir: str,
  current: dict,
  *,
  allow_change: bool = False,
  in_current_layout: Callable[[dict], dict] = lambda saved: saved,
) -> int | None:
  """`check_resume` of `current` against the config of the newest intact checkpoint in `workdir`
  (read as today's code reads it: `in_current_layout`); logs the accepted changes. The step the run
  resumes from, or None for a new run. Reads files only (no arrays); raises
  `checkpoint.DamagedCheckpointError` when every saved step is damaged."""
  saved = ckpt_lib.newest_saved_config(workdir)
  if saved is None:
    return None
  step, config = saved
  changes = check_resume(
    in_current_layout(config), current, workdir=workdir, step=step, allow_change=allow_change
  )
  if changes:
    logging.warning("resuming step %d with config changes: %s", step, describe(changes))
  return step
