"""Static anti-cheating checks on a candidate's source, before anything runs.

The rule set follows KernelBench's ``kernel_static_checker.py`` (STRICT: try/except bypass, timer
patching, thread injection, lazy tensor subclasses, "requires __global__ and load_inline"; WARNING: torch
compute ops, stream injection) (github.com/ScalingIntelligence/KernelBench, ``src/kernelbench/kernel_static_checker.py``), but works
on the Python AST instead of regexes where it can, and checks that a defined kernel is also launched.

The check terminates by construction in bounded time and memory on any text (issue 24): the source, its
AST's node count and nesting depth have limits (``SourceLimits``; beyond them the verdict is
SOURCE_TOO_COMPLEX), alias resolution has explicit caps (``MAX_ALIAS_*``; passing one is that verdict too),
and every regex is linear (bounded repetitions; comments and launches are found by scanning, not by
backtracking). The service runs it in a separate process under a deadline besides (``static_worker``).
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import re
import typing

from verifier.api.contract import FailureKind, Strictness
from verifier.static import aten_ops


@dataclasses.dataclass(frozen=True)
class SourceLimits:
  """What the static check reads at most. KernelBench and DICE sources (4,568 files) reach 23,170
  characters, 3,703 AST nodes and depth 17 (docs/verifier-security.md, "Liveness and blame")."""

  max_chars: int = 262_144
  max_nodes: int = 50_000
  max_depth: int = 200


LIMITS = SourceLimits()
# Caps on alias resolution (``_bindings``); passing one is SOURCE_TOO_COMPLEX: parts of an alias target or
# of a module path a name stands for, module paths one name may stand for, and derived values in all.
MAX_ALIAS_PARTS = 16
MAX_ALIAS_VALUES = 8
MAX_ALIAS_WORK = 100_000


@dataclasses.dataclass(frozen=True)
class StaticVerdict:
  kind: FailureKind  # OK when nothing rejects the candidate
  reason: str = ""
  warnings: tuple[str, ...] = ()
  kernel_names: tuple[
    str, ...
  ] = ()  # __global__ functions defined in the candidate's C++/CUDA text
  functions: tuple[str, ...] = ()  # names exported through load_inline(functions=[...])


# Calls under torch.* / F.* that only allocate, view or describe shape (no arithmetic on data).
ALLOWED_TORCH_CALLS = frozenset(
  {
    "empty",
    "empty_like",
    "empty_strided",
    "zeros",
    "zeros_like",
    "ones",
    "ones_like",
    "full",
    "full_like",
    "tensor",
    "as_tensor",
    "from_numpy",
    "arange",
    "Size",
    "no_grad",
    "inference_mode",
    "device",
    "dtype",
    "is_tensor",
    "numel",
    "reshape",
    "flatten",
    "unflatten",
    "squeeze",
    "unsqueeze",
    "permute",
    "transpose",
    "t",
    "narrow",
    "split",
    "chunk",
    "unbind",
    "select",
    "movedim",
    "broadcast_to",
    "view_as_real",
    "view_as_complex",
    "contiguous_format",
    "channels_last",
    "get_default_dtype",
    "is_grad_enabled",
    "current_stream",
    "current_device",
    "get_device_properties",
    "synchronize",
    "is_available",
    "set_grad_enabled",
    "manual_seed",
    "empty_cache",
    "finfo",
    "iinfo",
  }
)
# Tensor methods that compute on data; calling them in the forward path is using torch, not a kernel.
COMPUTE_METHODS = frozenset(
  {
    "matmul",
    "mm",
    "bmm",
    "addmm",
    "baddbmm",
    "einsum",
    "sum",
    "mean",
    "prod",
    "max",
    "min",
    "amax",
    "amin",
    "argmax",
    "argmin",
    "relu",
    "relu_",
    "sigmoid",
    "tanh",
    "softmax",
    "log_softmax",
    "exp",
    "log",
    "pow",
    "sqrt",
    "rsqrt",
    "abs",
    "clamp",
    "clamp_",
    "clip",
    "add",
    "add_",
    "sub",
    "sub_",
    "mul",
    "mul_",
    "div",
    "div_",
    "norm",
    "var",
    "std",
    "cumsum",
    "cumprod",
    "sort",
    "topk",
    "softplus",
    "gelu",
    "conv2d",
    "logsumexp",
    "masked_fill",
    "where",
    "gather",
    "scatter",
    "scatter_add",
    "index_select",
    "tril",
    "triu",
    "diag",
    "outer",
    "dot",
    "mv",
    "neg",
    "reciprocal",
    "sin",
    "cos",
    "erf",
    "any",
    "all",
    "logical_and",
    "logical_or",
    "logical_xor",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "floor",
    "ceil",
    "round",
    "sign",
    "square",
    "minimum",
    "maximum",
    "lerp",
    "addcmul",
    "addcdiv",
    "kthvalue",
    "median",
    "mode",
    "nonzero",
  }
)
# Modules a candidate may not import. Introspection, native access, file writing, processes, networking,
# persistence and this verifier itself (KernelBench's STRICT list plus the hacks kernel-RL projects reported).
FORBIDDEN_MODULES = frozenset(
  {
    "gc",
    "ctypes",
    "cffi",
    "subprocess",
    "_posixsubprocess",
    "socket",
    "socketserver",
    "ssl",
    "select",
    "selectors",
    "http",
    "urllib",
    "requests",
    "ftplib",
    "smtplib",
    "signal",
    "importlib",
    "builtins",
    "pickle",
    "marshal",
    "shelve",
    "dbm",
    "sqlite3",
    "copyreg",
    "dill",
    "cloudpickle",
    "shutil",
    "sys",
    "code",
    "codeop",
    "pty",
    "tty",
    "termios",
    "mmap",
    "faulthandler",
    "tracemalloc",
    "pathlib",
    "io",
    "_io",
    "tempfile",
    "fcntl",
    "posix",
    "resource",
    "atexit",
    "runpy",
    "zipimport",
    "site",
    "platform",
    "webbrowser",
    "logging",
    "zipfile",
    "tarfile",
    "weakref",
    "dis",
    "types",
    "verifier",
  }
)
FORBIDDEN_TORCH_MODULES = (
  "torch.multiprocessing",
  "torch.distributed",
  "torch.library",
  "torch.overrides",
  "torch.utils._python_dispatch",
  "torch._C",
  "torch._dynamo",
  "torch.hub",
)
FRAME_MODULES = frozenset({"inspect", "traceback"})
THREAD_MODULES = frozenset({"threading", "multiprocessing", "concurrent", "asyncio", "_thread"})
# Attributes that reach frames, code objects or another scope's variables (walking to the caller).
FRAME_ATTRIBUTES = frozenset(
  {
    "f_back",
    "f_locals",
    "f_globals",
    "f_builtins",
    "f_code",
    "f_trace",
    "f_lasti",
    "tb_frame",
    "tb_next",
    "gi_frame",
    "gi_code",
    "gi_yieldfrom",
    "cr_frame",
    "cr_code",
    "cr_await",
    "ag_frame",
    "ag_code",
    "_getframe",
    "_current_frames",
    "exc_info",
    "settrace",
    "setprofile",
    "walk_stack",
    "walk_tb",
    "extract_stack",
    "currentframe",
    "__traceback__",
    "__code__",
    "__globals__",
    "__closure__",
    "__builtins__",
  }
)
# Module names that must not be reached through another module either (``torch.utils.cpp_extension.os``).
REACHABLE_MODULE_ATTRIBUTES = frozenset(
  {
    "os",
    "sys",
    "subprocess",
    "ctypes",
    "inspect",
    "traceback",
    "gc",
    "builtins",
    "importlib",
    "shutil",
    "pathlib",
    "tempfile",
    "socket",
    "threading",
    "multiprocessing",
    "_thread",
    "pickle",
    "marshal",
    "_C",
  }
)
# Roots whose attributes a candidate may not assign: timers, builtins, numpy, os. Names bound to anything
# imported from torch (whatever the alias) are added per candidate.
PATCH_ROOTS = frozenset({"time", "builtins", "np", "numpy", "os", "sys", "math", "random"})
FORBIDDEN_CALLS = frozenset(
  {
    "exec",
    "eval",
    "compile",
    "__import__",
    "globals",
    "locals",
    "setattr",
    "delattr",
    "getattr",
    "vars",
    "breakpoint",
    "open",
    "input",
  }
)
# Builtins that reach other scopes or run code: refused wherever they are named, not only where called
# by that name (``g = getattr; g(torch, "sys")``).
BUILTIN_ALIASES = (FORBIDDEN_CALLS - {"open", "input"}) | {"__builtins__"}
# OpenMP by any route: pragmas, its header and runtime calls, the compiler and linker flags that enable it.
OPENMP = re.compile(
  r"#\s*pragma\s+omp\b|<omp\.h>|\bomp_\w+\s*\(|-f?openmp\b|-qopenmp\b|-l\s*gomp\b|-l\s*iomp5\b|"
  r"\bkmp_\w+\s*\(|\bat\s*::\s*(?:parallel_for|parallel_reduce|set_num_threads|launch|intraop_launch)\b"
)
CPP_STREAM_OR_THREAD = re.compile(
  r"cudaStreamCreate|cudaStreamCreateWithFlags|cudaStreamCreateWithPriority|getStreamFromPool|"
  r"std::thread|pthread_create|std::async|cudaGraphLaunch|#\s*include\s*<thread>"
)
PY_STREAM = re.compile(
  r"torch\.cuda\.Stream\s*\(|torch\.cuda\.stream\s*\(|\.wait_stream\s*\(|\.record_stream\s*\("
)
CPP_FOREIGN_LIBS = re.compile(
  r"\bcublas\w*\s*\(|\bcudnn\w*\s*\(|\bat::(?:matmul|mm|bmm|addmm|conv\w*|linear)\s*\(|"
  r"\btorch::(?:matmul|mm|bmm|addmm|conv\w*|linear)\s*\("
)
# Kernels called without the dispatcher (no profiler event): at::cpu::clamp_min, at::native::add_out,
# at::_ops::sum::call, at::redispatch::..., and namespace aliases or using-directives for them.
CPP_BACKEND_CALL = re.compile(
  r"\bat\s*::\s*(cpu|cuda|native|meta|mps|compositeexplicitautograd|"
  r"compositeexplicitautogradnonfunctional|compositeimplicitautograd)\s*::\s*(\w+)"
)
CPP_ANY_OP_CALL = re.compile(r"\bat\s*::\s*(_ops|redispatch)\s*::\s*\w+")
CPP_NAMESPACE_ESCAPE = re.compile(
  r"\busing\s+namespace\s+(?:::)?at\s*::\s*(?:cpu|cuda|native|_ops|meta|redispatch)\b|"
  r"\bnamespace\s+\w+\s*=\s*(?:::)?at\s*::\s*(?:cpu|cuda|native|_ops|meta|redispatch)\b|"
  r"\busing\s+(?:::)?at\s*::\s*(?:cpu|native|_ops|meta)\s*::\s*\w+"
)
GLOBAL_KERNEL = re.compile(
  r"__global__\s+(?:__launch_bounds__\s*\([^)]{0,512}\)\s*)?(?:static\s+)?(?:inline\s+)?void\s+"
  r"(?:__launch_bounds__\s*\([^)]{0,512}\)\s*)?(\w+)"
)
# A triple-chevron launch and the name before it (``k<<<``, ``ns::k<float, 4><<<``).
CHEVRON_LAUNCH = re.compile(r"\b(\w+)\s*(?:<[^<>;]{0,512}>\s*)?<<<")
CUDA_LAUNCH_CALL = re.compile(r"cudaLaunch\w*\s*\(")
IDENTIFIER = re.compile(r"\b\w+\b")
NOT_NEWLINE = re.compile(r"[^\n]")
# os functions that write files, change the process tree or signal anything.
OS_FORBIDDEN = frozenset(
  {
    "system",
    "popen",
    "fork",
    "forkpty",
    "kill",
    "killpg",
    "abort",
    "_exit",
    "execv",
    "execve",
    "execvp",
    "execvpe",
    "execl",
    "execle",
    "execlp",
    "execlpe",
    "spawnl",
    "spawnle",
    "spawnlp",
    "spawnv",
    "spawnve",
    "spawnvp",
    "posix_spawn",
    "posix_spawnp",
    "setsid",
    "setpgid",
    "setpgrp",
    "putenv",
    "unsetenv",
    "open",
    "fdopen",
    "write",
    "writev",
    "pwrite",
    "sendfile",
    "remove",
    "unlink",
    "rmdir",
    "removedirs",
    "rename",
    "renames",
    "replace",
    "mkdir",
    "makedirs",
    "mkfifo",
    "mknod",
    "symlink",
    "link",
    "truncate",
    "ftruncate",
    "chmod",
    "fchmod",
    "chown",
    "fchown",
    "lchown",
    "utime",
    "chdir",
    "fchdir",
    "chroot",
    "dup",
    "dup2",
    "pipe",
    "pipe2",
    "openpty",
    "memfd_create",
    "pidfd_open",
    "register_at_fork",
    "nice",
    "sched_setaffinity",
    "setuid",
    "setgid",
  }
)
LOAD_CALLS = frozenset({"load_inline", "load"})
TASK_FUNCTIONS = frozenset({"get_inputs", "get_init_inputs"})


@dataclasses.dataclass(frozen=True)
class Rejection:
  kind: FailureKind
  reason: str
  warning: str = ""  # what a strictness that only warns records ("": the reason)


def _blank(text: str) -> str:
  """``text`` with everything but its newlines turned into spaces."""
  return NOT_NEWLINE.sub(" ", text)


def _strip_cpp_comments(text: str) -> str:
  """Blank out C/C++ comments, keeping every newline so positions still map to lines. One left-to-right
  scan, linear in the text whatever it holds (an unterminated ``/*`` is left as it is)."""
  out, pos = [], 0
  block, line = text.find("/*"), text.find("//")
  while True:
    if 0 <= block < pos:  # each search resumes where the last one stopped: linear in all
      block = text.find("/*", pos)
    if 0 <= line < pos:
      line = text.find("//", pos)
    if block < 0 and line < 0:
      out.append(text[pos:])
      return "".join(out)
    start = min(p for p in (block, line) if p >= 0)
    if start == block:
      end = text.find("*/", start + 2)
      if end < 0:  # not a comment (nor is any later "/*"): scanned on, as the compiler would
        block = -1
        continue
      end += 2
    else:
      end = text.find("\n", start)
      end = len(text) if end < 0 else end
    out.append(text[pos:start])
    out.append(_blank(text[start:end]))
    pos = end


def _dotted(node: ast.AST) -> str:
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  if isinstance(node, ast.Name):
    parts.append(node.id)
    return ".".join(reversed(parts))
  return ""


def _launched_names(cpp: str) -> set[str]:
  """Names launched with ``<<<`` or named in a ``cudaLaunch*(...)`` call's statement (up to its ``;``).
  One pass over the text for each form (no per-kernel scans)."""
  names = set(CHEVRON_LAUNCH.findall(cpp))
  for statement in cpp.split(";"):
    m = CUDA_LAUNCH_CALL.search(statement)
    if m:
      names.update(IDENTIFIER.findall(statement, m.end()))
  return names


@dataclasses.dataclass(frozen=True)
class _CppText:
  """One string constant of the candidate (C++/CUDA source, comments blanked) and where it starts."""

  text: str
  lineno: int

  def line_of(self, pos: int) -> int:
    return self.lineno + self.text.count("\n", 0, pos)


def _cpp_texts(tree: ast.AST) -> list[_CppText]:
  return [
    _CppText(_strip_cpp_comments(node.value), node.lineno)
    for node in ast.walk(tree)
    if isinstance(node, ast.Constant) and isinstance(node.value, str)
  ]


def _search_cpp(pattern: re.Pattern, texts: list[_CppText]) -> tuple[re.Match, int] | None:
  for t in texts:
    m = pattern.search(t.text)
    if m:
      return m, t.line_of(m.start())
  return None


def _exported_functions(tree: ast.AST) -> tuple[list[str], int, bool]:
  """(names in functions=[...] of load_inline/load calls, number of such calls, any has cuda_sources)."""
  names, calls, with_cuda = [], 0, False
  for node in ast.walk(tree):
    if isinstance(node, ast.Call) and _dotted(node.func).split(".")[-1] in LOAD_CALLS:
      calls += 1
      for kw in node.keywords:
        if kw.arg == "functions" and isinstance(kw.value, (ast.List, ast.Tuple)):
          names += [
            e.value
            for e in kw.value.elts
            if isinstance(e, ast.Constant) and isinstance(e.value, str)
          ]
        if kw.arg == "cuda_sources":
          with_cuda = True
  return names, calls, with_cuda


def _extension_names(tree: ast.AST) -> set[str]:
  """Names bound to extension modules: ``ext = load_inline(...)`` and ``self.ext = ext``."""
  names: set[str] = set()
  assigns = [n for n in ast.walk(tree) if isinstance(n, ast.Assign)]
  for n in assigns:
    if isinstance(n.value, ast.Call) and _dotted(n.value.func).split(".")[-1] in LOAD_CALLS:
      names.update(_dotted(t) for t in n.targets if _dotted(t))
  for n in assigns:  # one level of aliasing, e.g. self.ops = ops
    if _dotted(n.value) in names:
      names.update(_dotted(t) for t in n.targets if _dotted(t))
  return names


def _model_new(tree: ast.Module) -> ast.ClassDef | None:
  for node in tree.body:
    if isinstance(node, ast.ClassDef) and node.name == "ModelNew":
      return node
  return None


def _skipped_scopes(tree: ast.Module, cls: ast.ClassDef) -> list[ast.AST]:
  """``ModelNew.__init__`` (builds the model once) and ``get_inputs``/``get_init_inputs`` when nothing of
  the candidate names them (the verifier never calls the candidate's)."""
  named = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
  return [
    item
    for item in cls.body
    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == "__init__"
  ] + [
    item
    for item in tree.body
    if isinstance(item, ast.FunctionDef) and item.name in TASK_FUNCTIONS and item.name not in named
  ]


def _compute_scope_calls(tree: ast.Module, cls: ast.ClassDef) -> list[ast.Call]:
  """Calls in every function of the module (any of them may run in the forward: module-level helpers,
  other classes' methods, lambdas), except ``ModelNew.__init__``, which builds the model once, and the
  task's own ``get_inputs``/``get_init_inputs`` when nothing of the candidate names them (the verifier
  never calls the candidate's)."""
  init = {id(n) for item in _skipped_scopes(tree, cls) for n in ast.walk(item)}
  calls: list[ast.Call] = []
  for fn in ast.walk(tree):
    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and id(fn) not in init:
      body = fn.body if isinstance(fn.body, list) else [fn.body]
      for stmt in body:
        calls += [n for n in ast.walk(stmt) if isinstance(n, ast.Call) and id(n) not in init]
  return list({id(c): c for c in calls}.values())


def _imported_modules(node: ast.AST) -> list[str]:
  if isinstance(node, ast.Import):
    return [a.name for a in node.names]
  if isinstance(node, ast.ImportFrom) and node.module:
    return [node.module] + [f"{node.module}.{a.name}" for a in node.names]
  return []


class _Overflow(Exception):
  """The bindings passed one of the alias caps (the reason names which)."""


def _bindings(tree: ast.AST) -> tuple[dict[str, frozenset[str]], str]:
  """Local dotted name -> every dotted module path it may stand for: each import and each plain alias
  (``T = torch``; ``self.t = Tensor``) anywhere in the module adds to its name's set, resolved through
  the other names' sets in any order. ``from torch import Tensor as X`` makes ``X`` stand for
  ``torch.Tensor``; ``x = torch`` and ``x = os`` make ``x`` stand for both. Rules fire if any value
  matches. The string returned with them says which cap was passed ('' if none; SOURCE_TOO_COMPLEX),
  and the sets are then those found so far (each value in them is still a value the name may have).

  Terminates by construction: a value has at most ``MAX_ALIAS_PARTS`` parts, a name at most
  ``MAX_ALIAS_VALUES`` values, and all evaluations together at most ``MAX_ALIAS_WORK`` derived values;
  passing a cap is a verdict, never a dropped value. A value that grows along a chain (``x = x.nn``:
  ``torch``, ``torch.nn``, ``torch.nn.nn``) is widened to ``torch.*``, where ``*`` stands for any
  attribute path, empty included, so self-extending and cyclic aliases reach a fixed point."""
  state = _BindingState()
  try:
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        for a in node.names:
          state.add(a.asname or a.name.split(".")[0], a.name if a.asname else a.name.split(".")[0])
      elif isinstance(node, ast.ImportFrom) and node.module:
        for a in node.names:
          state.add(a.asname or a.name, f"{node.module}.{a.name}")
    aliases = _aliases(tree)
    waiting: dict[str, list[int]] = collections.defaultdict(list)  # name -> aliases that read it
    for i, (_, value) in enumerate(aliases):
      parts = value.split(".")
      for k in range(1, min(len(parts), MAX_ALIAS_PARTS) + 1):
        waiting[".".join(parts[:k])].append(i)
    queue, queued = collections.deque(range(len(aliases))), set(range(len(aliases)))
    while queue:
      i = queue.popleft()
      queued.discard(i)
      name, value = aliases[i]
      changed = False
      for src in _resolve(value, state.bound, state):
        if name.count(".") >= MAX_ALIAS_PARTS:
          raise _Overflow(f"alias target {name[:80]!r} has more than {MAX_ALIAS_PARTS} parts")
        changed |= state.add(name, src)
      if changed:
        for j in waiting.get(name, ()):
          if j not in queued:
            queued.add(j)
            queue.append(j)
  except _Overflow as e:
    overflow = str(e)
  else:
    overflow = ""
  return {k: frozenset(v) for k, v in state.bound.items()}, overflow


class _BindingState:
  """The growing name -> values map of ``_bindings`` and its caps."""

  def __init__(self):
    self.bound: dict[str, set[str]] = {}
    self.work = 0

  def spend(self, steps: int = 1) -> None:
    self.work += steps
    if self.work > MAX_ALIAS_WORK:
      raise _Overflow(f"resolving aliases took more than {MAX_ALIAS_WORK:,} steps")

  def add(self, name: str, value: str) -> bool:
    """Add ``value`` to ``name``'s set (widened if it extends a chain there); True if the set grew."""
    if value.count(".") >= MAX_ALIAS_PARTS:
      raise _Overflow(f"{name[:80]!r} may stand for a path of more than {MAX_ALIAS_PARTS} parts")
    values = self.bound.setdefault(name, set())
    self.spend(1 + len(values))
    if value in values or any(_subsumes(w, value) for w in values):
      return False
    below = [u for u in values if value.startswith(u + ".")]  # values that ``value`` extends
    self.spend(len(below) * len(values))
    if any(v.startswith(u + ".") for u in values for v in below):  # a chain of three: widen
      root = min(below, key=len)
      values.difference_update([u for u in values if u == root or u.startswith(root + ".")])
      value = root + ".*"
    values.add(value)
    if len(values) > MAX_ALIAS_VALUES:
      raise _Overflow(f"{name[:80]!r} may stand for more than {MAX_ALIAS_VALUES} module paths")
    return True


def _subsumes(wide: str, value: str) -> bool:
  """Whether ``wide`` (``p.*``) stands for every path ``value`` stands for."""
  return wide.endswith(".*") and (value == wide[:-2] or value.startswith(wide[:-1]))


def _aliases(tree: ast.AST) -> list[tuple[str, str]]:
  """(target, value) of every plain ``name = dotted.name`` assignment, in walk order."""
  out = []
  for n in ast.walk(tree):
    if not isinstance(n, (ast.Assign, ast.AnnAssign)) or n.value is None:
      continue
    value = _dotted(n.value)
    if not value:
      continue
    for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
      name = _dotted(t)
      if name:
        out.append((name, value))
  return out


def _resolve(
  dotted: str, bound: dict[str, frozenset[str]] | dict[str, set[str]], state=None
) -> list[str]:
  """Every module path a dotted expression may stand for, through each of its bound heads (empty if
  none is bound). Bound names have at most ``MAX_ALIAS_PARTS`` parts, so longer heads are not looked
  up."""
  if not dotted:
    return []
  parts = dotted.split(".")
  out = []
  for i in range(min(len(parts), MAX_ALIAS_PARTS), 0, -1):
    for value in bound.get(".".join(parts[:i]), ()):
      if state is not None:
        state.spend()
      out.append(".".join([value] + parts[i:]))
  return out


def _may_be(value: str, path: str) -> bool:
  """Whether ``value`` (a resolved path, ``*`` standing for any attribute path) may be ``path``."""
  return _glob(value.split("."), path.split(".")) if "*" in value else value == path


def _glob(pattern: list[str], parts: list[str]) -> bool:
  if not pattern:
    return not parts
  if pattern[0] == "*":
    return any(_glob(pattern[1:], parts[k:]) for k in range(len(parts) + 1))
  return bool(parts) and pattern[0] == parts[0] and _glob(pattern[1:], parts[1:])


def _may_be_os_forbidden(value: str) -> bool:
  """Whether ``value`` may be an ``os`` function that writes files or controls processes."""
  if not value.startswith("os."):
    return False
  leaf = value.rsplit(".", 1)[-1]
  return leaf in OS_FORBIDDEN or leaf == "*"


def _line(node: ast.AST) -> int:
  return getattr(node, "lineno", 0)


def _import_rules(tree: ast.AST, strictness: Strictness) -> Rejection | None:
  for node in ast.walk(tree):
    for m in _imported_modules(node):
      root, line = m.split(".")[0], _line(node)
      if root in THREAD_MODULES and strictness.forbid_threads_streams:
        return Rejection(
          FailureKind.THREAD_OR_STREAM,
          f"imports {m!r} (line {line}): extra threads/processes are not allowed",
        )
      if not strictness.forbid_imports:
        continue
      if root in FRAME_MODULES:
        return Rejection(
          FailureKind.FRAME_INTROSPECTION,
          f"imports {m!r} (line {line}): frame and stack introspection is not allowed",
        )
      if root in FORBIDDEN_MODULES or any(
        m == t or m.startswith(t + ".") for t in FORBIDDEN_TORCH_MODULES
      ):
        return Rejection(
          FailureKind.FORBIDDEN_IMPORT, f"imports {m!r} (line {line}), which is not allowed"
        )
      if root == "os" and m.split(".")[-1] in OS_FORBIDDEN | {"*"}:  # from os import *: all of them
        return Rejection(
          FailureKind.FORBIDDEN_IMPORT,
          f"imports {m!r} (line {line}): file writing and process control are not allowed",
        )
  return None


Bound = dict[str, frozenset[str]]


def _introspection_rules(tree: ast.AST, bound: Bound) -> Rejection | None:
  """Builtins that execute or reach other scopes, frame walking, dunders and os process/file calls."""
  cleared: set[str] = set()
  for node in ast.walk(tree):
    line = _line(node)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
      if node.func.id in FORBIDDEN_CALLS:
        return Rejection(
          FailureKind.FORBIDDEN_IMPORT, f"calls builtin {node.func.id}() (line {line})"
        )
    if isinstance(node, ast.Attribute):
      if node.attr in FRAME_ATTRIBUTES:
        return Rejection(
          FailureKind.FRAME_INTROSPECTION,
          f"uses .{node.attr} (line {line}): frame and stack introspection is not allowed",
        )
      if node.attr.startswith("__") and node.attr not in ("__init__", "__name__"):
        return Rejection(
          FailureKind.FORBIDDEN_IMPORT, f"uses dunder attribute {node.attr} (line {line})"
        )
      if node.attr in REACHABLE_MODULE_ATTRIBUTES and _dotted(node.value) not in ("self", ""):
        return Rejection(
          FailureKind.FORBIDDEN_IMPORT,
          f"reaches module {node.attr!r} through {_dotted(node.value)} (line {line})",
        )
    if isinstance(node, ast.Call) and _dotted(node.func) not in cleared:
      cleared.add(_dotted(node.func))  # a callee name is looked at once
      for target in _resolve(_dotted(node.func), bound):  # any path the callee may stand for
        r = _forbidden_call(target, line)
        if r:
          return r
  return None


def _compute_references(tree: ast.Module, cls: ast.ClassDef, bound: Bound) -> list[tuple]:
  """(node, name) for each torch compute function referenced without being called there
  (``forward = torch.relu`` in a class body, ``map(F.relu, xs)``): a call by another name the call rules
  cannot see. Outside ``ModelNew.__init__`` and the task's own input functions."""
  skipped = {id(n) for n in _skipped_scopes(tree, cls) for n in ast.walk(n)}
  called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
  found = []
  for node in ast.walk(tree):
    if id(node) in skipped or id(node) in called:
      continue
    if not isinstance(node, (ast.Attribute, ast.Name)) or not isinstance(node.ctx, ast.Load):
      continue
    name = _dotted(node)
    for value in _resolve(name, bound) or [name]:
      parts = value.split(".")
      if (
        parts[0] == "torch"
        and len(parts) >= 2
        and parts[1] != "cuda"
        and parts[-1] not in ALLOWED_TORCH_CALLS
        and aten_ops.is_compute_operator(parts[-1])
      ):
        found.append((node, name))
        break
  return found


def _builtin_alias_rules(tree: ast.AST) -> Rejection | None:
  """A refused builtin named anywhere (an alias is as good as a call), unless the name is the
  candidate's own (an argument or an assigned name)."""
  own = {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in _all_args(n)}
  own |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
  for node in ast.walk(tree):
    if isinstance(node, ast.Name) and node.id in BUILTIN_ALIASES and node.id not in own:
      return Rejection(
        FailureKind.FORBIDDEN_IMPORT, f"refers to builtin {node.id} (line {_line(node)})"
      )
  return None


def _all_args(a: ast.arguments) -> list[ast.arg]:
  return a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]


