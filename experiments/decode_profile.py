r"""Where one decode forward's time goes, per kernel, for today's cache attention and its variants.

  python -m experiments.decode_profile --out=DIR --parts=kernel,forward \
      --kernel_variants=base,fold_new=1,splits=3,cache=fp8+fp8_widen=asm \
      --forward_variants=base,fold_new=1+splits=3,fold_new=1+splits=3+halves=1

Variants as `experiments.decode_forward` reads them (`base`, or `DecodeTiles` fields and
`cache=bf16|fp8` joined by `+`). Every part runs `--tokens` new tokens per row (4: an in-block
forward; 8: the fused / ragged forward) over `--rows` rows whose caches are filled to `--fill`
slots of random values.
  kernel   the cached attention (kernel, merges, the new tokens' part) of every layer, per
           variant: ms, the bytes it must move (`attention_counts`) and so its TB/s, and its
           output against the variant's reference (max |difference|; `exact` when bit for bit).
  forward  one decode forward on the split weights (what the sampler runs), per variant, all
           compiled together: wall ms, device ms by kind and by kernel from a profiler trace, each
           kernel with its bytes and FLOPs and so its achieved GB/s and TFLOP/s; logits against
           the reference (max |difference|, argmax agreement).
Results go to DIR/decode.jsonl and DIR/decode.md as they come; DIR/best_tiles.json names the
fastest bf16-cache forward variant whose argmax agrees with its reference on >= 99 % of tokens
(`bench_sampler --decode_tiles`). Nothing starts once `--deadline_s` (from the start) has passed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx

from dice_jax import sharding
from dice_jax.diffusion import sampler, slots
from dice_jax.model import Transformer, flash_decode, get_config
from experiments import decode_forward as df
from experiments import trace_summary

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "sdar_4b", "Model preset.")
flags.DEFINE_integer("rows", 128, "Rows (batch).")
flags.DEFINE_integer("prompt_len", 1024, "Prompt tokens (sets the cache's slots with new_tokens).")
flags.DEFINE_integer("new_tokens", 1024, "New tokens (sets the cache's slots with prompt_len).")
flags.DEFINE_integer("fill", 1536, "Cache slots filled before the forward.")
flags.DEFINE_integer("tokens", 4, "New tokens per row in the forward (4 or 8).")
flags.DEFINE_list("parts", ["kernel", "forward"], "kernel, forward.")
flags.DEFINE_list("kernel_variants", ["base"], "Variants of the kernel part.")
flags.DEFINE_list("forward_variants", ["base"], "Variants of the forward part.")
flags.DEFINE_string("out", "", "Directory for decode.jsonl / decode.md / best_tiles.json.")
flags.DEFINE_float("deadline_s", 1e9, "Start nothing after this many seconds.")
flags.DEFINE_integer("iters", 5, "Timed calls per measurement.")
flags.DEFINE_integer("compile_threads", 8, "Programs compiled at once.")

_T0 = time.perf_counter()


class Profiler:
  """The model, its split weights, the caches and the results."""

  def __init__(self):
    self.cfg = get_config(
      FLAGS.config, dtype="bfloat16", param_dtype="bfloat16", attention_impl="flash"
    )
    mesh = sharding.make_mesh()
    model = sharding.create_sharded(lambda: Transformer(self.cfg, rngs=nnx.Rngs(0)), mesh)
    self.graphdef, self.state = nnx.split(model)
    self.weights = sampler.split_weights(self.graphdef, self.state)
    b = self.cfg.block_size
    self.cap = slots.cache_slots(b, FLAGS.prompt_len + FLAGS.new_tokens, 0, 64)
    self.caches = {}

  def cache(self, v: df.Variant):
    key = "fp8" if v.fp8 else "bf16"
    if key not in self.caches:
      if v.fp8 and "bf16" in self.caches:
        self.caches[key] = df.as_fp8(self.caches["bf16"])
      else:
        dtype = jnp.float8_e4m3fn if v.fp8 else jnp.bfloat16
        self.caches[key] = df.random_cache(
          self.cfg, FLAGS.rows, self.cap, FLAGS.fill, v.tiles, dtype
        )
    return dataclasses.replace(self.caches[key], tiles=v.tiles)

  def counts(self, v: df.Variant) -> dict:
    return df.attention_counts(
      self.cfg, FLAGS.rows, FLAGS.fill, FLAGS.tokens, v.tiles, v.fp8, self.cap
    )

  def record(self, row: dict) -> None:
    row = dict(row, device=jax.devices()[0].device_kind, jax=jax.__version__)
    row["t_s"] = round(time.perf_counter() - _T0, 1)
    print(json.dumps(row), flush=True)
    if FLAGS.out:
      with open(os.path.join(FLAGS.out, "decode.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")

  def write_md(self, text: str) -> None:
    print(text, flush=True)
    if FLAGS.out:
      with open(os.path.join(FLAGS.out, "decode.md"), "a") as f:
        f.write(text + "\n")

  def late(self, part: str, v: df.Variant) -> bool:
    if time.perf_counter() - _T0 <= FLAGS.deadline_s:
      return False
    self.record(dict(part=part, variant=v.name, skipped="deadline"))
    return True

  # --- the cached attention alone -------------------------------------------------------------

  def kernel(self, variants):
    cfg, rows, t = self.cfg, FLAGS.rows, FLAGS.tokens
    kq = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(kq[0], (rows, t, cfg.num_heads, cfg.head_dim), jnp.bfloat16)
    kn = jax.random.normal(kq[1], (rows, t, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16)
    vn = jax.random.normal(kq[2], (rows, t, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16)
    _, pos, spec = df.new_inputs(cfg, rows, FLAGS.fill, t)
    seg, blk = spec.segment_ids, spec.block_ids

    @jax.jit
    def all_layers(cache):
      def one(layer, acc):
        o = flash_decode.cached_attention(q, kn, vn, layer, spec, pos, seg, blk, cache)
        return acc + o.astype(jnp.float32)

      return jax.lax.fori_loop(0, cfg.num_layers, one, jnp.zeros(q.shape, jnp.float32))

    refs, outs = df.references(variants), {}
    for v in variants:
      if self.late("kernel", v):
        continue
      counts = self.counts(v)
      row = dict(part="kernel", variant=v.name, rows=rows, fill=FLAGS.fill, tokens=t)
      try:
        t0 = time.perf_counter()
        all_layers(self.cache(v)).block_until_ready()
        row["compile_s"] = round(time.perf_counter() - t0, 1)
        sec, out = df.time_fn(all_layers, self.cache(v), iters=FLAGS.iters)
        row.update(
          ms=round(1e3 * sec, 3),
          gb=round(counts["total"] / 1e9, 2),
          kv_gb=round(counts["kv"] / 1e9, 2),
          tb_s=round(counts["total"] / sec / 1e12, 2),
          kv_tb_s=round(counts["kv"] / sec / 1e12, 2),
          tflop_s=round(counts["flops"] / sec / 1e12, 1),
        )
        outs[v.name] = out
        if refs[v.name] != v.name and refs[v.name] in outs:
          row.update(vs=refs[v.name], **df.compare(out, outs[refs[v.name]]))
      except Exception as e:  # a variant that does not build or run: report and go on
        row["failed"] = f"{type(e).__name__}: {str(e)[:600]}"
      self.record(row)

  # --- one decode forward ---------------------------------------------------------------------

  def forward(self, variants):
    cfg, t = self.cfg, FLAGS.tokens
    fwd = jax.jit(df.forward_fn(self.graphdef, *df.new_inputs(cfg, FLAGS.rows, FLAGS.fill, t)))
    rows = {}
    for v, row, summary in df.measure_forwards(
      variants,
      fwd,
      self.state,
      self.weights,
      self.cache,
      self.counts,
      iters=FLAGS.iters,
      threads=FLAGS.compile_threads,
      late=lambda v: time.perf_counter() - _T0 > FLAGS.deadline_s,
    ):
      rows[v.name] = row
      self.record(dict(part="forward", rows=FLAGS.rows, fill=FLAGS.fill, tokens=t, **row))
      if summary is not None:
        self.write_md(f"\n## forward `{v.name}` ({t} tokens, fill {FLAGS.fill})\n")
        self.write_md(trace_summary.markdown(summary))
    best = df.fastest(variants, rows)
    if best is not None and FLAGS.out:
      with open(os.path.join(FLAGS.out, "best_tiles.json"), "w") as f:
        json.dump(dataclasses.asdict(best.tiles), f)


def main(argv):
  del argv
  unknown = set(FLAGS.parts) - {"kernel", "forward"}
  if unknown:
    raise app.UsageError(f"--parts: unknown {sorted(unknown)} (kernel, forward)")
  if FLAGS.tokens < 1 or not 0 < FLAGS.fill <= FLAGS.prompt_len + FLAGS.new_tokens:
    raise app.UsageError(
      f"need --tokens >= 1 and 0 < --fill <= prompt_len + new_tokens, got {FLAGS.tokens}, "
      f"{FLAGS.fill}"
    )
  try:
    kernel_variants = df.parse_variants(FLAGS.kernel_variants)
    forward_variants = df.parse_variants(FLAGS.forward_variants)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  if FLAGS.out:
    os.makedirs(FLAGS.out, exist_ok=True)
  prof = Profiler()
  print(
    f"device {jax.devices()[0].device_kind}, jax {jax.__version__}; {FLAGS.config} x "
    f"{FLAGS.rows} rows, fill {FLAGS.fill}, {FLAGS.tokens} tokens, cache {prof.cap} slots",
    flush=True,
  )
  for part in FLAGS.parts:
    t0 = time.perf_counter()
    if part == "kernel":
      prof.kernel(kernel_variants)
    else:
      prof.forward(forward_variants)
    print(f"[{part}: {time.perf_counter() - t0:.0f} s]", flush=True)


if __name__ == "__main__":
  from experiments import _cli

  _cli.run(main)
