"""Device-memory estimate of the TraceRL update, and the choice of layout / micro_rows / remat.

The update (`train_step.make_train_step` on `tracerl.tracerl_loss`) holds, per device:

  weights     the fp32 master parameters
  grads       their fp32 gradients; with accumulation the running sum and one micro-batch's
              gradients (XLA may add part of them in place: CPU +0.3 of a copy; the H200 peak of
              issue 30, 43.7 GiB at 256 micro-batches, is 0.89x the estimate without it)
  optimizer   AdamW's two fp32 moments
  update      `OPT_TEMPS` parameter-sized fp32 temporaries of clipping and the update (XLA on
              CPU: one); live only after the backward pass, when the batch, residuals and working
              set below are freed: the total takes the larger of the two phases
  batch       the mini-batch's token fields (all micro-batches, ~`BATCH_BYTES_PER_TOKEN` each)
  residuals   what the forward keeps for the backward pass, every layer, one micro-batch: per
              token and layer, by remat policy (model/config.REMAT_POLICIES; counted from the
              jaxpr residuals of `transformer._layer`):
                full  the layer input (a D)
                dots  the input, the q/k/v/o and gate/up matmul outputs (a (2D + Nq + 2Kv + 2F))
                *_attn  full or dots, and the attention output (a Nq) with the flash kernel's
                      log-sum-exp (4 N, f32)
                none  every intermediate: f32 norm inputs and outputs, the compute-dtype copies
                      of the layer's weights, RoPE tables, the MLP's six [F] vectors and, with a
                      dense attention, the [N, S] mask, scores, exponentials and probabilities
  working     the larger of: one layer's backward (its `none` residuals, recomputed under
              remat, and with a dense attention the f32 cotangent of its [N, S] probabilities)
              and one LM-head chunk (`logit_chunk`
              positions: `LOGIT_TEMPS` f32 [rows, chunk, V] buffers, the compute-dtype head and
              its f32 gradient)

a = compute-dtype bytes, D hidden, F MLP, Nq = heads x head_dim, Kv = kv heads x head_dim, S the
row length. It is an estimate (XLA's buffer assignment reuses and fuses), checked against XLA's
own memory analysis of the compiled update on CPU in tests/rl/test_rl_memory.py; it exists to
refuse a setting before the rollout and to pick one that fits, instead of an out-of-memory error
after the whole rollout.

Per platform (`platform`: the one the update is traced for, `model.platform.target`). The parts
above are XLA:CPU's, and serve GPU too (they are 0.95-1.07 of the H200 peaks of
docs/performance.md). XLA:TPU plans the same update differently, read off the buffer assignment of sdar_1p7b's
update compiled for a v5e-8 (docs/tpu.md, "What the RL planner models per platform"):
  - the compute-dtype copy of the parameter shards: XLA:TPU casts each fp32 shard before the
    FSDP all-gather and hoists the cast of the scanned layer stack out of the loop, so a
    compute-dtype copy of the layers' shards lives through the backward pass;
  - one layer's backward keeps compute-dtype buffers only (`TPU_LAYER_BWD`: the f32 norm and
    RoPE intermediates the CPU count has are fused away), and the Mosaic flash kernel's
    log-sum-exp is `[N, T, 128]` f32 (`TPU_STAT_LANES`);
  - the kernel keeps one lane of its log-sum-exp for the backward pass (`[N, T]` f32, widened
    again there), and `*_attn` keeps it with the attention's output (`flash_tpu` names both,
    as `flash_bd`: the backward runs no forward kernel again);
  - the LM head: `TPU_LOGIT_TEMPS` f32 chunks, the head gathered whole in compute dtype and its
    f32 gradient shard;
  - of the embedding and final norm only the final norm's compute-dtype input and output;
  - the layers' gradients are live from the layers' backward on: not while the LM head's runs
    (with one micro-batch), so the backward's peak is the larger of its two phases.

Row lengths are the worst case of the layout for a prompt of P tokens and L new tokens, decoded
with `steps` steps per block and the TraceRL `shrink` (R = ceil(steps / shrink) rounds per block
at most): per_round `P + 2L`, packed `P + L (1 + R)`, each rounded up by `tracerl.bucket_length`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax.numpy as jnp

from dice_jax.diffusion.blocks import resolve_block_size
from dice_jax.diffusion.memory import GIB
from dice_jax.model.config import REMAT_POLICIES, remat_policy_name
from dice_jax.rl.tracerl import LAYOUTS, bucket_length

OPT_TEMPS = 1  # fp32 parameter-sized temporaries of clip + AdamW (the scaled gradient)
LOGIT_TEMPS = 3  # f32 [rows, chunk, V] buffers of one LM-head chunk (logits, exp/probs, cotangent)
BATCH_BYTES_PER_TOKEN = 40  # int32/f32/bool token fields of a TraceRL batch, with old_logp
FLASH_IMPLS = ("flash", "cudnn")  # attention kernels that keep no [T, S] matrix
# Fastest first: less recomputation before more rows per micro-batch. Keeping the attention's
# output saves its forward kernel in the backward pass (dots_attn before dots); recomputing the
# attention is cheaper than recomputing the layer's matmuls (dots before full_attn).
REMAT_ORDER = ("none", "dots_attn", "dots", "full_attn", "full")
MAX_MICRO_TOKENS = 65_536  # more tokens per micro-batch buy no speed, only memory
# XLA:TPU (module docstring). Each is read off the buffer assignment at the compiled peak of
# sdar_1p7b's RL update, 8 x 24,576 tokens on a v5e-8 (jax 0.10.2, libtpu 0.0.42.1, 2026-12-04,
# `compile(compiler_options={'xla_dump_to': ...})`: peak 9.21 GiB in the layers' backward): one
# layer's backward held five compute-dtype [T, F] buffers (the MLP's activations and
# cotangents), seven [T, D], one [T, Nq], three [T, Kv] and the kernel's lane-wide log-sum-exp;
# the LM head's phase two f32 [chunk, V] buffers (logits and their cotangent) beside the head
# gathered in bf16. The model is 1-4 % above the four RL rows of docs/tpu.md.
TPU_STAT_LANES = 128  # flash_tpu keeps its log-sum-exp `[B, N, T, 128]` f32 (lane-wide)
TPU_LAYER_BWD = dict(f=5, d=7, nq=1, kv=3)  # compute-dtype [T, width] buffers of a layer's backward
TPU_LOGIT_TEMPS = 2  # f32 [rows, chunk, V] buffers of one LM-head chunk on TPU
PLATFORMS = ("cpu", "gpu", "tpu")


def row_length(
  layout: str,
  *,
  prompt_len: int,
  new_tokens: int,
  steps: int,
  shrink: int = 1,
  length_multiple: int = 128,
) -> int:
  """The longest TraceRL row of `layout` (module docstring), rounded up to `length_multiple`: the
  longest batch `build_batches` makes with this as `max_length`."""
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  rounds = -(-steps // shrink)
  n = prompt_len + new_tokens * (2 if layout == "per_round" else 1 + rounds)
  return bucket_length(n, length_multiple, cap=n)


def _platform(platform: Optional[str]) -> str:
  """`platform`, or the one programs are traced for (`model.platform.target`)."""
  if platform is None:
    from dice_jax.model import platform as platform_lib

    platform = platform_lib.target().platform
  if platform not in PLATFORMS:
    raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
  return platform


def _stat_bytes(c, platform: str, kept: bool = False) -> int:
  """Bytes per token of the flash kernel's f32 log-sum-exp (lane-wide on TPU; `kept` for the
  backward pass, one lane wide everywhere: `flash_tpu` keeps `[B, N, T]`); 0 without one."""
  if c.attention_impl not in FLASH_IMPLS:
    return 0
  return 4 * c.num_heads * (TPU_STAT_LANES if platform == "tpu" and not kept else 1)


def layer_residual_bytes(
  c, policy: str, seq_len: int, platform: str = "cpu"
) -> tuple[float, float]:
  """(bytes per token, bytes per layer independent of tokens) one layer keeps for the backward
  pass under remat `policy` (module docstring; `seq_len` = S, for the dense attention matrix;
  `platform` sizes the flash kernel's log-sum-exp)."""
  a = jnp.dtype(c.compute_dtype).itemsize
  d, f = c.hidden_size, c.intermediate_size
  nq, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  # *_attn keeps the attention's output and the kernel's log-sum-exp (flash_bd and flash_tpu name
  # both, so the backward runs no forward kernel again; the TPU kernel keeps one lane of it)
  attention = a * nq + _stat_bytes(c, platform, kept=True)
  if policy in ("full", "full_attn"):
    return float(a * d + (attention if policy == "full_attn" else 0)), 0.0
  if policy in ("dots", "dots_attn"):
    dots = a * (2 * d + nq + 2 * kv + 2 * f)
    return float(dots + (attention if policy == "dots_attn" else 0)), 0.0
  if policy != "none":
    raise ValueError(f"remat policy must be one of {REMAT_POLICIES}, got {policy!r}")
  f32_compute = a == 4  # the casts to float32 (norm inputs, probabilities) then copy nothing
  per_token = a * (2 * d + 2 * nq + 3 * kv + 6 * f)  # compute-dtype activations
  per_token += 4 * (4 * d + 2 * nq + 2 * kv + 2 * c.head_dim)  # f32 norms, RoPE tables
  per_token -= 4 * (2 * d + nq + kv) if f32_compute else 0
  per_token += 8 * (c.num_heads + c.num_kv_heads + 2)  # norm statistics
  if c.attention_impl in FLASH_IMPLS:
    per_token += a * nq + _stat_bytes(c, platform, kept=True)  # the kernel's output and lse
  else:  # mask, scores, exp (f32), probabilities (compute dtype)
    per_token += c.num_heads * seq_len * (9 + (0 if f32_compute else a))
  return float(per_token), float(a * _layer_params(c))  # + the layer's weights in compute dtype


def _layer_params(c) -> int:
  d, nq, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  return d * (2 * nq + 2 * kv) + 3 * d * c.intermediate_size


def tpu_layer_backward_bytes(c, seq_len: int) -> tuple[float, float]:
  """(bytes per token, per layer) of one layer's backward under XLA:TPU (`TPU_LAYER_BWD`, the
  kernel's lane-wide log-sum-exp, the layer's weights in compute dtype); a dense attention adds
  its [N, S] mask, scores, probabilities and their f32 cotangent as on CPU."""
  a = jnp.dtype(c.compute_dtype).itemsize
  w = dict(
    f=c.intermediate_size,
    d=c.hidden_size,
    nq=c.num_heads * c.head_dim,
    kv=c.num_kv_heads * c.head_dim,
  )
  per_token = a * sum(n * w[k] for k, n in TPU_LAYER_BWD.items()) + _stat_bytes(c, "tpu")
  if c.attention_impl not in FLASH_IMPLS:
    per_token += c.num_heads * seq_len * (9 + a + 4)
  return float(per_token), float(a * _layer_params(c))


def update_estimate(
  model_cfg,
  *,
  micro_rows: int,
  row_len: int,
  accum_steps: int,
  remat=None,
  logit_chunk: int = 2048,
  param_shards: int = 1,
  row_shards: int = 1,
  platform: Optional[str] = None,
) -> dict:
  """Bytes by part of one TraceRL optimizer step on one device (module docstring): `weights`,
  `grads`, `optimizer`, `update`, `batch`, `residuals`, `working`, `compute_copy` (XLA:TPU's
  compute-dtype copy of the layers' shards; 0 elsewhere), and the `total` at the peak
  (weights, grads and optimizer, plus the larger of the backward pass's batch + residuals +
  working and the update's temporaries; on TPU the backward's two phases apart: the layers'
  with their gradients, the LM head's without them unless accumulated).

  `micro_rows` rows of `row_len` tokens per micro-batch, `accum_steps` micro-batches; `remat` a
  policy name or bool (None: the model config's); parameters over `param_shards` devices (fsdp x
  tensor), rows over `row_shards` (data x fsdp); `platform` 'cpu', 'gpu' or 'tpu' (None: the
  one programs are traced for).
  """
  c = model_cfg
  platform = _platform(platform)
  tpu = platform == "tpu"
  policy = c.remat_policy if remat is None else remat_policy_name(remat)
  for name, v in (("micro_rows", micro_rows), ("row_len", row_len), ("accum_steps", accum_steps)):
    if not isinstance(v, int) or v < 1:
      raise ValueError(f"{name} must be a positive int, got {v!r}")
  a = jnp.dtype(c.compute_dtype).itemsize
  p = c.num_params() / param_shards
  weights = p * jnp.dtype(c.weight_dtype).itemsize
  grads = p * 4 * (2 if accum_steps > 1 else 1)
  optimizer = p * 4 * 2
  update = p * 4 * OPT_TEMPS
  rows = -(-micro_rows // row_shards)
  tokens = rows * row_len
  batch = BATCH_BYTES_PER_TOKEN * tokens * accum_steps
  per_tok, per_layer = layer_residual_bytes(c, policy, row_len, platform)
  residuals = c.num_layers * (per_tok * tokens + per_layer)
  if tpu:  # the final norm's compute-dtype input and output
    residuals += tokens * 2 * a * c.hidden_size
  else:  # embedding, final norm
    residuals += tokens * (3 * a * c.hidden_size + 8 * c.hidden_size)
  if tpu:
    bwd_tok, bwd_layer = tpu_layer_backward_bytes(c, row_len)
    layer_bwd = bwd_tok * tokens + bwd_layer
  else:
    none_tok, none_layer = layer_residual_bytes(c, "none", row_len, platform)
    layer_bwd = none_tok * tokens + none_layer
    if c.attention_impl not in FLASH_IMPLS:  # the f32 cotangent of the [N, S] probabilities
      layer_bwd += 4 * c.num_heads * row_len * tokens
  chunk = min(logit_chunk, row_len)
  head = c.hidden_size * c.vocab_size
  if tpu:  # f32 chunks, the head gathered whole in compute dtype, its f32 gradient shard
    logits = TPU_LOGIT_TEMPS * 4 * rows * chunk * c.vocab_size + head * (a + 4 / param_shards)
  else:
    logits = LOGIT_TEMPS * 4 * rows * chunk * c.vocab_size + head / param_shards * (a + 4)
  working = max(layer_bwd, logits)
  w_bytes = jnp.dtype(c.weight_dtype).itemsize
  narrower = a < w_bytes and param_shards > 1
  compute_copy = c.num_layers * _layer_params(c) / param_shards * a if tpu and narrower else 0.0
  backward = batch + residuals + compute_copy
  if tpu:  # by phase: the layers' gradients come out of the layers' backward, so only their
    # running sum (accumulation) is live while the LM head's runs (its own shard is in `logits`)
    head_grads = grads / 2 if accum_steps > 1 else 0.0
    phases = (grads + backward + layer_bwd, head_grads + backward + logits, grads + update)
    total = weights + optimizer + max(phases)
  else:
    total = weights + grads + optimizer + max(backward + working, update)
  return dict(
    weights=weights,
    grads=grads,
    optimizer=optimizer,
    update=update,
    batch=batch,
    residuals=residuals,
    working=working,
    compute_copy=compute_copy,
    total=total,
  )


@dataclasses.dataclass(frozen=True)
class UpdatePlan:
  """One setting of the update and its estimate (bytes by part, `update_estimate`)."""

  layout: str
  micro_rows: int
  remat: str
  row_len: int
  estimate: dict

  def describe(self) -> str:
    return (
      f"layout={self.layout} micro_rows={self.micro_rows} remat={self.remat} "
      f"(rows of up to {self.row_len} tokens): ~{self.estimate['total'] / GIB:.1f} GiB"
    )


def micro_row_options(rows_per_update: int) -> list[int]:
  """Rows per micro-batch that divide `rows_per_update`, largest first."""
  return [m for m in range(rows_per_update, 0, -1) if rows_per_update % m == 0]


def estimate_plan(
  model_cfg,
  *,
  layout: str,
  micro_rows: int,
  remat,
  rows_per_update: int,
  prompt_len: int,
  new_tokens: int,
  steps: int,
  shrink: int = 1,
  length_multiple: int = 128,
  logit_chunk: int = 2048,
  param_shards: int = 1,
  row_shards: int = 1,
  platform: Optional[str] = None,
) -> UpdatePlan:
  """The `UpdatePlan` of one explicit setting (`platform` as `update_estimate`)."""
  if rows_per_update % micro_rows:
    raise ValueError(f"micro_rows ({micro_rows}) must divide rows_per_update ({rows_per_update})")
  row_len = row_length(
    layout,
    prompt_len=prompt_len,
    new_tokens=new_tokens,
    steps=steps,
    shrink=shrink,
    length_multiple=length_multiple,
  )
  policy = remat_policy_name(remat)
  est = update_estimate(
    model_cfg,
    micro_rows=micro_rows,
    row_len=row_len,
    accum_steps=rows_per_update // micro_rows,
    remat=policy,
    logit_chunk=logit_chunk,
    param_shards=param_shards,
    row_shards=row_shards,
    platform=platform,
  )
  return UpdatePlan(layout, micro_rows, policy, row_len, est)


def choose_plan(
  model_cfg,
  limit_bytes: int,
  *,
  layouts: Sequence[str],
  micro_rows: Sequence[int],
  remats: Sequence[str],
  **shape,
) -> tuple[Optional[UpdatePlan], list[UpdatePlan]]:
  """(the fastest plan whose estimate fits `limit_bytes`, or None; every plan tried).

  Order, fastest first: `layouts` as given (packed before per_round: fewer tokens per
  response), then less rematerialisation (`REMAT_ORDER`), then more rows per micro-batch (when
  there is a choice, a micro-batch of more than one row is not tried beyond `MAX_MICRO_TOKENS`
  tokens).
  """
  tried = []
  for layout in layouts:
    for remat in sorted(remats, key=REMAT_ORDER.index):
      for m in sorted(micro_rows, reverse=True):
        plan = estimate_plan(model_cfg, layout=layout, micro_rows=m, remat=remat, **shape)
        if len(micro_rows) > 1 and m > 1 and m * plan.row_len > MAX_MICRO_TOKENS:
          continue
        tried.append(plan)
        if plan.estimate["total"] <= limit_bytes:
          return plan, tried
  return None, tried


def resolve_update(
  cfg,
  model_cfg,
  limit_bytes: Optional[int],
  *,
  param_shards: int = 1,
  row_shards: int = 1,
  platform: Optional[str] = None,
):
  """(`cfg` with `tracerl.layout`, `accum_steps` and `update_remat` concrete, the `UpdatePlan`
  or None) for an `RLConfig`, checked against `limit_bytes` before anything is sampled.

  What the config sets is kept (`update_remat='auto'` with `model_overrides['remat']` keeps the
  model's); what it leaves to memory (`layout='auto'`, `accum_steps=0`, `update_remat='auto'`)
  is the fastest setting that fits (`choose_plan`); with no known limit (CPU) those are today's
  defaults: packed, one micro-batch, the model's remat. Raises ValueError naming the setting and
  its estimate against the limit when nothing fits.
  """
  t = cfg.tracerl
  layouts = [t.layout] if t.layout != "auto" else ["packed", "per_round"]
  if cfg.accum_steps:
    micro = [cfg.rows_per_update // cfg.accum_steps]
  else:
    micro = [m for m in micro_row_options(cfg.rows_per_update) if m % row_shards == 0]
    micro = micro or [cfg.rows_per_update]
  if cfg.update_remat != "auto":
    remats = [cfg.update_remat]
  elif "remat" in cfg.run.model_overrides:
    remats = [remat_policy_name(cfg.run.model_overrides["remat"])]
  else:
    remats = list(REMAT_ORDER)
  auto = len(layouts) * len(micro) * len(remats) > 1
  if limit_bytes is None:
    layouts = layouts[:1]
    micro = [micro[0] if cfg.accum_steps else cfg.rows_per_update]
    remats = remats if len(remats) == 1 else [model_cfg.remat_policy]
  shape = dict(
    rows_per_update=cfg.rows_per_update,
    prompt_len=cfg.max_prompt_len  # + the absolute grid's prompt tail
    + resolve_block_size(cfg.sampler.block_size, model_cfg, "RLConfig.sampler"),
    new_tokens=cfg.sampler.max_new_tokens,
    steps=cfg.sampler.steps,
    shrink=t.shrink,
    length_multiple=cfg.length_multiple,
    logit_chunk=t.logit_chunk,
    param_shards=param_shards,
    row_shards=row_shards,
    platform=_platform(platform),
  )
  limit = float("inf") if limit_bytes is None else limit_bytes
  plan, tried = choose_plan(
    model_cfg, limit, layouts=layouts, micro_rows=micro, remats=remats, **shape
  )
  if plan is None:
    smallest = min(tried, key=lambda p: p.estimate["total"]) if tried else None
    g = lambda k: smallest.estimate[k] / GIB  # noqa: E731
    which = "no setting of the update fits" if auto else "the update's setting does not fit"
    raise ValueError(
      f"RL update: {which} in device memory ({limit / GIB:.1f} GiB) at prompts of "
      f"{cfg.max_prompt_len} + {cfg.sampler.max_new_tokens} new tokens; smallest tried: "
      f"{smallest.describe()} (weights {g('weights'):.1f}, grads {g('grads'):.1f}, optimizer "
      f"{g('optimizer'):.1f}, residuals {g('residuals'):.1f}, working {g('working'):.1f}). "
      f"Set tracerl.layout / accum_steps / update_remat to 'auto' / 0 / 'auto', or use fewer "
      f"max_new_tokens, a smaller max_prompt_len or more devices (mesh_fsdp)"
    )
  resolved = dataclasses.replace(
    cfg,
    tracerl=dataclasses.replace(t, layout=plan.layout),
    accum_steps=cfg.rows_per_update // plan.micro_rows,
    update_remat=plan.remat,
  )
  return resolved, plan
