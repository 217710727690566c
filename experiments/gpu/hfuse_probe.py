"""Issue 39's last route, probed: does one kernel launch that holds both the decode cache attention
of one half of the rows and a projection GEMM of the other half (horizontal fusion: the grid's
programs are of two kinds, interleaved) run them at once on the GPU's SMs, where XLA ran them one
after the other (one stream, the latency-hiding scheduler, CONCURRENT command buffers:
docs/performance.md, "Sampler")?

Per layer of sdar_4b at fill S (default 1,536), half a batch of 128 rows:
  attention  64 rows x 8 K/V heads, 16 query rows each (4 new tokens x 4 query heads), over S
             bf16 cache slots: 64 x S x 8 x 128 x 2 (K, V) x 2 bytes (403 MB at 1,536)
  gemm       the other half's 256 tokens through gate/up: [256, 2560] x [2560, 19456] (25.5 GFLOP,
             100 MB of weights)
over `--layers` layers (each its own cache and weights, so the bytes are real), in one jitted loop.

Variants (ms a layer, median of `--iters` timed calls after a warm-up):
  attn       the attention programs alone           gemm     the GEMM programs alone (Triton)
  seq        attn's launch then gemm's, per layer   fused    both kinds in one launch
  xla_dot    the same GEMM by XLA (cuBLAS), for reference
`over_sum` is fused / (attn + gemm): 1.0 is no overlap. `over_bytes` is fused against the floor of a
launch that reads both kinds' bytes (the cache's and the weights') at the attention's own rate: 1.0 is
every bit of the GEMM's compute hidden. Measured on an H100 in docs/performance.md ("Issue 39,
session 39").

  python -m experiments.gpu.hfuse_probe --out=DIR            # on the GPU
  python -m experiments.gpu.hfuse_probe --small --interpret  # any host: the kernel's values
"""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags
from jax import lax
from jax.experimental import pallas as pl

try:
  from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
  plgpu = None

FLAGS = flags.FLAGS


def define_flags():
  """The probe's flags (defined when run, so that importing its kernels defines none)."""
  flags.DEFINE_string("out", None, "directory for hfuse.json (printed only when unset)")
  flags.DEFINE_bool("small", False, "tiny shapes (for the interpreter)")
  flags.DEFINE_bool("interpret", False, "the Pallas interpreter (any host)")
  flags.DEFINE_integer("layers", 36, "layers in the timed loop")
  flags.DEFINE_integer("fill", 1536, "cache slots attended a row")
  flags.DEFINE_integer("iters", 20, "timed calls a variant")
  flags.DEFINE_integer("num_warps", 4, "warps a program (both kinds)")
  flags.DEFINE_integer("num_stages", 2, "Triton pipeline stages")
  flags.DEFINE_list("orders", ["interleave", "attn_first"], "program orders of the fused launch")
  flags.DEFINE_list("gemm_tiles", ["128x128x64", "64x128x64"], "GEMM tiles bm x bn x bk")


def shapes(small: bool) -> dict:
  if small:
    return dict(rows=2, kv_heads=2, q_rows=16, head=32, block_k=16, m=32, k=64, n=64)
  return dict(rows=64, kv_heads=8, q_rows=16, head=128, block_k=64, m=256, k=2560, n=19456)


