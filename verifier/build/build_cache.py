"""A content-addressed cache in front of ``torch.utils.cpp_extension.load_inline``.

Inside a worker, ``load_inline`` is replaced by :class:`CachedLoadInline`: the build directory is
``<build_root>/<sha256 of sources, functions, flags and toolchain>``, so identical extensions build once
across candidates, processes and hosts that share ``build_root`` (PyTorch's ``torch/utils/cpp_extension.py``: unique build
dirs, stale locks, compile on CPU then run on GPU). A build happens in a private temporary directory that
is renamed into place when it succeeds, so a killed build never leaves a stale lock behind; a cache hit
imports the ``.so`` directly, without ninja. Extension modules are wrapped so the worker can count calls
into the candidate's own functions (runtime anti-cheating check).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import inspect
import json
import os
import re
import shutil
import sys
import time
import uuid

from verifier.api.contract import truncate_log
from verifier.build import pch
from verifier.build.split_build import LEAN_TORCH_INCLUDES, lean_may_have_failed, split_variant

# Arguments that change what is built. verbose/build_directory/keep_intermediates do not.
_KEY_ARGS = (
  "name",
  "cpp_sources",
  "cuda_sources",
  "functions",
  "extra_cflags",
  "extra_cuda_cflags",
  "extra_ldflags",
  "extra_include_paths",
  "with_cuda",
  "is_python_module",
  "with_pytorch_error_handling",
  "no_implicit_headers",
)


FAST_BUILD_VERSION = 1
# One published build's files at most (the ``.so`` and the sources kept beside it): an honest extension's
# entry is 0.2-2 MB; a candidate that carried 900 MB of initialised data built, passed and stayed (red team
# 42, round 2), and ~80 of those fill a host's disk. A build over it fails as the candidate's compile error.
MAX_ENTRY_BYTES = 256 << 20


def fast_variant(params: dict) -> dict | None:
  """Cheaper build of the same extension, or None when no shortcut applies.

  - In ``cuda_sources``, ``torch/extension.h`` (pybind11 + Python headers) becomes ``torch/types.h``
    (tensors, factories, TORCH_CHECK); the bindings live in ``main.cpp`` anyway. About 2.4x less nvcc
    time on a one-kernel extension.
  - ``main.cpp`` is compiled at -O0 when ``cpp_sources`` only declares functions (no bodies), since then
    it holds nothing but the pybind11 bindings.
  A failed fast build falls back to the stock one, so a shortcut can never reject a candidate.
  """
  cuda = params.get("cuda_sources")
  if not cuda:
    return None
  cuda_text = cuda if isinstance(cuda, str) else "\n".join(cuda)
  cpp = params.get("cpp_sources") or ""
  cpp_text = cpp if isinstance(cpp, str) else "\n".join(cpp)
  out = dict(params)
  changed = False
  if pch.EXTENSION_INCLUDE.search(cuda_text) and not re.search(
    r"\bpy::|pybind11|PYBIND11", cuda_text
  ):
    out["cuda_sources"] = pch.EXTENSION_INCLUDE.sub("#include <torch/types.h>", cuda_text)
    changed = True
  if "{" not in cpp_text:
    out["extra_cflags"] = list(params.get("extra_cflags") or []) + ["-O0"]
    changed = True
  return out if changed else None


def toolchain_signature() -> dict:
  import torch

  return {
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "python": sys.version_info[:2],
    "arch": os.environ.get("TORCH_CUDA_ARCH_LIST", ""),
    "cxx": os.environ.get("CXX", ""),
  }


def build_key(bound: dict, split: bool = False) -> str:
  payload = {k: bound.get(k) for k in _KEY_ARGS}
  payload["split"] = split
  payload["toolchain"] = toolchain_signature()
  payload["fast_build"] = FAST_BUILD_VERSION
  return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:32]


class ExtensionProxy:
  """Delegates to an extension module and counts calls to its exported functions."""

  def __init__(self, module, calls: dict[str, int]):
    object.__setattr__(self, "_module", module)
    object.__setattr__(self, "_calls", calls)

  def __getattr__(self, attr):
    value = getattr(self._module, attr)
    if callable(value) and not attr.startswith("_"):
      calls = self._calls

      def counted(*args, **kwargs):
        calls[attr] = calls.get(attr, 0) + 1
        return value(*args, **kwargs)

      return counted
    return value


class CachedLoadInline:
  """Three modes. ``publish`` (compile workers, which run no candidate code): a build lands in
  ``build_root``; with ``build_only`` nothing is imported into the process (a hit is only touched, a build's
  module is not loaded: its static initialisers must not run where the cache is writable). ``remote`` (build
  workers, which run the candidate with the cache read-only): a miss is sent to ``remote(params) -> event``,
  the service's trusted compile, and the published result imported. Otherwise (run workers, cache read-only)
  a miss builds under ``scratch`` and is used once."""

  def __init__(
    self,
    real,
    build_root: str,
    fast: bool = True,
    split: bool = False,
    use_pch: bool = True,
    publish: bool = True,
    scratch: str = "",
    remote=None,
    build_only: bool = False,
    tmp_tag: str = "",
  ):
    self.real = real
    self.tmp_tag = tmp_tag or str(os.getpid())  # names its build directories (``remove_tmp``)
    self.publish = publish
    self.remote = remote
    self.build_only = build_only
    self.work_root = build_root if publish else (scratch or build_root)
    self.fast = fast
    self.split = split
    self.use_pch = use_pch
    self.signature = inspect.signature(real)
    self.build_root = build_root
    self.calls: dict[str, int] = {}
    self.events: list[dict] = []  # one per load_inline call: key, cached, seconds, error

  def __call__(self, *args, **kwargs):
    bound = self.signature.bind(*args, **kwargs)
    bound.apply_defaults()
    params = dict(bound.arguments)
    name = params["name"]
    key = build_key(params, self.split)
    final = os.path.join(self.build_root, key)
    so_path = os.path.join(final, f"{name}.so")
    event = {"name": name, "key": key, "cached": False, "seconds": 0.0, "error": ""}
    self.events.append(event)
    t0 = time.monotonic()
    python_module = params.get("is_python_module", True)
    if os.path.exists(so_path) and (python_module or self.build_only):
      event["cached"] = True
      touch(final)
      if self.build_only:
        return None
      module = _import_so(name, so_path)
    elif self.remote is not None:
      event.update(self.remote(params), name=name, key=key)
      if event["error"]:
        raise RuntimeError(event["error"])
      if not python_module:
        import torch

        torch.ops.load_library(so_path)
        return so_path
      module = _import_so(name, so_path)
    else:
      tmp = os.path.join(self.work_root, f"{key}.tmp-{self.tmp_tag}-{uuid.uuid4().hex[:8]}")
      os.makedirs(tmp)
      params.update(
        build_directory=tmp, verbose=False
      )  # verbose=False keeps compiler output in the error
      module, built, split_failed = None, False, False
      if self.split:
        module, built = self._build_split(params, event, tmp)
        split_failed = not built and "split_error" in event
      # After a failed split build, the stock build alone decides: the fast one compiles the same kernels
      # with fewer headers, so it fails too on the candidate's own errors (a broken candidate saves one
      # compile); what only the split's rewrite broke, the stock build builds as well, just slower.
      fast = fast_variant(params) if self.fast and not built and not split_failed else None
      if fast is not None:
        try:
          module, built = self._build(fast, event), True
          event["fast"] = True
        except Exception as e:  # noqa: BLE001 - fall back to the stock build below
          event["fast_error"] = str(e)[:2000]
          shutil.rmtree(tmp, ignore_errors=True)
          os.makedirs(tmp)
      if not built:
        try:
          module = self._build(params, event)
        except BaseException as e:
          event["error"] = truncate_log(str(e))  # compiler output: head and tail only
          event["seconds"] = time.monotonic() - t0
          shutil.rmtree(tmp, ignore_errors=True)
          raise
      if self.publish:
        strip_intermediates(tmp)
        event["bytes"] = entry_bytes(tmp)
        if event["bytes"] > MAX_ENTRY_BYTES:
          shutil.rmtree(tmp, ignore_errors=True)
          event["error"] = (
            f"the build's output is {event['bytes'] / 2**20:.0f} MiB, over the build cache's cap of "
            f"{MAX_ENTRY_BYTES >> 20} MiB for one extension"
          )
          event["seconds"] = time.monotonic() - t0
          raise RuntimeError(event["error"])
        try:
          os.rename(tmp, final)
        except OSError:  # another process published the same key first
          shutil.rmtree(tmp, ignore_errors=True)
    event["seconds"] = time.monotonic() - t0
    if self.build_only or not python_module:
      return module
    return ExtensionProxy(module, self.calls)

  def _build_split(self, params: dict, event: dict, tmp: str):
    """The split build (split_build.py), on the lean torch headers first; torch/extension.h again only when
    g++ failed in main.cpp. Returns (module, built); a failure leaves ``tmp`` empty for the next build."""
    for lean in (True, False):
      split = split_variant(params, lean=lean)
      if split is None:
        break
      try:
        module = self._build(split, event)
        event.update(split=True, lean=lean)
        return module, True
      except Exception as e:  # noqa: BLE001 - fall back to the next build
        # the compiler's message ends the error; its head is ninja's command lines
        event["lean_error" if lean else "split_error"] = str(e)[-2000:]
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        if not (lean and lean_may_have_failed(str(e))):
          event.setdefault("split_error", str(e)[-2000:])
          break
    return None, False

  def _build(self, params: dict, event: dict):
    """One real load_inline call (its module not imported when ``build_only``)."""
    if not self.build_only:
      return self._build_pch(params, event)
    import torch.utils.cpp_extension as cpp_extension

    real_import = cpp_extension._import_module_from_library
    cpp_extension._import_module_from_library = lambda name, path, is_python_module: None
    try:
      return self._build_pch(params, event)
    finally:
      cpp_extension._import_module_from_library = real_import

  def _build_pch(self, params: dict, event: dict):
    """One real load_inline call, with main.cpp on the cache's precompiled torch header (pch.py)."""
    includes = _leading_torch_includes(params) if self.use_pch else None
    if includes is None:
      return self.real(**params)
    flags = list(params.get("extra_cflags") or [])
    directory = pch.pch_dir(
      self.build_root,
      flags,
      params.get("extra_include_paths"),
      bool(params.get("cuda_sources")),
      toolchain_signature(),
      includes,
    )
    event["pch"] = pch.ready(directory)
    module = self.real(**dict(params, extra_cflags=flags + pch.include_flags(directory, includes)))
    if self.publish and not event["pch"] and not pch.ready(directory):
      event["pch_request"] = pch.request_from_build(params["build_directory"], directory)
    return module


