"""A byte-level tokenizer for tiny models: 256 byte tokens (ids 0-255) and 4 specials (256-259).

`write_byte_tokenizer(dir)` writes it as a Qwen2-style HF tokenizer directory (loadable by
`dice_jax.data.tokenizer.Tokenizer` and by transformers); `byte_model_overrides()` are the model
config fields that match it (vocab, mask, pad and eos ids).
"""

from __future__ import annotations

import json
import os

from dice_jax import atomic

BYTE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>")
BYTE_VOCAB_SIZE = 264  # 256 bytes + 4 specials, rounded up to a multiple of 8
_TEMPLATE = (
  "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + "
  "message.content + '<|im_end|>' + '\\n' }}{%- endfor %}"
  "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def write_byte_tokenizer(path: str) -> str:
  """A byte-level Qwen2-style tokenizer dir: 256 byte tokens (ids 0-255) + 4 specials (256-259)."""
  from tokenizers import pre_tokenizers

  os.makedirs(path, exist_ok=True)
  vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
  decoder = {
    str(256 + i): {
      "content": t,
      "lstrip": False,
      "normalized": False,
      "rstrip": False,
      "single_word": False,
      "special": t != "<|MASK|>",
    }
    for i, t in enumerate(BYTE_SPECIALS)
  }
  cfg = {
    "added_tokens_decoder": decoder,
    "eos_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
    "mask_token": "<|MASK|>",
    "tokenizer_class": "Qwen2Tokenizer",
    "add_prefix_space": False,
    "bos_token": None,
    "unk_token": None,
    "clean_up_tokenization_spaces": False,
  }
  files = {
    "vocab.json": json.dumps(vocab, ensure_ascii=False),
    "merges.txt": "#version: 0.2\n",
    "tokenizer_config.json": json.dumps(cfg),
    "chat_template.jinja": _TEMPLATE,
  }
  for name, text in files.items():
    atomic.write_text(os.path.join(path, name), text)
  return path


def byte_model_overrides() -> dict:
  """Model-config fields that match the byte tokenizer."""
  return dict(
    vocab_size=BYTE_VOCAB_SIZE,
    mask_token_id=259,
    pad_token_id=256,
    eos_token_id=256,
    bos_token_id=None,
  )


def load_byte_tokenizer():
  """The byte tokenizer as a `Tokenizer`, without leaving files behind (built in a temp dir)."""
  import tempfile

  from dice_jax.data.tokenizer import Tokenizer

  with tempfile.TemporaryDirectory(prefix="byte_tokenizer-") as d:
    tok = Tokenizer.from_dir(write_byte_tokenizer(d))
  tok.source_dir = None  # the files are gone; `Tokenizer.save` writes what it needs
  return tok
