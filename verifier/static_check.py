"""Static anti-cheating checks on a candidate's source, before anything runs.

The rule set follows KernelBench's ``kernel_static_checker.py`` (STRICT: try/except bypass, timer
patching, thread injection, lazy tensor subclasses, "requires __global__ and load_inline"; WARNING: torch
compute ops, stream injection) as summarised in reference/kernelbench_verifiers.md section 1.8, but works
on the Python AST instead of regexes where it can, and checks that a defined kernel is also launched.
"""

from __future__ import annotations

import ast
import dataclasses
import re

from verifier.contract import FailureKind, Strictness


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
FORBIDDEN_MODULES = frozenset(
  {
    "gc",
    "inspect",
    "ctypes",
    "cffi",
    "subprocess",
    "socket",
    "signal",
    "importlib",
    "builtins",
    "pickle",
    "marshal",
    "shutil",
    "sys",
    "code",
    "pty",
    "mmap",
    "faulthandler",
    "tracemalloc",
  }
)
THREAD_MODULES = frozenset({"threading", "multiprocessing", "concurrent", "asyncio", "_thread"})
PATCH_ROOTS = frozenset({"torch", "time", "F", "nn", "builtins", "np", "numpy", "os", "sys"})
FORBIDDEN_CALLS = frozenset(
  {
    "exec",
    "eval",
    "compile",
    "__import__",
    "globals",
    "setattr",
    "delattr",
    "getattr",
    "vars",
    "breakpoint",
    "open",
  }
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
GLOBAL_KERNEL = re.compile(
  r"__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(?:static\s+)?(?:inline\s+)?void\s+"
  r"(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)"
)
OS_FORBIDDEN = frozenset(
  {
    "system",
    "popen",
    "fork",
    "forkpty",
    "kill",
    "killpg",
    "_exit",
    "execv",
    "execve",
    "execvp",
    "execl",
    "execlp",
    "spawnl",
    "spawnv",
    "posix_spawn",
    "setsid",
    "putenv",
  }
)
LOAD_CALLS = frozenset({"load_inline", "load"})


def _strip_cpp_comments(text: str) -> str:
  text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
  return re.sub(r"//[^\n]*", " ", text)


def _dotted(node: ast.AST) -> str:
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  if isinstance(node, ast.Name):
    parts.append(node.id)
    return ".".join(reversed(parts))
  return ""


def _string_constants(tree: ast.AST) -> str:
  chunks = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
      chunks.append(node.value)
  return "\n".join(chunks)


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


def _forward_path_calls(cls: ast.ClassDef) -> list[ast.Call]:
  calls = []
  for item in cls.body:
    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name != "__init__":
      calls += [n for n in ast.walk(item) if isinstance(n, ast.Call)]
  return calls


def check_candidate(source: str, strictness: Strictness, device: str) -> StaticVerdict:
  """Parse and statically check a candidate; the first rule that fails decides the kind."""
  try:
    tree = ast.parse(source)
  except SyntaxError as e:
    return StaticVerdict(
      FailureKind.SYNTAX_ERROR, f"candidate is not valid Python: {e.msg} (line {e.lineno})"
    )
  cls = _model_new(tree)
  if cls is None:
    return StaticVerdict(
      FailureKind.MISSING_MODEL_NEW, "candidate defines no top-level class ModelNew"
    )

  cpp = _strip_cpp_comments(_string_constants(tree))
  kernels = tuple(dict.fromkeys(GLOBAL_KERNEL.findall(cpp)))
  functions, n_loads, with_cuda = _exported_functions(tree)
  warnings: list[str] = []

  def reject(kind: FailureKind, reason: str) -> StaticVerdict:
    return StaticVerdict(kind, reason, tuple(warnings), kernels, tuple(functions))

  # Imports and dangerous builtins.
  for node in ast.walk(tree):
    mods = []
    if isinstance(node, ast.Import):
      mods = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      mods = [node.module]
    for m in mods:
      root = m.split(".")[0]
      if root in THREAD_MODULES and strictness.forbid_threads_streams:
        return reject(
          FailureKind.THREAD_OR_STREAM, f"imports {m!r}: extra threads/processes are not allowed"
        )
      if root in FORBIDDEN_MODULES and strictness.forbid_imports:
        return reject(
          FailureKind.FORBIDDEN_IMPORT, f"imports {m!r}, which is not allowed in a candidate"
        )
    if (
      isinstance(node, ast.Call)
      and isinstance(node.func, ast.Name)
      and node.func.id in FORBIDDEN_CALLS
      and strictness.forbid_imports
    ):
      return reject(
        FailureKind.FORBIDDEN_IMPORT, f"calls builtin {node.func.id}() (line {node.lineno})"
      )
    if (
      isinstance(node, ast.Attribute)
      and node.attr.startswith("__")
      and node.attr not in ("__init__", "__name__")
      and strictness.forbid_imports
    ):
      return reject(
        FailureKind.FORBIDDEN_IMPORT, f"uses dunder attribute {node.attr} (line {node.lineno})"
      )

  # Fallbacks: try/except around the kernel, or reusing the reference Model.
  if strictness.forbid_fallback:
    for node in ast.walk(tree):
      if isinstance(node, ast.Try) or (hasattr(ast, "TryStar") and isinstance(node, ast.TryStar)):
        return reject(
          FailureKind.FALLBACK, f"try/except at line {node.lineno}: no fallback paths allowed"
        )
    for base in cls.bases:
      if _dotted(base) not in ("nn.Module", "torch.nn.Module", "Module"):
        return reject(
          FailureKind.FALLBACK, f"ModelNew must subclass nn.Module only, not {_dotted(base) or '?'}"
        )

  # Monkey patching of torch / timers / builtins, and lazy tensor subclasses.
  if strictness.forbid_monkey_patch:
    for node in ast.walk(tree):
      targets = []
      if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      for t in targets:
        name = _dotted(t) if isinstance(t, ast.Attribute) else ""
        if name and name.split(".")[0] in PATCH_ROOTS:
          return reject(FailureKind.MONKEY_PATCH, f"assigns to {name} (line {node.lineno})")
      if isinstance(node, ast.ClassDef):
        for b in node.bases:
          if _dotted(b) in ("torch.Tensor", "Tensor"):
            return reject(FailureKind.LAZY_OUTPUT, f"class {node.name} subclasses torch.Tensor")
    if re.search(r"_make_subclass|__torch_function__|__torch_dispatch__", source):
      return reject(
        FailureKind.LAZY_OUTPUT, "uses tensor-subclass hooks (_make_subclass/__torch_function__)"
      )

  if strictness.forbid_threads_streams:
    m = PY_STREAM.search(source) or CPP_STREAM_OR_THREAD.search(cpp)
    if m:
      return reject(
        FailureKind.THREAD_OR_STREAM,
        f"uses {m.group(0).strip()!r}: extra streams/threads are not allowed",
      )
  elif PY_STREAM.search(source) or CPP_STREAM_OR_THREAD.search(cpp):
    warnings.append("uses extra CUDA streams or threads")

  # A real kernel of its own, defined and launched.
  if strictness.require_kernel:
    if n_loads == 0:
      return reject(
        FailureKind.NO_KERNEL,
        "no torch.utils.cpp_extension.load_inline/load call builds an extension",
      )
    if device == "cuda":
      if not kernels:
        return reject(
          FailureKind.NO_KERNEL, "no __global__ kernel is defined in the candidate's CUDA source"
        )
      launched = [
        k
        for k in kernels
        if re.search(rf"\b{re.escape(k)}\s*(?:<[^<>;]*>\s*)?<<<", cpp)
        or re.search(rf"cudaLaunch\w*\s*\([^;]*\b{re.escape(k)}\b", cpp)
      ]
      if not launched:
        return reject(
          FailureKind.KERNEL_NOT_LAUNCHED,
          f"__global__ kernel(s) {', '.join(kernels)} defined but never launched with <<<...>>>",
        )
    elif not functions and not cpp.strip():
      return reject(
        FailureKind.NO_KERNEL, "no C++ function is exported through load_inline(functions=[...])"
      )
  m = CPP_FOREIGN_LIBS.search(cpp)
  if m:
    if strictness.forbid_torch_compute:
      return reject(
        FailureKind.FOREIGN_KERNELS,
        f"C++ source calls {m.group(0).strip()!r} (library compute, not an own kernel)",
      )
    warnings.append(f"C++ calls {m.group(0).strip()!r}")

  # Process control through os.
  if strictness.forbid_imports:
    for node in ast.walk(tree):
      if (
        isinstance(node, ast.Call)
        and _dotted(node.func).split(".")[0] == "os"
        and _dotted(node.func).split(".")[-1] in OS_FORBIDDEN
      ):
        return reject(
          FailureKind.FORBIDDEN_IMPORT, f"calls {_dotted(node.func)}() (line {node.lineno})"
        )

  # Torch compute in the forward path (calls into the candidate's own extension modules are fine).
  exported, extensions = set(functions), _extension_names(tree)
  for call in _forward_path_calls(cls):
    name = _dotted(call.func)
    parts = name.split(".")
    offending = ""
    if isinstance(call.func, ast.Attribute) and (
      call.func.attr in exported or _dotted(call.func.value) in extensions
    ):
      continue
    if parts[0] in ("torch", "F") and len(parts) >= 2:
      leaf = parts[-1]
      if parts[:2] == ["torch", "cuda"] or leaf in ALLOWED_TORCH_CALLS:
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
      if strictness.forbid_torch_compute:
        return reject(
          FailureKind.TORCH_COMPUTE,
          f"forward path calls {offending} (line {call.lineno}); only allocation/view/shape torch ops are allowed",
        )
      warnings.append(f"forward path calls {offending}")
  return StaticVerdict(FailureKind.OK, "", tuple(warnings), kernels, tuple(functions))
