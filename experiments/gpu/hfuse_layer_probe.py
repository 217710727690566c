"""Issue 39: a decode layer's heavy work on the staggered two-half schedule, before building it.

`hfuse_probe` showed one launch hiding a GEMM's compute behind the other half's cache attention
(H100: 1.03x the floor of both kinds' bytes). Here the whole layer's heavy kernels (the cache
attention and the four projection GEMMs of sdar_4b, no norms, RoPE or SiLU) run on four schedules,
over `--layers` layers each with its own cache and weights, 128 rows x 4 new tokens at fill S:

  seq_xla      today's shape: attention of all 128 rows, then q/k/v, o, gate/up, down by XLA (cuBLAS)
               at 512 tokens
  seq_triton   the same with the GEMMs in Triton (what a fused launch would run), 512 tokens
  stag_seq     two row halves A, B staggered by half a layer, eight steps a layer; step i runs a
               quarter of one half's attention, then one of the other half's GEMMs (256 tokens):
                 attn A (rows a0) | o B (layer l-1)     attn B (rows b0) | o A
                 attn A (rows a1) | gate/up B           attn B (rows b1) | gate/up A
                 attn A (rows a2) | down B              attn B (rows b2) | down A
                 attn A (rows a3) | q/k/v B (layer l)   attn B (rows b3) | q/k/v A (layer l+1)
               (each half's attention of layer l follows its q/k/v of layer l); the quarters are sized
               by their GEMM's FLOPs, so the big GEMMs get more bytes to hide behind
  stag_fused   stag_seq with each step one launch (`hfuse_probe`'s two kinds of programs)

Reported: ms a layer, and against the floor of the layer's bytes (the cache's and every projection
weight's) at the attention's own rate. `stag_fused` near 1.0x of that floor and well under `seq_xla`
says the forward is worth building on this schedule.

  python -m experiments.gpu.hfuse_layer_probe --out=DIR            # on the GPU
  python -m experiments.gpu.hfuse_layer_probe --small --interpret  # any host: the values
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
from absl import app, flags
from jax import lax
from jax.experimental import pallas as pl

from experiments.gpu import hfuse_probe as hp

FLAGS = flags.FLAGS


def define_flags():
  """The probe's flags (defined when run)."""
  flags.DEFINE_string("out", None, "directory for hfuse_layer.json (printed only when unset)")
  flags.DEFINE_bool("small", False, "tiny shapes (for the interpreter)")
  flags.DEFINE_bool("interpret", False, "the Pallas interpreter (any host)")
  flags.DEFINE_integer("layers", 36, "layers in the timed loop")
  flags.DEFINE_integer("fill", 1536, "cache slots attended a row")
  flags.DEFINE_integer("iters", 10, "timed calls a schedule")
  flags.DEFINE_integer("num_warps", 4, "warps a program")
  flags.DEFINE_integer("num_stages", 3, "Triton pipeline stages")
  flags.DEFINE_string("gemm_tile", "64x128x64", "GEMM tile bm x bn x bk")
  flags.DEFINE_list(
    "schedules", ["attn", "seq_xla", "seq_triton", "stag_seq", "stag_fused"], "what to run"
  )


GEMMS = ("o", "gu", "dn", "qkv")  # a half-phase's order (see the module docstring)


def dims(small: bool) -> dict:
  """sdar_4b's decode widths (hidden 2,560; 32 query and 8 K/V heads of 128; MLP 9,728)."""
  if small:
    d = dict(rows=16, kv_heads=2, q_rows=16, head=32, block_k=16, hidden=64, q_heads=4, mlp=96)
  else:
    d = dict(rows=128, kv_heads=8, q_rows=16, head=128, block_k=64, hidden=2560, q_heads=32)
    d["mlp"] = 9728
  h, hd = d["hidden"], d["head"]
  d["tokens"] = d["rows"] * d["q_rows"] // (d["q_heads"] // d["kv_heads"])  # 4 new tokens a row
  d["gemm"] = {  # name: (K, N)
    "qkv": (h, (d["q_heads"] + 2 * d["kv_heads"]) * hd),
    "o": (d["q_heads"] * hd, h),
    "gu": (h, 2 * d["mlp"]),
    "dn": (d["mlp"], h),
  }
  return d


