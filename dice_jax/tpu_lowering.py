"""The learner's compiled programs lowered for a TPU pod from any host.

The SFT train step, the TraceRL update and the sampler's prefill (`slots.admit`) and decode step
(`slots.advance`) are built as `Program`s: the jitted function (its shardings and donation, as the
launchers jit it) and abstract arguments (`nnx.eval_shape`, `jax.ShapeDtypeStruct` with the
project's shardings: no weights are materialised) on a mesh. They are traced under
`platform.lowering_for('tpu')`, so that `attention_impl='flash'` lowers to the Pallas TPU kernels
(`flash_tpu`), and either exported with `platforms=['tpu']` (`Program.export`: any host, fake CPU
devices; the Mosaic kernels appear as `tpu_custom_call`s) or lowered for the mesh's devices and
compiled (`Program.lower().compile()`: a mesh of TPU devices, e.g. the compile-only devices of a
named topology, `tpu_topology`, which gives the compiler's per-chip memory).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dice_jax.diffusion import engine as engine_lib
from dice_jax.diffusion import objective as objective_lib
from dice_jax.diffusion import placement as placement_lib
from dice_jax.model import platform
from dice_jax.model.transformer import Transformer
from dice_jax.rl import tracerl
from dice_jax.train import optimizer as optim_lib
from dice_jax.train import train_step as ts


def _sds(x, sharding):
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def abstract_model(mcfg, mesh):
  """(graphdef, abstract params (pure dict of ShapeDtypeStructs), their shardings by the rules)."""
  graphdef, state = nnx.split(
    nnx.eval_shape(lambda: Transformer(mcfg, rngs=nnx.Rngs(0))), nnx.Param
  )
  params = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), state.to_pure_dict())
  return graphdef, params, ts.param_shardings(state, mesh)


@dataclasses.dataclass(frozen=True)
class Program:
  """A jitted program (`fn`: shardings and donation as the learner jits it) and its abstract
  arguments on `mesh`, traced for TPU."""

  fn: Any
  args: tuple
  mesh: Mesh

  def lower(self) -> jax.stages.Lowered:
    """Lowered for TPU on the mesh's devices (compilable where they are TPU devices)."""
    with jax.set_mesh(self.mesh), platform.lowering_for("tpu"):
      return self.fn.trace(*self.args).lower(lowering_platforms=("tpu",))

  def export(self) -> jax.export.Exported:
    """Serialised for TPU with `jax.export` (any host)."""
    with jax.set_mesh(self.mesh), platform.lowering_for("tpu"):
      return jax.export.export(self.fn, platforms=["tpu"])(*self.args)


def _train_step_program(mcfg, mesh, loss_fn, means, batch: dict) -> Program:
  graphdef, params, p_sh = abstract_model(mcfg, mesh)
  tx = optim_lib.make_optimizer(optim_lib.OptimizerConfig(), 1000)
  shardings = ts.state_shardings(tx, params, p_sh, mesh)
  shapes = {
    "params": params,
    "opt_state": jax.eval_shape(tx.init, params),
    "step": jax.ShapeDtypeStruct((), np.int32),
  }
  state = ts.abstract_state(shapes, shardings)
  step = ts.jit_train_step(ts.make_train_step(graphdef, tx, loss_fn, means=means), shardings, mesh)
  rows = ts.batch_shardings(mesh)
  batch = {k: _sds(v, rows) for k, v in batch.items()}
  rng = _sds(jax.eval_shape(lambda: jax.random.key(0)), NamedSharding(mesh, P()))
  return Program(step.jitted, (state, batch, rng), mesh)


def sft_step(mcfg, mesh, *, batch: int, seq_len: int) -> Program:
  """The block-diffusion SFT train step on `[batch, seq_len]` rows (a `2 * seq_len` 2L input)."""
  ocfg = objective_lib.ObjectiveConfig()
  loss = lambda model, b, rng: objective_lib.block_diffusion_loss(model, b, rng, ocfg)
  i32 = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
  fields = {k: i32 for k in ("tokens", "positions", "segment_ids")}
  fields["loss_mask"] = jax.ShapeDtypeStruct((batch, seq_len), jnp.bool_)
  return _train_step_program(mcfg, mesh, loss, objective_lib.METRIC_MEANS, fields)


def rl_step(mcfg, mesh, *, batch: int, row_len: int) -> Program:
  """The TraceRL update on `[batch, row_len]` `[prompt | x_0 | x_t rounds]` rows."""
  cfg = tracerl.TraceRLConfig()
  loss = lambda model, b, rng: tracerl.tracerl_loss(model, b, rng, cfg)
  tok = lambda dt: jax.ShapeDtypeStruct((batch, row_len), dt)
  fields = {k: tok(jnp.int32) for k in tracerl.TOKEN_FIELDS}
  fields["p_mask"] = tok(jnp.bool_)
  for k in ("advantages", "sampler_logp", "old_logp"):
    fields[k] = tok(jnp.float32)
  for k in tracerl.ROW_FIELDS:
    fields[k] = jax.ShapeDtypeStruct((batch, 1), jnp.int32 if k == "traj_index" else jnp.float32)
  return _train_step_program(mcfg, mesh, loss, tracerl.METRIC_MEANS, fields)