def _sys_modules_rules(tree: ast.AST, bound: Bound) -> Rejection | None:
  """``sys`` reached as an attribute of anything (``torch.sys``, ``f().sys``), or ``sys.modules``."""
  for node in ast.walk(tree):
    if not isinstance(node, ast.Attribute):
      continue
    base = _dotted(node.value)
    if node.attr == "sys" and base != "self":
      return Rejection(
        FailureKind.FORBIDDEN_IMPORT,
        f"reaches module 'sys' through {base or 'an expression'} (line {_line(node)})",
      )
    if node.attr == "modules" and (
      base == "sys" or any(_may_be(v, "sys") for v in _resolve(base, bound))
    ):
      return Rejection(FailureKind.FORBIDDEN_IMPORT, f"uses sys.modules (line {_line(node)})")
  return None


def _profiler_rules(tree: ast.AST) -> Rejection | None:
  """The profiler behind the runtime check, named in any way (``torch.autograd._profiler_enabled``,
  ``from torch import profiler``): a candidate has no business asking whether it is observed."""
  for node in ast.walk(tree):
    names = []
    if isinstance(node, ast.Attribute):
      names = [node.attr]
    elif isinstance(node, ast.Name):
      names = [node.id]
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      names = [p for m in _imported_modules(node) for p in m.split(".")]
      names += [a.asname or "" for a in node.names]
    for name in names:
      if "profiler" in name.lower() or "kineto" in name.lower():
        return Rejection(
          FailureKind.FRAME_INTROSPECTION,
          f"refers to {name!r} (line {_line(node)}): the profiler is not the candidate's to see",
        )
  return None


