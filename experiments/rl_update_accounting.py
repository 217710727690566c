r"""Where the TraceRL update's work goes, counted on CPU (no GPU needed): a table per micro-step.

  python -m experiments.rl_update_accounting --config=sdar_1p7b --prompt_len=896 \
      --new_tokens=4096 --micro_rows=2 --out=/tmp/acct.json

One micro-batch of `--micro_rows` worst-case packed rows (`experiments/rl_shapes.py`: every block
takes 4 rounds, every token trained), the update's own code, and three counts side by side:

  useful     `dice_jax/rl/flops.update_flops`: what the MFU counts (linear layers on real
             tokens, attention on the pairs the trace mask allows, the LM head on trained
             positions; x3 for forward + backward)
  XLA        `cost_analysis()` of the compiled micro-step (value and gradient of the TraceRL
             loss) and of the old log-prob forward: FLOPs and bytes accessed. XLA counts a
             loop's body once, so: the layers are compiled as a scan (one layer counted, per
             remat policy, the recomputation included), one layer without remat is measured as
             the difference of an unrolled 2-layer and 1-layer model, and the rest (embedding,
             final norm, LM head, loss) is what remains. The flash kernel is compiled in the
             Pallas interpreter, whose loops XLA counts once: its work is the tile count below.
  tiles      the flash kernel's work from its own schedule (`flash_bd.live_tiles`): the tiles it
             computes (live) and, for the earlier skipping loop, the tiles it visits; forward
             tiles x (1, or 2 when the policy recomputes the attention) + backward tiles
             (dK/dV: 4 tile matmuls, dQ: 3).

The accumulation over micro-batches is a `lax.scan` inside the one jitted step: no host work
between micro-steps. Writes the table (markdown) to stdout and everything to `--out` (JSON).
"""

from __future__ import annotations

import json
import time

import jax
import numpy as np
from absl import app, flags
from flax import nnx

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "sdar_1p7b", "model preset")
flags.DEFINE_integer("prompt_len", 896, "prompt tokens")
flags.DEFINE_integer("new_tokens", 4096, "response tokens")
flags.DEFINE_integer("micro_rows", 2, "rows per micro-batch")
flags.DEFINE_list("remats", ["none", "dots_attn", "dots", "full_attn", "full"], "policies")
flags.DEFINE_integer("logit_chunk", 2048, "TraceRLConfig.logit_chunk of the real update")
flags.DEFINE_bool("xla", True, "compile and count with XLA (minutes on CPU); False: tiles only")
flags.DEFINE_string("out", "", "JSON file for the results")

G = 1e9


def micro_batch(mcfg, tcfg, rows: int) -> dict:
  from dice_jax.rl import memory, tracerl
  from experiments.rl_shapes import synthetic_trajectories

  trajs = synthetic_trajectories(
    np.random.default_rng(0),
    tasks=1,
    group_size=rows,
    prompt_len=FLAGS.prompt_len,
    new_tokens=FLAGS.new_tokens,
    vocab_size=mcfg.vocab_size,
  )
  cap = memory.row_length(
    "packed", prompt_len=FLAGS.prompt_len, new_tokens=FLAGS.new_tokens, steps=mcfg.block_size
  )
  (batch,) = tracerl.build_batches(
    trajs,
    tcfg,
    block_size=mcfg.block_size,
    mask_token_id=mcfg.mask_token_id,
    rows_per_batch=rows,
    max_length=cap,
  )
  return batch


def tile_counts(batch, mcfg) -> dict:
  """Tiles the flash kernel computes (live) and visits (earlier loop: all), forward/backward."""
  from dice_jax.model import flash_bd
  from dice_jax.rl import flops

  seg, rank, klo = flops.trace_vectors(batch)
  bq, bk, bb = mcfg.flash_tiles
  fwd = np.asarray(flash_bd.live_tiles(seg, rank, klo, bq, bk))
  bwd = np.asarray(flash_bd.live_tiles(seg, rank, klo, bb, bb))
  h, heads, layers = mcfg.head_dim, mcfg.num_heads, mcfg.num_layers
  scale = heads * layers
  return dict(
    fwd_live=int(fwd.sum()) * scale,
    fwd_visited_skipping_loop=int(fwd.size) * scale,
    bwd_live=int(bwd.sum()) * scale,
    bwd_visited_skipping_loop=int(bwd.size) * scale,
    fwd_flops=2 * 2.0 * bq * bk * h * int(fwd.sum()) * scale,  # QK^T and PV
    bwd_flops=7 * 2.0 * bb * bb * h * int(bwd.sum()) * scale,  # dK/dV 4 matmuls + dQ 3
  )


