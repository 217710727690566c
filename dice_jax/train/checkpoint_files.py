"""What is wrong with one saved checkpoint step, found by reading its files, not through orbax.

A step directory `<checkpoints>/<step>/` holds the three items of `checkpoint.Checkpointer`:
  state    orbax's StandardSave: `_METADATA` (JSON: the tree and each array's entry), the OCDBT
           database (`manifest.ocdbt`, the b-tree and array data under `d/` and `ocdbt.process_*/`),
  data     the data iterator state (JsonSave: `data/metadata`),
  config   the run config (JsonSave: `config/metadata`).
`damage` checks what is cheap to check: each item there, the JSON files parse, the OCDBT database
opens, holds an entry for every array `_METADATA` names, and the last byte of every value reads
(the manifest, the b-tree nodes and one byte per chunk are read, not the arrays). A damaged step
then gets one line naming the file instead of an orbax traceback (or ~200 lines of `Event loop is
closed` from tensorstore's callbacks into orbax's closed event loop). Bytes overwritten inside a
chunk are found only when the arrays are read; `Checkpointer` treats a failed restore the same.
"""

from __future__ import annotations

import json
import os


def damage(step_dir: str) -> str | None:
  """One line naming what is missing, unreadable or inconsistent in `step_dir` (paths relative to
  it), or None when its files look whole."""
  if not os.path.isdir(step_dir):
    return "the step directory is missing"
  for item in ("config", "data"):
    _, problem = _read_json(step_dir, f"{item}/metadata")
    if problem:
      return problem
  meta, problem = _read_json(step_dir, "state/_METADATA")
  if problem:
    return problem
  tree = meta.get("tree_metadata") if isinstance(meta, dict) else None
  if not isinstance(tree, dict):
    return "state/_METADATA has no tree_metadata"
  if meta.get("use_ocdbt", True):
    return _ocdbt_damage(os.path.join(step_dir, "state"), tree)
  return None


def saved_steps(directory: str) -> list[int]:
  """The steps saved under a checkpoint `directory`, read from its listing alone (no orbax manager,
  so no collective and nothing created): orbax names a step's directory by its number once the
  step is complete (until then it carries a temporary suffix)."""
  if not os.path.isdir(directory):
    return []
  return sorted(
    int(name)
    for name in os.listdir(directory)
    if name.isdigit() and os.path.isdir(os.path.join(directory, name))
  )


def read_config(step_dir: str) -> dict:
  """The run config saved with a step (`config/metadata`); ValueError naming what is wrong."""
  config, problem = _read_json(step_dir, "config/metadata")
  if problem:
    raise ValueError(problem)
  return config


def _read_json(step_dir: str, rel: str):
  path = os.path.join(step_dir, rel)
  if not os.path.isfile(path):
    return None, f"{rel} is missing"
  try:
    with open(path) as f:
      return json.load(f), None
  except (OSError, UnicodeDecodeError, ValueError) as e:
    return None, f"{rel} is unreadable: {one_line(e)}"


def array_keys(tree_metadata: dict) -> list[str]:
  """The OCDBT key prefix (`a.b.c`) of every array leaf `_METADATA` lists (skipped leaves, e.g.
  optax's empty states, have no data)."""
  out = []
  for entry in tree_metadata.values():
    if entry.get("value_metadata", {}).get("skip_deserialize", False):
      continue
    out.append(".".join(str(k["key"]) for k in entry.get("key_metadata", [])))
  return out


def _ocdbt_damage(state_dir: str, tree_metadata: dict) -> str | None:
  """Opens the OCDBT database and reads the last byte of every value: a value whose data file is
  missing reads as empty, one whose file was cut short fails (tensorstore, no asyncio)."""
  if not os.path.isfile(os.path.join(state_dir, "manifest.ocdbt")):
    return "state/manifest.ocdbt is missing"
  import tensorstore as ts

  try:
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{state_dir}/"}).result()
    keys = kv.list().result()
  except (ValueError, RuntimeError, OSError) as e:
    return f"state (the OCDBT database) is unreadable: {one_line(e)}"
  arrays = {k.decode().split("/", 1)[0] for k in keys}
  missing = [k for k in array_keys(tree_metadata) if k not in arrays]
  if missing:
    return f"state holds no data for {len(missing)} arrays of its _METADATA (e.g. {missing[0]})"
  reads = [(k, kv.read(k, byte_range=slice(-1, None))) for k in keys]
  for key, read in reads:
    try:
      value = read.result()
    except (ValueError, RuntimeError, OSError) as e:
      return f"state: {key.decode()} is unreadable: {one_line(e)}"
    if value.state != "value" or len(value.value) != 1:
      return f"state: the data file of {key.decode()} is missing or empty"
  return None


def one_line(e: BaseException, limit: int = 300) -> str:
  """The innermost cause of `e` (the chain Python prints: orbax wraps tensorstore's error, which
  names the file) as `Type: first line`, at most `limit` characters."""
  while True:
    inner = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    if inner is None:
      break
    e = inner
  text = " ".join((str(e).strip().splitlines() or [""])[0].split())
  text = f"{type(e).__name__}: {text}" if text else type(e).__name__
  return text if len(text) <= limit else text[: limit - 3] + "..."
