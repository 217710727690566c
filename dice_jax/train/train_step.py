"""Train state, sharded initialisation and the generic jitted train step (SFT and BiC-RL).

The train state is a plain dict pytree `{'params', 'opt_state', 'step'}`: params are the model's
`nnx.Param` values as a pure nested dict (float32 masters; the model casts to its compute dtype),
so optax, orbax and `jax.jit` shardings all see ordinary arrays. The model is rebuilt inside the
step with `nnx.merge(graphdef, params)`.

Loss contract: `loss_fn(model, batch, rng) -> (loss_sum, metrics)`, where `loss_sum` is a sum over
the (micro-)batch and `metrics["denominator"]` is what it is divided by (SFT: answer tokens;
TraceRL: L1 x rounds, or trained tokens). Every metric is a sum over the micro-batch, except
names ending in `_max` / `_min` (combined by max / min).

Gradient accumulation (`accum_steps > 1`): the batch arrives as `[accum, micro, T]` and the step
scans over micro-batches, summing the gradients of each micro-batch's `loss_sum` and its metrics,
then divides once by the summed denominator. The result equals the gradient of the whole batch's
loss_sum / denominator, whatever the micro-batch split. With `is_empty`, a micro-batch it marks
(rows of padding only) is skipped (`lax.cond`): its gradient and metrics are zero anyway.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dice_jax import sharding as sharding_lib
from dice_jax import trace_context

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


def combine_metrics(a: dict, b: dict) -> dict:
  """Two micro-batches' metrics as one: sums, except `*_max` (max) and `*_min` (min)."""
  out = {}
  for k in a:
    if k.endswith("_max"):
      out[k] = jnp.maximum(a[k], b[k])
    elif k.endswith("_min"):
      out[k] = jnp.minimum(a[k], b[k])
    else:
      out[k] = a[k] + b[k]
  return out


def _identity_metrics(shapes: dict) -> dict:
  fill = lambda k: -jnp.inf if k.endswith("_max") else jnp.inf if k.endswith("_min") else 0.0
  return {k: jnp.full(v.shape, fill(k), v.dtype) for k, v in shapes.items()}


def make_train_step(
  graphdef,
  tx: optax.GradientTransformation,
  loss_fn: LossFn,
  *,
  accum_steps: int = 1,
  schedule: optax.Schedule | None = None,
  means: Mapping[str, tuple[str, str]] | None = None,
  is_empty: Callable[[dict], jax.Array] | None = None,
):
  """`step(state, batch, rng) -> (state, metrics)`; pure, to be wrapped by `jit_train_step`.

  `loss_fn` follows the module's loss contract. The update uses the gradient of
  sum(loss_sum) / sum(denominator) over the micro-batches. Metrics: the combined sums, `loss`
  (= loss_sum / denominator), `grad_norm` (of that gradient), `param_norm` (after the update),
  `lr` when a `schedule` is given, and for each `name: (numerator, count)` of `means` the ratio
  of the two summed metrics (e.g. SFT's `masked_ce`, TraceRL's `kl`). `is_empty(micro_batch)`
  -> bool scalar: micro-batches with nothing to train, skipped under accumulation.
  """
  if accum_steps < 1:
    raise ValueError(f"accum_steps must be >= 1, got {accum_steps}")
  means = dict(means or {})

  def micro(params, batch, rng):
    def f(p):
      loss_sum, m = loss_fn(nnx.merge(graphdef, p), batch, rng)
      if "denominator" not in m:
        raise KeyError(f"loss_fn metrics need a 'denominator' entry, got {sorted(m)}")
      return loss_sum, m

    (loss_sum, m), g = jax.value_and_grad(f, has_aux=True)(params)
    m = {k: jnp.asarray(jax.lax.stop_gradient(v), jnp.float32) for k, v in m.items()}
    m["loss_sum"] = jnp.asarray(loss_sum, jnp.float32)
    return g, m

  def step(state, batch, rng):
    params = state["params"]
    rng = jax.random.fold_in(rng, state["step"])
    if accum_steps == 1:
      grads, m = micro(params, batch, rng)
    else:
      g_shape, m_shape = jax.eval_shape(
        lambda: micro(params, jax.tree.map(lambda x: x[0], batch), rng)
      )
      zeros = (
        jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), g_shape),
        _identity_metrics(m_shape),
      )

      def body(carry, xs):
        i, mb = xs
        run = lambda: micro(params, mb, jax.random.fold_in(rng, i))  # noqa: E731
        g, m = run() if is_empty is None else jax.lax.cond(is_empty(mb), lambda: zeros, run)
        return (jax.tree.map(jnp.add, carry[0], g), combine_metrics(carry[1], m)), None

      (grads, m), _ = jax.lax.scan(body, zeros, (jnp.arange(accum_steps), batch))
    den = m["denominator"]
    n = jnp.where(den > 0, den, 1.0)
    grads = jax.tree.map(lambda g: g / n, grads)
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    params = optax.apply_updates(params, updates)
    metrics = dict(m, loss=m["loss_sum"] / n, grad_norm=_norm(grads), param_norm=_norm(params))
    for name, (num, count) in means.items():
      metrics[name] = m[num] / jnp.maximum(m[count], 1e-12)
    if schedule is not None:
      metrics["lr"] = jnp.asarray(schedule(state["step"]), jnp.float32)
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

  return step


def jit_train_step(step_fn, shardings: dict, mesh: Mesh, accum_steps: int = 1):
  """jax.jit with explicit in/out shardings; the input state is donated."""
  trace_context.settle()  # else the first step's kernels change the context (trace_context.py)
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


def local_rows(mesh: Mesh, batch_size: int, accum_steps: int = 1) -> np.ndarray:
  """The rows of the global `[batch_size, T]` host batch that this process passes to
  `shard_batch`, in order: all of them on one process; with several, the rows its devices hold.

  With accumulation, micro-batch i is global rows `[i*B/accum, (i+1)*B/accum)`, of which a
  process holds the same slice in each, so its rows are `accum` runs. A process whose devices
  hold rows that are not one contiguous slice (a mesh whose row axes are not process-major)
  cannot feed `jax.make_array_from_process_local_data`, which is an error.
  """
  if batch_size % accum_steps:
    raise ValueError(f"batch of {batch_size} rows is not divisible by accum_steps={accum_steps}")
  micro = batch_size // accum_steps
  sh = batch_shardings(mesh, accum_steps)
  shape, dim = ((batch_size, 1), 0) if accum_steps == 1 else ((accum_steps, micro, 1), 1)
  spans = sorted(
    {idx[dim].indices(shape[dim])[:2] for idx in sh.addressable_devices_indices_map(shape).values()}
  )
  lo, hi = spans[0][0], max(stop for _, stop in spans)
  covered = np.zeros(shape[dim], bool)
  for start, stop in spans:
    covered[start:stop] = True
  if not covered[lo:hi].all():
    raise ValueError(
      f"process {jax.process_index()} holds batch rows {spans}, not one contiguous slice: "
      f"order the mesh's devices by process (mesh {dict(mesh.shape)})"
    )
  return (np.arange(accum_steps)[:, None] * micro + np.arange(lo, hi)[None, :]).ravel()


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
