r"""Bytes and FLOPs of each instruction of a compiled XLA program, read off its HLO text.

  costs = hlo_costs.instruction_costs(compiled.as_text())   # {name: Cost}

A kernel of a profiler trace names the HLO instruction it runs (`hlo_op`), so the trace's time per
kernel and these counts give each kernel's achieved bandwidth and FLOP rate
(`trace_summary.summarize(..., costs=...)`). Counted:
  bytes  the instruction's operands and result as whole arrays (what a kernel that reads every
         operand once and writes its result once moves). An in-place update (dynamic-update-slice,
         scatter, or a fusion rooted at one) counts its update and indices twice instead of the
         whole buffer it updates; a custom call (e.g. a Pallas kernel) counts its arguments as
         whole arrays, an upper bound where it reads part of them (give it its own count).
  flops  2 x (result elements) x (contracted elements) for every `dot` (inside a fusion too)
         and for a GEMM custom call (cuBLAS, whose dimension numbers are in its backend config).
Nothing here compiles or runs; plain text in, numbers out.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_COMP = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*->.*\{\s*$")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_IN_PLACE = ("dynamic-update-slice", "scatter")


@dataclasses.dataclass(frozen=True)
class Cost:
  opcode: str
  bytes: int
  flops: int


@dataclasses.dataclass
class _Instr:
  name: str
  opcode: str
  type_str: str
  operands: list
  attrs: str
  root: bool


def shape_bytes(type_str: str) -> int:
  """Bytes of an HLO type: an array (`bf16[128,4]{1,0}`) or a tuple of arrays."""
  total = 0
  for dtype, dims in _ARRAY.findall(type_str):
    if dtype in _BYTES:
      total += _BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
  return total


def _dims(type_str: str) -> list:
  m = _ARRAY.search(type_str)
  return [int(d) for d in m.group(2).split(",") if d] if m else []


def _split_args(text: str):
  """(operand names, attribute text) of an instruction's `(...)...` tail."""
  depth, i = 1, 0
  while i < len(text) and depth:
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    i += 1
  inside, attrs = text[: i - 1], text[i:]
  names = re.findall(r"%([\w.\-]+)", inside)
  return names, attrs


def parse(hlo_text: str) -> dict:
  """{computation name: [_Instr]} of an HLO module's text."""
  comps, current = {}, None
  for line in hlo_text.splitlines():
    m = _COMP.match(line)
    if m and "=" not in line.split("->")[0].split("(")[0]:
      current = comps.setdefault(m.group(2), [])
      continue
    if current is None:
      continue
    m = _INSTR.match(line)
    if m:
      names, attrs = _split_args(m.group(5))
      current.append(_Instr(m.group(2), m.group(4), m.group(3), names, attrs, bool(m.group(1))))
  return comps


def _contracted(instr: _Instr, shapes: dict) -> int:
  """Elements summed per result element of a `dot` (product of the lhs contracting dims)."""
  m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", instr.attrs)
  lhs = _dims(shapes.get(instr.operands[0], "")) if instr.operands else []
  if not m or not lhs:
    return 0
  return math.prod(lhs[int(d)] for d in m.group(1).split(",") if d)


def _gemm_contracted(instr: _Instr, shapes: dict) -> int:
  """The same for a GEMM custom call (cuBLAS: dimension numbers in the backend config)."""
  m = re.search(r"backend_config=(\{.*\})", instr.attrs)
  lhs = _dims(shapes.get(instr.operands[0], "")) if instr.operands else []
  if not m or not lhs:
    return 0
  try:
    cfg = json.loads(m.group(1))
  except json.JSONDecodeError:
    return 0
  gemm = cfg.get("gemm_backend_config", cfg)
  dims = gemm.get("dot_dimension_numbers", {}).get("lhs_contracting_dimensions", [])
  return math.prod(lhs[int(d)] for d in dims) if dims else 0


