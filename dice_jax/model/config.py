"""Model configuration: one frozen dataclass, named presets, HF config conversion.

The architecture is Qwen3 dense (SDAR keeps Qwen3's weights layout unchanged: JetAstra/SDAR, HF JetLM/SDAR-*-Chat).
SDAR adds two fields: `block_size` (diffusion block length) and `mask_token_id` (`<|MASK|>`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
ATTENTION_IMPLS = ("dense", "xla", "cudnn", "flash")
# What each decoder layer keeps for the backward pass (`ModelConfig.remat`; transformer.py):
#   none  everything the forward makes (no rematerialisation)
#   full  only the layer's input; the whole layer is recomputed in the backward pass
#   dots  the outputs of the weight matmuls (q/k/v/o, gate/up/down projections: dot products
#         without batch dimensions, jax.checkpoint_policies.dots_with_no_batch_dims_saveable);
#         norms, RoPE, attention and the SwiGLU product are recomputed
#   dots_attn  dots, and the flash attention kernel's output and log-sum-exp (flash_bd.OUT_NAME,
#         LSE_NAME; flash_bd and flash_tpu name both, the layer adds no second name for the
#         output): the backward pass does not run the attention forward again
#   full_attn  the layer's input and the flash kernel's output and log-sum-exp: everything but
#         the attention forward is recomputed
# (With a non-flash attention the `_attn` policies save the attention output only.)
REMAT_POLICIES = ("none", "full", "dots", "dots_attn", "full_attn")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Qwen3/SDAR transformer hyper-parameters. Validated on construction."""

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 32768
  # SDAR fields.
  block_size: int = 4
  mask_token_id: int = 151669
  bos_token_id: int | None = 151643
  eos_token_id: int | tuple[int, ...] | None = 151643
  pad_token_id: int | None = None
  # Numerics and implementation (not part of the HF config).
  dtype: str = "bfloat16"  # activation / compute dtype
  param_dtype: str = "float32"  # master parameter dtype
  # dense reference | xla | cudnn (jax.nn.dot_product_attention, GPU) | flash (the mask-aware Pallas
  # kernel of the platform: flash_bd/flash_decode on GPU, flash_tpu on TPU; model/platform.py)
  attention_impl: str = "dense"
  remat: bool | str = False  # a REMAT_POLICIES name; True = "full", False = "none"
  scan_layers: bool = True  # lax.scan over the stacked layers; False: an unrolled loop (static
  # per-layer slices instead of a dynamic slice per scan step; longer compile)
  flash_tiles: tuple[int, int, int] = (
    128,
    64,
    64,
  )  # flash kernel tiles: block_q, block_k, block_bwd
  # flash_bd: each program loops over its live tiles only (a schedule made before the launch);
  # False: over every tile, skipping the all-false ones (the earlier kernel, for comparison)
  flash_live_only: bool = True
  # TPU flash kernel tiles (flash_tpu): block_q (a multiple of 8), block_k (of 128); each the
  # largest such size <= it dividing the length. Forward and backward share them.
  flash_tpu_tiles: tuple[int, int] = (512, 512)

  def __post_init__(self):
    def need(cond, msg):
      if not cond:
        raise ValueError(f"ModelConfig: {msg}")

    for name in ("eos_token_id", "flash_tiles", "flash_tpu_tiles"):  # JSON lists; must hash
      if isinstance(getattr(self, name), list):
        object.__setattr__(self, name, tuple(getattr(self, name)))

    for name in (
      "vocab_size",
      "hidden_size",
      "intermediate_size",
      "num_layers",
      "num_heads",
      "num_kv_heads",
      "head_dim",
      "block_size",
      "max_position_embeddings",
    ):
      v = getattr(self, name)
      need(isinstance(v, int) and v > 0, f"{name} must be a positive int, got {v!r}")
    need(
      self.num_heads % self.num_kv_heads == 0,
      f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})",
    )
    need(
      0 <= self.mask_token_id < self.vocab_size,
      f"mask_token_id {self.mask_token_id} outside vocab of size {self.vocab_size}",
    )
    need(self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta}")
    need(self.dtype in _DTYPES, f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
    need(
      self.param_dtype in _DTYPES,
      f"param_dtype must be one of {sorted(_DTYPES)}, got {self.param_dtype!r}",
    )
    need(
      isinstance(self.remat, bool) or self.remat in REMAT_POLICIES,
      f"remat must be True, False or one of {REMAT_POLICIES}, got {self.remat!r}",
    )
    need(
      isinstance(self.flash_live_only, bool),
      f"flash_live_only must be True or False, got {self.flash_live_only!r}",
    )
    need(
      self.attention_impl in ATTENTION_IMPLS,
      f"attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}",
    )
    need(
      len(self.flash_tiles) == 3 and all(isinstance(t, int) and t > 0 for t in self.flash_tiles),
      f"flash_tiles must be three positive ints (block_q, block_k, block_bwd), "
      f"got {self.flash_tiles!r}",
    )
    tq, tk = (tuple(self.flash_tpu_tiles) + (0, 0))[:2]
    need(
      len(self.flash_tpu_tiles) == 2
      and all(isinstance(t, int) for t in (tq, tk))
      and tq >= 8
      and tq % 8 == 0
      and tk >= 128
      and tk % 128 == 0,
      f"flash_tpu_tiles must be (block_q, block_k): multiples of 8 and of 128, "
      f"got {self.flash_tpu_tiles!r}",
    )

  @property
  def remat_policy(self) -> str:
    """`remat` as a REMAT_POLICIES name (True -> "full", False -> "none")."""
    return remat_policy_name(self.remat)

  @property
  def compute_dtype(self):
    return _DTYPES[self.dtype]

  @property
  def weight_dtype(self):
    return _DTYPES[self.param_dtype]

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  def num_params(self) -> int:
    d, f, v, h = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
    attn = d * h * (2 * self.num_heads + 2 * self.num_kv_heads) + 2 * h
    layer = attn + 3 * d * f + 2 * d
    head = 0 if self.tie_word_embeddings else v * d
    return v * d + self.num_layers * layer + d + head


def remat_policy_name(remat: bool | str) -> str:
  """A `remat` value (bool or REMAT_POLICIES name) as a policy name; ValueError otherwise."""
  if isinstance(remat, bool):
    return "full" if remat else "none"
  if remat not in REMAT_POLICIES:
    raise ValueError(f"remat must be True, False or one of {REMAT_POLICIES}, got {remat!r}")
  return remat


# --- presets -----------------------------------------------------------------------------------

_SDAR_COMMON = dict(
  vocab_size=151936,
  head_dim=128,
  rope_theta=1_000_000.0,
  rms_norm_eps=1e-6,
  tie_word_embeddings=False,
  max_position_embeddings=32768,
  block_size=4,
  mask_token_id=151669,
  bos_token_id=151643,
  eos_token_id=151643,
)

PRESETS: dict[str, dict[str, Any]] = {
  # Small enough for CPU tests; vocab covers the mask id used by tests (255).
  "tiny": dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10_000.0,
    block_size=4,
    mask_token_id=255,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=1,
    max_position_embeddings=4096,
  ),
  # Qwen3-1.7B dimensions with untied embeddings (HF JetLM/SDAR-1.7B-Chat `config.json`).
  "sdar_1p7b": dict(
    _SDAR_COMMON,
    hidden_size=2048,
    intermediate_size=6144,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
  ),
  # HF JetLM/SDAR-4B-Chat `config.json`
  "sdar_4b": dict(
    _SDAR_COMMON,
    hidden_size=2560,
    intermediate_size=9728,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
  ),
  # HF JetLM/SDAR-8B-Chat `config.json`
  "sdar_8b": dict(
    _SDAR_COMMON,
    hidden_size=4096,
    intermediate_size=12288,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
  ),
}


