r"""Forward-pass benchmark of a preset with random weights: tokens/s, MFU, compile time, peak memory.

  python -m experiments.bench_forward --config=sdar_1p7b --batch=4 --seq_len=4096 \
      --attention_impl=dense,cudnn --init_compile_configs=sdar_8b

Prints one table row per attention implementation; also times the sharded abstract-init compile
(and the init itself) of the presets in --init_compile_configs.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx

from dice_jax import sharding
from dice_jax.model import AttentionSpec, Transformer, get_config
from experiments import _cli

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "tiny", "Model preset.")
flags.DEFINE_integer("batch", 4, "Batch size.")
flags.DEFINE_integer("seq_len", 4096, "Tokens per sequence.")
flags.DEFINE_list("attention_impl", ["dense"], "Attention implementations to compare.")
flags.DEFINE_enum("mask", "block_causal", ["causal", "block_causal"], "Mask kind.")
flags.DEFINE_integer("iters", 10, "Timed iterations.")
flags.DEFINE_list("init_compile_configs", [], "Presets whose sharded init compile is timed.")
flags.DEFINE_float("peak_tflops", 0.0, "Device peak bf16 TFLOP/s for MFU (0: guess from device).")


def forward_flops(cfg, batch, seq):
  """2 * params-in-matmuls per token + attention scores/values (4 * T^2 * N * H per sequence)."""
  matmul_params = cfg.num_params() - cfg.vocab_size * cfg.hidden_size  # embedding is a gather
  dense = 2 * matmul_params * batch * seq
  attn = 4 * batch * seq * seq * cfg.num_heads * cfg.head_dim * cfg.num_layers
  return dense + attn


def peak_flops():
  if FLAGS.peak_tflops:
    return FLAGS.peak_tflops * 1e12
  kind = jax.devices()[0].device_kind.lower()
  for name, tf in (("h200", 989), ("h100", 989), ("a100", 312), ("v5", 197), ("v4", 275)):
    if name in kind:
      return tf * 1e12
  return float("nan")


def peak_memory_gib():
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use", float("nan")) / 2**30


def bench_impl(impl, mesh):
  cfg = get_config(FLAGS.config, dtype="bfloat16", param_dtype="bfloat16", attention_impl=impl)
  model = sharding.create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
  b, t = FLAGS.batch, FLAGS.seq_len
  tok = jax.random.randint(jax.random.key(1), (b, t), 0, cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  spec = AttentionSpec(FLAGS.mask, cfg.block_size)
  fwd = jax.jit(lambda m, x, p: m(x, p, spec, return_hidden=True))  # hidden: skip [B,T,V] logits
  t0 = time.perf_counter()
  compiled = fwd.lower(model, tok, pos).compile()
  compile_s = time.perf_counter() - t0
  out = compiled(model, tok, pos)
  out.block_until_ready()
  t0 = time.perf_counter()
  for _ in range(FLAGS.iters):
    out = compiled(model, tok, pos)
  out.block_until_ready()
  step = (time.perf_counter() - t0) / FLAGS.iters
  flops = forward_flops(cfg, b, t) - 2 * b * t * cfg.hidden_size * cfg.vocab_size  # no LM head
  finite = bool(np.isfinite(np.asarray(out[:, -1].astype(jnp.float32))).all())
  return dict(
    impl=impl,
    compile_s=compile_s,
    step_ms=step * 1e3,
    tok_s=b * t / step,
    mfu=flops / step / peak_flops(),
    peak_gib=peak_memory_gib(),
    finite=finite,
  )


def bench_init_compile(name, mesh):
  cfg = get_config(name, param_dtype="bfloat16")
  fn = lambda: Transformer(cfg, rngs=nnx.Rngs(0))
  t0 = time.perf_counter()
  abstract = nnx.eval_shape(fn)
  graphdef, abs_state = nnx.split(abstract)
  shardings = sharding.state_shardings(abs_state, mesh)
  init = jax.jit(lambda: nnx.split(fn())[1], out_shardings=shardings)
  compiled = init.lower().compile()
  compile_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  state = compiled()
  jax.block_until_ready(state)
  run_s = time.perf_counter() - t0
  del state
  return dict(config=name, params_b=cfg.num_params() / 1e9, compile_s=compile_s, init_s=run_s)


def main(argv):
  del argv
  mesh = sharding.make_mesh()
  print(
    f"device: {jax.devices()[0].device_kind} x{jax.device_count()}, jax {jax.__version__}; "
    f"{FLAGS.config}, batch {FLAGS.batch} x {FLAGS.seq_len}, mask {FLAGS.mask}, bf16"
  )
  print(
    f"{'attention':<10}{'compile s':>10}{'step ms':>10}{'tokens/s':>12}{'MFU':>7}"
    f"{'peak GiB':>10}{'finite':>8}"
  )
  for impl in FLAGS.attention_impl:
    try:
      r = bench_impl(impl, mesh)
      print(
        f"{r['impl']:<10}{r['compile_s']:>10.1f}{r['step_ms']:>10.1f}{r['tok_s']:>12,.0f}"
        f"{r['mfu']:>7.1%}{r['peak_gib']:>10.1f}{str(r['finite']):>8}",
        flush=True,
      )
    except Exception as e:  # report and continue with the next implementation
      print(f"{impl:<10} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
  for name in FLAGS.init_compile_configs:
    r = bench_init_compile(name, mesh)
    print(
      f"init {r['config']} ({r['params_b']:.2f}B params, bf16, sharded jit): compile "
      f"{r['compile_s']:.1f} s, run {r['init_s']:.1f} s",
      flush=True,
    )


if __name__ == "__main__":
  _cli.run(main)