def _leading_torch_includes(params: dict) -> str | None:
  """The torch includes main.cpp begins with, or None: torch/extension.h unless ``no_implicit_headers``, else
  what the sources begin with (the split build's full or lean set). Only those may be force-included from a
  PCH."""
  if not params.get("no_implicit_headers"):
    return pch.FULL_INCLUDES
  cpp = params.get("cpp_sources") or ""
  text = (cpp if isinstance(cpp, str) else "\n".join(cpp)).lstrip()
  for includes in (LEAN_TORCH_INCLUDES, pch.FULL_INCLUDES):
    if text.startswith(includes + "\n"):
      return includes
  return None


_ENTRY = re.compile(r"^[0-9a-f]{32}$")
_INTERMEDIATE = re.compile(r"\.(?:o|ninja_deps|ninja_log)$")


def is_entry_name(name: str) -> bool:
  """A cache entry's directory name (a build key), nothing a path could escape with."""
  return bool(_ENTRY.match(name))


def strip_intermediates(build_dir: str) -> None:
  """Drop object files and ninja state from a finished build: the cache serves the ``.so`` (sources and
  build.ninja stay for debugging). About 60% of a CPU entry."""
  for f in os.listdir(build_dir):
    if _INTERMEDIATE.search(f):
      try:
        os.remove(os.path.join(build_dir, f))
      except OSError:
        pass


