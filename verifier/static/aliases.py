"""Alias resolution for the static rules: which module paths each local name may stand for.

``T = torch``, ``from torch import Tensor as X``, ``self.t = Tensor``: the rules look through every
alias, in any order. Resolution terminates by construction under explicit caps (``MAX_ALIAS_*``);
passing one is a verdict (SOURCE_TOO_COMPLEX, or the patch rule on what was found), never a dropped
value (issue 24).
"""

from __future__ import annotations

import ast
import collections

from verifier.static.syntax import dotted

# Caps on alias resolution (``bindings``); passing one is SOURCE_TOO_COMPLEX: parts of an alias target or
# of a module path a name stands for, module paths one name may stand for, and derived values in all.
MAX_ALIAS_PARTS = 16
MAX_ALIAS_VALUES = 8
MAX_ALIAS_WORK = 100_000
# A name -> the module paths it may stand for (``bindings``).
Bound = dict[str, frozenset[str]]


class Overflow(Exception):
  """The bindings passed one of the alias caps (the reason names which)."""


def bindings(tree: ast.AST) -> tuple[dict[str, frozenset[str]], str]:
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
      for src in resolve(value, state.bound, state):
        if name.count(".") >= MAX_ALIAS_PARTS:
          raise Overflow(f"alias target {name[:80]!r} has more than {MAX_ALIAS_PARTS} parts")
        changed |= state.add(name, src)
      if changed:
        for j in waiting.get(name, ()):
          if j not in queued:
            queued.add(j)
            queue.append(j)
  except Overflow as e:
    overflow = str(e)
  else:
    overflow = ""
  return {k: frozenset(v) for k, v in state.bound.items()}, overflow


class _BindingState:
  """The growing name -> values map of ``bindings`` and its caps."""

  def __init__(self):
    self.bound: dict[str, set[str]] = {}
    self.work = 0

  def spend(self, steps: int = 1) -> None:
    self.work += steps
    if self.work > MAX_ALIAS_WORK:
      raise Overflow(f"resolving aliases took more than {MAX_ALIAS_WORK:,} steps")

  def add(self, name: str, value: str) -> bool:
    """Add ``value`` to ``name``'s set (widened if it extends a chain there); True if the set grew."""
    if value.count(".") >= MAX_ALIAS_PARTS:
      raise Overflow(f"{name[:80]!r} may stand for a path of more than {MAX_ALIAS_PARTS} parts")
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
      raise Overflow(f"{name[:80]!r} may stand for more than {MAX_ALIAS_VALUES} module paths")
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
    value = dotted(n.value)
    if not value:
      continue
    for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
      name = dotted(t)
      if name:
        out.append((name, value))
  return out


def resolve(
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


def may_be(value: str, path: str) -> bool:
  """Whether ``value`` (a resolved path, ``*`` standing for any attribute path) may be ``path``."""
  return _glob(value.split("."), path.split(".")) if "*" in value else value == path


def _glob(pattern: list[str], parts: list[str]) -> bool:
  if not pattern:
    return not parts
  if pattern[0] == "*":
    return any(_glob(pattern[1:], parts[k:]) for k in range(len(parts) + 1))
  return bool(parts) and pattern[0] == parts[0] and _glob(pattern[1:], parts[1:])
