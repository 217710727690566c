r"""The ops of one decode forward, their bytes and FLOPs, and each op's roofline (no device needed).

  python -m experiments.decode_roofline --config=sdar_4b --rows=128 --fill=1536 --tokens=4

Two views of the forward the sampler runs (split weights, flash cache attention):
  lowered  the program lowered for CUDA on this host (`platform.lowering_for("gpu")`, abstract
           arguments: nothing is allocated or run): its matrix products (`dot_general`, grouped by
           shape, with FLOPs), the Triton kernels (custom calls) and the in-place writes. XLA's
           GPU fusions are decided when compiling on the device; `decode_profile` lists those.
  table    one row per op of a layer (x layers) and the LM head: bytes (weights, activations,
           the live K/V at `--fill`), FLOPs, and its time at `--hbm_tbs` / `--peak_tflops`
           (max of the two: each op alone on the device), with the sum and the max form of the
           forward's roofline.
Markdown on stdout.
"""

from __future__ import annotations

import collections
import math
import re

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx

from dice_jax.diffusion import sampler
from dice_jax.model import AttentionSpec, KVCache, Transformer, flash_decode, get_config, platform

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "sdar_4b", "Model preset.")
flags.DEFINE_integer("rows", 128, "Rows (batch).")
flags.DEFINE_integer("fill", 1536, "Cache slots filled.")
flags.DEFINE_integer("cache_len", 2112, "Cache slots per row (the sampler's for 1024 + 1024).")
flags.DEFINE_integer("tokens", 4, "New tokens per row.")
flags.DEFINE_bool("fp8", False, "A float8_e4m3fn K/V cache.")
flags.DEFINE_bool("lower", True, "Also lower the forward for CUDA and list its ops.")
flags.DEFINE_float("peak_tflops", 790.0, "bf16 dense TFLOP/s (H200).")
flags.DEFINE_float("hbm_tbs", 4.8, "HBM TB/s (H200 spec).")


