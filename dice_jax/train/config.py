"""The SFT run config: one frozen dataclass, validated on construction, with dotted overrides."""

from __future__ import annotations

import ast
import dataclasses
from typing import Any

from dice_jax.diffusion.blocks import BlockGrid
from dice_jax.diffusion.objective import ObjectiveConfig
from dice_jax.train.optimizer import OptimizerConfig
from dice_jax.train.run_config import RunConfig, nest_flat_fields

DATA_SOURCES = ("infill_pairs", "cuke", "pairs")


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """Everything an SFT run needs besides its workdir (saved with every checkpoint)."""

  recipe: str = "ours"  # a label: the launcher applies it (dice_jax/recipe.py)

  # model, tokenizer, seed, mesh, checkpoints (shared with RLConfig)
  run: RunConfig = RunConfig()
  # data
  # infill_pairs: DICE infilling file, task -> known solution; cuke: {prompt, response} rows;
  # pairs: ConCuR-style {pytorch_code, cuda_code} rows (e.g. experiments/demo_data/pairs.jsonl)
  data_source: str = "infill_pairs"
  data_path: str = ""  # json/jsonl/parquet for the source
  max_prompt_chars: int | None = None  # truncate texts (tiny CPU runs only)
  max_response_chars: int | None = None
  seq_len: int = 6144  # DICE cutoff_len; longer samples are dropped
  max_sample_len: int = 0  # drop samples longer than this (block-padded); 0: seq_len
  batch_size: int = 8  # global rows per optimizer step
  # independent data streams the batch is drawn from (batch_size % data_shards == 0); a process
  # reads only the streams its rows come from: a multiple of the host count splits data loading
  # (the batches depend on data_shards, not on the process count)
  data_shards: int = 1
  accum_steps: int = 1  # micro-batches per step (batch_size % accum_steps == 0)
  num_steps: int = 100
  # optimisation and objective (the objective's block grid is also the packing's)
  optim: OptimizerConfig = OptimizerConfig()
  objective: ObjectiveConfig = ObjectiveConfig()
  log_every: int = 1

  def __post_init__(self):
    def need(cond, msg):
      if not cond:
        raise ValueError(f"SFTConfig: {msg}")

    need(
      self.data_source in DATA_SOURCES,
      f"data_source must be one of {DATA_SOURCES}, got {self.data_source!r}",
    )
    need(isinstance(self.run, RunConfig), "run must be a RunConfig")
    need(
      not self.run.init_checkpoint,
      "run.init_checkpoint is RL's (an SFT run starts from run.init_hf or a fresh model)",
    )
    for name in (
      "seq_len",
      "batch_size",
      "data_shards",
      "accum_steps",
      "num_steps",
      "log_every",
    ):
      v = getattr(self, name)
      need(isinstance(v, int) and v >= 1, f"{name} must be a positive int, got {v!r}")
    need(
      isinstance(self.max_sample_len, int) and 0 <= self.max_sample_len <= self.seq_len,
      f"max_sample_len must be in [0, seq_len], got {self.max_sample_len!r}",
    )
    need(
      self.batch_size % self.accum_steps == 0,
      f"batch_size ({self.batch_size}) must be a multiple of accum_steps ({self.accum_steps})",
    )
    need(
      self.batch_size % self.data_shards == 0,
      f"batch_size ({self.batch_size}) must be a multiple of data_shards ({self.data_shards})",
    )
    need(isinstance(self.optim, OptimizerConfig), "optim must be an OptimizerConfig")
    need(isinstance(self.objective, ObjectiveConfig), "objective must be an ObjectiveConfig")
    from dice_jax.recipe import RECIPES

    need(self.recipe in RECIPES, f"recipe must be one of {RECIPES}, got {self.recipe!r}")
    micro = self.batch_size // self.accum_steps
    need(
      micro % self.objective.device_rows == 0,
      f"objective.device_rows ({self.objective.device_rows}) must divide the micro-batch "
      f"(batch_size / accum_steps = {micro} rows)",
    )

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d: dict) -> "SFTConfig":
    d = nest_flat_fields(d)  # configs saved before the run section
    d["optim"] = OptimizerConfig(**d.get("optim", {}))
    obj = dict(d.get("objective", {}))
    # Configs saved before the objective section (flat eps / per_block_t / block_alignment).
    for flat in ("eps", "per_block_t"):
      if flat in d:
        obj[flat] = d.pop(flat)
    if "block_alignment" in d:
      obj["grid"] = {**dict(obj.get("grid", {})), "alignment": d.pop("block_alignment")}
    obj["grid"] = BlockGrid(**dict(obj.get("grid", {})))
    d["objective"] = ObjectiveConfig(**obj)
    return cls(**d)


def _coerce(raw: str, current: Any, where: str):
  try:
    value = ast.literal_eval(raw)
  except (ValueError, SyntaxError):
    value = raw  # a bare string
  if isinstance(current, bool) and not isinstance(value, bool):
    raise ValueError(f"override {where}: expected True/False, got {raw!r}")
  if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  if (
    current is not None
    and not isinstance(value, type(current))
    and not (isinstance(current, (int, float)) and value is None)
  ):
    raise ValueError(f"override {where}: expected {type(current).__name__}, got {raw!r}")
  return value


def apply_overrides(cfg, overrides: list[str]):
  """`['optim.learning_rate=1e-4', 'model_overrides.remat=True', 'seq_len=512']` -> new config.

  A bad key or a value of the wrong type raises ValueError naming it.
  """
  for item in overrides:
    if "=" not in item:
      raise ValueError(f"override {item!r}: expected key=value")
    key, raw = item.split("=", 1)
    cfg = _set(cfg, key.strip().split("."), raw.strip(), key)
  return cfg


def recipe_then_overrides(cfg, overrides: list[str]):
  """The launchers' order: the recipe named by `--set=recipe=NAME` (the last one) applied to
  `cfg` first, then every `--set` (so an explicit field wins over its recipe default)."""
  from dice_jax.recipe import apply_recipe

  named = [o.split("=", 1)[1].strip() for o in overrides if o.split("=", 1)[0].strip() == "recipe"]
  if named:
    cfg = apply_recipe(cfg, named[-1])
  return apply_overrides(cfg, overrides)


def _set(obj, path, raw, where):
  head, rest = path[0], path[1:]
  if isinstance(obj, dict):
    if rest:
      raise ValueError(f"override {where}: cannot descend into {head!r}")
    try:
      value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
      value = raw
    return {**obj, head: value}
  fields = {f.name for f in dataclasses.fields(obj)}
  if head not in fields and isinstance(getattr(obj, "run", None), RunConfig):
    if head in {f.name for f in dataclasses.fields(RunConfig)}:
      rest_path = ".".join([head, *rest])
      raise ValueError(
        f"override {where}: {head!r} moved into the run section: use --set=run.{rest_path}=..."
      )
  if head not in fields:
    raise ValueError(
      f"override {where}: unknown field {head!r} of {type(obj).__name__} (known: {sorted(fields)})"
    )
  current = getattr(obj, head)
  if rest:
    return dataclasses.replace(obj, **{head: _set(current, rest, raw, where)})
  if dataclasses.is_dataclass(current) or isinstance(current, dict):
    raise ValueError(f"override {where}: {head!r} is a section; set one of its fields")
  return dataclasses.replace(obj, **{head: _coerce(raw, current, where)})
