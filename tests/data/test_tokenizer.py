"""Tokenizer: ids match transformers' independent Qwen2 tokenizer; chat template; save/load round trip."""

import json

import pytest

from dice_jax.data.tokenizer import Tokenizer, TokenizerError, render_im_start

from ._helpers import TINY_ADDED, write_tiny_tokenizer_dir

SAMPLES = [
  "hello world",
  "import torch\nimport torch.nn as nn\n\nclass Model(nn.Module):\n    def forward(self, a, b):\n        return a + b\n",
  "__global__ void k(const float* a, float* out, int n) {\n\tint idx = blockIdx.x * blockDim.x + threadIdx.x;\n}\n",
  "Ünïcödé — 中文 テスト 123456 ''s 've    trailing   \n\n\n  x",
  "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<|MASK|><|MASK|> done<|endoftext|>",
]


def _hf_tokenizer(path):
  transformers = pytest.importorskip(
    "transformers", reason="transformers (test extra) not installed"
  )
  return transformers.AutoTokenizer.from_pretrained(str(path))


def test_sdar_ids_match_transformers(sdar_dir, sdar_tokenizer):
  hf = _hf_tokenizer(sdar_dir)
  for s in SAMPLES:
    assert sdar_tokenizer.encode(s) == hf.encode(s, add_special_tokens=False), s
    assert sdar_tokenizer.decode(sdar_tokenizer.encode(s)) == s


def test_sdar_ids_match_transformers_on_kernel_files(sdar_dir, sdar_tokenizer):
  from ._helpers import shared_path

  hf = _hf_tokenizer(sdar_dir)
  rows = json.loads(shared_path("dice_rl", "kernel_infilling_evaluation.json").read_text())
  for r in rows[:20]:
    for field in ("pytorch_code", "cuda_code"):
      assert sdar_tokenizer.encode(r[field]) == hf.encode(r[field], add_special_tokens=False)


def test_sdar_special_tokens(sdar_tokenizer):
  t = sdar_tokenizer
  assert t.mask_token_id == 151669 and t.id_to_token(151669) == "<|MASK|>"
  assert t.encode("<|MASK|>") == [151669]
  assert t.encode("<MASK>") != [151669]  # added_tokens.json's spelling is not the real token
  assert t.eos_token_id == 151643 and t.pad_token_id == 151643
  assert t.token_to_id("<|im_end|>") == 151645
  assert t.stop_token_ids == (151645, 151643)  # generation_config.json
  assert t.vocab_size == 151670


def test_sdar_chat_template_matches_transformers_and_builtin(sdar_dir, sdar_tokenizer):
  hf = _hf_tokenizer(sdar_dir)
  msgs = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "write a kernel"},
    {"role": "assistant", "content": "```python\nx\n```"},
    {"role": "user", "content": "again"},
  ]
  for gen in (True, False):
    ours = sdar_tokenizer.apply_chat_template(msgs[:2], add_generation_prompt=gen)
    assert ours == hf.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=gen)
    assert ours == render_im_start(msgs[:2], add_generation_prompt=gen)
  assert sdar_tokenizer.apply_chat_template(msgs) == hf.apply_chat_template(
    msgs, tokenize=False, add_generation_prompt=True
  )
  assert sdar_tokenizer.apply_chat_template(msgs[1:2], enable_thinking=False).endswith(
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
  )


