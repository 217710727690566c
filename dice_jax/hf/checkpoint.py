"""Import an HF checkpoint directory onto a mesh, and export a model to an HF directory.

Import reads `config.json` (model_type qwen3 or sdar) and `model.safetensors` or the shards named by
`model.safetensors.index.json`. Every parameter is built with `jax.make_array_from_callback`: each
device reads only the slice it holds from memory-mapped files, so no device (and no host buffer)
ever holds the whole model.

Export writes `config.json` (Qwen3ForCausalLM, model_type qwen3, keeping block_size and
mask_token_id), `generation_config.json`, safetensors shards + index, and the tokenizer files of a
source directory, into a temporary directory that is renamed into place only when complete. In a
multi-process run every process takes part (each tensor is gathered whole, one at a time) and
process 0 alone writes.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from typing import Optional

import jax
import numpy as np
from absl import logging
from flax import nnx
from tqdm import tqdm

from dice_jax import atomic, distributed
from dice_jax import sharding as sharding_lib
from dice_jax.data.tokenizer import Tokenizer, TokenizerError, check_compatible
from dice_jax.errors import UserError
from dice_jax.hf import mapping
from dice_jax.hf.safetensors_io import DTYPES, SafetensorsError, SafetensorsFile, save_file
from dice_jax.model.config import ModelConfig, from_hf_config, to_hf_config
from dice_jax.model.transformer import Transformer

TOKENIZER_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "vocab.json",
  "merges.txt",
  "added_tokens.json",
  "special_tokens_map.json",
  "chat_template.jinja",
)
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(UserError):
  """A malformed or incomplete HF checkpoint directory."""


def read_config(hf_dir: str, **overrides) -> ModelConfig:
  if not os.path.isdir(hf_dir):
    raise CheckpointError(f"{hf_dir}: no such directory")
  path = os.path.join(hf_dir, "config.json")
  if not os.path.exists(path):
    raise CheckpointError(f"{hf_dir}: no config.json (not an HF checkpoint directory)")
  try:
    with open(path) as f:
      hf = json.load(f)
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{path}: invalid JSON ({e})") from e
  try:
    return from_hf_config(hf, source=path, **overrides)
  except ValueError as e:
    raise CheckpointError(str(e)) from e


def has_tokenizer(directory: str) -> bool:
  """Whether `directory` holds tokenizer files (tokenizer.json, or vocab.json + merges.txt)."""
  return os.path.exists(os.path.join(directory, "tokenizer.json")) or all(
    os.path.exists(os.path.join(directory, f)) for f in ("vocab.json", "merges.txt")
  )


def load_tokenizer(tokenizer_dir: str, cfg: ModelConfig, *, where: str):
  """The tokenizer of `tokenizer_dir`, checked against the model config (`check_compatible`)."""
  if not os.path.isdir(tokenizer_dir):
    raise CheckpointError(f"{where}: tokenizer directory {tokenizer_dir}: no such directory")
  tok = Tokenizer.from_dir(tokenizer_dir)
  check_compatible(tok, cfg, where=where)
  return tok


def _check_own_tokenizer(hf_dir: str, cfg: ModelConfig) -> None:
  """An HF directory's own tokenizer must fit its model; one we cannot read is only reported."""
  if not has_tokenizer(hf_dir):
    return
  try:
    tok = Tokenizer.from_dir(hf_dir)
  except TokenizerError as e:
    logging.warning("%s: tokenizer not checked against the model (%s)", hf_dir, e)
    return
  check_compatible(tok, cfg, where=f"import {hf_dir}")