def _openmp_rules(source: str) -> Rejection | None:
  """OpenMP (pragmas, runtime calls, the flags that enable it) and ATen's thread pool: threads."""
  m = OPENMP.search(source)
  if m:
    line = source.count("\n", 0, m.start()) + 1
    return Rejection(
      FailureKind.THREAD_OR_STREAM,
      f"uses {m.group(0).strip()!r} (line {line}): OpenMP and other threads are not allowed",
    )
  return None


def _forbidden_call(target: str, line: int) -> Rejection | None:
  """The rejection of a call to ``target`` (a resolved path; ``*`` may stand for any path), if any."""
  if _may_be_os_forbidden(target):
    return Rejection(
      FailureKind.FORBIDDEN_IMPORT,
      f"calls {target}() (line {line}): file writing and process control are not allowed",
    )
  if any(_may_be(target, t) for t in ("torch.utils.cpp_extension.load", "torch.ops.load_library")):
    return Rejection(
      FailureKind.FORBIDDEN_IMPORT,
      f"calls {target}() (line {line}): extensions are built from the candidate's own sources "
      "(load_inline), not from files",
    )
  if any(
    _may_be(target, t)
    for t in ("torch.save", "torch.load", "numpy.save", "numpy.savez", "numpy.load")
  ):
    return Rejection(FailureKind.FORBIDDEN_IMPORT, f"calls {target}() (line {line}): no file I/O")
  return None


