"""Test helpers for the data tests (shared-data locator, tiny tokenizer dir builder)."""

import json
import pathlib

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def shared_path(*parts: str) -> pathlib.Path:
  """A path under the data root (`$DICE_DATA_ROOT`, else ../shared/data); skips the test with a
  reason when absent."""
  from experiments.data_root import ENV, data_root

  p = data_root().joinpath(*parts)
  if not p.exists():
    pytest.skip(
      f"data not available: {p} (set ${ENV}; CI provides ../shared/data next to the repo)"
    )
  return p


TINY_MERGES = [
  ("Ġ", "t"),
  ("h", "e"),
  ("Ġt", "he"),
  ("e", "r"),
  ("c", "o"),
  ("co", "d"),
  ("cod", "e"),
  ("Ċ", "Ċ"),
  ("Ġ", "Ġ"),
  ("ĠĠ", "ĠĠ"),
  ("d", "e"),
  ("de", "f"),
]
TINY_ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]


def write_tiny_tokenizer_dir(path: pathlib.Path, with_template: bool = True) -> pathlib.Path:
  """A tiny Qwen2-style tokenizer dir (vocab.json + merges.txt + tokenizer_config.json) built from scratch."""
  from tokenizers import pre_tokenizers

  path.mkdir(parents=True, exist_ok=True)
  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  vocab = {ch: i for i, ch in enumerate(alphabet)}
  for a, b in TINY_MERGES:
    vocab.setdefault(a + b, len(vocab))
  (path / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
  (path / "merges.txt").write_text(
    "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in TINY_MERGES)
  )
  decoder = {
    str(len(vocab) + i): {
      "content": t,
      "lstrip": False,
      "normalized": False,
      "rstrip": False,
      "single_word": False,
      "special": t != "<|MASK|>",
    }
    for i, t in enumerate(TINY_ADDED)
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
  (path / "tokenizer_config.json").write_text(json.dumps(cfg))
  if with_template:
    (path / "chat_template.jinja").write_text(
      "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content"
      " + '<|im_end|>' + '\\n' }}{%- endfor %}"
      "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
  return path