def _abstract(batch):
  return {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}


def xla_cost(mcfg, tcfg, batch, *, remat: str, layers: int, scan: bool, what: str) -> dict:
  """cost_analysis() of the compiled micro-step (`what='update'`: value and gradient of the
  TraceRL loss) or old log-prob forward (`'forward'`) on the abstract batch."""
  from dice_jax.model.transformer import Transformer
  from dice_jax.rl import tracerl

  cfg = mcfg.replace(num_layers=layers, scan_layers=scan, remat=remat)
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, abs_params = nnx.split(model, nnx.Param)
  params = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), abs_params.to_pure_dict())

  def update(p, b):
    loss = lambda q: tracerl.tracerl_loss(nnx.merge(graphdef, q), b, None, tcfg)  # noqa: E731
    return jax.value_and_grad(loss, has_aux=True)(p)

  def forward(p, b):
    return tracerl.token_logprobs(nnx.merge(graphdef, p), b, chunk=tcfg.logit_chunk)

  fn = update if what == "update" else forward
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(params, _abstract(batch)).compile()
  ca = compiled.cost_analysis()
  ca = ca[0] if isinstance(ca, (list, tuple)) else ca
  return dict(
    flops=float(ca.get("flops", 0.0)),
    bytes=float(ca.get("bytes accessed", 0.0)),
    transcendentals=float(ca.get("transcendentals", 0.0)),
    compile_s=round(time.perf_counter() - t0, 1),
  )