def _patch_rules(tree: ast.AST, bound: Bound) -> Rejection | None:
  """Assignment to (or deletion of) an attribute of anything imported from torch / timers / os, under any
  alias, or of an expression that is not a plain name (``type(x).sum = ...``)."""
  for node in ast.walk(tree):
    if isinstance(node, ast.Assign):
      targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
      targets = [node.target]
    elif isinstance(node, ast.Delete):
      targets = node.targets
    else:
      continue
    flat = []
    for t in targets:
      flat += list(t.elts) if isinstance(t, (ast.Tuple, ast.List)) else [t]
    for t in flat:
      if isinstance(t, ast.Subscript):
        t = t.value
      if not isinstance(t, ast.Attribute):
        continue
      name = _dotted(t)
      if not name:
        return Rejection(
          FailureKind.MONKEY_PATCH,
          f"assigns to attribute .{t.attr} of an expression (line {_line(node)})",
        )
      owner = name.rsplit(".", 1)[0]  # the object whose attribute changes
      roots = {"torch"} | PATCH_ROOTS
      sources = [s for s in _resolve(owner, bound) if s.split(".")[0] in roots]
      if owner.split(".")[0] in PATCH_ROOTS or sources:
        source = sources[0] if sources else ""
        shown = name if source in ("", owner) else f"{name} ({owner} may be {source})"
        return Rejection(FailureKind.MONKEY_PATCH, f"assigns to {shown} (line {_line(node)})")
  return None


