"""Atomic writes of files and directories, with normal permissions.

A file is written under a temporary name beside its target and renamed over it; a directory is
filled under a temporary name and renamed into place. A reader sees the old content or the new,
never half of it, and a failure removes the temporary and leaves the target as it was.
Temporaries are created like any other file (0666 / 0777 under the user's umask): `tempfile`'s
`mkstemp` / `mkdtemp` would make the outputs private (0600 / 0700).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from typing import Any, Callable, Iterator


def _temp_sibling(path: str) -> str:
  """A fresh hidden name in `path`'s directory that keeps its extension (savefig reads it)."""
  head, tail = os.path.split(os.path.abspath(path))
  return os.path.join(head, f".tmp-{secrets.token_hex(6)}-{tail}")


def _fsync(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def write_file(path: str, write: Callable[[str], Any]) -> str:
  """Calls `write(tmp)` to create a file at a temporary path, then renames it to `path`."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = _temp_sibling(path)
  try:
    write(tmp)
    _fsync(tmp)
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(tmp)
    raise
  return path


def write_text(path: str, text: str) -> str:
  """Writes `text` (UTF-8) to `path` atomically."""

  def write(tmp):
    with open(tmp, "x", encoding="utf-8") as f:
      f.write(text)

  return write_file(path, write)


def write_json(path: str, obj: Any, **dump_kwargs) -> str:
  """Writes `obj` as JSON (`json.dumps(obj, **dump_kwargs)`) to `path` atomically."""
  return write_text(path, json.dumps(obj, **dump_kwargs))


@contextlib.contextmanager
def new_directory(path: str, *, overwrite: bool = False) -> Iterator[str]:
  """Yields an empty temporary directory that becomes `path` when the block succeeds.

  An existing `path` is an error unless `overwrite` (then it is replaced whole, after the new
  content is complete). If the block raises, the temporary directory is removed.
  """
  path = os.path.abspath(path)
  if os.path.exists(path) and not overwrite:
    raise FileExistsError(f"{path} already exists")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = _temp_sibling(path)
  os.mkdir(tmp)
  try:
    yield tmp
    if os.path.exists(path):
      if not overwrite:
        raise FileExistsError(f"{path} already exists")
      old = _temp_sibling(path)
      os.rename(path, old)
      os.rename(tmp, path)
      shutil.rmtree(old)
    else:
      os.rename(tmp, path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