_LEFTOVER = re.compile(r"^[0-9a-f]{32}\.(?:tmp|evict)-")
STALE_TMP_S = 3600.0  # longer than any build may run (a request's timeout, the PCH build's limit)


def remove_tmp(build_root: str, tmp_tag: str) -> int:
  """Remove the build directories a compile worker named with ``tmp_tag`` (``CachedLoadInline``): what
  it left when it was killed or lost mid-build (red team 44: a compile killed at the request's deadline
  left 1.9 GB of compiler dumps that nothing removed). Returns how many were removed."""
  marker = f".tmp-{tmp_tag}-"
  doomed = [n for n in _listdir(build_root) if _LEFTOVER.match(n) and marker in n]
  for name in doomed:
    path = os.path.join(build_root, name)
    for wait_s in (0.0, 0.5, 2.0):  # a killed compiler may still be writing for a moment
      time.sleep(wait_s)
      shutil.rmtree(path, ignore_errors=True)
      if not os.path.lexists(path):
        break
  return len(doomed)


def remove_stale(build_root: str, max_age_s: float = STALE_TMP_S) -> int:
  """Remove build directories and precompiled-header temporaries untouched for ``max_age_s``: what a
  build left where no one removed it (its worker killed, the service itself killed). Returns the count."""
  now, removed = time.time(), 0
  paths = [os.path.join(build_root, n) for n in _listdir(build_root) if _LEFTOVER.match(n)]
  pch_root = os.path.join(build_root, "pch")
  for d in _listdir(pch_root):
    sub = os.path.join(pch_root, d)
    paths += [os.path.join(sub, n) for n in _listdir(sub) if ".tmp-" in n]
  for path in paths:
    try:
      if now - os.lstat(path).st_mtime < max_age_s:
        continue
      if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
      else:
        os.remove(path)
      removed += 1
    except OSError:
      continue  # removed meanwhile
  return removed


