"""Model: config presets, the Flax NNX Qwen3/SDAR transformer, attention masks, KV cache."""

from dice_jax.model.config import PRESETS, ModelConfig, from_hf_config, get_config, to_hf_config
from dice_jax.model.kv_cache import KVCache
from dice_jax.model.masks import AttentionSpec
from dice_jax.model.transformer import Transformer

__all__ = [
  "AttentionSpec",
  "KVCache",
  "ModelConfig",
  "PRESETS",
  "Transformer",
  "from_hf_config",
  "get_config",
  "to_hf_config",
]
