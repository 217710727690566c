"""What the static check reads of a candidate: its source within limits, parsed once (``Candidate``).

The check terminates by construction in bounded time and memory on any text (issue 24): the source,
its AST's node count and nesting depth have limits (``SourceLimits``; beyond them the verdict is
SOURCE_TOO_COMPLEX), C++/CUDA comments are blanked by one linear scan, and every regex is linear
(bounded repetitions).
"""

from __future__ import annotations

import ast
import dataclasses
import re

from verifier.api.contract import FailureKind
from verifier.static.aliases import Bound, bindings
from verifier.static.syntax import dotted, node_line


@dataclasses.dataclass(frozen=True)
class SourceLimits:
  """What the static check reads at most. KernelBench and DICE sources (4,568 files) reach 23,170
  characters, 3,703 AST nodes and depth 17 (docs/verifier-security.md, "Liveness and blame")."""

  max_chars: int = 262_144
  max_nodes: int = 50_000
  max_depth: int = 200


LIMITS = SourceLimits()


@dataclasses.dataclass(frozen=True)
class StaticVerdict:
  kind: FailureKind  # OK when nothing rejects the candidate
  reason: str = ""
  warnings: tuple[str, ...] = ()
  kernel_names: tuple[
    str, ...
  ] = ()  # __global__ functions defined in the candidate's C++/CUDA text
  functions: tuple[str, ...] = ()  # names exported through load_inline(functions=[...])


GLOBAL_KERNEL = re.compile(
  r"__global__\s+(?:__launch_bounds__\s*\([^)]{0,512}\)\s*)?(?:static\s+)?(?:inline\s+)?void\s+"
  r"(?:__launch_bounds__\s*\([^)]{0,512}\)\s*)?(\w+)"
)

NOT_NEWLINE = re.compile(r"[^\n]")
LOAD_CALLS = frozenset({"load_inline", "load"})


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


@dataclasses.dataclass(frozen=True)
class CppText:
  """One string constant of the candidate (C++/CUDA source, comments blanked) and where it starts."""

  text: str
  lineno: int

  def line_of(self, pos: int) -> int:
    return self.lineno + self.text.count("\n", 0, pos)


def _cpp_texts(tree: ast.AST) -> list[CppText]:
  return [
    CppText(_strip_cpp_comments(node.value), node.lineno)
    for node in ast.walk(tree)
    if isinstance(node, ast.Constant) and isinstance(node.value, str)
  ]


def search_cpp(pattern: re.Pattern, texts: list[CppText]) -> tuple[re.Match, int] | None:
  for t in texts:
    m = pattern.search(t.text)
    if m:
      return m, t.line_of(m.start())
  return None


def _exported_functions(tree: ast.AST) -> tuple[list[str], int, bool]:
  """(names in functions=[...] of load_inline/load calls, number of such calls, any has cuda_sources)."""
  names, calls, with_cuda = [], 0, False
  for node in ast.walk(tree):
    if isinstance(node, ast.Call) and dotted(node.func).split(".")[-1] in LOAD_CALLS:
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


def _model_new(tree: ast.Module) -> ast.ClassDef | None:
  for node in tree.body:
    if isinstance(node, ast.ClassDef) and node.name == "ModelNew":
      return node
  return None


def too_complex(what: str) -> StaticVerdict:
  return StaticVerdict(
    FailureKind.SOURCE_TOO_COMPLEX, f"candidate source is beyond the static check's limits: {what}"
  )


def _parse(source: str, limits: SourceLimits) -> ast.Module | StaticVerdict:
  """The candidate's AST, or the verdict on a source that is not Python or is beyond ``limits``."""
  if len(source) > limits.max_chars:
    return too_complex(f"{len(source):,} characters (limit {limits.max_chars:,})")
  try:
    tree = ast.parse(source)
  except SyntaxError as e:
    return StaticVerdict(
      FailureKind.SYNTAX_ERROR, f"candidate is not valid Python: {e.msg} (line {e.lineno})"
    )
  except ValueError as e:  # null bytes (Python 3.11)
    return StaticVerdict(FailureKind.SYNTAX_ERROR, f"candidate is not valid Python: {e}")
  except (RecursionError, MemoryError) as e:  # the parser's own nesting limits
    return too_complex(f"the parser gave up ({type(e).__name__}: {str(e)[:120]})")
  return _within_limits(tree, limits)


def _within_limits(tree: ast.Module, limits: SourceLimits) -> ast.Module | StaticVerdict:
  """``tree`` if it has at most ``max_nodes`` nodes nested at most ``max_depth`` deep (an iterative
  walk that stops at the first excess), else the verdict."""
  stack, nodes = [(tree, 1)], 0
  while stack:
    node, depth = stack.pop()
    nodes += 1
    if nodes > limits.max_nodes:
      return too_complex(f"more than {limits.max_nodes:,} syntax nodes")
    if depth > limits.max_depth:
      return too_complex(
        f"syntax nested more than {limits.max_depth} deep (line {node_line(node)})"
      )
    stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
  return tree


@dataclasses.dataclass(frozen=True)
class Candidate:
  """What the rules read: the parsed source and what was found in it once."""

  source: str
  tree: ast.Module
  cls: ast.ClassDef  # ModelNew
  device: str
  texts: list[CppText]
  cpp: str
  kernels: tuple[str, ...]
  functions: list[str]
  n_loads: int
  bound: Bound
  overflow: str  # the alias cap that was passed, or ""


def read_candidate(
  source: str, device: str, limits: SourceLimits = LIMITS
) -> Candidate | StaticVerdict:
  """The candidate as the rules read it, or the verdict on a source that is not Python, is beyond
  ``limits`` or has no top-level ``ModelNew``."""
  parsed = _parse(source, limits)
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
  bound, overflow = bindings(tree)
  kernels = tuple(dict.fromkeys(GLOBAL_KERNEL.findall(cpp)))
  return Candidate(
    source, tree, cls, device, texts, cpp, kernels, functions, n_loads, bound, overflow
  )
