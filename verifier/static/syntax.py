"""Reading Python syntax trees for the static rules: dotted names, lines, imported modules."""

from __future__ import annotations

import ast


def dotted(node: ast.AST) -> str:
  """``a.b.c`` for a chain of names and attributes; "" for anything else (a call, a subscript)."""
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  if isinstance(node, ast.Name):
    parts.append(node.id)
    return ".".join(reversed(parts))
  return ""


def node_line(node: ast.AST) -> int:
  """The line a node starts on (0 for nodes without one)."""
  return getattr(node, "lineno", 0)


def imported_modules(node: ast.AST) -> list[str]:
  """The modules an import names (``from m import n``: ``m`` and ``m.n``, which may be a module)."""
  if isinstance(node, ast.Import):
    return [a.name for a in node.names]
  if isinstance(node, ast.ImportFrom) and node.module:
    return [node.module] + [f"{node.module}.{a.name}" for a in node.names]
  return []
