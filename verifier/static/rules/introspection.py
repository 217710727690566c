"""Introspection: no way to reach the checker's frames, other scopes, the profiler or the file system.

A candidate that walks to its caller's frame reads the reference's golden outputs; one that asks
the profiler whether it is observed can behave only when unobserved (docs/verifier-security.md).
"""

from __future__ import annotations

import ast

from verifier.api.contract import FailureKind, Strictness
from verifier.static.aliases import Bound, may_be, resolve
from verifier.static.rules.base import Findings, Rejection, Rule
from verifier.static.rules.imports import OS_FORBIDDEN
from verifier.static.source import Candidate
from verifier.static.syntax import dotted, imported_modules, node_line

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


def _may_be_os_forbidden(value: str) -> bool:
  """Whether ``value`` may be an ``os`` function that writes files or controls processes."""
  if not value.startswith("os."):
    return False
  leaf = value.rsplit(".", 1)[-1]
  return leaf in OS_FORBIDDEN or leaf == "*"


def _introspection_rules(tree: ast.AST, bound: Bound) -> Rejection | None:
  """Builtins that execute or reach other scopes, frame walking, dunders and os process/file calls."""
  cleared: set[str] = set()
  for node in ast.walk(tree):
    line = node_line(node)
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
      if node.attr in REACHABLE_MODULE_ATTRIBUTES and dotted(node.value) not in ("self", ""):
        return Rejection(
          FailureKind.FORBIDDEN_IMPORT,
          f"reaches module {node.attr!r} through {dotted(node.value)} (line {line})",
        )
    if isinstance(node, ast.Call) and dotted(node.func) not in cleared:
      cleared.add(dotted(node.func))  # a callee name is looked at once
      for target in resolve(dotted(node.func), bound):  # any path the callee may stand for
        r = _forbidden_call(target, line)
        if r:
          return r
  return None


def _forbidden_call(target: str, line: int) -> Rejection | None:
  """The rejection of a call to ``target`` (a resolved path; ``*`` may stand for any path), if any."""
  if _may_be_os_forbidden(target):
    return Rejection(
      FailureKind.FORBIDDEN_IMPORT,
      f"calls {target}() (line {line}): file writing and process control are not allowed",
    )
  if any(may_be(target, t) for t in ("torch.utils.cpp_extension.load", "torch.ops.load_library")):
    return Rejection(
      FailureKind.FORBIDDEN_IMPORT,
      f"calls {target}() (line {line}): extensions are built from the candidate's own sources "
      "(load_inline), not from files",
    )
  if any(
    may_be(target, t)
    for t in ("torch.save", "torch.load", "numpy.save", "numpy.savez", "numpy.load")
  ):
    return Rejection(FailureKind.FORBIDDEN_IMPORT, f"calls {target}() (line {line}): no file I/O")
  return None


def _builtin_alias_rules(tree: ast.AST) -> Rejection | None:
  """A refused builtin named anywhere (an alias is as good as a call), unless the name is the
  candidate's own (an argument or an assigned name)."""
  own = {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in _all_args(n)}
  own |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
  for node in ast.walk(tree):
    if isinstance(node, ast.Name) and node.id in BUILTIN_ALIASES and node.id not in own:
      return Rejection(
        FailureKind.FORBIDDEN_IMPORT, f"refers to builtin {node.id} (line {node_line(node)})"
      )
  return None


def _all_args(a: ast.arguments) -> list[ast.arg]:
  return a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]


def _sys_modules_rules(tree: ast.AST, bound: Bound) -> Rejection | None:
  """``sys`` reached as an attribute of anything (``torch.sys``, ``f().sys``), or ``sys.modules``."""
  for node in ast.walk(tree):
    if not isinstance(node, ast.Attribute):
      continue
    base = dotted(node.value)
    if node.attr == "sys" and base != "self":
      return Rejection(
        FailureKind.FORBIDDEN_IMPORT,
        f"reaches module 'sys' through {base or 'an expression'} (line {node_line(node)})",
      )
    if node.attr == "modules" and (
      base == "sys" or any(may_be(v, "sys") for v in resolve(base, bound))
    ):
      return Rejection(FailureKind.FORBIDDEN_IMPORT, f"uses sys.modules (line {node_line(node)})")
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
      names = [p for m in imported_modules(node) for p in m.split(".")]
      names += [a.asname or "" for a in node.names]
    for name in names:
      if "profiler" in name.lower() or "kineto" in name.lower():
        return Rejection(
          FailureKind.FRAME_INTROSPECTION,
          f"refers to {name!r} (line {node_line(node)}): the profiler is not the candidate's to see",
        )
  return None


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


RULES = (
  Rule("introspection", introspection_rule, "forbid_imports"),
  Rule("builtin_aliases", builtin_alias_rule, "forbid_imports"),
  Rule("sys_modules", sys_modules_rule, "forbid_imports"),
  Rule("profiler", profiler_rule, "forbid_imports"),
)
