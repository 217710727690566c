"""Judging a built extension by what it links against: its undefined dynamic symbols.

The source rules read the C++ before the preprocessor, so a macro (``#define NS cpu`` then
``at::NS::clamp_min``) or a generated name hides a call from them; the linker cannot be fooled that way.
Whatever produced it, a ``.so`` that imports an ATen kernel without the dispatcher (``at::cpu::``,
``at::native::``, ``at::cuda::`` kernels, ``at::_ops::<op>::call``, ``at::redispatch::``), a switch of the
profiler's RecordFunction, Python reached by name or through the interpreter's frames, or a thread/OpenMP
runtime is refused. Allocation, view and copy operators and utilities (``at::cuda::getCurrentCUDAStream``)
stay allowed (``aten_ops``).

Runs in the service (trusted code: it parses the file, never loads it). The ELF reader is small and
bounded: a malformed file is refused, not trusted.
"""

from __future__ import annotations

import dataclasses
import os
import struct

from verifier.api.contract import FailureKind
from verifier.static import aten_ops

MAX_SO_BYTES = 1 << 30
KERNEL_NAMESPACES = frozenset(
  {
    "cpu",
    "cuda",
    "native",
    "meta",
    "mps",
    "redispatch",
    "compositeexplicitautograd",
    "compositeexplicitautogradnonfunctional",
    "compositeimplicitautograd",
  }
)
RECORD_FUNCTION_NAMES = frozenset(
  {
    "enableRecordFunction",
    "isRecordFunctionEnabled",
    "addThreadLocalCallback",
    "addGlobalCallback",
    "removeCallback",
    "disableCallback",
    "reenableCallback",
    "clearCallbacks",
    "clearThreadLocalCallbacks",
    "clearGlobalCallbacks",
    "hasCallbacks",
    "hasThreadLocalCallbacks",
    "hasGlobalCallbacks",
  }
)
THREAD_C_PREFIXES = ("omp_", "GOMP_", "__kmpc_", "kmp_", "pthread_create", "thrd_create")
# Python reached from C++ by name (``py::module_::import("torch").attr("relu")``): not the static check's
# to see, so not the extension's to do.
PYTHON_BY_NAME_PREFIXES = ("PyImport_", "PyRun_", "PyEval_EvalCode", "Py_CompileString")
# The interpreter's frames, locals and globals reached from C++ (red team 42, Hole E2: the worker's own
# frame, ``PyEval_GetFrame`` + ``PyFrame_GetLocals``, gave its exchange buffers to write the output into
# and return) and ``sys`` (``sys.modules`` reaches every module). Every pybind11 build links three
# ``PyFrame_`` functions (``error_already_set`` walks a traceback's frames for its message) and
# ``PyEval_GetBuiltins`` (pickling a function record): those stay allowed, so builtins and a traceback's
# frames remain reachable (docs/verifier-security.md).
PYTHON_FRAME_PREFIXES = (
  "PyEval_GetFrame",  # and PyEval_GetFrameLocals/Globals/Builtins (3.13)
  "PyThreadState_GetFrame",
  "PyEval_GetLocals",
  "PyEval_GetGlobals",
  "PyFrame_",
  "_PyFrame_",
  "_PyEval_",
  "PySys_GetObject",
)
PYBIND11_FRAME_NAMES = frozenset({"PyFrame_GetBack", "PyFrame_GetCode", "PyFrame_GetLineNumber"})
THREAD_ATEN_NAMES = frozenset(
  {"invoke_parallel", "lazy_init_num_threads", "set_num_threads", "launch", "intraop_launch"}
)


@dataclasses.dataclass(frozen=True)
class Finding:
  kind: FailureKind
  reason: str


class ElfError(ValueError):
  pass


