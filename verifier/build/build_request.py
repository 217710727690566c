"""What a candidate may ask the trusted compiler to build (``load_inline`` arguments), checked before any
compiler runs.

Candidate Python never runs where the build cache is writable: a build worker that executes the candidate
sends each ``load_inline`` call's arguments to the service, and a compile worker that runs no candidate code
builds them and publishes the result (``build_main``). The arguments are still the candidate's, and compiler
flags can run code (``-fplugin=``, ``-wrapper``, ``-B``, ``-specs=``, ``-ccbin``, ``-Wl,-plugin``, ...), so
only flags from an allow-list pass: optimisation, debug info, warnings, language standard, macros, target
architecture, ptxas options and the CUDA/BLAS/OpenMP libraries. Anything else is refused with its name.
(Builds shared across candidates: PyTorch's ``torch/utils/cpp_extension.py`` mechanics.)
"""

from __future__ import annotations

import re
from typing import Any

# Arguments that change what is built (build_cache._KEY_ARGS) plus ones the compile worker overrides.
SOURCE_ARGS = ("cpp_sources", "cuda_sources")
FLAG_ARGS = ("extra_cflags", "extra_cuda_cflags", "extra_ldflags")
BOOL_ARGS = ("with_cuda", "is_python_module", "with_pytorch_error_handling", "no_implicit_headers")
IGNORED_ARGS = ("build_directory", "verbose", "keep_intermediates", "use_pch")
MAX_SOURCE_CHARS = 2_000_000

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}")
_LIBS = (
  "cublas|cublasLt|cudnn|curand|cufft|cusparse|cusolver|cuda|cudart|nvrtc|nvToolsExt|gomp|m|pthread"
)
# Words g++ takes as the flags they are (``extra_cflags``, ``extra_ldflags`` and what ``-Xcompiler`` hands
# to nvcc's host compiler) ...
_HOST_WORDS = (
  r"-O[0-3s]?|-Ofast",
  r"-g[0-3]?|-DNDEBUG",
  r"-w|-W(?:all|extra|error|pedantic)|-Wno-[A-Za-z0-9-]+",
  r"-std=(?:c|gnu)\+\+[0-9a-z]{2}|--std=c\+\+[0-9a-z]{2}",
  r"-[DU][A-Za-z_][A-Za-z0-9_]*(?:=[A-Za-z0-9_.+\-]*)?",
  r"-?-use_fast_math|-ffast-math|-funroll-loops|-fno-strict-aliasing|-fopenmp|-fPIC|-fno-math-errno",
  r"-march=native|-mtune=native|-mavx2?|-mavx512[a-z]*|-mfma|-mf16c",
  r"-v",
  rf"-l(?:{_LIBS})",
)
# ... and nvcc's own, for ``extra_cuda_cflags`` only: to g++ some mean something else (red team 44:
# ``-dlcm=ca`` is ``-d`` with ``a``, every RTL dump written into the build directory, gigabytes; a bare
# number is an input file; ``-t`` traces the link; ``-lineinfo`` is ``-l ineinfo``).
_NVCC_WORDS = (
  r"-G|-lineinfo|--generate-line-info|--disable-warnings|-Wno-deprecated-gpu-targets",
  r"--expt-relaxed-constexpr|--expt-extended-lambda|--extended-lambda|--restrict",
  r"--ftz=(?:true|false)|--prec-div=(?:true|false)|--prec-sqrt=(?:true|false)|--fmad=(?:true|false)",
  r"-Xptxas|-Xcompiler|-dlcm=c[ag]|--?maxrregcount=?[0-9]*|[0-9]{1,4}",
  r"-Xptxas=[A-Za-z0-9_,=.\-]+|--ptxas-options=[A-Za-z0-9_,=.\-]+",
  r"-arch=(?:sm|compute)_[0-9]{2,3}a?|--gpu-architecture=(?:sm|compute)_[0-9]{2,3}a?",
  r"-gencode(?:=|\s)?|(?:-gencode=)?arch=compute_[0-9]{2,3}a?,code=\[?(?:sm|compute)_[0-9]{2,3}a?"
  r"(?:,(?:sm|compute)_[0-9]{2,3}a?)*\]?",
  r"--threads=?[0-9]*|-t[0-9]*",
)
_HOST_FLAG = re.compile(r"|".join(_HOST_WORDS))
_FLAG = re.compile(r"|".join(_HOST_WORDS + _NVCC_WORDS))
NVCC_ARGS = ("extra_cuda_cflags",)  # the rest of FLAG_ARGS go to g++


class BuildRefused(ValueError):
  """A ``load_inline`` call the compile worker will not run; the message names the argument."""


