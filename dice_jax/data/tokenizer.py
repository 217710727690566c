"""Qwen2 byte-level BPE tokenizer and Qwen chat template, as used by SDAR / DICE.

Facts (the SDAR tokenizer files of HF JetLM/SDAR-*-Chat; docs/learner-spec.md "Data"):
  * byte-level BPE (GPT-2 byte map) over a regex pre-split, NFC normalisation, no BOS;
  * ``<|endoftext|>`` = 151643 is both eos and pad; ``<|im_end|>`` = 151645 ends a chat turn;
  * the mask token is id 151669. ``tokenizer_config.json`` spells it ``<|MASK|>`` while
    ``added_tokens.json`` spells it ``<MASK>``: only the id is consistent, so the id is what we trust
    and ``added_tokens_decoder`` (tokenizer_config.json) wins over ``added_tokens.json``, as in transformers.
  * ``generation_config.json``'s ``eos_token_id`` = [151645, 151643] are the stop tokens.

Loading order for an HF directory: ``tokenizer.json`` when present, else ``vocab.json`` + ``merges.txt`` plus
added tokens from ``tokenizer_config.json:added_tokens_decoder`` and ``added_tokens.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

from jinja2 import sandbox
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from dice_jax import atomic
from dice_jax.errors import UserError

# Qwen2 pre-tokenisation regex (same split rule as the Qwen2 tokenizer family).
QWEN2_SPLIT_REGEX = (
  r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
  r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK_TOKEN_ID = 151669  # SDAR config.mask_token_id


class TokenizerError(UserError):
  """A tokenizer directory is missing files or is inconsistent."""


def build_qwen2_bpe(vocab: Mapping[str, int], merges: Sequence[tuple[str, str]]) -> _HFTokenizer:
  """A `tokenizers` pipeline equivalent to the Qwen2 tokenizer, from a vocab and merge list."""
  tok = _HFTokenizer(
    models.BPE(
      vocab=dict(vocab),
      merges=list(merges),
      dropout=None,
      unk_token=None,
      continuing_subword_prefix="",
      end_of_word_suffix="",
      fuse_unk=False,
      byte_fallback=False,
    )
  )
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence(
    [
      pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
  )
  tok.decoder = decoders.ByteLevel()
  return tok


def _read_merges(path: str) -> list[tuple[str, str]]:
  merges = []
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, 1):
      line = line.rstrip("\n")
      if not line or (lineno == 1 and line.startswith("#version")):
        continue
      parts = line.split(" ")
      if len(parts) != 2:
        raise TokenizerError(f"{path}:{lineno}: expected 'a b' merge pair, got {line!r}")
      merges.append((parts[0], parts[1]))
  return merges


def _token_content(tok: Any) -> str | None:
  if tok is None:
    return None
  if isinstance(tok, str):
    return tok
  if isinstance(tok, Mapping):
    return tok.get("content")
  raise TokenizerError(f"cannot read a token from {tok!r}")


def _load_json(path: str) -> Any:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise TokenizerError(f"{path}: invalid JSON: {e}") from e


def render_im_start(
  messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
) -> str:
  """Built-in renderer for the plain Qwen ``<|im_start|>role\\ncontent<|im_end|>\\n`` format."""
  out = []
  for i, m in enumerate(messages):
    if "role" not in m or "content" not in m:
      raise ValueError(f"message {i} needs 'role' and 'content', got keys {sorted(m)}")
    out.append(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n")
  if add_generation_prompt:
    out.append(f"{IM_START}assistant\n")
  return "".join(out)


@dataclasses.dataclass(frozen=True)
class SpecialIds:
  eos_token_id: int
  pad_token_id: int
  mask_token_id: int
  im_end_token_id: int | None
  stop_token_ids: tuple[int, ...]


class Tokenizer:
  """Qwen2 BPE + chat template. ``encode`` never adds BOS/EOS (Qwen has no BOS)."""

  def __init__(
    self,
    backend: _HFTokenizer,
    *,
    eos_token: str = ENDOFTEXT,
    pad_token: str = ENDOFTEXT,
    mask_token_id: int = MASK_TOKEN_ID,
    stop_token_ids: Sequence[int] | None = None,
    chat_template: str | None = None,
    source_dir: str | None = None,
    extra_config: Mapping[str, Any] | None = None,
  ):
    self._tok = backend
    self.chat_template = chat_template
    self.source_dir = source_dir
    self._extra_config = dict(extra_config or {})
    self.eos_token = eos_token
    self.pad_token = pad_token
    self.eos_token_id = self._require_id(eos_token, "eos_token")
    self.pad_token_id = self._require_id(pad_token, "pad_token")
    if backend.id_to_token(mask_token_id) is None:
      raise TokenizerError(f"mask token id {mask_token_id} is not in the vocabulary")
    self.mask_token_id = int(mask_token_id)
    self.mask_token = backend.id_to_token(mask_token_id)
    self.im_end_token_id = backend.token_to_id(IM_END)
    if stop_token_ids is None:
      stop_token_ids = [i for i in (self.im_end_token_id, self.eos_token_id) if i is not None]
    self.stop_token_ids = tuple(int(i) for i in stop_token_ids)
    self._jinja = None

  def _require_id(self, token: str, what: str) -> int:
    i = self._tok.token_to_id(token)
    if i is None:
      raise TokenizerError(f"{what} {token!r} is not in the vocabulary")
    return int(i)

  # ---------------------------------------------------------------- loading
  @classmethod
  def from_dir(cls, path: str | os.PathLike) -> "Tokenizer":
    """Load an HF tokenizer directory (SDAR/Qwen layout)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
      raise TokenizerError(f"tokenizer directory not found: {path}")
    cfg_path = os.path.join(path, "tokenizer_config.json")
    cfg = _load_json(cfg_path) if os.path.exists(cfg_path) else {}
    tj = os.path.join(path, "tokenizer.json")
    if os.path.exists(tj):
      backend = _HFTokenizer.from_file(tj)
    else:
      vocab_p, merges_p = os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt")
      for p in (vocab_p, merges_p):
        if not os.path.exists(p):
          raise TokenizerError(
            f"{path}: needs tokenizer.json or vocab.json + merges.txt; missing {p}"
          )
      backend = build_qwen2_bpe(_load_json(vocab_p), _read_merges(merges_p))
    # Added tokens: tokenizer_config.json's decoder is authoritative; added_tokens.json fills gaps only.
    added: dict[int, AddedToken] = {}
    at_path = os.path.join(path, "added_tokens.json")
    if os.path.exists(at_path):
      for content, idx in _load_json(at_path).items():
        added[int(idx)] = AddedToken(content, special=True, normalized=False)
    for idx, spec in (cfg.get("added_tokens_decoder") or {}).items():
      added[int(idx)] = AddedToken(
        spec["content"],
        single_word=spec.get("single_word", False),
        lstrip=spec.get("lstrip", False),
        rstrip=spec.get("rstrip", False),
        normalized=spec.get("normalized", False),
        special=spec.get("special", True),
      )
    _add_tokens_with_ids(backend, added, where=path)

    chat_template = cfg.get("chat_template")
    ct_path = os.path.join(path, "chat_template.jinja")
    if os.path.exists(ct_path):
      with open(ct_path, encoding="utf-8") as f:
        chat_template = f.read()
    eos = _token_content(cfg.get("eos_token")) or ENDOFTEXT
    pad = _token_content(cfg.get("pad_token")) or eos
    mask_id = MASK_TOKEN_ID
    mask_tok = _token_content(cfg.get("mask_token"))
    if mask_tok is not None and backend.token_to_id(mask_tok) is not None:
      mask_id = backend.token_to_id(mask_tok)
    stop = None
    gc_path = os.path.join(path, "generation_config.json")
    if os.path.exists(gc_path):
      e = _load_json(gc_path).get("eos_token_id")
      if e is not None:
        stop = [e] if isinstance(e, int) else list(e)
    return cls(
      backend,
      eos_token=eos,
      pad_token=pad,
      mask_token_id=mask_id,
      stop_token_ids=stop,
      chat_template=chat_template,
      source_dir=path,
      extra_config={k: cfg[k] for k in ("model_max_length",) if k in cfg},
    )

  # ---------------------------------------------------------------- encode / decode
  @property
  def vocab_size(self) -> int:
    """Number of ids the tokenizer can produce (max id + 1); the model's embedding may be larger."""
    return int(max(self._tok.get_vocab(with_added_tokens=True).values())) + 1

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def token_to_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)

  def id_to_token(self, i: int) -> str | None:
    return self._tok.id_to_token(int(i))

  # ---------------------------------------------------------------- chat template
  def apply_chat_template(
    self,
    messages: Sequence[Mapping[str, str]],
    add_generation_prompt: bool = True,
    use_builtin: bool = False,
    **kwargs: Any,
  ) -> str:
    """Render messages with the directory's Jinja chat template (or the plain ``<|im_start|>`` renderer
    when there is none or ``use_builtin``). Extra kwargs (e.g. ``enable_thinking``) go to the template."""
    if use_builtin or not self.chat_template:
      return render_im_start(messages, add_generation_prompt)
    if self._jinja is None:
      env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
      env.filters["tojson"] = _tojson
      self._jinja = env.from_string(self.chat_template)
    return self._jinja.render(
      messages=[dict(m) for m in messages],
      add_generation_prompt=add_generation_prompt,
      tools=kwargs.pop("tools", None),
      **kwargs,
    )

  def __getstate__(
    self,
  ):  # picklable for grain worker processes (the compiled template is rebuilt lazily)
    state = dict(self.__dict__)
    state["_jinja"] = None
    return state

  # ---------------------------------------------------------------- saving
  def save(self, out_dir: str | os.PathLike) -> None:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and chat_template.jinja
    (plus vocab.json/merges.txt/added_tokens.json/generation_config.json copied from the source dir when
    it had them) into ``out_dir``, loadable by this class and by ``transformers.AutoTokenizer``."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    if self.source_dir:
      for name in ("vocab.json", "merges.txt", "added_tokens.json", "generation_config.json"):
        src = os.path.join(self.source_dir, name)
        if os.path.exists(src):
          shutil.copyfile(src, os.path.join(out_dir, name))
    decoder = {}
    for idx, at in sorted(self._tok.get_added_tokens_decoder().items()):
      decoder[str(idx)] = {
        "content": at.content,
        "lstrip": at.lstrip,
        "normalized": at.normalized,
        "rstrip": at.rstrip,
        "single_word": at.single_word,
        "special": at.special,
      }
    cfg = {
      "add_bos_token": False,
      "add_prefix_space": False,
      "added_tokens_decoder": decoder,
      "bos_token": None,
      "clean_up_tokenization_spaces": False,
      "eos_token": self.eos_token,
      "pad_token": self.pad_token,
      "mask_token": self.mask_token,
      "errors": "replace",
      "split_special_tokens": False,
      "tokenizer_class": "Qwen2Tokenizer",
      "unk_token": None,
      **self._extra_config,
    }
    specials = {
      "eos_token": self.eos_token,
      "pad_token": self.pad_token,
      "mask_token": self.mask_token,
    }
    files = {
      "tokenizer.json": self._tok.to_str(pretty=False),
      "tokenizer_config.json": json.dumps(cfg, indent=2, ensure_ascii=False),
      "special_tokens_map.json": json.dumps(specials, indent=2, ensure_ascii=False),
    }
    if self.chat_template:
      files["chat_template.jinja"] = self.chat_template
    for name, text in files.items():
      atomic.write_text(os.path.join(out_dir, name), text)


