"""Optax optimizer and learning-rate schedules (DICE SFT: AdamW, lr 1e-5, constant with 3% warm-up)."""

from __future__ import annotations

import dataclasses
import math

import jax
import optax

SCHEDULES = ("constant_with_warmup", "cosine", "linear", "constant")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW + global-norm clipping. Defaults follow DICE's LlamaFactory SFT yaml (DICE `training/sft/llama_factory_sdar/examples/train_full_sdar/sdar_*_full.yaml`) and the HF
  Trainer defaults it inherits (betas 0.9/0.999, eps 1e-8, weight decay 0, max_grad_norm 1)."""

  learning_rate: float = 1e-5
  schedule: str = "constant_with_warmup"
  warmup_ratio: float = 0.03  # of the total steps; HF: warmup = ceil(ratio * total)
  warmup_steps: int | None = None  # overrides warmup_ratio when set
  end_lr_ratio: float = 0.0  # final lr / peak lr for cosine and linear decay
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  weight_decay: float = 0.0
  clip_norm: float | None = 1.0  # None: no clipping
  # The gradient is multiplied by this before clipping and Adam. DICE's RL (DeepSpeed) divides
  # the loss by GAS by hand and again in `engine.backward`: 1/GAS = 1/32 of the mean gradient
  # reaches its clip at 1.0 (docs/dice_recipe.md, item 3).
  grad_scale: float = 1.0

  def __post_init__(self):
    if self.schedule not in SCHEDULES:
      raise ValueError(
        f"OptimizerConfig.schedule must be one of {SCHEDULES}, got {self.schedule!r}"
      )
    if not self.learning_rate > 0:
      raise ValueError(f"OptimizerConfig.learning_rate must be > 0, got {self.learning_rate}")
    if not 0.0 <= self.warmup_ratio < 1.0:
      raise ValueError(f"OptimizerConfig.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
    if self.warmup_steps is not None and self.warmup_steps < 0:
      raise ValueError(f"OptimizerConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
    if not self.grad_scale > 0:
      raise ValueError(f"OptimizerConfig.grad_scale must be > 0, got {self.grad_scale}")
    if self.clip_norm is not None and not self.clip_norm > 0:
      raise ValueError(f"OptimizerConfig.clip_norm must be > 0 or None, got {self.clip_norm}")


def warmup_steps(cfg: OptimizerConfig, total_steps: int) -> int:
  if cfg.warmup_steps is not None:
    return cfg.warmup_steps
  return math.ceil(cfg.warmup_ratio * total_steps)


def make_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
  """lr(step) for update number `step` (0-based), matching HF's schedulers."""
  if total_steps < 1:
    raise ValueError(f"total_steps must be >= 1, got {total_steps}")
  peak, warm = cfg.learning_rate, warmup_steps(cfg, total_steps)
  warm_fn = lambda s: peak * s / max(1, warm)  # noqa: E731  HF: step / max(1, warmup)
  if cfg.schedule == "constant":
    return optax.constant_schedule(peak)
  if cfg.schedule == "constant_with_warmup":
    return lambda s: jax.numpy.where(s < warm, warm_fn(s), peak)
  decay = max(1, total_steps - warm)
  end = peak * cfg.end_lr_ratio
  if cfg.schedule == "cosine":
    after = optax.cosine_decay_schedule(peak - end, decay)
    return lambda s: jax.numpy.where(s < warm, warm_fn(s), end + after(s - warm))
  after = optax.linear_schedule(peak, end, decay)
  return lambda s: jax.numpy.where(s < warm, warm_fn(s), after(s - warm))


def _decay_mask(params):
  """Weight decay on matrices only (HF excludes norms and biases)."""

  def keep(path, _):
    return not any("norm" in str(getattr(k, "key", k)) for k in path)

  return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
  sched = make_schedule(cfg, total_steps)
  parts = []
  if cfg.grad_scale != 1.0:
    parts.append(optax.scale(cfg.grad_scale))
  if cfg.clip_norm is not None:
    parts.append(optax.clip_by_global_norm(cfg.clip_norm))
  parts.append(
    optax.adamw(
      sched, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=_decay_mask
    )
  )
  return optax.chain(*parts)