def _strings(value: Any, arg: str) -> list[str]:
  if value is None:
    return []
  if isinstance(value, str):
    return [value]
  if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
    return list(value)
  raise BuildRefused(f"load_inline {arg} must be a string or a list of strings")


def _check_flags(flags: list[str], arg: str) -> None:
  """Each word of ``flags`` against the allow-list: torch joins the flags with spaces into a ninja line
  that ``/bin/sh`` splits again, so ``"-Xptxas -v"`` is two flags and ``""`` (KernelBench's one-shot
  example, and the prompts built from it, pass ``extra_cflags=[""]``) is none. Words for g++ (all of
  ``extra_cflags`` and ``extra_ldflags``, and what ``-Xcompiler`` passes on) come from the host list."""
  for flag in flags:  # a newline would start a new line of build.ninja
    if any(ord(c) < 32 and c != "\t" for c in flag):
      raise BuildRefused(f"build flag {flag!r} in load_inline {arg} holds a control character")
  prefix = "-Xcompiler="
  words = " ".join(flags).replace("\t", " ").split(" ")  # the shell's blanks only
  host_next = False
  for word in filter(None, words):
    host = arg not in NVCC_ARGS or host_next or word.startswith(prefix)
    parts = word[len(prefix) :].split(",") if word.startswith(prefix) else [word]
    for part in parts:
      _check_word(part, arg, host)
    host_next = word == "-Xcompiler"


def _check_word(part: str, arg: str, host: bool) -> None:
  if (_HOST_FLAG if host else _FLAG).fullmatch(part):
    return
  if host and _FLAG.fullmatch(part):
    raise BuildRefused(
      f"build flag {part!r} in load_inline {arg} is an nvcc flag, which g++ would take for another "
      "(pass it in extra_cuda_cflags)"
    )
  raise BuildRefused(
    f"build flag {part!r} in load_inline {arg} is not allowed (flags that load code or change "
    "the tools or their search paths are refused; allowed: -O, -g, -W..., -std=, -D/-U, "
    "--use_fast_math, -arch/-gencode, -Xptxas, --maxrregcount, -l of the CUDA/BLAS/OpenMP libraries)"
  )


def check(params: dict[str, Any]) -> dict[str, Any]:
  """The arguments of one ``load_inline`` call as the compile worker will pass them, or BuildRefused."""
  unknown = set(params) - {"name", "functions", "extra_include_paths", "sycl_sources"}
  unknown -= set(
    SOURCE_ARGS + FLAG_ARGS + BOOL_ARGS + IGNORED_ARGS + ("extra_sycl_cflags", "with_sycl")
  )
  if unknown:
    raise BuildRefused(f"load_inline got unknown arguments {sorted(unknown)}")
  name = params.get("name")
  if not isinstance(name, str) or not _NAME.fullmatch(name):
    raise BuildRefused(f"load_inline name must be a Python identifier (<= 100 chars), got {name!r}")
  if params.get("sycl_sources") or params.get("extra_sycl_cflags") or params.get("with_sycl"):
    raise BuildRefused("load_inline SYCL sources are not supported")
  out: dict[str, Any] = {"name": name}
  size = 0
  for (
    arg
  ) in SOURCE_ARGS:  # kept as given (a string or a list): the cache key hashes them as they are
    if params.get(arg) is not None:
      size += sum(len(s) for s in _strings(params[arg], arg))
      out[arg] = params[arg] if isinstance(params[arg], str) else list(params[arg])
  if size > MAX_SOURCE_CHARS:
    raise BuildRefused(f"load_inline sources are {size:,} characters (limit {MAX_SOURCE_CHARS:,})")
  functions = params.get("functions")
  if isinstance(functions, dict):
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in functions.items()):
      raise BuildRefused("load_inline functions must map names to docstrings (strings)")
    out["functions"] = dict(functions)
  elif functions is not None:
    out["functions"] = _strings(functions, "functions")
  for arg in FLAG_ARGS:
    _check_flags(_strings(params.get(arg), arg), arg)
  for p in _strings(params.get("extra_include_paths"), "extra_include_paths"):
    if not p or any(c.isspace() for c in p) or p.startswith("-"):
      raise BuildRefused(f"load_inline extra_include_paths entry {p!r} is not a plain path")
  for arg in FLAG_ARGS + ("extra_include_paths",):
    if params.get(arg) is not None:
      out[arg] = params[arg] if isinstance(params[arg], str) else list(params[arg])
  for arg in BOOL_ARGS:
    value = params.get(arg)
    if value is not None and not isinstance(value, bool):
      raise BuildRefused(f"load_inline {arg} must be True, False or None, got {value!r}")
    if value is not None:
      out[arg] = value
  return out