class TokenizerMismatchError(TokenizerError):
  """A tokenizer and a model that disagree on vocabulary size, mask id or eos ids."""


def _ids(value) -> tuple[int, ...]:
  if value is None:
    return ()
  return tuple(int(i) for i in value) if isinstance(value, (list, tuple)) else (int(value),)


def check_compatible(tokenizer: Tokenizer, model_cfg: Any, *, where: str) -> None:
  """Raises TokenizerMismatchError (one line, every disagreement) unless the tokenizer fits the model.

  `model_cfg` is a `dice_jax.model.ModelConfig` (anything with `vocab_size`, `mask_token_id`,
  `eos_token_id`). Checked: every id the tokenizer can produce has an embedding row
  (`tokenizer.vocab_size <= vocab_size`); the mask ids are equal; the model's eos ids are tokens
  of the tokenizer and include its eos or one of its stop ids. `where` names the place the two
  meet (e.g. 'export --tokenizer_dir=DIR', 'sft', 'generate') and starts the message.
  """
  problems = []
  if tokenizer.vocab_size > model_cfg.vocab_size:
    problems.append(
      f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
      f"{model_cfg.vocab_size}"
    )
  if tokenizer.mask_token_id != model_cfg.mask_token_id:
    problems.append(
      f"mask id {tokenizer.mask_token_id} ({tokenizer.mask_token}) != the model's "
      f"mask_token_id {model_cfg.mask_token_id}"
    )
  eos = _ids(model_cfg.eos_token_id)
  unknown = [i for i in eos if tokenizer.id_to_token(i) is None]
  if unknown:
    problems.append(f"the model's eos_token_id {list(unknown)} are not tokens of the tokenizer")
  elif eos and not set(eos) & {tokenizer.eos_token_id, *tokenizer.stop_token_ids}:
    problems.append(
      f"eos ids differ: the tokenizer's eos {tokenizer.eos_token_id} ({tokenizer.eos_token}) "
      f"and stop ids {list(tokenizer.stop_token_ids)}, the model's eos_token_id {list(eos)}"
    )
  if problems:
    source = f"tokenizer {tokenizer.source_dir}" if tokenizer.source_dir else "the tokenizer"
    raise TokenizerMismatchError(
      f"{where}: {source} does not match the model: " + "; ".join(problems)
    )


def _tojson(x: Any, **kw: Any) -> str:
  return json.dumps(x, ensure_ascii=False, **kw)


def _add_tokens_with_ids(
  backend: _HFTokenizer, added: Mapping[int, AddedToken], where: str
) -> None:
  """Register added tokens so each lands at its declared id (ids past the BPE vocab must be contiguous)."""
  vocab = backend.get_vocab(with_added_tokens=True)
  for idx in sorted(added):
    at = added[idx]
    existing = vocab.get(at.content)
    if existing is not None:
      if existing != idx:
        raise TokenizerError(f"{where}: token {at.content!r} has id {existing}, config says {idx}")
      backend.add_special_tokens([at]) if at.special else backend.add_tokens([at])
      continue
    size = backend.get_vocab_size(with_added_tokens=True)
    if idx != size:
      raise TokenizerError(
        f"{where}: added token {at.content!r} declared at id {idx} but the next free id is {size}"
      )
    n = backend.add_special_tokens([at]) if at.special else backend.add_tokens([at])
    if n != 1 or backend.token_to_id(at.content) != idx:
      raise TokenizerError(f"{where}: failed to add {at.content!r} at id {idx}")
    vocab[at.content] = idx
