"""The run section both SFT and RL configs nest (`cfg.run`): model, tokenizer, seed, mesh and
checkpointing; `run_setup.py` builds the mesh, model, tokenizer and checkpointer from it."""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """What a training run is made of and how it is laid out and saved, whatever it trains."""

  # model: a preset of dice_jax.model.config (ignored with --init_hf / an RL --init_checkpoint)
  model: str = "tiny"
  model_overrides: dict = dataclasses.field(default_factory=dict)  # e.g. {'remat': True}
  tokenizer: str = "byte"  # 'byte' (256 bytes + 4 specials; tiny models) or an HF tokenizer dir
  # where the weights start (launcher flags --init_hf / --init_checkpoint; ignored on resume)
  init_hf: str = ""  # an HF checkpoint directory (its config replaces the preset)
  init_checkpoint: str = ""  # an SFT or RL run directory (RL only: its latest checkpoint)
  seed: int = 0
  # mesh (-1 fills)
  mesh_data: int = 1
  mesh_fsdp: int = -1
  mesh_tensor: int = 1
  # slices of a multi-slice pod (DCN between them): the data axis crosses them, its outer factor
  # mesh_slices; fsdp, tensor and data / mesh_slices stay inside a slice (sharding.make_mesh)
  mesh_slices: int = 1
  shard_tolerance: float = 0.02  # max fraction of unsharded params on a multi-device mesh
  # checkpoints (steps: SFT steps or RL steps)
  checkpoint_every: int = 100
  checkpoint_keep: int = 3
  async_checkpoint: bool = True

  def __post_init__(self):
    def need(cond, msg):
      if not cond:
        raise ValueError(f"RunConfig: {msg}")

    need(isinstance(self.model_overrides, dict), "run.model_overrides must be a dict")
    need(isinstance(self.seed, int), f"run.seed must be an int, got {self.seed!r}")
    for name in ("checkpoint_every", "checkpoint_keep"):
      v = getattr(self, name)
      need(isinstance(v, int) and v >= 1, f"run.{name} must be a positive int, got {v!r}")
    for name in ("mesh_data", "mesh_fsdp", "mesh_tensor"):
      v = getattr(self, name)
      need(isinstance(v, int) and (v >= 1 or v == -1), f"run.{name} must be >= 1 or -1, got {v!r}")
    need(
      isinstance(self.mesh_slices, int) and self.mesh_slices >= 1,
      f"run.mesh_slices must be a positive int, got {self.mesh_slices!r}",
    )
    need(
      self.mesh_slices == 1 or (self.mesh_data != -1 and self.mesh_data % self.mesh_slices == 0),
      f"run.mesh_data ({self.mesh_data}) must be a multiple of run.mesh_slices "
      f"({self.mesh_slices}): data is the axis that crosses slices",
    )
    need(isinstance(self.async_checkpoint, bool), "run.async_checkpoint must be True or False")
    need(
      not (self.init_hf and self.init_checkpoint),
      "set at most one of run.init_hf and run.init_checkpoint (--init_hf, --init_checkpoint)",
    )

  def tokenizer_dir(self, workdir: str, inherited: str | None = None) -> str:
    """Where the run's tokenizer files are: `workdir/tokenizer` for 'byte' or one inherited from
    an init run, else `tokenizer`."""
    if inherited or self.tokenizer == "byte":
      return os.path.join(workdir, "tokenizer")
    return self.tokenizer


FIELDS = tuple(f.name for f in dataclasses.fields(RunConfig))


def nest_flat_fields(d: dict) -> dict:
  """A saved config dict from before the run section (flat `model`, `seed`, `mesh_*`, ...) with
  those fields moved into `run`; `run` itself as a RunConfig."""
  d = dict(d)
  run = dict(d.get("run", {}))
  for name in FIELDS:
    if name in d:
      run[name] = d.pop(name)
  d["run"] = RunConfig(**run)
  return d