def _direct_aten(texts: list[_CppText]) -> Rejection | None:
  for t in texts:
    for pattern in (CPP_ANY_OP_CALL, CPP_NAMESPACE_ESCAPE):
      m = pattern.search(t.text)
      if m:
        return Rejection(
          FailureKind.DIRECT_ATEN_CALL,
          f"C++ uses {' '.join(m.group(0).split())!r} (line {t.line_of(m.start())}): ATen kernels "
          "called directly skip the dispatcher and the runtime check",
        )
    for m in CPP_BACKEND_CALL.finditer(t.text):
      if aten_ops.is_compute_operator(m.group(2)):
        return Rejection(
          FailureKind.DIRECT_ATEN_CALL,
          f"C++ calls at::{m.group(1)}::{m.group(2)} (line {t.line_of(m.start())}): an ATen kernel "
          "called directly (no dispatcher, invisible to the runtime check) is not an own kernel",
        )
  return None


def _too_complex(what: str) -> StaticVerdict:
  return StaticVerdict(
    FailureKind.SOURCE_TOO_COMPLEX, f"candidate source is beyond the static check's limits: {what}"
  )


def _parse(source: str, limits: SourceLimits) -> ast.Module | StaticVerdict:
  """The candidate's AST, or the verdict on a source that is not Python or is beyond ``limits``."""
  if len(source) > limits.max_chars:
    return _too_complex(f"{len(source):,} characters (limit {limits.max_chars:,})")
  try:
    tree = ast.parse(source)
  except SyntaxError as e:
    return StaticVerdict(
      FailureKind.SYNTAX_ERROR, f"candidate is not valid Python: {e.msg} (line {e.lineno})"
    )
  except ValueError as e:  # null bytes (Python 3.11)
    return StaticVerdict(FailureKind.SYNTAX_ERROR, f"candidate is not valid Python: {e}")
  except (RecursionError, MemoryError) as e:  # the parser's own nesting limits
    return _too_complex(f"the parser gave up ({type(e).__name__}: {str(e)[:120]})")
  return _within_limits(tree, limits)