def _dot_flops(instrs: list, comps: dict, shapes: dict, seen=()) -> int:
  flops = 0
  for ins in instrs:
    if ins.opcode == "dot":
      flops += 2 * math.prod(_dims(ins.type_str)) * _contracted(ins, shapes)
    elif ins.opcode == "custom-call" and re.search(r"gemm|matmul", ins.attrs, re.I):
      flops += 2 * math.prod(_dims(ins.type_str)) * _gemm_contracted(ins, shapes)
    elif ins.opcode == "fusion":
      called = _CALLS.search(ins.attrs)
      if called and called.group(1) in comps and called.group(1) not in seen:
        body = comps[called.group(1)]
        inner = {i.name: i.type_str for i in body}
        flops += _dot_flops(body, comps, {**shapes, **inner}, seen + (called.group(1),))
  return flops


def _root(comps: dict, ins: _Instr):
  called = _CALLS.search(ins.attrs)
  body = comps.get(called.group(1), []) if called else []
  return next((i for i in body if i.root), None), body


def instruction_costs(hlo_text: str) -> dict:
  """{instruction name: Cost} for every instruction of every computation of the module."""
  comps = parse(hlo_text)
  shapes = {i.name: i.type_str for body in comps.values() for i in body}
  out = {}
  for body in comps.values():
    for ins in body:
      operand_bytes = [shape_bytes(shapes.get(o, "")) for o in ins.operands]
      result = shape_bytes(ins.type_str)
      opcode = ins.opcode
      update = None
      if opcode in _IN_PLACE:
        update = operand_bytes[1:]
      elif opcode == "fusion":
        root, fbody = _root(comps, ins)
        if root is not None and root.opcode in _IN_PLACE:
          opcode = f"fusion({root.opcode})"
          inner = {i.name: i.type_str for i in fbody}
          update = [shape_bytes(inner.get(o, "")) for o in root.operands[1:]]
      if update is not None:
        nbytes = 2 * sum(update)
      else:
        nbytes = result + sum(operand_bytes)
      flops = _dot_flops([ins], comps, shapes)
      out[ins.name] = Cost(opcode, nbytes, flops)
  return out


def _lines(hlo_text: str) -> tuple[dict, dict]:
  """({instruction name: its line}, {computation name: its lines}) of an HLO module's text."""
  instrs, comps, current = {}, {}, None
  for line in hlo_text.splitlines():
    m = _COMP.match(line)
    if m and "=" not in line.split("->")[0].split("(")[0]:
      current = comps.setdefault(m.group(2), [])
      continue
    m = _INSTR.match(line)
    if m and current is not None:
      instrs.setdefault(m.group(2), line.strip())
      current.append(line.strip())
  return instrs, comps


def describe(hlo_text: str, kernel: str) -> str:
  """What a profiler trace's kernel computes: the instruction it names (`loop_transpose_fusion_71`
  is `loop_transpose_fusion.71`), its operands' definitions and, for a fusion, the body of the
  computation it calls. A KeyError naming the kernel where the module has no such instruction."""
  instrs, comps = _lines(hlo_text)
  name = next((n for n in (kernel, re.sub(r"_(\d+)$", r".\1", kernel)) if n in instrs), None)
  if name is None:
    raise KeyError(f"no instruction {kernel!r} in this HLO module")
  line = instrs[name]
  names, _ = _split_args(_INSTR.match(line).group(5))
  out = [line, "operands:"] + [f"  {instrs.get(o, o)[:300]}" for o in names]
  called = _CALLS.search(line)
  if called and called.group(1) in comps:
    out += [f"body of {called.group(1)}:"] + [f"  {b}" for b in comps[called.group(1)]]
  return "\n".join(out)


def main(argv: list[str]) -> None:
  """`python -m experiments.hlo_costs HLO_FILE[.gz] KERNEL...`: each kernel's `describe`; a bad
  argument or an unknown kernel is one line on stderr, exit status 2."""
  import gzip

  from experiments import _cli

  if len(argv) < 2:
    _cli.fail("usage: python -m experiments.hlo_costs HLO_FILE[.gz] KERNEL...")
  path, kernels = argv[0], argv[1:]
  try:
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
      text = f.read()
    for k in kernels:
      print(f"## {k}\n{describe(text, k)}\n")
  except OSError as e:
    _cli.fail(_cli.message(e))
  except KeyError as e:
    _cli.fail(e.args[0])


if __name__ == "__main__":
  import sys

  main(sys.argv[1:])