class _TensorIndex:
  """Name -> file lookup over a single or sharded safetensors checkpoint."""

  def __init__(self, hf_dir: str):
    self.dir = hf_dir
    self._files: dict[str, SafetensorsFile] = {}
    index_path = os.path.join(hf_dir, INDEX)
    if os.path.exists(index_path):
      with open(index_path) as f:
        self.weight_map = json.load(f).get("weight_map")
      if not isinstance(self.weight_map, dict):
        raise CheckpointError(f"{index_path}: no weight_map")
      missing = sorted(
        {fn for fn in self.weight_map.values() if not os.path.exists(os.path.join(hf_dir, fn))}
      )
      if missing:
        name = next(k for k, v in self.weight_map.items() if v == missing[0])
        raise CheckpointError(
          f"{index_path}: shard file {missing[0]} is missing "
          f"(it holds e.g. tensor {name}); missing shards: {missing}"
        )
    elif os.path.exists(os.path.join(hf_dir, SINGLE)):
      self.weight_map = {k: SINGLE for k in self._file(SINGLE).keys()}
    else:
      raise CheckpointError(f"{hf_dir}: neither {INDEX} nor {SINGLE} found")

  def _file(self, fn: str) -> SafetensorsFile:
    if fn not in self._files:
      try:
        self._files[fn] = SafetensorsFile(os.path.join(self.dir, fn))
      except SafetensorsError as e:
        raise CheckpointError(str(e)) from e
    return self._files[fn]

  def get(self, name: str, expected_shape) -> np.ndarray:
    if name not in self.weight_map:
      raise CheckpointError(f"{self.dir}: tensor {name} not found in the checkpoint")
    fn = self.weight_map[name]
    f = self._file(fn)
    if name not in f.header:
      raise CheckpointError(
        f"{os.path.join(self.dir, fn)}: tensor {name} is listed in the "
        f"index but not present in the file"
      )
    try:
      w = f.get(name)
    except SafetensorsError as e:
      raise CheckpointError(str(e)) from e
    if tuple(w.shape) != tuple(expected_shape):
      raise CheckpointError(
        f"{os.path.join(self.dir, fn)}: tensor {name} has shape "
        f"{tuple(w.shape)}, expected {tuple(expected_shape)} from config.json"
      )
    return w


def _state_path(keypath) -> tuple:
  return tuple(getattr(k, "key", getattr(k, "name", k)) for k in keypath)