def op_table(cfg, rows, fill, tokens, cache_len, fp8=False, tiles=None):
  """[(op, count per forward, bytes, FLOPs)] of one decode forward, each count's bytes/FLOPs per
  instance. Activations are bf16; per-layer elementwise ops are grouped as XLA would fuse them at
  best (one read of each input, one write of each output)."""
  tiles = tiles or flash_decode.DecodeTiles()
  D, F, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
  N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  G, m = N // K, rows * tokens
  a = 2  # bytes per activation / weight element
  gemm = lambda k, n: (a * (m * k + k * n + m * n), 2 * m * k * n)
  r = tokens * G
  rpad = max(16, 1 << (r - 1).bit_length())
  live = -(-fill // tiles.block_k) * tiles.block_k
  programs = tiles.splits or -(-cache_len // tiles.split)
  kv = 2 * rows * live * K * H * (1 if fp8 else 2)
  rows_out = [
    ("input RMSNorm (+ residual)", L, a * 2 * m * D, 0),
    ("q/k/v GEMM", L, *gemm(D, (N + 2 * K) * H)),
    ("q/k RMSNorm + RoPE + query layout", L, a * 2 * m * (N + K) * H, 0),
    (
      "cache attention kernel (live K/V, metadata, q, partial o/lse)",
      L,
      kv + 8 * rows * K * live + a * rows * K * rpad * H + 4 * rows * K * programs * rpad * (H + 1),
      4 * rows * K * r * live * H,
    ),
    ("merge of the programs' partials", L, 4 * rows * K * programs * rpad * (H + 1) + 4 * m * N * H, 0),
    (
      "new tokens' own attention + 2-way merge (not with fold_new)",
      0 if tiles.fold_new else L,
      a * 3 * m * N * H + 4 * 2 * m * N * H,
      4 * rows * K * r * tokens * H,
    ),
    ("o GEMM", L, *gemm(N * H, D)),
    ("residual + post-attention RMSNorm", L, a * 3 * m * D, 0),
    ("gate/up GEMM", L, *gemm(D, 2 * F)),
    ("SiLU(gate) * up", L, a * 3 * m * F, 0),
    ("down GEMM (+ residual)", L, *gemm(F, D)),
    ("final RMSNorm", 1, a * 2 * m * D, 0),
    ("LM head GEMM (f32 logits)", 1, a * (m * D + D * V) + 4 * m * V, 2 * m * D * V),
    ("cache write of the new K/V (in place; update_cache)", 1, 2 * 2 * L * m * K * H * a, 0),
  ]  # fmt: skip
  return [row for row in rows_out if row[1]]


def roofline(table, tbs, tflops):
  """Per op: (op, count, GB, GFLOP, us each at the bandwidth, us each at the FLOP rate, bound);
  and the totals (bytes, FLOPs, sum-form ms, max-form ms)."""
  out, tb, tf, tsum = [], 0, 0, 0.0
  for op, n, nbytes, flops in table:
    tm, tc = nbytes / tbs / 1e6, flops / tflops / 1e6  # microseconds
    out.append((op, n, nbytes / 1e9, flops / 1e9, tm, tc, "compute" if tc > tm else "memory"))
    tb, tf, tsum = tb + n * nbytes, tf + n * flops, tsum + n * max(tm, tc)
  return out, dict(
    gb=tb / 1e9,
    tflop=tf / 1e12,
    sum_ms=tsum / 1e3,
    max_ms=max(tb / tbs / 1e12, tf / tflops / 1e12) * 1e3,
  )


def lowered_ops(cfg, rows, fill, tokens, cache_len, fp8=False):
  """{'dots': {(lhs, rhs, out): (count, FLOPs each)}, 'kernels': count, 'scatters': [...]} of
  the forward lowered for CUDA (abstract arguments)."""
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model)
  weights = jax.eval_shape(lambda s: nnx.merge(graphdef, s).decode_weights(), state)
  dtype = jnp.float8_e4m3fn if fp8 else cfg.compute_dtype
  shape = (cfg.num_layers, rows, cache_len, cfg.num_kv_heads * cfg.head_dim)
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  cache = KVCache(
    k=jax.ShapeDtypeStruct(shape, dtype),
    v=jax.ShapeDtypeStruct(shape, dtype),
    positions=i32(rows, cache_len),
    segment_ids=i32(rows, cache_len),
    block_ids=i32(rows, cache_len),
    length=i32(rows),
    head_dim=cfg.head_dim,
  )
  tok, pos = i32(rows, tokens), i32(rows, tokens)

  def fwd(state, weights, cache, tok, pos):
    m = sampler.decoding_model(graphdef, state, weights)
    spec = AttentionSpec.block_causal(cfg.block_size, jnp.ones_like(pos), pos // cfg.block_size)
    return m(tok, pos, spec, cache=cache, update_cache=True, return_hidden=True)

  with platform.lowering_for("gpu"):
    text = (
      jax.jit(fwd)
      .trace(state, weights, cache, tok, pos)
      .lower(lowering_platforms=("cuda",))
      .as_text(debug_info=False)
    )
  dots = collections.Counter()
  flops = {}
  for line in text.splitlines():
    if "stablehlo.dot_general" in line:
      types = re.findall(r"tensor<([0-9x]+)x[a-z0-9]+>", line.split(":")[-1])
      dims = [[int(d) for d in t.split("x")] for t in types]
      if len(dims) == 3:
        lhs, rhs, out = dims
        key = tuple("x".join(map(str, d)) for d in dims)
        dots[key] += 1
        flops[key] = _dot_flops(line, lhs, out)
  kernels = text.count("__gpu$xla.gpu.triton")
  scatters = re.findall(r"\"stablehlo.scatter\".*?->\s*tensor<([0-9x]+x[a-z0-9]+)>", text)
  return dict(dots={k: (n, flops[k]) for k, n in dots.items()}, kernels=kernels, scatters=scatters)


def _dot_flops(line, lhs, out):
  """2 x out elements x contracted elements (`contracting_dims = [a] x [b]`)."""
  m = re.search(r"contracting_dims\s*=\s*\[([0-9, ]*)\]", line)
  contracted = math.prod(lhs[int(d)] for d in m.group(1).split(",") if d.strip()) if m else 0
  return 2 * math.prod(out) * contracted


def markdown(cfg, table, totals, lowered=None) -> str:
  f = FLAGS
  lines = [
    f"{f.config}, {f.rows} rows x {f.tokens} new tokens, fill {f.fill} of {f.cache_len} slots, "
    f"{'float8' if f.fp8 else 'bf16'} cache; at {f.hbm_tbs} TB/s and {f.peak_tflops} TFLOP/s",
    "",
    "| op | per forward | GB each | GFLOP each | us at HBM | us at tensor | bound | ms per forward |",
    "| --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for op, n, gb, gf, tm, tc, bound in table:
    lines.append(
      f"| {op} | {n} | {gb:.4g} | {gf:.4g} | {tm:.3g} | {tc:.3g} | {bound} | "
      f"{n * max(tm, tc) / 1e3:.3f} |"
    )
  lines += [
    "",
    f"total {totals['gb']:.2f} GB, {totals['tflop']:.3f} TFLOP; roofline sum of ops "
    f"{totals['sum_ms']:.2f} ms, max form {totals['max_ms']:.2f} ms",
  ]
  if lowered:
    lines += ["", "Lowered for CUDA: matrix products (lhs, rhs, out) x count, GFLOP each:", ""]
    for (lhs, rhs, out), (n, fl) in sorted(lowered["dots"].items(), key=lambda kv: -kv[1][1]):
      lines.append(f"- `{lhs} . {rhs} -> {out}` x {n}: {fl / 1e9:.4g} GFLOP")
    lines += [
      "",
      f"Triton kernels (custom calls): {lowered['kernels']}; in-place scatters (result "
      f"shapes): {lowered['scatters']}",
    ]
  return "\n".join(lines)


def main(argv):
  del argv
  cfg = get_config(FLAGS.config, dtype="bfloat16", param_dtype="bfloat16", attention_impl="flash")
  if FLAGS.fill > FLAGS.cache_len or FLAGS.tokens < 1:
    raise app.UsageError(
      f"need 1 <= tokens and fill <= cache_len, got {FLAGS.tokens}, {FLAGS.fill}"
    )
  table = op_table(cfg, FLAGS.rows, FLAGS.fill, FLAGS.tokens, FLAGS.cache_len, FLAGS.fp8)
  rows, totals = roofline(table, FLAGS.hbm_tbs, FLAGS.peak_tflops)
  low = None
  if FLAGS.lower:
    low = lowered_ops(cfg, FLAGS.rows, FLAGS.fill, FLAGS.tokens, FLAGS.cache_len, FLAGS.fp8)
  print(markdown(cfg, rows, totals, low))


if __name__ == "__main__":
  from experiments import _cli

  _cli.quiet_missing_tpu()
  _cli.run(main)
