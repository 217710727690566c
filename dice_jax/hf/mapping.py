"""HF Qwen3/SDAR tensor names <-> our parameter paths: a mapping table plus a hook table.

Mapping table: our parameter -> HF name template (`{i}` = layer index for stacked parameters).
Hook table: our parameter -> (to_ours, to_hf) pure reshapes/transposes between the torch layout
`[out, in]` and ours (`[in, ...]` with heads split). Norms and the embedding need no hook.
"""

from __future__ import annotations

import numpy as np

from dice_jax.model.config import ModelConfig

# our path (tuple of keys in the nnx state) -> HF name
GLOBAL_PARAMS = {
  ("embed",): "model.embed_tokens.weight",
  ("final_norm",): "model.norm.weight",
  ("lm_head",): "lm_head.weight",
}
LAYER_PARAMS = {
  ("layers", "input_norm"): "model.layers.{i}.input_layernorm.weight",
  ("layers", "q_proj"): "model.layers.{i}.self_attn.q_proj.weight",
  ("layers", "k_proj"): "model.layers.{i}.self_attn.k_proj.weight",
  ("layers", "v_proj"): "model.layers.{i}.self_attn.v_proj.weight",
  ("layers", "o_proj"): "model.layers.{i}.self_attn.o_proj.weight",
  ("layers", "q_norm"): "model.layers.{i}.self_attn.q_norm.weight",
  ("layers", "k_norm"): "model.layers.{i}.self_attn.k_norm.weight",
  ("layers", "post_attn_norm"): "model.layers.{i}.post_attention_layernorm.weight",
  ("layers", "gate_proj"): "model.layers.{i}.mlp.gate_proj.weight",
  ("layers", "up_proj"): "model.layers.{i}.mlp.up_proj.weight",
  ("layers", "down_proj"): "model.layers.{i}.mlp.down_proj.weight",
}
# HF tensors that carry nothing we need (recomputed buffers in old checkpoints).
IGNORED_HF_SUFFIXES = (".rotary_emb.inv_freq",)


def _hooks(cfg: ModelConfig):
  d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  t = lambda w: w.T
  return {
    ("lm_head",): (t, t),
    ("layers", "q_proj"): (lambda w: w.T.reshape(d, n, h), lambda w: w.reshape(d, n * h).T),
    ("layers", "k_proj"): (lambda w: w.T.reshape(d, k, h), lambda w: w.reshape(d, k * h).T),
    ("layers", "v_proj"): (lambda w: w.T.reshape(d, k, h), lambda w: w.reshape(d, k * h).T),
    ("layers", "o_proj"): (lambda w: w.T.reshape(n, h, d), lambda w: w.reshape(n * h, d).T),
    ("layers", "gate_proj"): (t, t),
    ("layers", "up_proj"): (t, t),
    ("layers", "down_proj"): (t, t),
  }


def hf_shape(cfg: ModelConfig, path: tuple) -> tuple[int, ...]:
  """Shape of the HF tensor behind one (per-layer) slice of our parameter `path`."""
  d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
  n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  return {
    ("embed",): (v, d),
    ("final_norm",): (d,),
    ("lm_head",): (v, d),
    ("layers", "input_norm"): (d,),
    ("layers", "post_attn_norm"): (d,),
    ("layers", "q_proj"): (n * h, d),
    ("layers", "k_proj"): (k * h, d),
    ("layers", "v_proj"): (k * h, d),
    ("layers", "o_proj"): (d, n * h),
    ("layers", "q_norm"): (h,),
    ("layers", "k_norm"): (h,),
    ("layers", "gate_proj"): (f, d),
    ("layers", "up_proj"): (f, d),
    ("layers", "down_proj"): (d, f),
  }[path]


def to_ours(cfg: ModelConfig, path: tuple, w: np.ndarray) -> np.ndarray:
  hook = _hooks(cfg).get(path)
  return hook[0](w) if hook else w


def to_hf(cfg: ModelConfig, path: tuple, w: np.ndarray) -> np.ndarray:
  hook = _hooks(cfg).get(path)
  return hook[1](w) if hook else w


def param_paths(cfg: ModelConfig) -> list[tuple]:
  paths = [p for p in GLOBAL_PARAMS if not (p == ("lm_head",) and cfg.tie_word_embeddings)]
  return paths + list(LAYER_PARAMS)


def hf_names(cfg: ModelConfig, path: tuple) -> list[str]:
  """HF tensor names for our parameter: one, or one per layer for stacked parameters."""
  if path in GLOBAL_PARAMS:
    return [GLOBAL_PARAMS[path]]
  return [LAYER_PARAMS[path].format(i=i) for i in range(cfg.num_layers)]