def sampler_programs(
  mcfg, mesh, scfg, *, slots: int, prompt_width: int, prefill_rows: int
) -> dict[str, tuple[Callable, tuple]]:
  """{'prefill': admit `prefill_rows` prompts of `prompt_width` tokens, 'decode': one block of
  every slot}: each (the engine's jitted step, its abstract arguments). The steps are the
  continuous-batching engine's (`engine.build_steps`): weights and their decode copy sharded by
  the rules, the slots and cache split over the mesh's data axes (`placement.Placement`), as
  `engine.ContinuousSampler` holds them. Lower under `jax.set_mesh(mesh)` (the kernels split
  themselves by it): `export_sampler_steps`, or `fn.lower(*args).compile()` on a TPU topology."""
  scfg = scfg.for_model(mcfg)
  graphdef, params, p_sh = abstract_model(mcfg, mesh)
  st = jax.tree.map(_sds, params, p_sh)
  lay = placement_lib.Placement(mesh)
  weights = None
  if scfg.splits_weights(mcfg):
    model = nnx.eval_shape(lambda: Transformer(mcfg, rngs=nnx.Rngs(0)))
    split = lambda s: nnx.merge(graphdef, s).decode_weights(
      lay.fuses_projections, scfg.weights_dtype
    )
    weights = jax.eval_shape(split, st)
    weights = jax.tree.map(_sds, weights, lay.decode_weights(model, weights))
  b = scfg.block_size
  cache_len = -(-(prompt_width + b + scfg.max_new_tokens + b) // 512) * 512
  steps = engine_lib.build_steps(graphdef, mcfg, scfg, lay, slots, cache_len)
  sl, cache = jax.eval_shape(steps.init)
  sl, cache = jax.tree.map(_sds, (sl, cache), (lay.row_tree(sl), lay.cache(cache)))
  repl = lay.replicated
  vec = lambda dt, *s: jax.ShapeDtypeStruct(s, dt, sharding=repl)
  r = prefill_rows
  keys = _sds(jax.eval_shape(lambda: jax.random.split(jax.random.key(0), r)), repl)
  host = (vec(jnp.int32, r), vec(jnp.int32, r, prompt_width), vec(jnp.int32, r))
  host += (vec(jnp.int32, r), keys)
  return {
    "prefill": (steps.admit, (st, weights, sl, cache) + host),
    "decode": (steps.advance, (st, weights, sl, cache)),
  }


def sampler_steps(
  mcfg, mesh, scfg, *, slots: int, prompt_width: int, prefill_rows: int
) -> dict[str, Program]:
  """`sampler_programs` as `Program`s."""
  programs = sampler_programs(
    mcfg, mesh, scfg, slots=slots, prompt_width=prompt_width, prefill_rows=prefill_rows
  )
  return {k: Program(fn, args, mesh) for k, (fn, args) in programs.items()}


def export_sft_step(mcfg, mesh, **shape) -> jax.export.Exported:
  return sft_step(mcfg, mesh, **shape).export()


def export_rl_step(mcfg, mesh, **shape) -> jax.export.Exported:
  return rl_step(mcfg, mesh, **shape).export()


def export_sampler_steps(mcfg, mesh, scfg, **shape) -> dict[str, jax.export.Exported]:
  """`sampler_programs`, exported for TPU."""
  return {k: p.export() for k, p in sampler_steps(mcfg, mesh, scfg, **shape).items()}


def summary(exported: jax.export.Exported) -> dict:
  """Size of the serialized module and the custom calls it contains (name -> count)."""
  text = exported.mlir_module()
  calls = re.findall(r"stablehlo\.custom_call @([\w.]+)", text)
  kernels = re.findall(r'kernel_name = "([^"]+)"', text)
  count = lambda xs: {x: xs.count(x) for x in sorted(set(xs))}
  return {
    "serialized_bytes": len(exported.mlir_module_serialized),
    "custom_calls": count(calls),
    "mosaic_kernels": count(kernels),
    "platforms": exported.platforms,
    "devices": exported.nr_devices,
  }


EXPORTS: dict[str, Callable] = {
  "sft": export_sft_step,
  "rl": export_rl_step,
  "sampler": export_sampler_steps,
}
PROGRAMS: dict[str, Callable] = {"sft": sft_step, "rl": rl_step, "sampler": sampler_steps}