def lm_head(batch, mcfg, tcfg) -> dict:
  """Positions through the vocabulary projection and the projection's FLOPs: forward, the chunk's
  recomputation in the backward pass (`jax.checkpoint`, when there is more than one chunk) and
  the backward's two matmuls."""
  if "trained_index" in batch:
    positions = batch["trained_index"].size
    chunks = -(-batch["trained_index"].shape[1] // tcfg.logit_chunk)
  else:
    t = batch["tokens"].shape[1]
    n = -(-t // tcfg.logit_chunk)
    pad = np.pad(batch["p_mask"], ((0, 0), (0, n * tcfg.logit_chunk - t)))
    live = pad.reshape(pad.shape[0], n, -1).any(-1).any(0)  # chunks run for the whole micro-batch
    positions, chunks = int(live.sum()) * tcfg.logit_chunk * batch["tokens"].shape[0], n
  per = 2.0 * mcfg.hidden_size * mcfg.vocab_size * positions
  passes = 3 + (1 if chunks > 1 else 0)
  return dict(positions=positions, chunks=chunks, flops=per * passes, forward_flops=per)


def main(argv):
  del argv
  from dice_jax.model.config import REMAT_POLICIES, get_config
  from dice_jax.rl import flops, tracerl

  mcfg = get_config(FLAGS.config, dtype="bfloat16", param_dtype="float32", attention_impl="flash")
  tcfg = tracerl.TraceRLConfig(layout="packed", old_logp="sampler", logit_chunk=FLAGS.logit_chunk)
  batch = micro_batch(mcfg, tcfg, FLAGS.micro_rows)
  useful = flops.update_flops(mcfg, batch)
  tiles = tile_counts(batch, mcfg)
  head = lm_head(batch, mcfg, tcfg)
  nogather = lm_head(
    {k: v for k, v in batch.items() if k != "trained_index"},
    mcfg,
    tcfg,
  )
  res = dict(
    config=FLAGS.config,
    shape=dict(
      prompt_len=FLAGS.prompt_len,
      new_tokens=FLAGS.new_tokens,
      micro_rows=FLAGS.micro_rows,
      row_len=int(batch["tokens"].shape[1]),
    ),
    useful=useful,
    tiles=tiles,
    lm_head_gathered=head,
    lm_head_chunks_without_gather=nogather,
  )
  print(json.dumps({k: res[k] for k in ("shape", "useful", "tiles")}), flush=True)
  if FLAGS.xla:
    # XLA's count keeps the gathered head in one chunk: a loop would be counted once
    xcfg = tracerl.TraceRLConfig(
      layout="packed", old_logp="sampler", logit_chunk=batch["trained_index"].shape[1]
    )
    one = xla_cost(mcfg, xcfg, batch, remat="none", layers=1, scan=False, what="update")
    two = xla_cost(mcfg, xcfg, batch, remat="none", layers=2, scan=False, what="update")
    layer_none = {k: two[k] - one[k] for k in ("flops", "bytes")}
    rest = {k: one[k] - layer_none[k] for k in ("flops", "bytes")}
    res["xla"] = dict(unrolled_1=one, unrolled_2=two, layer_none=layer_none, rest=rest)
    for policy in FLAGS.remats:
      if policy not in REMAT_POLICIES:
        raise SystemExit(f"rl_update_accounting: unknown remat policy {policy!r}")
      c = xla_cost(mcfg, xcfg, batch, remat=policy, layers=2, scan=True, what="update")
      res["xla"][f"layer_{policy}"] = {k: c[k] - rest[k] for k in ("flops", "bytes")}
      res["xla"][f"scan_{policy}"] = c
      print(json.dumps({policy: res["xla"][f"layer_{policy}"]}), flush=True)
    f1 = xla_cost(mcfg, xcfg, batch, remat="none", layers=1, scan=False, what="forward")
    f2 = xla_cost(mcfg, xcfg, batch, remat="none", layers=2, scan=False, what="forward")
    res["xla"]["forward_layer"] = {k: f2[k] - f1[k] for k in ("flops", "bytes")}
    res["xla"]["forward_rest"] = {k: 2 * f1[k] - f2[k] for k in ("flops", "bytes")}
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(res, f, indent=2)
  print(table(res, mcfg))


def table(res: dict, mcfg) -> str:
  """The markdown table of one accounting (module docstring)."""
  u, tl, hd = res["useful"], res["tiles"], res["lm_head_gathered"]
  L = mcfg.num_layers
  lines = [
    f"{res['config']}, {res['shape']['micro_rows']} rows of {res['shape']['row_len']} tokens "
    f"({u['tokens']} real, {u['trained']} trained, {u['pairs']:,} visible pairs); GFLOP per "
    f"micro-step",
    "",
    "| part | useful | executed | executed / useful | how counted |",
    "| --- | --- | --- | --- | --- |",
  ]
  attn_fwd = tl["fwd_flops"] / G
  attn_bwd = tl["bwd_flops"] / G
  att_u = u["attention"] / G
  lines.append(
    f"| attention, no recompute | {att_u:,.0f} | {attn_fwd + attn_bwd:,.0f} | "
    f"{(attn_fwd + attn_bwd) / att_u:.2f} | live tiles: fwd {tl['fwd_live']:,} (of "
    f"{tl['fwd_visited_skipping_loop']:,} visited by the skipping loop), bwd {tl['bwd_live']:,} "
    f"(of {tl['bwd_visited_skipping_loop']:,}) |"
  )
  lines.append(
    f"| attention, forward recomputed (dots, full) | {att_u:,.0f} | "
    f"{2 * attn_fwd + attn_bwd:,.0f} | {(2 * attn_fwd + attn_bwd) / att_u:.2f} | + one forward |"
  )
  lines.append(
    f"| LM head (gathered: {hd['positions']:,} positions, {hd['chunks']} chunks) | "
    f"{u['lm_head'] / G:,.0f} | {hd['flops'] / G:,.0f} | {hd['flops'] / u['lm_head']:.2f} | "
    f"fwd + chunk recompute + 2 bwd matmuls |"
  )
  ng = res["lm_head_chunks_without_gather"]
  lines.append(
    f"| LM head without gathering ({ng['positions']:,} positions) | {u['lm_head'] / G:,.0f} | "
    f"{ng['flops'] / G:,.0f} | {ng['flops'] / u['lm_head']:.2f} | every chunk holding a "
    f"trained position |"
  )
  if "xla" in res:
    x = res["xla"]
    lin_u = u["linear"] / G
    for key in sorted(k for k in x if k.startswith("layer_") and k != "layer_none") + [
      "layer_none"
    ]:
      if key not in x:
        continue
      fl = x[key]["flops"] * L / G
      lines.append(
        f"| layers (XLA, {key[6:]}; attention kernel excluded) | {lin_u:,.0f} | {fl:,.0f} | "
        f"{fl / lin_u:.2f} | {x[key]['bytes'] * L / G:,.0f} GB accessed |"
      )
    lines.append(
      f"| rest (XLA: embedding, final norm, gathered LM head in one chunk, loss) | "
      f"{u['lm_head'] / G:,.0f} | {x['rest']['flops'] / G:,.0f} | - | "
      f"{x['rest']['bytes'] / G:,.0f} GB accessed |"
    )
    fw = (x["forward_layer"]["flops"] * L + x["forward_rest"]["flops"]) / G + attn_fwd
    lines.append(
      f"| old log-prob forward (trainer) | 0 | {fw:,.0f} | - | XLA layers and head + "
      f"attention tiles; none with old_logp=sampler |"
    )
  lines.append(f"| **useful total** | {u['total'] / G:,.0f} | | | `rl/flops.update_flops` |")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  app.run(main)