def _within_limits(tree: ast.Module, limits: SourceLimits) -> ast.Module | StaticVerdict:
  """``tree`` if it has at most ``max_nodes`` nodes nested at most ``max_depth`` deep (an iterative
  walk that stops at the first excess), else the verdict."""
  stack, nodes = [(tree, 1)], 0
  while stack:
    node, depth = stack.pop()
    nodes += 1
    if nodes > limits.max_nodes:
      return _too_complex(f"more than {limits.max_nodes:,} syntax nodes")
    if depth > limits.max_depth:
      return _too_complex(f"syntax nested more than {limits.max_depth} deep (line {_line(node)})")
    stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
  return tree


@dataclasses.dataclass(frozen=True)
class Candidate:
  """What the rules read: the parsed source and what was found in it once."""

  source: str
  tree: ast.Module
  cls: ast.ClassDef  # ModelNew
  device: str
  texts: list[_CppText]
  cpp: str
  kernels: tuple[str, ...]
  functions: list[str]
  n_loads: int
  bound: Bound
  overflow: str  # the alias cap that was passed, or ""


Findings = list[Rejection]


def imports_rule(c: Candidate, strictness: Strictness) -> Findings:
  """No import of modules that reach the process, the network, the profiler or frames (the strictness
  decides which lists apply): a candidate must compute, not inspect or escape."""
  return [r for r in [_import_rules(c.tree, strictness)] if r]