def test_builtin_renderer_format():
  got = render_im_start([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
  assert (
    got
    == "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n<|im_start|>assistant\n"
  )
  with pytest.raises(ValueError, match="message 0"):
    render_im_start([{"content": "x"}])


def test_tiny_tokenizer_matches_transformers(tiny_tokenizer_dir, tiny_tokenizer):
  hf = _hf_tokenizer(tiny_tokenizer_dir)
  for s in ["the code def  the\n\ncoder", "    def f(): the <|im_end|>", *SAMPLES]:
    assert tiny_tokenizer.encode(s) == hf.encode(s, add_special_tokens=False), s
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(s)) == s
  # merges are applied: " the" is one token, "code" is one token
  assert len(tiny_tokenizer.encode(" the")) == 1 and len(tiny_tokenizer.encode("code")) == 1
  n_bpe = 256 + len(
    {
      a + b
      for a, b in [
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
    }
  )
  assert tiny_tokenizer.eos_token_id == n_bpe == tiny_tokenizer.pad_token_id
  assert tiny_tokenizer.mask_token_id == n_bpe + TINY_ADDED.index("<|MASK|>")
  assert tiny_tokenizer.stop_token_ids == (n_bpe + 2, n_bpe)  # no generation_config: im_end, eos
  assert tiny_tokenizer.vocab_size == n_bpe + len(TINY_ADDED)


def test_save_round_trip(tmp_path, tiny_tokenizer, tiny_tokenizer_dir):
  out = tmp_path / "saved"
  tiny_tokenizer.save(out)
  assert (out / "tokenizer.json").exists() and (out / "chat_template.jinja").exists()
  again = Tokenizer.from_dir(out)
  s = "the code <|MASK|> def<|im_end|>"
  assert again.encode(s) == tiny_tokenizer.encode(s)
  assert again.mask_token_id == tiny_tokenizer.mask_token_id
  assert again.apply_chat_template(
    [{"role": "user", "content": "x"}]
  ) == tiny_tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
  hf = _hf_tokenizer(out)
  assert hf.encode(s, add_special_tokens=False) == tiny_tokenizer.encode(s)


def test_sdar_save_round_trip(tmp_path, sdar_tokenizer):
  out = tmp_path / "sdar_saved"
  sdar_tokenizer.save(out)
  again = Tokenizer.from_dir(out)  # now via tokenizer.json
  assert again.encode(SAMPLES[4]) == sdar_tokenizer.encode(SAMPLES[4])
  assert again.stop_token_ids == (151645, 151643) and again.mask_token_id == 151669
  hf = _hf_tokenizer(out)  # what an HF export ships must load in transformers with the same ids
  assert hf.encode(SAMPLES[4], add_special_tokens=False) == sdar_tokenizer.encode(SAMPLES[4])
  assert (hf.mask_token_id, hf.eos_token_id, hf.pad_token_id) == (151669, 151643, 151643)


def test_bad_dirs_give_clear_errors(tmp_path):
  with pytest.raises(TokenizerError, match="not found"):
    Tokenizer.from_dir(tmp_path / "nope")
  d = write_tiny_tokenizer_dir(tmp_path / "t")
  (d / "merges.txt").unlink()
  with pytest.raises(TokenizerError, match="merges.txt"):
    Tokenizer.from_dir(d)
  d = write_tiny_tokenizer_dir(tmp_path / "t2")
  cfg = json.loads((d / "tokenizer_config.json").read_text())
  first = sorted(cfg["added_tokens_decoder"], key=int)[0]
  cfg["added_tokens_decoder"][str(int(first) + 100)] = cfg["added_tokens_decoder"].pop(first)
  (d / "tokenizer_config.json").write_text(json.dumps(cfg))
  with pytest.raises(TokenizerError, match="next free id"):
    Tokenizer.from_dir(d)


def test_check_compatible_accepts_a_fitting_model_and_names_each_disagreement():
  from types import SimpleNamespace

  from dice_jax.data.byte_tokenizer import load_byte_tokenizer
  from dice_jax.data.tokenizer import TokenizerMismatchError, check_compatible

  tok = load_byte_tokenizer()  # 260 ids, eos 256, <|im_end|> 258 (a stop id), mask 259
  model = lambda **kw: SimpleNamespace(**{"vocab_size": 264, "mask_token_id": 259, **kw})  # noqa
  check_compatible(tok, model(eos_token_id=256), where="t")
  check_compatible(tok, model(eos_token_id=(258, 7)), where="t")  # a stop id is enough
  check_compatible(tok, model(eos_token_id=None), where="t")
  with pytest.raises(TokenizerMismatchError) as e:
    check_compatible(tok, model(vocab_size=200, eos_token_id=[300]), where="generate")
  assert str(e.value) == (
    "generate: the tokenizer does not match the model: the tokenizer has 260 ids but "
    "the model's vocab_size is 200; the model's eos_token_id [300] are not tokens of the tokenizer"
  )