def get_config(name: str, **overrides) -> ModelConfig:
  """Returns the named preset, with keyword overrides."""
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
  return ModelConfig(**{**PRESETS[name], **overrides})


# --- HF config conversion ----------------------------------------------------------------------

# HF field -> ModelConfig field.
_HF_TO_OURS = {
  "vocab_size": "vocab_size",
  "hidden_size": "hidden_size",
  "intermediate_size": "intermediate_size",
  "num_hidden_layers": "num_layers",
  "num_attention_heads": "num_heads",
  "num_key_value_heads": "num_kv_heads",
  "head_dim": "head_dim",
  "rope_theta": "rope_theta",
  "rms_norm_eps": "rms_norm_eps",
  "tie_word_embeddings": "tie_word_embeddings",
  "max_position_embeddings": "max_position_embeddings",
  "block_size": "block_size",
  "mask_token_id": "mask_token_id",
  "bos_token_id": "bos_token_id",
  "eos_token_id": "eos_token_id",
  "pad_token_id": "pad_token_id",
}
# Fields that carry no information for this architecture (bookkeeping, training-only switches of
# SDAR's PyTorch code, defaults of generic PretrainedConfig). Accepted with any value.
_HF_IGNORED = {
  "architectures",
  "auto_map",
  "model_type",
  "transformers_version",
  "torch_dtype",
  "dtype",
  "use_cache",
  "initializer_range",
  "attn_implementation",
  "_attn_implementation",
  "fuse_cross_entropy",
  "micro_forward",
  "skip_checkpoint",
  "use_deepep",
  "ep_size",
  "debug",
  "max_window_layers",
  "layer_types",
  "output_hidden_states",
  "output_attentions",
  "return_dict",
  "chunk_size_feed_forward",
  "is_encoder_decoder",
  "id2label",
  "label2id",
  "problem_type",
  "_name_or_path",
  "tokenizer_class",
  "sliding_window",
}
# Fields we accept only at the value that this architecture implements.
_HF_REQUIRED_VALUE = {
  "hidden_act": ("silu",),
  "attention_bias": (False,),
  "attention_dropout": (0.0, 0),
  "use_sliding_window": (False,),
  "rope_scaling": (None,),
}
SUPPORTED_MODEL_TYPES = ("qwen3", "sdar")