def introspection_rule(c: Candidate, strictness: Strictness) -> Findings:
  """No frame walking (``sys._getframe``, ``f_back``, ``gc.get_referrers``): it reaches the checker's
  reference and golden outputs."""
  return [r for r in [_introspection_rules(c.tree, c.bound)] if r]


def builtin_alias_rule(c: Candidate, strictness: Strictness) -> Findings:
  """No aliasing of dangerous builtins (``exec``, ``eval``, ``__import__``, ``__builtins__``): an alias
  hides a forbidden call from the other rules."""
  return [r for r in [_builtin_alias_rules(c.tree)] if r]


def sys_modules_rule(c: Candidate, strictness: Strictness) -> Findings:
  """No reads of ``sys.modules``: it hands out modules the import rule forbids."""
  return [r for r in [_sys_modules_rules(c.tree, c.bound)] if r]


def profiler_rule(c: Candidate, strictness: Strictness) -> Findings:
  """No use of the profiler: the runtime check's evidence comes from it."""
  return [r for r in [_profiler_rules(c.tree)] if r]


def openmp_rule(c: Candidate, strictness: Strictness) -> Findings:
  """No OpenMP pragmas or flags: extra threads beside the timed stream."""
  return [r for r in [_openmp_rules(c.source)] if r]


def alias_budget_rule(c: Candidate, strictness: Strictness) -> Findings:
  """Alias resolution stays within its caps; a source that passes one is refused (by the patch rule when
  the values found so far show a patch, else as too complex): the rules below would be unsound on it."""
  if not c.overflow:
    return []
  r = _patch_rules(c.tree, c.bound) if strictness.forbid_monkey_patch else None
  return [r or Rejection(FailureKind.SOURCE_TOO_COMPLEX, c.overflow)]


def fallback_rule(c: Candidate, strictness: Strictness) -> Findings:
  """No try/except (a fallback path around the kernel) and ModelNew subclasses nn.Module only (not the
  reference Model)."""
  for node in ast.walk(c.tree):
    if isinstance(node, ast.Try) or (hasattr(ast, "TryStar") and isinstance(node, ast.TryStar)):
      return [
        Rejection(
          FailureKind.FALLBACK, f"try/except at line {node.lineno}: no fallback paths allowed"
        )
      ]
  for base in c.cls.bases:
    if _dotted(base) not in ("nn.Module", "torch.nn.Module", "Module"):
      return [
        Rejection(
          FailureKind.FALLBACK,
          f"ModelNew must subclass nn.Module only, not {_dotted(base) or '?'} (line {c.cls.lineno})",
        )
      ]
  return []


def monkey_patch_rule(c: Candidate, strictness: Strictness) -> Findings:
  """No assignment into torch, timers or builtins under any alias: it fakes results or timings."""
  return [r for r in [_patch_rules(c.tree, c.bound)] if r]


def lazy_output_rule(c: Candidate, strictness: Strictness) -> Findings:
  """No torch.Tensor subclasses or tensor-subclass hooks: a lazy output computes when compared."""
  for node in ast.walk(c.tree):
    if isinstance(node, ast.ClassDef):
      for b in node.bases:
        if any(_may_be(v, "torch.Tensor") for v in _resolve(_dotted(b), c.bound)) or _dotted(b) in (
          "torch.Tensor",
          "Tensor",
        ):
          return [
            Rejection(
              FailureKind.LAZY_OUTPUT,
              f"class {node.name} subclasses torch.Tensor (line {node.lineno})",
            )
          ]
  if re.search(r"_make_subclass|__torch_function__|__torch_dispatch__", c.source):
    return [
      Rejection(
        FailureKind.LAZY_OUTPUT, "uses tensor-subclass hooks (_make_subclass/__torch_function__)"
      )
    ]
  return []


def streams_rule(c: Candidate, strictness: Strictness) -> Findings:
  """No extra CUDA streams or threads (Python or C++): work off the timed stream escapes the clock."""
  stream = PY_STREAM.search(c.source)
  stream_line = c.source.count("\n", 0, stream.start()) + 1 if stream else 0
  found = _search_cpp(CPP_STREAM_OR_THREAD, c.texts)
  if not (stream or found):
    return []
  what, line = (stream.group(0), stream_line) if stream else (found[0].group(0), found[1])
  return [
    Rejection(
      FailureKind.THREAD_OR_STREAM,
      f"uses {what.strip()!r} (line {line}): extra streams/threads are not allowed",
      "uses extra CUDA streams or threads",
    )
  ]


def own_kernel_rule(c: Candidate, strictness: Strictness) -> Findings:
  """An extension is built with load_inline/load; on GPU a __global__ kernel of its own is defined and
  launched, on CPU a C++ function is exported."""
  if c.n_loads == 0:
    return [
      Rejection(
        FailureKind.NO_KERNEL,
        "no torch.utils.cpp_extension.load_inline/load call builds an extension",
      )
    ]
  if c.device == "cuda":
    if not c.kernels:
      return [
        Rejection(
          FailureKind.NO_KERNEL, "no __global__ kernel is defined in the candidate's CUDA source"
        )
      ]
    launches = _launched_names(c.cpp)
    if not [k for k in c.kernels if k in launches]:
      return [
        Rejection(
          FailureKind.KERNEL_NOT_LAUNCHED,
          f"__global__ kernel(s) {', '.join(c.kernels)} defined but never launched with <<<...>>>",
        )
      ]
  elif not c.functions and not c.cpp.strip():
    return [
      Rejection(
        FailureKind.NO_KERNEL,
        "no C++ function is exported through load_inline(functions=[...])",
      )
    ]
  return []


def foreign_libraries_rule(c: Candidate, strictness: Strictness) -> Findings:
  """No calls into cuBLAS/cuDNN/CUTLASS-style libraries from C++: library compute, not an own kernel."""
  found = _search_cpp(CPP_FOREIGN_LIBS, c.texts)
  if not found:
    return []
  call = found[0].group(0).strip()
  return [
    Rejection(
      FailureKind.FOREIGN_KERNELS,
      f"C++ source calls {call!r} (line {found[1]}): library compute, not an own kernel",
      f"C++ calls {call!r}",
    )
  ]


