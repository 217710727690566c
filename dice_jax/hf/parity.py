"""Logit parity between our JAX model and `transformers` on the same HF directory (float32).

transformers accepts a custom 4D attention mask, so the same block-causal mask that our
`AttentionSpec` describes is handed to it as a dense `[B, 1, T, T]` additive mask.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from dice_jax.hf.checkpoint import import_hf
from dice_jax.model.masks import AttentionSpec, dense_mask


@dataclasses.dataclass
class ParityResult:
  mask: str
  max_abs_diff: float
  max_abs_logit: float


def torch_logits(hf_dir: str, tokens: np.ndarray, mask: np.ndarray | None):
  """transformers' float32 logits; `mask` is a boolean `[B, T, T]` (None = its own causal mask)."""
  import torch
  import transformers

  model = transformers.AutoModelForCausalLM.from_pretrained(
    hf_dir, dtype=torch.float32, attn_implementation="eager"
  )
  model.eval()
  ids = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
  pos = torch.arange(ids.shape[1])[None].expand_as(ids)
  kw = {}
  if mask is not None:
    m = torch.as_tensor(np.array(mask, dtype=bool))[:, None]
    kw["attention_mask"] = torch.where(m, 0.0, torch.finfo(torch.float32).min)
  with torch.no_grad():
    return model(input_ids=ids, position_ids=pos, **kw).logits.float().numpy()


def check_parity(
  hf_dir: str, *, batch: int = 2, seq_len: int = 24, block_size: int | None = None, seed: int = 0
) -> list[ParityResult]:
  """Max |logit difference| under a causal and a block-causal mask."""
  model, cfg = import_hf(hf_dir, param_dtype="float32", dtype="float32")
  b = block_size or cfg.block_size
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, cfg.vocab_size, size=(batch, seq_len), dtype=np.int32)
  positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), tokens.shape)
  results = []
  for name, spec in (
    ("causal", AttentionSpec.causal()),
    ("block_causal", AttentionSpec.block_causal(b)),
  ):
    ours = np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions), spec))
    mask = None if name == "causal" else np.asarray(dense_mask(spec, jnp.asarray(positions)))
    theirs = torch_logits(hf_dir, tokens, mask)
    results.append(
      ParityResult(name, float(np.abs(ours - theirs).max()), float(np.abs(theirs).max()))
    )
  return results
