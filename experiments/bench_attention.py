r"""The flash kernel alone on TraceRL rows: forward and forward + backward, live-tile loops against
the earlier skipping loops, in TFLOP/s of the attention the trace mask needs.

  python -m experiments.bench_attention --config=sdar_1p7b --prompt_len=896 --new_tokens=4096 \
      --rows=2 --out=DIR/bench_attention.json

One micro-batch of `--rows` worst-case packed rows (`experiments/rl_shapes.py`), random bf16
q/k/v of the model's head shape, one layer's attention. Useful FLOPs are `rl/flops.py`'s attention
term for one layer (forward: a third of it). `--iters` timed calls after one compiling call.
`--tiles` times the live-tile loops at other tile sizes too (the model's are `flash_tiles`).
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "sdar_1p7b", "model preset (head shape, tiles)")
flags.DEFINE_integer("prompt_len", 896, "prompt tokens")
flags.DEFINE_integer("new_tokens", 4096, "response tokens")
flags.DEFINE_integer("rows", 2, "rows per call (a micro-batch)")
flags.DEFINE_integer("iters", 5, "timed calls")
flags.DEFINE_list(
  "tiles", [], "more live-tile settings to time, each block_q:block_k:block_bwd (e.g. 128:128:64)"
)
flags.DEFINE_string("out", "", "JSON file for the results")


def main(argv):
  del argv
  from dice_jax.model import flash_bd
  from dice_jax.model.config import get_config
  from dice_jax.rl import flops, memory, tracerl
  from dice_jax.train import metrics
  from experiments.rl_shapes import synthetic_trajectories

  mcfg = get_config(FLAGS.config)
  trajs = synthetic_trajectories(
    np.random.default_rng(0),
    tasks=1,
    group_size=FLAGS.rows,
    prompt_len=FLAGS.prompt_len,
    new_tokens=FLAGS.new_tokens,
    vocab_size=mcfg.vocab_size,
  )
  cap = memory.row_length(
    "packed", prompt_len=FLAGS.prompt_len, new_tokens=FLAGS.new_tokens, steps=mcfg.block_size
  )
  (batch,) = tracerl.build_batches(
    trajs,
    tracerl.TraceRLConfig(layout="packed"),
    block_size=mcfg.block_size,
    mask_token_id=mcfg.mask_token_id,
    rows_per_batch=FLAGS.rows,
    max_length=cap,
  )
  useful = flops.update_flops(mcfg, batch)["attention"] / mcfg.num_layers  # one layer, x3
  spec = tracerl.trace_spec(batch, mcfg.block_size)
  positions = jnp.asarray(batch["positions"])
  b, t = positions.shape
  keys = jax.random.split(jax.random.key(0), 4)
  n, k, h = mcfg.num_heads, mcfg.num_kv_heads, mcfg.head_dim
  q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
  kk = jax.random.normal(keys[1], (b, t, k, h), jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, t, k, h), jnp.bfloat16)
  ct = jax.random.normal(keys[3], (b, t, n, h), jnp.bfloat16)
  peak = metrics.peak_flops() or float("nan")
  res = dict(
    config=FLAGS.config,
    rows=b,
    row_len=t,
    tiles=list(mcfg.flash_tiles),
    useful_gflop_fwd=round(useful / 3 / 1e9, 1),
    useful_gflop_fwd_bwd=round(useful / 1e9, 1),
    device=jax.devices()[0].device_kind,
  )

  def timed(fn, work):
    jax.block_until_ready(fn(q, kk, v))
    t0 = time.perf_counter()
    for _ in range(FLAGS.iters):
      out = fn(q, kk, v)
    jax.block_until_ready(out)
    sec = (time.perf_counter() - t0) / FLAGS.iters
    return dict(
      ms=round(sec * 1e3, 2), tflops=round(work / sec / 1e12, 1), mfu=round(work / sec / peak, 4)
    )

  def kernels(tiles, live_only):
    bq, bk, bb = tiles

    def attn(q, kk, v):
      return flash_bd.attention(
        q, kk, v, spec, positions, block_q=bq, block_k=bk, block_bwd=bb, live_only=live_only
      )

    loss = lambda q, kk, v: (attn(q, kk, v).astype(jnp.float32) * ct).sum()  # noqa: E731
    return jax.jit(attn), jax.jit(jax.grad(loss, (0, 1, 2)))

  outs = {}
  for live_only in (True, False):
    fwd, fwd_bwd = kernels(mcfg.flash_tiles, live_only)
    name = "live_only" if live_only else "skipping_loop"
    outs[live_only] = (fwd(q, kk, v), fwd_bwd(q, kk, v))
    for what, fn, work in (("fwd", fwd, useful / 3), ("fwd_bwd", fwd_bwd, useful)):
      for key, val in timed(fn, work).items():
        res[f"{name}_{what}_{'useful_tflops' if key == 'tflops' else key}"] = val
      print(json.dumps({f"{name}_{what}_ms": res[f"{name}_{what}_ms"]}), flush=True)
  sweep = {}
  for spec_s in FLAGS.tiles:
    tiles = tuple(int(x) for x in spec_s.split(":"))
    if len(tiles) != 3:
      raise SystemExit(
        f"bench_attention: --tiles entries are block_q:block_k:block_bwd, got {spec_s!r}"
      )
    try:
      fwd, fwd_bwd = kernels(tiles, True)
      sweep[spec_s] = {"fwd": timed(fwd, useful / 3), "fwd_bwd": timed(fwd_bwd, useful)}
    except Exception as e:  # a tiling Triton refuses (shared memory): recorded, not fatal
      sweep[spec_s] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    print(json.dumps({spec_s: sweep[spec_s]}), flush=True)
  res["tile_sweep_live_only"] = sweep
  for what in ("fwd", "fwd_bwd"):
    res[f"{what}_speedup"] = round(res[f"skipping_loop_{what}_ms"] / res[f"live_only_{what}_ms"], 2)
  # the same tiles in the same order: the two loops should agree (to the bit in the interpreter)
  diff = lambda a, b: float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())  # noqa: E731
  (o1, g1), (o0, g0) = outs[True], outs[False]
  res["max_abs_diff_out"] = diff(o1, o0)
  res["max_abs_diff_grads"] = max(diff(a, b) for a, b in zip(g1, g0))
  print(json.dumps(res), flush=True)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(res, f, indent=2)


if __name__ == "__main__":
  app.run(main)
