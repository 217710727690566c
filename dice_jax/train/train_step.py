"""Train state, sharded initialisation and the jitted SFT train step.

The train state is a plain dict pytree `{'params', 'opt_state', 'step'}`: params are the model's
`nnx.Param` values as a pure nested dict (float32 masters; the model casts to its compute dtype),
so optax, orbax and `jax.jit` shardings all see ordinary arrays. The model is rebuilt inside the
step with `nnx.merge(graphdef, params)`.

Gradient accumulation (`accum_steps > 1`): the batch arrives as `[accum, micro, T]` and the step
scans over micro-batches, summing the gradients of each micro-batch's *token sum*
(`loss * answer_tokens` = weighted CE sum) and dividing once by the total answer tokens. The result
equals the gradient of the whole batch's token-weighted mean, whatever the micro-batch split.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dice_jax import sharding as sharding_lib

_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm
LossFn = Callable[[Any, dict, jax.Array], tuple[jax.Array, dict]]


def param_shardings(abstract_params_state, mesh: Mesh) -> dict:
  """NamedShardings (pure dict) of an nnx Param state, from the logical-axis rules."""
  return sharding_lib.state_shardings(abstract_params_state, mesh).to_pure_dict()


def opt_state_shardings(
  tx: optax.GradientTransformation, params_abstract: dict, params_sh: dict, mesh: Mesh
):
  """Optimizer state shardings: per-parameter leaves (Adam moments) follow their parameter."""
  abs_opt = jax.eval_shape(tx.init, params_abstract)
  replicated = NamedSharding(mesh, P())
  return optax.tree_map_params(
    tx, lambda _, s: s, abs_opt, params_sh, transform_non_params=lambda _: replicated
  )


def state_shardings(tx, params_abstract: dict, params_sh: dict, mesh: Mesh) -> dict:
  return {
    "params": params_sh,
    "opt_state": opt_state_shardings(tx, params_abstract, params_sh, mesh),
    "step": NamedSharding(mesh, P()),
  }


def split_model(model) -> tuple[nnx.GraphDef, dict]:
  """(graphdef, pure-dict params) of a model; the model must hold only Params."""
  graphdef, params = nnx.split(model, nnx.Param)
  return graphdef, params.to_pure_dict()


def init_train_state(
  model, tx: optax.GradientTransformation, mesh: Mesh, *, tolerance: float = 0.02
):
  """(graphdef, state, shardings) from a model already placed on `mesh` (create_sharded/import_hf).

  Fails when more than `tolerance` of the parameters would be unsharded on a multi-device mesh.
  """
  _, abs_state = nnx.split(model, nnx.Param)
  sharding_lib.assert_sufficiently_sharded(abs_state, mesh, tolerance)
  graphdef, params = split_model(model)
  p_sh = param_shardings(abs_state, mesh)
  params = jax.device_put(params, p_sh)  # no-op when already placed
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  shardings = state_shardings(tx, abstract, p_sh, mesh)
  opt_state = jax.jit(tx.init, out_shardings=shardings["opt_state"])(params)
  step = jax.device_put(jnp.zeros((), jnp.int32), shardings["step"])
  return graphdef, {"params": params, "opt_state": opt_state, "step": step}, shardings


def abstract_state(state_or_shapes, shardings) -> dict:
  """ShapeDtypeStructs with shardings: an orbax restore target on the current mesh."""
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state_or_shapes, shardings
  )


def batch_shardings(mesh: Mesh, accum_steps: int = 1) -> NamedSharding:
  """Sharding of a `[B, T]` batch (or `[accum, B, T]` with accumulation): rows over data x fsdp."""
  rows = sharding_lib.RULES["batch"][0]
  return NamedSharding(mesh, P(rows, None) if accum_steps == 1 else P(None, rows, None))


def make_train_step(
  graphdef,
  tx: optax.GradientTransformation,
  loss_fn: LossFn,
  *,
  accum_steps: int = 1,
  schedule: optax.Schedule | None = None,
):
  """`step(state, batch, rng) -> (state, metrics)`; pure, to be wrapped by `jit_train_step`."""
  if accum_steps < 1:
    raise ValueError(f"accum_steps must be >= 1, got {accum_steps}")

  def micro(params, batch, rng):
    def f(p):
      loss, m = loss_fn(nnx.merge(graphdef, p), batch, rng)
      return loss * jax.lax.stop_gradient(m["answer_tokens"]), m  # = the weighted CE sum

    (_, m), g = jax.value_and_grad(f, has_aux=True)(params)
    return g, {k: jnp.asarray(v, jnp.float32) for k, v in m.items()}

  def step(state, batch, rng):
    params = state["params"]
    rng = jax.random.fold_in(rng, state["step"])
    if accum_steps == 1:
      grads, m = micro(params, batch, rng)
    else:

      def body(carry, xs):
        i, mb = xs
        g, m = micro(params, mb, jax.random.fold_in(rng, i))
        return jax.tree.map(jnp.add, carry, (g, m)), None

      zeros = jax.tree.map(
        jnp.zeros_like,
        jax.eval_shape(lambda: micro(params, jax.tree.map(lambda x: x[0], batch), rng)),
      )
      (grads, m), _ = jax.lax.scan(body, zeros, (jnp.arange(accum_steps), batch))
    n = jnp.maximum(m["answer_tokens"], 1.0)
    grads = jax.tree.map(lambda g: g / n, grads)
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    params = optax.apply_updates(params, updates)
    metrics = dict(
      m, loss=m["weighted_ce_sum"] / n, grad_norm=_norm(grads), param_norm=_norm(params)
    )
    if "masked_ce_sum" in m:
      metrics["masked_ce"] = m["masked_ce_sum"] / jnp.maximum(m["masked_tokens"], 1.0)
    if schedule is not None:
      metrics["lr"] = jnp.asarray(schedule(state["step"]), jnp.float32)
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

  return step


def jit_train_step(step_fn, shardings: dict, mesh: Mesh, accum_steps: int = 1):
  """jax.jit with explicit in/out shardings; the input state is donated."""
  replicated = NamedSharding(mesh, P())
  jitted = jax.jit(
    step_fn,
    in_shardings=(shardings, batch_shardings(mesh, accum_steps), replicated),
    out_shardings=(shardings, replicated),
    donate_argnums=0,
  )

  def run(state, batch, rng):
    with jax.set_mesh(mesh):  # lets kernels without partitioning rules shard_map themselves
      return jitted(state, batch, rng)

  run.jitted = jitted
  return run


def shard_batch(batch: dict, mesh: Mesh, accum_steps: int = 1) -> dict:
  """Host numpy batch `[B, T]` -> global jax arrays (rows over data x fsdp); `[accum, B/accum, T]`
  with accumulation. Multi-host: each process passes its local rows."""

  def put(x):
    if accum_steps > 1:
      if x.shape[0] % accum_steps:
        raise ValueError(
          f"batch of {x.shape[0]} rows is not divisible by accum_steps={accum_steps}"
        )
      x = x.reshape(accum_steps, x.shape[0] // accum_steps, *x.shape[1:])
    sh = batch_shardings(mesh, accum_steps)
    if jax.process_count() == 1:
      return jax.device_put(x, sh)
    return jax.make_array_from_process_local_data(sh, x)

  return {k: put(v) for k, v in batch.items()}