def _listdir(path: str) -> list[str]:
  try:
    return os.listdir(path)
  except OSError:
    return []


def entry_bytes(path: str) -> int:
  """The bytes of the regular files directly in a build directory (what an entry keeps)."""
  return sum(e.stat().st_size for e in os.scandir(path) if e.is_file(follow_symlinks=False))


def touch(entry: str) -> None:
  """Mark a cache entry as used now (eviction is least-recently-used)."""
  try:
    os.utime(entry)
  except OSError:
    pass


def evict(
  build_root: str, max_bytes: int, min_age_s: float = 600.0, min_free_bytes: int = 0
) -> dict:
  """Remove least-recently-used build entries until the entries total at most ``max_bytes`` and the cache's
  filesystem has ``min_free_bytes`` free.

  Entries used within ``min_age_s`` are spared while the disk has ``min_free_bytes`` free, so a build made for a
  candidate still waiting for a device stays; under that floor nothing is spared (an evicted entry costs its
  reader a rebuild, never a wrong answer). An entry is renamed away before it is deleted, so a reader sees it
  whole or not at all. Precompiled headers are not touched; build temporaries are once stale
  (``remove_stale``)."""
  now = time.time()
  stale = remove_stale(build_root)
  entries = []
  for name in os.listdir(build_root):
    path = os.path.join(build_root, name)
    if not _ENTRY.match(name) or not os.path.isdir(path):
      continue
    try:
      entries.append((os.stat(path).st_mtime, entry_bytes(path), path))
    except OSError:
      continue  # removed meanwhile
  total = sum(size for _, size, _ in entries)
  free = shutil.disk_usage(build_root).free
  removed, freed = 0, 0
  for mtime, size, path in sorted(entries):
    short = free + freed < min_free_bytes
    if total <= max_bytes and not short:
      break
    if now - mtime < min_age_s and not short:
      continue
    doomed = f"{path}.evict-{uuid.uuid4().hex[:8]}"
    try:
      os.rename(path, doomed)
    except OSError:
      continue
    shutil.rmtree(doomed, ignore_errors=True)
    total, freed, removed = total - size, freed + size, removed + 1
  return {
    "removed": removed,
    "freed_bytes": freed,
    "kept_bytes": total,
    "entries": len(entries) - removed,
    "stale_removed": stale,
  }


def _import_so(name: str, path: str):
  loader = importlib.machinery.ExtensionFileLoader(name, path)
  spec = importlib.util.spec_from_file_location(name, path, loader=loader)
  module = importlib.util.module_from_spec(spec)
  loader.exec_module(module)
  sys.modules[name] = module
  return module


def install(build_root: str, **options) -> CachedLoadInline:
  """Replace load_inline in torch.utils.cpp_extension (what ``from ... import load_inline`` reads) by a
  ``CachedLoadInline`` with these options."""
  import torch.utils.cpp_extension as cpp_extension

  cached = CachedLoadInline(cpp_extension.load_inline, build_root, **options)
  if cached.publish:
    os.makedirs(build_root, exist_ok=True)
  cpp_extension.load_inline = cached
  return cached