def direct_aten_rule(c: Candidate, strictness: Strictness) -> Findings:
  """No direct ATen kernel calls from C++ (``at::cpu::``, ``at::native::``, ``at::_ops::``): they skip
  the dispatcher, so the runtime check's profiler never sees them."""
  return [r for r in [_direct_aten(c.texts)] if r]


def compute_references_rule(c: Candidate, strictness: Strictness) -> Findings:
  """No torch compute function referred to outside a call in the forward path: torch compute by another
  name."""
  return [
    Rejection(
      FailureKind.TORCH_COMPUTE,
      f"refers to {name} (line {_line(node)}) outside a call: torch compute by another name",
    )
    for node, name in _compute_references(c.tree, c.cls, c.bound)
  ]


def compute_calls_rule(c: Candidate, strictness: Strictness) -> Findings:
  """The forward path calls only allocation/view/shape torch ops (``ALLOWED_TORCH_CALLS``) and the
  candidate's own extension (calls into it are fine)."""
  out = []
  exported, extensions = set(c.functions), _extension_names(c.tree)
  for call in _compute_scope_calls(c.tree, c.cls):
    name = _dotted(call.func)
    parts = name.split(".")
    offending = ""
    if isinstance(call.func, ast.Attribute) and (
      call.func.attr in exported or _dotted(call.func.value) in extensions
    ):
      continue
    # Every torch path it may stand for ("torch.*" may be any torch function, not only torch.cuda).
    resolved = [
      r.split(".") for r in _resolve(name, c.bound) if r.startswith("torch.") and parts[0] != "self"
    ]
    if parts[0] in ("torch", "F") and len(parts) >= 2 or resolved:
      leaf = parts[-1]
      if parts[:2] == ["torch", "cuda"] or (
        resolved and all(r[:2] == ["torch", "cuda"] for r in resolved)
      ):
        continue
      if leaf in ALLOWED_TORCH_CALLS or leaf in LOAD_CALLS:
        continue
      offending = name
    elif (
      isinstance(call.func, ast.Attribute)
      and call.func.attr in COMPUTE_METHODS
      and parts[0] != "self"
    ):
      offending = f".{call.func.attr}()"
    elif (
      isinstance(call.func, ast.Attribute) and call.func.attr in COMPUTE_METHODS and len(parts) == 2
    ):
      offending = f".{call.func.attr}()"
    if offending:
      out.append(
        Rejection(
          FailureKind.TORCH_COMPUTE,
          f"forward path calls {offending} (line {call.lineno}); only allocation/view/shape torch "
          "ops are allowed",
          f"forward path calls {offending}",
        )
      )
  return out


@dataclasses.dataclass(frozen=True)
class Rule:
  """A named rule: ``check`` (its docstring is the rationale) runs when ``applies(strictness)``; when it
  does not and ``warns``, its findings become warnings instead."""

  name: str
  check: "typing.Callable[[Candidate, Strictness], Findings]"
  applies: "typing.Callable[[Strictness], bool]"
  warns: bool = False

  @property
  def rationale(self) -> str:
    return " ".join((self.check.__doc__ or "").split())


def _always(strictness: Strictness) -> bool:
  return True


def _flag(name: str):
  return lambda strictness: getattr(strictness, name)


# In order: the first rule with a finding decides the kind.
RULES: tuple[Rule, ...] = (
  Rule("imports", imports_rule, _always),
  Rule("introspection", introspection_rule, _flag("forbid_imports")),
  Rule("builtin_aliases", builtin_alias_rule, _flag("forbid_imports")),
  Rule("sys_modules", sys_modules_rule, _flag("forbid_imports")),
  Rule("profiler", profiler_rule, _flag("forbid_imports")),
  Rule("openmp", openmp_rule, _flag("forbid_threads_streams")),
  Rule("alias_budget", alias_budget_rule, _always),
  Rule("fallback", fallback_rule, _flag("forbid_fallback")),
  Rule("monkey_patch", monkey_patch_rule, _flag("forbid_monkey_patch")),
  Rule("lazy_output", lazy_output_rule, _flag("forbid_monkey_patch")),
  Rule("streams", streams_rule, _flag("forbid_threads_streams"), warns=True),
  Rule("own_kernel", own_kernel_rule, _flag("require_kernel")),
  Rule("foreign_libraries", foreign_libraries_rule, _flag("forbid_torch_compute"), warns=True),
  Rule("direct_aten", direct_aten_rule, _flag("forbid_torch_compute"), warns=True),
  Rule("compute_references", compute_references_rule, _flag("forbid_torch_compute"), warns=True),
  Rule("compute_calls", compute_calls_rule, _flag("forbid_torch_compute"), warns=True),
)


def rules_for(strictness: Strictness) -> list[str]:
  """The names of the rules that reject under ``strictness`` (the others run only to warn, or not)."""
  return [r.name for r in RULES if r.applies(strictness)]


def check_candidate(source: str, strictness: Strictness, device: str) -> StaticVerdict:
  """Parse and statically check a candidate; the first rule (``RULES``) with a finding decides the kind."""
  parsed = _parse(source, LIMITS)
  if isinstance(parsed, StaticVerdict):
    return parsed
  tree = parsed
  cls = _model_new(tree)
  if cls is None:
    return StaticVerdict(
      FailureKind.MISSING_MODEL_NEW, "candidate defines no top-level class ModelNew"
    )
  texts = _cpp_texts(tree)
  cpp = "\n".join(t.text for t in texts)
  functions, n_loads, _ = _exported_functions(tree)
  bound, overflow = _bindings(tree)
  kernels = tuple(dict.fromkeys(GLOBAL_KERNEL.findall(cpp)))
  c = Candidate(source, tree, cls, device, texts, cpp, kernels, functions, n_loads, bound, overflow)
  warnings: list[str] = []
  for rule in RULES:
    if rule.applies(strictness):
      found = rule.check(c, strictness)
      if found and found[0].kind is FailureKind.SOURCE_TOO_COMPLEX:
        return _too_complex(found[0].reason)
      if found:
        return StaticVerdict(
          found[0].kind, found[0].reason, tuple(warnings), kernels, tuple(functions)
        )
    elif rule.warns:
      warnings += [r.warning or r.reason for r in rule.check(c, strictness)]
  return StaticVerdict(FailureKind.OK, "", tuple(warnings), kernels, tuple(functions))