def from_hf_config(
  hf: Mapping[str, Any], *, source: str = "config.json", **overrides
) -> ModelConfig:
  """Builds a ModelConfig from an HF `config.json` dict (model_type qwen3 or sdar).

  An unknown field with a non-default value, or a known field at a value this architecture does
  not implement, raises ValueError naming the field: nothing is silently dropped.
  """
  model_type = hf.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(
      f"{source}: model_type {model_type!r} is not supported "
      f"(expected one of {SUPPORTED_MODEL_TYPES})"
    )
  kw: dict[str, Any] = {}
  problems = []
  for key, value in hf.items():
    if key in _HF_TO_OURS:
      if value is not None:
        kw[_HF_TO_OURS[key]] = value
    elif key == "rope_parameters":  # transformers >= 5 spelling of rope_theta (+ scaling)
      rp = dict(value or {})
      if rp.get("rope_type", "default") != "default":
        problems.append(f"rope_parameters.rope_type={rp.get('rope_type')!r} (only 'default')")
      if "rope_theta" in rp:
        kw["rope_theta"] = rp["rope_theta"]
    elif key in _HF_REQUIRED_VALUE:
      if value not in _HF_REQUIRED_VALUE[key]:
        problems.append(f"{key}={value!r} (supported: {_HF_REQUIRED_VALUE[key]})")
    elif key in _HF_IGNORED:
      continue
    elif value in (None, False, 0, "", [], {}):
      continue  # an unknown field at a default-like value changes nothing
    else:
      problems.append(f"unknown field {key}={value!r}")
  if problems:
    raise ValueError(f"{source}: unsupported config: " + "; ".join(problems))
  if isinstance(kw.get("eos_token_id"), list):
    kw["eos_token_id"] = tuple(kw["eos_token_id"])
  if "mask_token_id" not in kw and kw.get("vocab_size", 0) <= 151669:
    kw["mask_token_id"] = kw["vocab_size"] - 1  # plain Qwen3 with a small vocab: last id
  missing = [
    k
    for k in (
      "vocab_size",
      "hidden_size",
      "intermediate_size",
      "num_hidden_layers",
      "num_attention_heads",
      "num_key_value_heads",
    )
    if k not in hf
  ]
  if missing:
    raise ValueError(f"{source}: missing required fields {missing}")
  if "head_dim" not in kw:
    kw["head_dim"] = kw["hidden_size"] // kw["num_heads"]
  kw.update(overrides)
  try:
    return ModelConfig(**kw)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{source}: {e}") from e


def to_hf_config(cfg: ModelConfig, *, torch_dtype: str = "bfloat16") -> dict[str, Any]:
  """The `config.json` of an HF Qwen3ForCausalLM, keeping SDAR's block_size and mask_token_id."""
  eos = list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id
  return {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.hidden_size,
    "intermediate_size": cfg.intermediate_size,
    "num_hidden_layers": cfg.num_layers,
    "num_attention_heads": cfg.num_heads,
    "num_key_value_heads": cfg.num_kv_heads,
    "head_dim": cfg.head_dim,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "rms_norm_eps": cfg.rms_norm_eps,
    "rope_theta": cfg.rope_theta,
    "rope_scaling": None,
    "max_position_embeddings": cfg.max_position_embeddings,
    "tie_word_embeddings": cfg.tie_word_embeddings,
    "use_sliding_window": False,
    "sliding_window": None,
    "bos_token_id": cfg.bos_token_id,
    "eos_token_id": eos,
    "pad_token_id": cfg.pad_token_id,
    "block_size": cfg.block_size,
    "mask_token_id": cfg.mask_token_id,
    "torch_dtype": torch_dtype,
    "use_cache": True,
  }