def undefined_symbols(path: str) -> list[str]:
  """Names of the undefined symbols in an ELF64 little-endian file's dynamic symbol table."""
  if os.path.getsize(path) > MAX_SO_BYTES:
    raise ElfError(f"{path} is larger than {MAX_SO_BYTES} bytes")
  with open(path, "rb") as f:
    data = f.read()
  if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
    raise ElfError("not a 64-bit little-endian ELF file")
  shoff, shentsize, shnum = _header(data)
  sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
  names = []
  for _, sh_type, _, _, off, size, link, _, _, entsize in sections:
    if sh_type != 11 or entsize < 24 or link >= shnum:  # SHT_DYNSYM
      continue
    str_off, str_size = sections[link][4], sections[link][5]
    for k in range(size // entsize):
      st_name, _, _, st_shndx = struct.unpack_from("<IBBH", data, off + k * entsize)
      if st_shndx == 0 and 0 < st_name < str_size:
        end = data.index(b"\0", str_off + st_name)
        names.append(data[str_off + st_name : end].decode("ascii", "replace"))
  return names


def _header(data: bytes) -> tuple[int, int, int]:
  if len(data) < 64:
    raise ElfError("truncated ELF header")
  shoff = struct.unpack_from("<Q", data, 0x28)[0]
  shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
  if shentsize < 64 or shoff + shnum * shentsize > len(data):
    raise ElfError("section headers outside the file")
  return shoff, shentsize, shnum


def nested_name(symbol: str) -> list[str]:
  """The leading components of an Itanium-mangled nested name: ``_ZN2at3cpu9clamp_minE...`` ->
  ``['at', 'cpu', 'clamp_min']`` (empty for names that are not nested)."""
  if not symbol.startswith("_ZN"):
    return []
  i, parts = 3, []
  while i < len(symbol) and symbol[i] in "rVKRO":
    i += 1
  if symbol.startswith("St", i):  # ``std::`` is abbreviated
    parts.append("std")
    i += 2
  while i < len(symbol) and symbol[i].isdigit():
    j = i
    while j < len(symbol) and symbol[j].isdigit():
      j += 1
    n = int(symbol[i:j])
    parts.append(symbol[j : j + n])
    i = j + n
  return parts


def _op_struct_operator(name: str) -> str:
  """``at::_ops`` structs are named ``<op>_<overload>``: the longest prefix that is an operator."""
  pieces = name.split("_")
  ops = aten_ops.operator_names()
  for k in range(len(pieces), 0, -1):
    head = "_".join(pieces[:k])
    if head in ops or aten_ops.base_operator(head) in ops:
      return head
  return name


def _computes(op: str) -> bool:
  """An operator that computes: not one the runtime check allows (allocation, views, copies)."""
  allowed = aten_ops.ALLOWED_ATEN
  return aten_ops.is_compute_operator(op) and not (
    op in allowed or aten_ops.base_operator(op) in allowed
  )


def judge_symbol(symbol: str) -> Finding | None:
  """Why an extension importing ``symbol`` is refused (None: allowed)."""
  if symbol.startswith(THREAD_C_PREFIXES):
    return Finding(FailureKind.THREAD_OR_STREAM, f"imports {symbol} (threads or OpenMP)")
  if symbol.startswith(PYTHON_BY_NAME_PREFIXES):
    return Finding(
      FailureKind.FORBIDDEN_IMPORT, f"imports {symbol} (Python modules reached from C++)"
    )
  if symbol.startswith(PYTHON_FRAME_PREFIXES) and symbol not in PYBIND11_FRAME_NAMES:
    return Finding(
      FailureKind.FRAME_INTROSPECTION,
      f"imports {symbol} (the interpreter's frames, locals or sys reached from C++)",
    )
  parts = nested_name(symbol)
  if len(parts) < 2:
    return None
  if any("RecordFunction" in p or p in RECORD_FUNCTION_NAMES or p == "profiler" for p in parts):
    return Finding(
      FailureKind.DIRECT_ATEN_CALL,
      f"imports {'::'.join(parts)}: the profiler's RecordFunction is not the candidate's to touch",
    )
  if parts[0] == "std" and parts[1] == "thread":
    return Finding(FailureKind.THREAD_OR_STREAM, "imports std::thread")
  if parts[0] != "at" or len(parts) < 3:
    return None
  if parts[-1] in THREAD_ATEN_NAMES or parts[1] == "internal" and "parallel" in parts[2]:
    return Finding(FailureKind.THREAD_OR_STREAM, f"imports {'::'.join(parts)} (ATen's thread pool)")
  op = ""
  if parts[1] in KERNEL_NAMESPACES:
    op = parts[2]
  elif parts[1] == "_ops":
    op = _op_struct_operator(parts[2])
  if op and _computes(op):
    return Finding(
      FailureKind.DIRECT_ATEN_CALL,
      f"imports {'::'.join(parts[:3])}: an ATen kernel called from the extension is not an own kernel",
    )
  return None


def judge_extension(path: str) -> Finding | None:
  """The first reason to refuse the built extension at ``path`` (None: nothing found)."""
  try:
    symbols = undefined_symbols(path)
  except (OSError, ElfError, struct.error, ValueError) as e:
    return Finding(FailureKind.COMPILE_ERROR, f"the built extension cannot be read: {e}")
  for symbol in symbols:
    found = judge_symbol(symbol)
    if found is not None:
      return found
  return None


def enforced(kind: FailureKind, strictness) -> bool:
  """Whether the request's strictness refuses a finding of ``kind``."""
  if kind is FailureKind.THREAD_OR_STREAM:
    return strictness.forbid_threads_streams
  if kind is FailureKind.DIRECT_ATEN_CALL:
    return strictness.forbid_torch_compute
  if kind in (FailureKind.FORBIDDEN_IMPORT, FailureKind.FRAME_INTROSPECTION):
    return strictness.forbid_imports
  return True


def check_build(build_root: str, events, strictness) -> Finding | None:
  """The first enforced finding over the extensions a build produced (``build_cache`` events name
  ``<build_root>/<key>/<name>.so``); an extension that is not a Python module or not in the cache is
  not judged here."""
  for ev in events:
    key, name = ev.get("key", ""), ev.get("name", "")
    path = os.path.join(build_root, key, f"{name}.so")
    if not key or not name or ev.get("error") or not os.path.isfile(path):
      continue
    found = judge_extension(path)
    if found is not None and enforced(found.kind, strictness):
      return dataclasses.replace(found, reason=f"extension {name!r} {found.reason}")
  return None
