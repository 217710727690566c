"""Named TPU slices compiled for from any host, and what the compiler says of a program for them.

`jax.experimental.topologies.get_topology_desc` (libtpu, no TPU needed) describes a slice by its
topology (`v5p:2x2x1`, several with `num_slices`) as compile-only devices; a mesh on them
(`sharding.make_mesh`) makes `tpu_lowering.Program.lower().compile()` run TPU's own compiler
(XLA's TPU passes, SPMD partitioning, Mosaic for the Pallas kernels) from this host. What comes
back is what a slice would run: its per-chip memory (`memory_analysis`, `ChipMemory`) within the
chip's HBM, and its HLO, in which attention must be the Mosaic kernels only (`attention_kernels`)
with no `[T, S]` score tensor (`score_shapes`).

libtpu locks `/tmp/libtpu_lockfile` for the process that loads it, so that two processes never
drive one TPU; describing a topology drives none, so `devices` sets `ALLOW_MULTIPLE_LIBTPU_LOAD=1`
(unless already set) and two compiling processes can run side by side.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re

import jax
import numpy as np

from dice_jax import sharding

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Slice:
  """A Cloud TPU slice: its accelerator type, libtpu topology, chips and HBM per chip (GiB, as
  the compiler's out-of-memory message states it)."""

  name: str
  topology: str
  chips: int
  hbm_gib: float
  chips_per_host: tuple | None = None  # libtpu's default (2x2x1) unless given

  def describe(self) -> str:
    return f"{self.name} `{self.topology}` ({self.chips})"


# Cloud TPU names count TensorCores for v5p (2 per chip: v5p-8 is 4 chips) and chips for v5e.
# `v5p-chip`: one v5p chip alone (what one GPU is to the GPU sampler's memory check).
SLICES = {
  s.name: s
  for s in (
    Slice("v5e-8", "v5e:2x4", 8, 15.75),
    Slice("v5p-8", "v5p:2x2x1", 4, 95.74),
    Slice("v5p-16", "v5p:2x2x2", 8, 95.74),
    Slice("v5p-chip", "v5p:1x1x1", 1, 95.74, chips_per_host=(1, 1, 1)),
  )
}


def libtpu_missing() -> str | None:
  """Why topologies cannot be described here (None when libtpu is installed)."""
  if importlib.util.find_spec("libtpu") is None:
    return "libtpu is not installed (pip install -e '.[tpu-compile]')"
  return None


def get_slice(name: str) -> Slice:
  if name not in SLICES:
    raise ValueError(f"unknown TPU slice {name!r}; known: {sorted(SLICES)}")
  return SLICES[name]


def devices(slice_: Slice, num_slices: int = 1) -> list:
  """The compile-only devices of `num_slices` slices of this kind (slice-major, with
  `slice_index`)."""
  from jax.experimental import topologies

  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # read when libtpu loads
  kw = {"num_slices": num_slices} if num_slices > 1 else {}
  if slice_.chips_per_host:
    kw["chips_per_host_bounds"] = slice_.chips_per_host
  out = list(topologies.get_topology_desc(slice_.topology, "tpu", **kw).devices)
  if len(out) != slice_.chips * num_slices:
    raise ValueError(f"{slice_.topology} x {num_slices} gave {len(out)} devices")
  return out


def mesh(slice_: Slice, *, num_slices: int = 1, data: int = 1, fsdp: int = -1, tensor: int = 1):
  """A `(data, fsdp, tensor)` mesh over `num_slices` such slices (data crossing them)."""
  return sharding.make_mesh(
    data, fsdp, tensor, devices=devices(slice_, num_slices), slices=num_slices
  )


@dataclasses.dataclass(frozen=True)
class ChipMemory:
  """Bytes per chip of a compiled program (`Compiled.memory_analysis()`): its arguments, outputs
  (less those aliased to donated arguments), temporaries, and the peak the compiler plans."""

  arguments: int
  outputs: int
  aliased: int
  temps: int
  peak: int

  @classmethod
  def of(cls, compiled: jax.stages.Compiled) -> "ChipMemory":
    m = compiled.memory_analysis()
    live = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    return cls(
      arguments=m.argument_size_in_bytes,
      outputs=m.output_size_in_bytes,
      aliased=m.alias_size_in_bytes,
      temps=m.temp_size_in_bytes,
      peak=getattr(m, "peak_memory_in_bytes", 0) or live + m.temp_size_in_bytes,
    )

  def gib(self, field: str = "peak") -> float:
    return getattr(self, field) / GIB


def compile_program(program) -> jax.stages.Compiled:
  """`program.lower().compile()` (a `tpu_lowering.Program` on a mesh of TPU devices)."""
  return program.lower().compile()


_KERNEL = re.compile(r'custom_call_target="tpu_custom_call".*?op_name="[^"]*?/(\w+)/pallas_call"')


def attention_kernels(hlo_text: str) -> dict[str, int]:
  """{Pallas kernel name: count} of the `tpu_custom_call`s in a compiled module's HLO."""
  names = _KERNEL.findall(hlo_text)
  return {k: names.count(k) for k in sorted(set(names))}


_SHAPE = re.compile(r"\b(?:f32|bf16|f16)\[([\d,]+)\]")


def score_shapes(hlo_text: str, q_len: int, k_len: int, width: int | None = None) -> list[str]:
  """Floating-point array shapes of rank >= 3 in the HLO whose last two dimensions are
  `(q_len, k_len)` (either order): the `[.., T, S]` scores and probabilities a dense attention
  materialises (not the TPU kernels' int32 mask vectors, e.g. `s32[rows, 8, S]`: k vectors on 8
  sublanes). With the model's `width`, rank-3 `[rows, T, width]` shapes are activations, not
  scores (a prompt as long as the model is wide: sdar_1p7b's 2,048); the dense path's scores keep
  their head axes (`[B, K, G, T, S]`)."""
  found = set()
  for dims in _SHAPE.findall(hlo_text):
    d = tuple(int(x) for x in dims.split(","))
    if len(d) == 3 and d[-1] == width:
      continue
    if len(d) >= 3 and d[-2:] in ((q_len, k_len), (k_len, q_len)):
      found.add(dims)
  return sorted(found)


_GROUPS = re.compile(r"replica_groups=(\{[\d,{}]*\}|mesh\[([^\]]*)\] \{([^}]*)\}|\S+)")


def collective_groups(hlo_text: str, op: str) -> list[list[int]]:
  """The device groups (logical ids: positions in the mesh's flat device order) of every `op`
  (`all-gather`, `all-reduce`, `reduce-scatter`, ...) in a compiled module's HLO, whether printed
  as explicit `{{0,1},{2,3}}` or as `mesh['axis_0'=2,'axis_1'=8] {'axis_1'}` (the ids in mesh
  order, grouped over the named axes)."""
  out = []
  for line in hlo_text.splitlines():
    if not re.search(rf"^\s*%\S+ = .*[}})\]] {op}(-start)?\(", line):
      continue
    m = _GROUPS.search(line)
    if m is None:
      raise ValueError(f"{op} without replica_groups: {line[:200]}")
    if m.group(1).startswith("{"):
      out += [[int(x) for x in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", m.group(1))]
    elif m.group(2) is not None:
      names = re.findall(r"'(\w+)'=(\d+)", m.group(2))
      over = set(re.findall(r"'(\w+)'", m.group(3)))
      ids = np.arange(math.prod(int(n) for _, n in names)).reshape([int(n) for _, n in names])
      keep = [i for i, (a, _) in enumerate(names) if a not in over]
      moved = np.moveaxis(ids, keep, list(range(len(keep))))
      size = math.prod(int(n) for a, n in names if a in over)
      out += moved.reshape(-1, size).tolist()
    else:
      raise ValueError(f"unknown replica_groups format: {m.group(1)[:80]}")
  return out


def dcn_transfers(hlo_text: str) -> dict[str, int]:
  """{transfer type: count} of the collectives between slices in a multi-slice program: the
  compiler keeps one slice's program with ICI collectives inside it and sends what crosses
  slices to the DCN runtime (`_xla_megascale_transfer_type`, e.g. ALL_REDUCE)."""
  kinds = re.findall(r'_xla_megascale_transfer_type="(\w+)"', hlo_text)
  return {k: kinds.count(k) for k in sorted(set(kinds))}
