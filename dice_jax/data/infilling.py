"""Split a whole candidate kernel file into DICE infilling parts (DICE, github.com/deadlykitten4/DICE `training/RL/`).

In DICE's infilling data ``prefix + middle + suffix == cuda_code``, where ``middle`` is the whole CUDA source
string assignment (``source = \"\"\" #include ... kernels ... host wrappers ... \"\"\"``), ``prefix`` the imports
(plus an optional comment) before it and ``suffix`` everything after (cpp declarations, ``load_inline``,
``class ModelNew``).
"""

from __future__ import annotations

import dataclasses
import re

from dice_jax.errors import UserError

# A top-level assignment of a triple-quoted string: NAME = [prefix]\"\"\" or '''.
_TRIPLE_ASSIGN = re.compile(r"^([A-Za-z_]\w*)[ \t]*=[ \t]*[rRuU]?(\"\"\"|''')", re.MULTILINE)
_CUDA_MARKERS = ("__global__", "<<<", "#include")


@dataclasses.dataclass(frozen=True)
class InfillSplit:
  prefix: str
  middle: str
  suffix: str

  def join(self) -> str:
    return self.prefix + self.middle + self.suffix


class NoCudaSourceError(UserError):
  """The file has no top-level triple-quoted CUDA source assignment."""


def _string_assignments(code: str) -> list[tuple[int, int, str, str]]:
  """(start, end, name, body) for every top-level NAME = \"\"\"...\"\"\" assignment, in file order."""
  out = []
  pos = 0
  while True:
    m = _TRIPLE_ASSIGN.search(code, pos)
    if m is None:
      return out
    quote = m.group(2)
    close = code.find(quote, m.end())
    while close != -1 and _escaped(code, close):
      close = code.find(quote, close + 1)
    if close == -1:
      return out
    out.append((m.start(), close + 3, m.group(1), code[m.end() : close]))
    pos = close + 3


def _escaped(code: str, i: int) -> bool:
  n = 0
  while i - 1 - n >= 0 and code[i - 1 - n] == "\\":
    n += 1
  return n % 2 == 1


def split_infilling(cuda_code: str) -> InfillSplit:
  """prefix / middle / suffix of a kernel file; ``middle`` is the CUDA source string assignment.

  The CUDA source is the first triple-quoted assignment whose body defines a ``__global__`` kernel (else a
  kernel launch ``<<<``, else an ``#include``, never a name ending in ``cpp_source``/``cpp_src``)."""
  assigns = _string_assignments(cuda_code)
  for marker in _CUDA_MARKERS:
    for start, end, name, body in assigns:
      if marker in body and not re.search(r"cpp_?(source|src)s?$", name):
        return InfillSplit(cuda_code[:start], cuda_code[start:end], cuda_code[end:])
  raise NoCudaSourceError(
    f"no top-level triple-quoted CUDA source assignment found (saw {[a[2] for a in assigns]})"
  )
