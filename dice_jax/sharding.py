"""Mesh, logical-axis rules and the shardings derived from them.

The lowest floor of the learner: model, hf, diffusion and train all use it; it imports none of them.

One table (`RULES`) maps the logical axis names that parameters carry (their `logical_axes`
metadata) and that activations/batches use onto the mesh axes `data`, `fsdp`, `tensor`.
A logical axis maps to the first of its candidate mesh axes (or tuple of axes) that divides the
dimension and is not already used by another dimension of the same array; otherwise it is
replicated along that dimension.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> candidate mesh axes, first fit wins.
RULES: dict[str, tuple[Any, ...]] = {
  # parameters
  "vocab": ("tensor",),
  "embed": ("fsdp",),
  "mlp": ("tensor",),
  "q_heads": ("tensor",),
  "kv_heads": ("tensor",),
  "head_dim": (),
  "layers": (),
  "norm": (),
  # activations and batches
  "batch": (("data", "fsdp"), "data", "fsdp"),
  "length": (),
  "cache_length": (),
}


def make_mesh(
  data: int = 1, fsdp: int = -1, tensor: int = 1, devices=None, *, slices: int = 1
) -> Mesh:
  """A `(data, fsdp, tensor)` mesh; one axis may be -1 to take the remaining devices.

  With `slices` > 1 (a multi-slice pod: ICI links inside a slice, the slower DCN between slices)
  the data axis is the one that crosses slices: its outer factor `slices` runs over the slices
  and its inner `data / slices`, fsdp and tensor over the chips of one slice (`slice_groups`),
  as `mesh_utils.create_hybrid_device_mesh(ici, dcn=(slices, 1, 1))` lays them out. Only the
  gradient all-reduce of the data replicas then crosses DCN; the fsdp gathers and the tensor
  collectives stay on ICI.
  """
  devices = list(devices if devices is not None else jax.devices())
  shape = [data, fsdp, tensor]
  if shape.count(-1) > 1:
    raise ValueError(
      f"mesh: at most one axis may be -1, got data={data} fsdp={fsdp} tensor={tensor}"
    )
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if len(devices) % known:
      raise ValueError(f"mesh: {len(devices)} devices not divisible by {known}")
    shape[shape.index(-1)] = len(devices) // known
  if math.prod(shape) != len(devices):
    raise ValueError(f"mesh: data*fsdp*tensor = {math.prod(shape)} != {len(devices)} devices")
  if slices == 1:
    arr = np.asarray(devices).reshape(shape)
  elif slices < 1 or shape[0] % slices:
    raise ValueError(
      f"mesh: the data axis ({shape[0]}) must be a multiple of the number of slices ({slices}): "
      "data is the axis that crosses slices"
    )
  else:
    ici = (shape[0] // slices, *shape[1:])
    arr = np.concatenate([np.asarray(g).reshape(ici) for g in slice_groups(devices, slices)])
  return Mesh(arr, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def slice_groups(devices, slices: int) -> list[list]:
  """The devices of each of `slices` slices, in device order: by `slice_index` where devices
  have one (TPU), else `slices` equal runs of the devices ordered by process (hosts or host
  groups joined over DCN, e.g. GPU nodes)."""
  if all(hasattr(d, "slice_index") for d in devices):
    by_slice: dict[int, list] = {}
    for d in devices:
      by_slice.setdefault(d.slice_index, []).append(d)
    groups = [by_slice[k] for k in sorted(by_slice)]
  else:
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    n = len(ordered) // slices
    groups = (
      [ordered[i * n : (i + 1) * n] for i in range(slices)] if n * slices == len(ordered) else []
    )
  if len(groups) != slices or len({len(g) for g in groups}) != 1:
    sizes = [len(g) for g in groups] or [len(devices)]
    raise ValueError(
      f"mesh: {len(devices)} devices do not form {slices} equal slices (slice sizes {sizes})"
    )
  return groups


def _axis_size(mesh: Mesh, axis) -> int:
  axes = axis if isinstance(axis, tuple) else (axis,)
  return math.prod(mesh.shape[a] for a in axes)


def logical_to_spec(
  logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: dict = RULES
) -> P:
  """PartitionSpec for an array of `shape` whose dimensions have these logical names."""
  used: set[str] = set()
  out = []
  for name, dim in zip(logical, shape):
    chosen = None
    for cand in rules.get(name, ()) if name else ():
      axes = cand if isinstance(cand, tuple) else (cand,)
      if used.intersection(axes) or any(a not in mesh.shape for a in axes):
        continue
      size = _axis_size(mesh, cand)
      if size > 1 and dim % size == 0:
        chosen = cand
        used.update(axes)
        break
    out.append(chosen)
  return P(*out)


def _is_var(x):
  return isinstance(x, nnx.Variable)


def param_logical_axes(state) -> Any:
  """The pytree of logical-axis tuples of an nnx.State (from each Variable's metadata)."""

  def axes(v):
    meta = v.get_metadata()
    if "logical_axes" not in meta:
      raise ValueError(f"parameter of shape {v.shape} has no logical_axes metadata")
    return tuple(meta["logical_axes"])

  return jax.tree.map(axes, state, is_leaf=_is_var)


def state_shardings(state, mesh: Mesh, rules: dict = RULES):
  """NamedShardings for every Variable of an nnx.State (same tree structure as the state)."""

  def shard(v):
    axes = v.get_metadata().get("logical_axes")
    spec = P() if axes is None else logical_to_spec(axes, v.shape, mesh, rules)
    return v.replace(NamedSharding(mesh, spec))

  return jax.tree.map(shard, state, is_leaf=_is_var)


def unsharded_fraction(state, mesh: Mesh, rules: dict = RULES) -> float:
  """Fraction of parameters (by count) replicated on every device of a multi-device mesh."""
  total = replicated = 0
  for v in jax.tree.leaves(state, is_leaf=_is_var):
    n = math.prod(v.shape)
    total += n
    axes = v.get_metadata().get("logical_axes")
    spec = P() if axes is None else logical_to_spec(axes, v.shape, mesh, rules)
    if all(s is None for s in spec):
      replicated += n
  return replicated / max(total, 1)


def assert_sufficiently_sharded(state, mesh: Mesh, tolerance: float = 0.02, rules=RULES):
  """Fails when more than `tolerance` of the parameters are unsharded on a multi-device mesh."""
  if mesh.size == 1:
    return
  frac = unsharded_fraction(state, mesh, rules)
  if frac > tolerance:
    raise ValueError(
      f"{frac:.1%} of parameters are unsharded on mesh {dict(mesh.shape)} "
      f"(tolerance {tolerance:.0%}): check the logical-axis rules"
    )


def create_sharded(model_fn, mesh: Mesh, rules: dict = RULES):
  """Builds `model_fn()` directly onto `mesh`: no full copy is materialised on any one device."""
  abstract = nnx.eval_shape(model_fn)
  graphdef, abs_state = nnx.split(abstract)
  shardings = state_shardings(abs_state, mesh, rules)
  state = jax.jit(lambda: nnx.split(model_fn())[1], out_shardings=shardings)()
  return nnx.merge(graphdef, state)


def named(mesh: Mesh, logical: Sequence[str | None], shape: Sequence[int], rules=RULES):
  """`NamedSharding` of an array of `shape` whose dimensions have these logical names."""
  return NamedSharding(mesh, logical_to_spec(logical, shape, mesh, rules))


def kernel_axes(mesh, rows: int, heads: Sequence[int]):
  """(row axis, head axis) for running a custom kernel per shard under `shard_map`.

  Rows go where the rules put a `batch` axis of `rows` (data x fsdp, else the one of them that
  divides `rows`: the layout of the sampler's cache rows and of training batches, so a kernel
  reads its shard in place); heads over `tensor` when it divides every count in `heads`. None
  where an axis does not apply.
  """
  row = logical_to_spec(("batch",), (rows,), mesh)[0]
  tp = mesh.shape.get("tensor", 1)
  head = "tensor" if tp > 1 and all(h % tp == 0 for h in heads) else None
  return row, head
