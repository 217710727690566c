"""Minimal safetensors reader/writer over numpy memory maps (bf16 via ml_dtypes).

Format (huggingface/safetensors): u64 little-endian header length N, an N-byte JSON header
`{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}`, then the raw bytes.
Reading maps the file, so taking a slice of a tensor reads only those bytes.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Mapping

import ml_dtypes
import numpy as np

from dice_jax.errors import UserError

DTYPES = {
  "F32": np.dtype(np.float32),
  "F16": np.dtype(np.float16),
  "BF16": np.dtype(ml_dtypes.bfloat16),
  "F64": np.dtype(np.float64),
}
_NAMES = {v: k for k, v in DTYPES.items()}


class SafetensorsError(UserError):
  pass


class SafetensorsFile:
  """Lazily mapped tensors of one .safetensors file."""

  def __init__(self, path: str):
    self.path = path
    try:
      size = os.path.getsize(path)
      with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
          raise SafetensorsError(f"{path}: header length {n} exceeds file size {size}")
        header = json.loads(f.read(n))
    except FileNotFoundError:
      raise
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
      raise SafetensorsError(f"{path}: not a safetensors file ({e})") from e
    self.metadata = header.pop("__metadata__", {}) or {}
    self.header = header
    self._data_start = 8 + n
    self._size = size
    self._mmap = None

  def keys(self):
    return list(self.header)

  def info(self, name):
    return self.header[name]

  def get(self, name: str) -> np.ndarray:
    """The tensor `name` as a read-only memory-mapped numpy array."""
    if name not in self.header:
      raise SafetensorsError(f"{self.path}: no tensor {name!r}")
    h = self.header[name]
    if h["dtype"] not in DTYPES:
      raise SafetensorsError(
        f"{self.path}: tensor {name!r} has unsupported dtype {h['dtype']} "
        f"(supported: {sorted(DTYPES)})"
      )
    dt = DTYPES[h["dtype"]]
    begin, end = h["data_offsets"]
    count = int(np.prod(h["shape"], dtype=np.int64))
    if end - begin != count * dt.itemsize or self._data_start + end > self._size:
      raise SafetensorsError(
        f"{self.path}: tensor {name!r} byte range {begin}..{end} does not "
        f"match shape {h['shape']} {h['dtype']} or the file size (truncated?)"
      )
    if self._mmap is None:
      self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
    raw = self._mmap[self._data_start + begin : self._data_start + end]
    return raw.view(dt).reshape(h["shape"])


def save_file(
  tensors: Mapping[str, np.ndarray], path: str, metadata: Mapping[str, str] | None = None
):
  """Writes `tensors` (C-contiguous numpy arrays) to `path` in safetensors format."""
  header, offset, arrays = {}, 0, []
  for name in sorted(tensors):
    a = np.ascontiguousarray(tensors[name])
    if a.dtype not in _NAMES:
      raise SafetensorsError(f"cannot save {name!r}: dtype {a.dtype} not supported")
    header[name] = {
      "dtype": _NAMES[a.dtype],
      "shape": list(a.shape),
      "data_offsets": [offset, offset + a.nbytes],
    }
    offset += a.nbytes
    arrays.append(a)
  if metadata:
    header["__metadata__"] = dict(metadata)
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # align the data section to 8 bytes
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for a in arrays:
      f.write(a.tobytes())