def _dot(a, b):
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _attend(layer, r, j, q_ref, k_ref, v_ref, o_ref, *, fill, block_k, head):
  """Program (row r, K/V head j): online softmax of its query rows over `fill` cache slots."""
  q = q_ref[r, j]
  scale = head**-0.5 * math.log2(math.e)

  def tile(t, carry):
    o, m, l = carry
    sl = pl.ds(pl.multiple_of(t * block_k, block_k), block_k)
    cols = pl.ds(pl.multiple_of(j * head, head), head)
    s = _dot(q, k_ref[layer, r, sl, cols].T) * scale
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    corr = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    v = v_ref[layer, r, sl, cols]
    return corr[:, None] * o + _dot(p.astype(v.dtype), v), m_new, corr * l + p.sum(axis=-1)

  n = q.shape[0]
  init = (jnp.zeros((n, head), jnp.float32), jnp.full((n,), -1e30, jnp.float32), jnp.zeros((n,)))
  o, _, l = lax.fori_loop(0, fill // block_k, tile, init)
  o_ref[r, j] = (o / l[:, None]).astype(o_ref.dtype)


def _gemm(layer, mi, ni, x_ref, w_ref, y_ref, *, bm, bn, bk):
  """Program (mi, ni): the output tile y[mi*bm:, ni*bn:] of x @ w[layer]."""
  rows = pl.ds(pl.multiple_of(mi * bm, bm), bm)
  cols = pl.ds(pl.multiple_of(ni * bn, bn), bn)

  def step(t, acc):
    ks = pl.ds(pl.multiple_of(t * bk, bk), bk)
    return acc + _dot(x_ref[rows, ks], w_ref[layer, ks, cols])

  acc = lax.fori_loop(0, x_ref.shape[1] // bk, step, jnp.zeros((bm, bn), jnp.float32))
  y_ref[rows, cols] = acc.astype(y_ref.dtype)


def _kernel(
  layer_ref,
  q_ref,
  k_ref,
  v_ref,
  x_ref,
  w_ref,
  *refs,
  n_attn,
  n_gemm,
  order,
  fill,
  block_k,
  head,
  bm,
  bn,
  bk,
  row0=0,
):
  """A grid of n_attn attention and n_gemm GEMM programs. `interleave`: the first 2 x min(...)
  programs alternate kinds, the rest are the larger kind; `attn_first`: all attention, then GEMM.
  Attention programs cover rows row0.. (q, the cache and o hold every row). `refs` end with the
  outputs (o, y); an input before them is o's aliased input (updated in place), left unread."""
  o_ref, y_ref = refs[-2:]
  pid = pl.program_id(0)
  layer = layer_ref[0]
  kv_heads = q_ref.shape[1]
  m_tiles = x_ref.shape[0] // bm
  if order == "interleave":
    both = 2 * min(n_attn, n_gemm)
    paired = pid < both
    is_attn = jnp.where(paired, pid % 2 == 0, n_attn > n_gemm)
    idx = jnp.where(paired, pid // 2, pid - both // 2)
  else:
    is_attn = pid < n_attn
    idx = jnp.where(is_attn, pid, pid - n_attn)
  if n_attn:

    @pl.when(is_attn)
    def _():
      _attend(
        layer,
        row0 + idx // kv_heads,
        idx % kv_heads,
        q_ref,
        k_ref,
        v_ref,
        o_ref,
        fill=fill,
        block_k=block_k,
        head=head,
      )

  if n_gemm:

    @pl.when(jnp.logical_not(is_attn))
    def _():
      _gemm(layer, idx % m_tiles, idx // m_tiles, x_ref, w_ref, y_ref, bm=bm, bn=bn, bk=bk)


def launch(
  layer,
  q,
  k,
  v,
  x,
  w,
  *,
  attn: bool,
  gemm: bool,
  order: str,
  fill: int,
  block_k: int,
  tiles: tuple[int, int, int],
  interpret: bool,
  num_warps: int,
  num_stages: int,
):
  """One launch: (o [rows, K, R, H] bf16, y [M, N] bf16); a kind left out returns zeros."""
  rows, kv_heads, _, head = q.shape
  bm, bn, bk = tiles
  n_attn = rows * kv_heads if attn else 0
  n_gemm = (x.shape[0] // bm) * (w.shape[2] // bn) if gemm else 0
  params = (
    plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    if plgpu is not None and not interpret
    else None
  )
  kernel = functools.partial(
    _kernel,
    n_attn=n_attn,
    n_gemm=n_gemm,
    order=order,
    fill=fill,
    block_k=block_k,
    head=head,
    bm=bm,
    bn=bn,
    bk=bk,
  )
  return pl.pallas_call(
    kernel,
    grid=(n_attn + n_gemm,),
    out_shape=[
      jax.ShapeDtypeStruct(q.shape, jnp.bfloat16),
      jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), jnp.bfloat16),
    ],
    compiler_params=params,
    interpret=interpret,
    name="hfuse",
  )(jnp.reshape(layer, (1,)).astype(jnp.int32), q, k, v, x, w)


def make_inputs(sh: dict, layers: int, fill: int, seed: int = 0):
  ks = jax.random.split(jax.random.key(seed), 5)
  bf = jnp.bfloat16
  cache = (layers, sh["rows"], fill, sh["kv_heads"] * sh["head"])
  q = jax.random.normal(ks[0], (sh["rows"], sh["kv_heads"], sh["q_rows"], sh["head"]), bf)
  k = jax.random.normal(ks[1], cache, bf)
  v = jax.random.normal(ks[2], cache, bf)
  x = jax.random.normal(ks[3], (sh["m"], sh["k"]), bf)
  w = (jax.random.normal(ks[4], (layers, sh["k"], sh["n"]), bf) * sh["k"] ** -0.5).astype(bf)
  return q, k, v, x, w


def attention_reference(q, k_layer, v_layer):
  """Every row's attention output over one layer's cache in plain XLA (float32 sums)."""
  rows, kv_heads, _, head = q.shape
  kl = k_layer.reshape(rows, -1, kv_heads, head).astype(jnp.float32)
  vl = v_layer.reshape(rows, -1, kv_heads, head).astype(jnp.float32)
  s = jnp.einsum("bjrh,bsjh->bjrs", q.astype(jnp.float32), kl) * head**-0.5
  return jnp.einsum("bjrs,bsjh->bjrh", jax.nn.softmax(s, axis=-1), vl)


def reference(layer, q, k, v, x, w):
  """The two results in plain XLA (float32 sums)."""
  y = jnp.dot(x.astype(jnp.float32), w[layer].astype(jnp.float32))
  return attention_reference(q, k[layer], v[layer]), y


def variants(sh, fill, interpret, tiles_list, orders):
  """name -> f(q, k, v, x, w) over every layer (outputs of the last layer)."""
  common = dict(
    fill=fill,
    block_k=sh["block_k"],
    interpret=interpret,
    num_warps=FLAGS.num_warps,
    num_stages=FLAGS.num_stages,
  )

  def looped(body):
    def run(q, k, v, x, w):
      def step(layer, carry):
        return body(layer, q, k, v, x, w)

      o0 = jnp.zeros(q.shape, jnp.bfloat16)
      y0 = jnp.zeros((x.shape[0], w.shape[2]), jnp.bfloat16)
      return lax.fori_loop(0, k.shape[0], step, (o0, y0))

    return jax.jit(run)

  out = {}
  for tiles in tiles_list:
    tag = "x".join(map(str, tiles))
    one = functools.partial(launch, tiles=tiles, **common)
    out["attn"] = looped(lambda l, *a: one(l, *a, attn=True, gemm=False, order="attn_first"))
    out[f"gemm/{tag}"] = looped(
      lambda l, *a, one=one: one(l, *a, attn=False, gemm=True, order="attn_first")
    )

    def seq(l, q, k, v, x, w, one=one):
      o, _ = one(l, q, k, v, x, w, attn=True, gemm=False, order="attn_first")
      _, y = one(l, q, k, v, x, w, attn=False, gemm=True, order="attn_first")
      return o, y

    out[f"seq/{tag}"] = looped(seq)
    for order in orders:
      out[f"fused/{order}/{tag}"] = looped(
        lambda l, *a, one=one, order=order: one(l, *a, attn=True, gemm=True, order=order)
      )

  return out


def xla_dot(x, ws):
  """The GEMM by XLA (cuBLAS) on every layer's weights, each its own array (a slice of a stacked
  array is copied before the call: 100 MB a layer)."""
  ys = [jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16) for w in ws]
  return functools.reduce(jnp.maximum, ys)


def timed(fn, args, iters):
  jax.block_until_ready(fn(*args))  # compile and warm
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def main(argv):
  del argv
  sh = shapes(FLAGS.small)
  layers = 2 if FLAGS.small else FLAGS.layers
  fill = 64 if FLAGS.small else FLAGS.fill
  tiles_list = (
    [(16, 16, 16)]
    if FLAGS.small
    else [tuple(int(t) for t in s.split("x")) for s in FLAGS.gemm_tiles]
  )
  args = make_inputs(sh, layers, fill)
  fns = variants(sh, fill, FLAGS.interpret, tiles_list, FLAGS.orders)
  ref_o, ref_y = reference(layers - 1, *args)
  attn_bytes = sh["rows"] * fill * sh["kv_heads"] * sh["head"] * 2 * 2
  gemm_flops = 2 * sh["m"] * sh["k"] * sh["n"]
  w_bytes = sh["k"] * sh["n"] * 2
  report = dict(
    device=str(jax.devices()[0].device_kind),
    jax=jax.__version__,
    shapes=sh,
    layers=layers,
    fill=fill,
    num_warps=FLAGS.num_warps,
    num_stages=FLAGS.num_stages,
    rows={},
  )
  outs = {}
  for name, fn in fns.items():
    try:
      o, y = jax.block_until_ready(fn(*args))
    except Exception as e:  # a variant that does not compile is a finding, not the run's end
      report["rows"][name] = dict(error=f"{type(e).__name__}: {str(e)[:400]}")
      print(name, "ERROR", report["rows"][name]["error"], flush=True)
      continue
    outs[name] = (o, y)
    row = {}
    if not name.startswith("gemm"):
      row["attn_max_err"] = float(jnp.max(jnp.abs(o.astype(jnp.float32) - ref_o)))
    if name != "attn":
      row["gemm_max_rel_err"] = float(
        jnp.max(jnp.abs(y.astype(jnp.float32) - ref_y)) / jnp.max(jnp.abs(ref_y))
      )
    if not FLAGS.interpret:
      sec = timed(fn, args, FLAGS.iters) / layers
      row["ms_a_layer"] = round(sec * 1e3, 4)
      if name == "attn":
        row["attn_TBps"] = round(attn_bytes / sec / 1e12, 3)
      if name.startswith("gemm"):
        row["gemm_TFLOPs"] = round(gemm_flops / sec / 1e12, 1)
    report["rows"][name] = row
    print(name, row, flush=True)
  for name, (o, y) in outs.items():  # a fused launch computes what its two halves compute
    if name.startswith("fused/"):
      tag = name.split("/")[-1]
      if f"seq/{tag}" in outs:
        so, sy = outs[f"seq/{tag}"]
        report["rows"][name]["same_as_seq"] = bool(jnp.all(so == o) & jnp.all(sy == y))
  rows = report["rows"]
  if not FLAGS.interpret and "attn" in rows and "ms_a_layer" in rows["attn"]:
    for name, row in rows.items():
      if name.startswith("fused/") and "ms_a_layer" in row:
        tag = name.split("/")[-1]
        a, g = rows["attn"]["ms_a_layer"], rows[f"gemm/{tag}"].get("ms_a_layer")
        if g:
          row["over_max"] = round(row["ms_a_layer"] / max(a, g), 3)
          row["over_sum"] = round(row["ms_a_layer"] / (a + g), 3)
          # the floor of one launch that reads both kinds' bytes at the attention's own rate
          row["over_bytes"] = round(
            row["ms_a_layer"] / (a * (attn_bytes + w_bytes) / attn_bytes), 3
          )
  if not FLAGS.interpret:
    ws = tuple(args[4][i] for i in range(layers))
    sec = timed(jax.jit(xla_dot), (args[3], ws), FLAGS.iters) / layers
    rows["xla_dot"] = dict(
      ms_a_layer=round(sec * 1e3, 4), gemm_TFLOPs=round(gemm_flops / sec / 1e12, 1)
    )
    print("xla_dot", rows["xla_dot"], flush=True)
  text = json.dumps(report, indent=1)
  print(text)
  if FLAGS.out:
    os.makedirs(FLAGS.out, exist_ok=True)
    with open(os.path.join(FLAGS.out, "hfuse.json"), "w") as f:
      f.write(text)


if __name__ == "__main__":
  define_flags()
  app.run(main)