def quarters(rows: int, d: dict) -> dict:
  """A half's `rows` split over the four GEMMs in proportion to their FLOPs (largest remainder),
  every quarter at least one row: {gemm: (first row, rows)} in `GEMMS` order."""
  flops = {g: d["gemm"][g][0] * d["gemm"][g][1] for g in GEMMS}
  total = sum(flops.values())
  share = {g: max(1, rows * flops[g] // total) for g in GEMMS}
  order = sorted(GEMMS, key=lambda g: -(rows * flops[g] % total))
  for g in order[: rows - sum(share.values())]:
    share[g] += 1
  out, row = {}, 0
  for g in GEMMS:
    out[g] = (row, share[g])
    row += share[g]
  assert row == rows, (row, rows)
  return out


def step(layer, q, k, v, o, x, w, *, row0, n_rows, gemm: bool, cfg):
  """One launch: attention of `n_rows` rows from row0 (0: none) into `o`,
  and, with `gemm`, y = x @ w[layer]. Returns (o, y or None)."""
  bm, bn, bk = cfg["tile"]
  kv_heads = q.shape[1]
  n_attn = n_rows * kv_heads
  n_gemm = (x.shape[0] // bm) * (w.shape[2] // bn) if gemm else 0
  params = None
  if hp.plgpu is not None and not cfg["interpret"]:
    params = hp.plgpu.CompilerParams(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
  kernel = functools.partial(
    hp._kernel, order="interleave", row0=row0, n_attn=n_attn, n_gemm=n_gemm, fill=cfg["fill"],
    block_k=cfg["block_k"], head=q.shape[-1], bm=bm, bn=bn, bk=bk,
  )  # fmt: skip
  y_shape = (x.shape[0], w.shape[2]) if gemm else (8, 128)
  o, y = pl.pallas_call(
    kernel,
    grid=(n_attn + n_gemm,),
    out_shape=[jax.ShapeDtypeStruct(o.shape, o.dtype), jax.ShapeDtypeStruct(y_shape, jnp.bfloat16)],
    input_output_aliases={6: 0},
    compiler_params=params,
    interpret=cfg["interpret"],
    name="hfuse_step",
  )(jnp.reshape(layer, (1,)).astype(jnp.int32), q, k, v, x, w, o)
  return o, (y if gemm else None)


@functools.partial(jax.jit, static_argnums=1)
def _layers_of(x, layers):
  return jnp.broadcast_to(x, (layers, *x.shape)) + jnp.zeros((), x.dtype)


def make_inputs(d: dict, layers: int, fill: int, seed: int = 0) -> dict:
  bf = jnp.bfloat16
  keys = iter(jax.random.split(jax.random.key(seed), 16))
  normal = lambda shape, scale=1.0: (jax.random.normal(next(keys), shape, bf) * scale).astype(bf)
  cache = (layers, d["rows"], fill, d["kv_heads"] * d["head"])
  half = d["tokens"] // 2
  out = dict(
    q=normal((d["rows"], d["kv_heads"], d["q_rows"], d["head"])),
    k=_layers_of(normal(cache[1:]), layers),  # every layer its own copy of one draw (a draw of
    v=_layers_of(normal(cache[1:]), layers),  # over 2^32 values at once is refused)
  )
  for g, (kk, n) in d["gemm"].items():
    out["w_" + g] = normal((layers, kk, n), kk**-0.5)
    out["x_" + g] = normal((d["tokens"], kk))  # all 512 tokens; a half is its first or last 256
    out["xh_" + g] = out["x_" + g][:half]
  return out


def schedules(d: dict, cfg: dict) -> dict:
  """name -> jitted f(inputs) -> (o, {gemm: y}) after every layer (the last layer's values)."""
  rows, half = d["rows"], d["rows"] // 2
  qs = quarters(half, d)
  sstep = functools.partial(step, cfg=cfg)

  def loop(body, n_outs):
    def run(a):
      o0 = jnp.zeros(a["q"].shape, jnp.bfloat16)
      ys0 = {g: jnp.zeros((n_outs, a["w_" + g].shape[2]), jnp.bfloat16) for g in GEMMS}
      return lax.fori_loop(0, a["k"].shape[0], lambda l, c: body(l, a, *c), (o0, ys0))

    return jax.jit(run)

  def attn_only(layer, a, o, ys):  # the floor's rate: the attention alone, in the same loop
    o, _ = sstep(layer, a["q"], a["k"], a["v"], o, a["x_o"], a["w_o"], row0=0,
                 n_rows=rows, gemm=False)  # fmt: skip
    return o, ys

  def seq_triton(layer, a, o, ys):
    o, _ = attn_only(layer, a, o, ys)
    ys = dict(ys)
    for g in GEMMS:
      _, ys[g] = sstep(layer, a["q"], a["k"], a["v"], o, a["x_" + g], a["w_" + g], row0=0,
                       n_rows=0, gemm=True)  # fmt: skip
    return o, ys

  def staggered(fused: bool):
    def body(layer, a, o, ys):
      ys = dict(ys)
      for attn_half, gemm_half in ((0, 1), (1, 0)):  # A's attention beside B's GEMMs, then B's
        del gemm_half  # the GEMMs' rows are a half's tokens; the probe reuses one half's inputs
        for g in GEMMS:
          r0, n = qs[g]
          start = attn_half * half + r0
          args = (layer, a["q"], a["k"], a["v"], o, a["xh_" + g], a["w_" + g])
          if fused:
            o, ys[g] = sstep(*args, row0=start, n_rows=n, gemm=True)
          else:
            o, _ = sstep(*args, row0=start, n_rows=n, gemm=False)
            _, ys[g] = sstep(*args, row0=0, n_rows=0, gemm=True)
      return o, ys

    return body

  def seq_xla(a):  # cuBLAS on each layer's own weight arrays (a slice would be copied first)
    o = jnp.zeros(a["q"].shape, jnp.bfloat16)
    ys = {}
    every = []  # every layer's products are outputs (one overwritten unused is dead code)
    for layer in range(a["k"].shape[0]):
      o, _ = sstep(jnp.int32(layer), a["q"], a["k"], a["v"], o, a["x_o"], a["w_o"], row0=0,
                   n_rows=rows, gemm=False)  # fmt: skip
      for g in GEMMS:
        w = a["wl_" + g][layer]
        ys[g] = jnp.dot(a["x_" + g], w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
        every.append(ys[g])
    return o, dict(ys, every=tuple(every))

  return {
    "attn": loop(attn_only, d["tokens"]),
    "seq_xla": jax.jit(seq_xla),
    "seq_triton": loop(seq_triton, d["tokens"]),
    "stag_seq": loop(staggered(False), d["tokens"] // 2),
    "stag_fused": loop(staggered(True), d["tokens"] // 2),
  }


def main(argv):
  del argv
  d = dims(FLAGS.small)
  layers = 2 if FLAGS.small else FLAGS.layers
  fill = 64 if FLAGS.small else FLAGS.fill
  tile = (16, 16, 16) if FLAGS.small else tuple(int(t) for t in FLAGS.gemm_tile.split("x"))
  cfg = dict(tile=tile, fill=fill, block_k=d["block_k"], interpret=FLAGS.interpret,
             num_warps=FLAGS.num_warps, num_stages=FLAGS.num_stages)  # fmt: skip
  a = make_inputs(d, layers, fill)
  if "seq_xla" in FLAGS.schedules:
    for g in GEMMS:
      a["wl_" + g] = tuple(a["w_" + g][i] for i in range(layers))
  fns = schedules(d, cfg)
  cache_bytes = d["rows"] * fill * d["kv_heads"] * d["head"] * 2 * 2
  w_bytes = sum(kk * n * 2 for kk, n in d["gemm"].values())
  ref_o = hp.attention_reference(a["q"], a["k"][layers - 1], a["v"][layers - 1])
  report = dict(
    device=str(jax.devices()[0].device_kind), jax=jax.__version__, layers=layers, fill=fill,
    tile=tile, num_warps=FLAGS.num_warps, num_stages=FLAGS.num_stages,
    quarters=quarters(d["rows"] // 2, d), cache_MB=cache_bytes / 1e6, weights_MB=w_bytes / 1e6,
    rows={},
  )  # fmt: skip
  outs = {}
  for name in FLAGS.schedules:
    fn = fns[name]
    try:
      o, ys = jax.block_until_ready(fn(a))
    except Exception as e:  # a schedule that does not compile is a finding, not the run's end
      report["rows"][name] = dict(error=f"{type(e).__name__}: {str(e)[:400]}")
      print(name, "ERROR", report["rows"][name]["error"], flush=True)
      continue
    outs[name] = (o, ys)
    row = dict(attn_max_err=float(jnp.max(jnp.abs(o.astype(jnp.float32) - ref_o))))
    errs = []
    # the last layer's y against x @ w in float32 (a half: its first tokens)
    for g in GEMMS if name != "attn" else ():
      x = a["x_" + g][: ys[g].shape[0]].astype(jnp.float32)
      ref = x @ a["w_" + g][layers - 1].astype(jnp.float32)
      errs.append(float(jnp.max(jnp.abs(ys[g].astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref))))
    row["gemm_max_rel_err"] = max(errs, default=0.0)
    if not FLAGS.interpret:
      row["ms_a_layer"] = round(hp.timed(fn, (a,), FLAGS.iters) / layers * 1e3, 4)
    report["rows"][name] = row
    print(name, row, flush=True)
  if "stag_fused" in outs and "stag_seq" in outs:
    (fo, fy), (so, sy) = outs["stag_fused"], outs["stag_seq"]
    same = bool(jnp.all(fo == so)) and all(bool(jnp.all(fy[g] == sy[g])) for g in GEMMS)
    report["rows"]["stag_fused"]["same_as_stag_seq"] = same
  if "ms_a_layer" in report["rows"].get("attn", {}):  # the floor: the layer's bytes at the
    # attention's own rate over the same 36-layer loop (one call's dispatch would count in a
    # single layer's time: session 40's first run read 1.29 TB/s that way)
    attn_s = report["rows"]["attn"]["ms_a_layer"] / 1e3
    report["attention_TBps"] = round(cache_bytes / attn_s / 1e12, 3)
    floor_ms = (cache_bytes + w_bytes) / (cache_bytes / attn_s) * 1e3
    report["floor_ms_a_layer"] = round(floor_ms, 4)
    for row in report["rows"].values():
      if "ms_a_layer" in row:
        row["over_floor"] = round(row["ms_a_layer"] / floor_ms, 3)
  text = json.dumps(report, indent=1)
  print(text)
  if FLAGS.out:
    os.makedirs(FLAGS.out, exist_ok=True)
    with open(os.path.join(FLAGS.out, "hfuse_layer.json"), "w") as f:
      f.write(text)


if __name__ == "__main__":
  define_flags()
  app.run(main)
