"""Where the sampler's arrays live on the model's mesh (DESIGN: "One mesh for everything").

Rows (the static sampler's batch, the engine's slots) and their KV cache go over the data axes (the
`batch` rule of `dice_jax.sharding`: data x fsdp, else the one of them that divides the rows), K/V
heads over `tensor`; the parameters stay as training shards them, and their decode copy
(`transformer.DecodeWeights`) is laid out by the same rules (embed over fsdp, heads and MLP
columns over tensor). N devices hold ~1/N of the cache and of the weights, and each decodes its
own rows: the attention kernels run per shard on the same row/head split (`sharding.kernel_axes`,
under the mesh the sampler sets), so no step gathers the cache.

The compiled steps take rows and cache with these shardings and give them back with the same ones
(explicit `in_shardings`/`out_shardings`), so a donated cache is updated in place and a step
compiles once per shape. Small host inputs (prompts, lengths, keys) come in as they are (numpy,
the same on every process of a multi-process run, or arrays on the mesh) and are split over the
rows inside the program; per-row outputs the host reads (the finished flags) go out replicated,
so reading them is no collective.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dice_jax import sharding as sharding_lib
from dice_jax.model import fp8 as fp8_lib
from dice_jax.model import kv_cache as kv_cache_lib
from dice_jax.model.transformer import DecodeWeights


@dataclasses.dataclass(frozen=True)
class Placement:
  """The sampler's layout on `mesh` (axes `data`, `fsdp`, `tensor`). Hashable: a static argument
  of the compiled steps."""

  mesh: Mesh

  @classmethod
  def of(cls, state) -> "Placement":
    """The mesh the model's parameters `state` live on; a one-device mesh for a model on one
    device."""
    leaves = jax.tree.leaves(state)
    for leaf in leaves:
      sh = getattr(leaf, "sharding", None)
      if isinstance(sh, NamedSharding) and not sh.mesh.empty:
        return cls(sh.mesh)
    devices = [d for leaf in leaves[:1] for d in getattr(leaf, "devices", lambda: ())()]
    device = devices[0] if devices else jax.devices()[0]
    return cls(Mesh(np.array([device]).reshape(1, 1, 1), sharding_lib.MESH_AXES))

  def named(self, logical, shape) -> NamedSharding:
    return sharding_lib.named(self.mesh, logical, shape)

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())

  def rows(self, x) -> NamedSharding:
    """An array whose leading axis is rows: split over the data axes, the rest whole."""
    return self.named(("batch",) + (None,) * (len(x.shape) - 1), x.shape)

  def row_axes(self, rows: int):
    """The mesh axis (or tuple of axes) `rows` rows are split over; None: not split."""
    return self.named(("batch",), (rows,)).spec[0]

  def shard_rows(self, rows: int) -> int:
    """How many row shards `rows` rows are split into (1: not split)."""
    axis = self.row_axes(rows)
    axes = () if axis is None else axis if isinstance(axis, tuple) else (axis,)
    return math.prod(self.mesh.shape[a] for a in axes)

  def row_tree(self, tree):
    """`rows` of every leaf of `tree` (e.g. `slots.Slots`, a `sampler.Layout`, keys)."""
    return jax.tree.map(self.rows, tree)

  def cache(self, cache: kv_cache_lib.KVCache) -> kv_cache_lib.KVCache:
    """Shardings of `cache`'s fields (`kv_cache.LOGICAL_AXES`: rows over the data axes, K/V heads
    over `tensor`, the stored `[.., K*H]` by whole heads), as a `KVCache` (jit's sharding tree)."""

    def sharding(f, axes):
      if getattr(cache, f) is None:  # the optional prompt-source fields, unset
        return None
      if f in ("k", "v"):
        spec = self.named(axes, cache.kv_shape).spec
        return NamedSharding(self.mesh, kv_cache_lib.fused_spec(spec))
      return self.named(axes, getattr(cache, f).shape)

    return dataclasses.replace(
      cache, **{f: sharding(f, axes) for f, axes in kv_cache_lib.LOGICAL_AXES.items()}
    )

  def constrain_rows(self, tree):
    """`tree` split over the rows inside a compiled program (`with_sharding_constraint`)."""
    return jax.lax.with_sharding_constraint(tree, self.row_tree(tree))

  def constrain_cache(self, cache: kv_cache_lib.KVCache) -> kv_cache_lib.KVCache:
    return jax.lax.with_sharding_constraint(cache, self.cache(cache))

  @property
  def fuses_projections(self) -> bool:
    """Whether the decode copy fuses q/k/v and gate/up (no `tensor` split to keep apart)."""
    return self.mesh.shape.get("tensor", 1) == 1

  def decode_weights(self, model, weights: DecodeWeights) -> DecodeWeights:
    """Shardings of `model.decode_weights(self.fuses_projections)` (shapes from `weights`): the
    stacked parameters' rules per layer (`Transformer.decode_weight_axes`); a float8 matrix
    (`fp8.Fp8Weight`, `[N, K]`) by its output axis and, when it is one axis, its input axis."""
    axes, head = model.decode_weight_axes(self.fuses_projections)

    def one(name, w):
      if not isinstance(w, fp8_lib.Fp8Weight):
        return self.named(axes[name], w.shape)
      ins, out = axes[name][:-1], axes[name][-1]
      w_axes = (out, ins[0] if len(ins) == 1 else None)
      return fp8_lib.Fp8Weight(
        w8=self.named(w_axes, w.w8.shape), scale=self.named((out,), w.scale.shape)
      )

    layers = tuple({name: one(name, w) for name, w in layer.items()} for layer in weights.layers)
    return DecodeWeights(layers=layers, head=self.named(head, weights.head.shape))

  def shards(self, model_cfg, rows: int) -> dict:
    """How many ways each part is split: `row_shards` (rows: the cache, per-row activations),
    `head_shards` (the cache's K/V heads), `param_shards` (the weights, over fsdp x tensor)."""
    tp = self.mesh.shape.get("tensor", 1)
    return dict(
      row_shards=self.shard_rows(rows),
      head_shards=tp if model_cfg.num_kv_heads % tp == 0 else 1,
      param_shards=self.mesh.shape.get("fsdp", 1) * tp,
    )

  def context(self):
    """The mesh context the steps run (and trace) under: the attention kernels split themselves
    by it (`sharding.kernel_axes`)."""
    return jax.set_mesh(self.mesh)

  def write_rows(self, cache: kv_cache_lib.KVCache, rows, k, v, offset: int, *meta):
    """`cache.write_rows(rows, k, v, offset, positions, segment_ids, block_ids, length)` with each
    device writing the rows it holds, from the K/V it computed (`shard_map`): no device gathers
    the admitted rows' K/V. Needs `rows` `[R]` split over the same axes as the cache's rows, in
    order: the j-th block of R/n rows in row shard j's slots, or out of range (nothing written);
    else (rows not split alike) the plain `write_rows`."""
    axis = self.row_axes(cache.length.shape[0])
    if axis is None or axis != self.row_axes(rows.shape[0]):
      return cache.write_rows(rows, k, v, offset, *meta)
    specs = jax.tree.map(lambda s: s.spec, self.cache(cache))
    kv_spec = P(*specs.k, None)  # the new K/V `[L, R, T, K, H]`: K split as the cache's K*H
    row_spec = P(axis)
    meta_specs = (P(axis, None),) * 3 + (row_spec,)

    def local(cache, rows, k, v, *meta):
      n_local = cache.length.shape[0]
      first = jax.lax.axis_index(axis) * n_local
      mine = (rows >= first) & (rows < first + n_local)
      return cache.write_rows(jnp.where(mine, rows - first, n_local), k, v, offset, *meta)

    return jax.shard_map(
      local,
      mesh=self.mesh,
      in_specs=(specs, row_spec, kv_spec, kv_spec) + meta_specs,
      out_specs=specs,
      check_vma=False,
    )(cache, rows, k, v, *meta)