def import_hf(
  hf_dir: str,
  mesh: Optional[jax.sharding.Mesh] = None,
  *,
  check_tokenizer: bool = True,
  **config_overrides,
):
  """Loads an HF directory into a `Transformer` placed on `mesh` (default: one device).

  `config_overrides` set non-HF fields such as `param_dtype`, `dtype`, `attention_impl`.
  The directory's tokenizer, when it has one, must fit the model (TokenizerMismatchError; skip
  with `check_tokenizer=False` when the caller checks the tokenizer it uses itself).
  Returns (model, cfg).
  """
  cfg = read_config(hf_dir, **config_overrides)
  if check_tokenizer:
    _check_own_tokenizer(hf_dir, cfg)
  index = _TensorIndex(hf_dir)
  expected = {n for p in mapping.param_paths(cfg) for n in mapping.hf_names(cfg, p)}
  unexpected = [
    n
    for n in index.weight_map
    if n not in expected
    and not n.endswith(mapping.IGNORED_HF_SUFFIXES)
    and not (cfg.tie_word_embeddings and n == "lm_head.weight")
  ]
  if unexpected:
    raise CheckpointError(
      f"{hf_dir}: tensors not used by a {cfg.num_layers}-layer Qwen3 model: "
      f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
    )
  mesh = mesh or sharding_lib.make_mesh(devices=jax.devices()[:1])
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, abs_state = nnx.split(abstract)
  shardings = sharding_lib.state_shardings(abs_state, mesh)
  dtype = cfg.weight_dtype
  total = sum(len(mapping.hf_names(cfg, p)) for p in mapping.param_paths(cfg))
  bar = tqdm(
    total=total,
    desc=f"import {os.path.basename(hf_dir)}",
    unit="tensor",
    mininterval=2,
    disable=not distributed.is_primary(),
  )

  def load(keypath, var, shard_var):
    path = _state_path(keypath)
    names = mapping.hf_names(cfg, path)
    hf_shape = mapping.hf_shape(cfg, path)
    stacked = path[0] == "layers"
    for n in names:  # validate every tensor up front: shape and dtype, with file names
      w = index.get(n, hf_shape)
      del w

    def fetch(idx):
      if stacked:
        layers = range(cfg.num_layers)[idx[0]]
        parts = [mapping.to_ours(cfg, path, index.get(names[i], hf_shape))[idx[1:]] for i in layers]
        out = np.stack(parts)
      else:
        out = mapping.to_ours(cfg, path, index.get(names[0], hf_shape))[idx]
      return np.asarray(out, dtype=dtype)

    arr = jax.make_array_from_callback(var.shape, shard_var.get_value(), fetch)
    bar.update(len(names))
    return var.replace(arr)

  with bar:
    state = jax.tree_util.tree_map_with_path(
      load, abs_state, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
  logging.info(
    "imported %s (%d parameters) onto mesh %s", hf_dir, cfg.num_params(), dict(mesh.shape)
  )
  return nnx.merge(graphdef, state), cfg


def _params_by_path(model) -> dict[tuple, jax.Array]:
  state = nnx.state(model, nnx.Param)
  out = {}
  for kp, v in jax.tree_util.tree_leaves_with_path(
    state, is_leaf=lambda x: isinstance(x, nnx.Variable)
  ):
    out[_state_path(kp)] = v.get_value()
  return out


def _hf_tensors(model: Transformer, np_dtype, *, convert: bool = True):
  """(HF name, numpy tensor in HF layout and `np_dtype`) for every tensor, in mapping order.

  Each tensor is gathered whole onto this host (one layer of a stacked parameter at a time); in a
  multi-process run that is a collective, so every process iterates (`convert=False` yields
  None in place of the tensor)."""
  cfg: ModelConfig = model.cfg
  params = _params_by_path(model)
  for path in mapping.param_paths(cfg):
    arr = params[path]
    for i, name in enumerate(mapping.hf_names(cfg, path)):
      ours = distributed.to_host(arr[i] if path[0] == "layers" else arr)
      if convert:
        yield name, np.ascontiguousarray(mapping.to_hf(cfg, path, ours)).astype(np_dtype)
      else:
        yield name, None


def export_hf(
  model: Transformer,
  out_dir: str,
  *,
  dtype: str = "bfloat16",
  tokenizer_dir: Optional[str] = None,
  max_shard_bytes: int = 4 << 30,
  overwrite: bool = False,
) -> str:
  """Writes `model` as an HF Qwen3ForCausalLM directory; atomic (temp dir + rename).

  `tokenizer_dir`'s tokenizer files are copied after checking that they fit the model
  (TokenizerMismatchError otherwise); without one the export has no tokenizer, which is logged.
  An existing `out_dir` is refused (FileExistsError) unless `overwrite`.
  Multi-process: every process calls it (each tensor is gathered from the processes holding its
  parts); the primary process alone writes `out_dir`, and all return once it is in place.
  """
  cfg: ModelConfig = model.cfg
  np_dtype = {"bfloat16": DTYPES["BF16"], "float32": DTYPES["F32"], "float16": DTYPES["F16"]}.get(
    dtype
  )
  if np_dtype is None:
    raise ValueError(f"export dtype must be bfloat16, float16 or float32, got {dtype!r}")
  out_dir = os.path.abspath(out_dir)
  if tokenizer_dir is not None:
    load_tokenizer(tokenizer_dir, cfg, where=f"export with tokenizer {tokenizer_dir}")
  elif distributed.is_primary():
    logging.warning("%s will have no tokenizer (none was given to copy)", out_dir)
  if os.path.exists(out_dir) and not overwrite:
    raise FileExistsError(errno.EEXIST, "output directory already exists", out_dir)
  if not distributed.is_primary():
    for _ in _hf_tensors(model, np_dtype, convert=False):
      pass
    distributed.barrier(f"export_hf {out_dir}")
    return out_dir
  total = sum(len(mapping.hf_names(cfg, p)) for p in mapping.param_paths(cfg))
  bar = tqdm(total=total, desc=f"export {os.path.basename(out_dir)}", unit="tensor", mininterval=2)
  with atomic.new_directory(out_dir, overwrite=overwrite) as tmp, bar:
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, w in _hf_tensors(model, np_dtype):
      bar.update()
      if size + w.nbytes > max_shard_bytes and shards[-1]:
        shards.append({})
        size = 0
      shards[-1][name] = w
      size += w.nbytes
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
      fn = SINGLE if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
      save_file(shard, os.path.join(tmp, fn), metadata={"format": "pt"})
      for name, w in shard.items():
        weight_map[name] = fn
        total += w.nbytes
    if len(shards) > 1:
      with open(os.path.join(tmp, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(to_hf_config(cfg, torch_dtype=dtype), f, indent=2)
    _write_generation_config(cfg, tmp, tokenizer_dir)
    if tokenizer_dir:
      for fn in TOKENIZER_FILES:
        src = os.path.join(tokenizer_dir, fn)
        if os.path.exists(src):
          shutil.copy2(src, os.path.join(tmp, fn))
  logging.info("exported %d tensors in %d shard(s) to %s", len(weight_map), len(shards), out_dir)
  distributed.barrier(f"export_hf {out_dir}")
  return out_dir


def _write_generation_config(cfg: ModelConfig, out: str, source_dir: Optional[str]):
  src = os.path.join(source_dir, "generation_config.json") if source_dir else None
  if src and os.path.exists(src):
    shutil.copy2(src, os.path.join(out, "generation_config.json"))
    return
  gen = {
    "bos_token_id": cfg.bos_token_id,
    "eos_token_id": (
      list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id
    ),
    "pad_token_id": cfg.pad_token_id,
  }
  with open(os.path.join(out, "generation_config.json"), "w") as f:
    json.dump({k: v for k, v in gen.items() if v is not None}, f, indent=2)
