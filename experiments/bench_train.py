r"""Benchmark of the sharded SFT train step on synthetic data (no grain needed).

  python -m experiments.bench_train --config=sdar_1p7b --seq_len=4096 [--batch_per_device=2]
      [--attention_impl=flash] [--remat] [--mesh_fsdp=-1 --mesh_tensor=1] [--steps=5]

Each row has `seq_len` tokens; the model input is the 2L `[x_t ; x_0]` sequence of 2*seq_len.
Prints step time, tokens/s (of the L-token rows) and MFU under two FLOP counts:
  mfu      mask-aware: linear layers on 2L tokens, LM head on the L x_t tokens, attention on the
           ~L^2 query/key pairs the block-diffusion mask allows (metrics.sft_flops_per_row);
  mfu_2l   the usual 6*N*D + 12*layers*heads*head_dim*S^2 count for a dense 2L-token input (N =
           parameters without the embedding table, D = 2L tokens, S = 2L).
`--check` first compares the attention implementation with the dense reference (values and
gradients) at a small size on the current backend.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx

from experiments import _cli

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "sdar_1p7b", "model preset")
flags.DEFINE_integer("seq_len", 4096, "tokens per row (model input is 2x this)")
flags.DEFINE_integer("batch_per_device", 2, "rows per device per step")
flags.DEFINE_string("attention_impl", "flash", "dense | xla | cudnn | flash")
flags.DEFINE_bool("remat", False, "rematerialise each layer")
flags.DEFINE_integer("mesh_data", 1, "data axis")
flags.DEFINE_integer("mesh_fsdp", -1, "fsdp axis (-1 fills)")
flags.DEFINE_integer("mesh_tensor", 1, "tensor axis")
flags.DEFINE_integer("steps", 5, "timed steps (after 2 warm-up steps)")
flags.DEFINE_bool("check", False, "check the attention impl against dense first")
flags.DEFINE_list("flash_blocks", None, "flash tiles: block_q,block_k,block_bwd")
flags.DEFINE_string("out", None, "append the result as a JSON line to this file")


def synthetic_batch(rows: int, seq_len: int, vocab: int, seed: int = 0) -> dict:
  """One segment per row, the first quarter prompt, the rest response (loss)."""
  rng = np.random.default_rng(seed)
  pos = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (rows, seq_len))
  return {
    "tokens": rng.integers(0, vocab - 2, (rows, seq_len), dtype=np.int32),
    "positions": np.array(pos),
    "segment_ids": np.ones((rows, seq_len), np.int32),
    "loss_mask": np.array(pos >= seq_len // 4),
  }


def flops_2l(cfg, seq_len: int) -> float:
  s = 2 * seq_len
  n = cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (
    1 if not cfg.tie_word_embeddings else 0
  )
  return 6.0 * n * s + 12.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * s * s


def check_attention(impl: str, flash_tiles=None):
  """Max abs error of `impl` vs the dense reference on a small block-diffusion problem."""
  from dice_jax.model import masks
  from dice_jax.model.transformer import dense_attention, self_attention

  b, t, n, k, h = 2, 256, 4, 2, 128
  rng = np.random.default_rng(0)
  q, kk, v = (jnp.asarray(rng.normal(size=(b, 2 * t, m, h)), jnp.bfloat16) for m in (n, k, k))
  pos = jnp.asarray(np.broadcast_to(np.arange(t), (b, t)), jnp.int32)
  seg = jnp.asarray(np.where(np.arange(t) < 200, 1, 2)[None].repeat(b, 0), jnp.int32)
  spec = masks.AttentionSpec.block_diffusion(4, seg, (pos - 13) // 4)
  positions = jnp.concatenate([pos, pos], 1)
  mask = masks.dense_mask(spec, positions)
  ct = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
  f_ref = lambda q, k, v: (dense_attention(q, k, v, mask).astype(jnp.float32) * ct).sum()  # noqa
  f_imp = lambda q, k, v: (
    self_attention(q, k, v, spec, positions, impl=impl, flash_tiles=flash_tiles).astype(  # noqa
      jnp.float32
    )
    * ct
  ).sum()
  o_ref = dense_attention(q, kk, v, mask).astype(jnp.float32)
  o_imp = jax.jit(
    lambda q, k, v: self_attention(q, k, v, spec, positions, impl=impl, flash_tiles=flash_tiles)
  )(q, kk, v).astype(jnp.float32)
  g_ref = jax.grad(f_ref, argnums=(0, 1, 2))(q, kk, v)
  g_imp = jax.jit(jax.grad(f_imp, argnums=(0, 1, 2)))(q, kk, v)
  errs = {"out": float(jnp.abs(o_ref - o_imp).max())}
  for name, a, c in zip(("dq", "dk", "dv"), g_ref, g_imp):
    a, c = a.astype(jnp.float32), c.astype(jnp.float32)
    errs[name] = float(jnp.abs(a - c).max() / (jnp.abs(a).max() + 1e-6))
  print(f"attention check ({impl} vs dense, bf16, rel. grad err): {errs}", flush=True)
  return errs


def main(argv):
  del argv
  from dice_jax import sharding
  from dice_jax.diffusion.objective import ObjectiveConfig, block_diffusion_loss
  from dice_jax.model.config import get_config
  from dice_jax.model.transformer import Transformer
  from dice_jax.train import metrics, optimizer
  from dice_jax.train import train_step as ts

  tiles = {"flash_tiles": tuple(map(int, FLAGS.flash_blocks))} if FLAGS.flash_blocks else {}
  cfg = get_config(FLAGS.config, attention_impl=FLAGS.attention_impl, remat=FLAGS.remat, **tiles)
  if FLAGS.check:
    check_attention(FLAGS.attention_impl, cfg.flash_tiles)
  mesh = sharding.make_mesh(FLAGS.mesh_data, FLAGS.mesh_fsdp, FLAGS.mesh_tensor)
  rows = FLAGS.batch_per_device * mesh.size // FLAGS.mesh_tensor
  t0 = time.perf_counter()
  model = sharding.create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
  tx = optimizer.make_optimizer(optimizer.OptimizerConfig(), 1000)
  graphdef, state, shardings = ts.init_train_state(model, tx, mesh)
  del model
  ocfg = ObjectiveConfig()
  step = ts.jit_train_step(
    ts.make_train_step(graphdef, tx, lambda m, b, r: block_diffusion_loss(m, b, r, ocfg)),
    shardings,
    mesh,
  )
  batch = ts.shard_batch(synthetic_batch(rows, FLAGS.seq_len, cfg.vocab_size), mesh)
  rng = jax.random.key(0)
  for _ in range(2):
    state, m = step(state, batch, rng)
    jax.block_until_ready(m)
  warm = time.perf_counter() - t0
  t0 = time.perf_counter()
  for _ in range(FLAGS.steps):
    state, m = step(state, batch, rng)
  jax.block_until_ready((state, m))
  dt = (time.perf_counter() - t0) / FLAGS.steps
  peak = metrics.peak_flops() or float("nan")
  f_mask = rows * metrics.sft_flops_per_row(cfg, FLAGS.seq_len)
  f_2l = rows * flops_2l(cfg, FLAGS.seq_len)
  mem = jax.devices()[0].memory_stats() or {}
  res = {
    "date": time.strftime("%Y-%m-%d"),
    "device": jax.devices()[0].device_kind,
    "devices": mesh.size,
    "mesh": dict(mesh.shape),
    "jax": jax.__version__,
    "config": FLAGS.config,
    "seq_len": FLAGS.seq_len,
    "input_len": 2 * FLAGS.seq_len,
    "rows": rows,
    "attention_impl": cfg.attention_impl,
    "remat": cfg.remat,
    "flash_blocks": list(cfg.flash_tiles),
    "step_s": round(dt, 4),
    "tokens_per_s": round(rows * FLAGS.seq_len / dt, 1),
    "input_tokens_per_s": round(rows * 2 * FLAGS.seq_len / dt, 1),
    "mfu": round(f_mask / dt / (peak * mesh.size), 4),
    "mfu_2l": round(f_2l / dt / (peak * mesh.size), 4),
    "loss": float(m["loss"]),
    "warmup_s": round(warm, 1),
    "peak_mem_gib": round(mem.get("peak_bytes_in_use", 0) / 2**30, 1),
  }
  print("| " + " | ".join(f"{k}={v}" for k, v in res.items()) + " |", flush=True)
  if FLAGS.out:
    with open(FLAGS.out, "a") as f:
      f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
  _cli.run(main)
