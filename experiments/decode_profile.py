r"""Where one decode forward's time goes, per kernel, for today's cache attention and its variants.

  python -m experiments.decode_profile --out=DIR --parts=kernel,forward \
      --kernel_variants=base,fold_new=1,splits=3,cache=fp8+fp8_widen=asm \
      --forward_variants=base,fold_new=1+splits=3,fold_new=1+splits=3+halves=1

A variant is `base` or `key=value` items joined by `+`: `DecodeTiles` fields (split, block_k,
num_warps, num_stages, dynamic_loop, splits, fold_new, fp8_widen, halves) and `cache=bf16|fp8`
(the K/V cache's element type). Every part runs `--tokens` new tokens per row (4: an in-block
forward; 8: the fused / ragged forward) over `--rows` rows whose caches are filled to `--fill`
slots of random values.
  kernel   the cached attention (kernel, merges, the new tokens' part) of every layer, per
           variant: ms, the bytes it must move (`attention_counts`) and so its TB/s, and its
           output against the first variant of the same cache type (max |difference|; `exact`
           when bit for bit equal).
  forward  one decode forward on the split weights (what the sampler runs), per variant: wall ms,
           device ms by kind and by kernel from a profiler trace, with each kernel's bytes and
           FLOPs from the compiled HLO (`hlo_costs`; the Pallas kernel's from
           `attention_counts`) and so its achieved GB/s and TFLOP/s; logits against the first
           variant (max |difference|, argmax agreement).
Results go to DIR/decode.jsonl and DIR/decode.md as they come; DIR/best_tiles.json names the
fastest exact (bf16 cache, logits agreeing with the first variant) forward variant's `DecodeTiles`
for `bench_sampler --decode_tiles`. A part is skipped once `--deadline_s` (from the start) has
passed. Traces are summarised and deleted (only the tables stay).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from dice_jax import sharding
from dice_jax.diffusion import sampler, slots
from dice_jax.model import AttentionSpec, KVCache, Transformer, flash_decode, get_config
from experiments import hlo_costs, trace_summary

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
flags.DEFINE_float("deadline_s", 1e9, "Skip what would start after this many seconds.")
flags.DEFINE_integer("iters", 5, "Timed calls per measurement.")
flags.DEFINE_float("peak_tflops", 790.0, "bf16 dense TFLOP/s of the device (H200).")
flags.DEFINE_float("hbm_tbs", 4.8, "HBM TB/s of the device (H200 spec; copies reach ~4.3).")

_T0 = time.perf_counter()
_TILE_FIELDS = {f.name: f.type for f in dataclasses.fields(flash_decode.DecodeTiles)}


@dataclasses.dataclass(frozen=True)
class Variant:
  name: str
  tiles: flash_decode.DecodeTiles
  fp8: bool


def parse_variant(spec: str) -> Variant:
  """`base` or `key=value+key=value` (DecodeTiles fields, `cache=bf16|fp8`) -> Variant."""
  fields, fp8 = {}, False
  for item in [] if spec == "base" else spec.split("+"):
    key, sep, value = item.partition("=")
    if not sep:
      raise app.UsageError(f"variant item {item!r} is not key=value (in {spec!r})")
    if key == "cache":
      if value not in ("bf16", "fp8"):
        raise app.UsageError(f"cache must be bf16 or fp8, got {value!r} (in {spec!r})")
      fp8 = value == "fp8"
    elif key in _TILE_FIELDS:
      kind = _TILE_FIELDS[key]
      if kind in ("bool", bool):
        fields[key] = value in ("1", "true", "True")
      elif kind in ("int", int):
        fields[key] = int(value)
      else:
        fields[key] = value
    else:
      raise app.UsageError(f"unknown variant key {key!r} (in {spec!r})")
  try:
    tiles = flash_decode.DecodeTiles(**fields)
  except (ValueError, TypeError) as e:
    raise app.UsageError(f"variant {spec!r}: {e}") from e
  return Variant(spec, tiles, fp8)


def attention_counts(cfg, rows: int, fill: int, tokens: int, tiles, fp8: bool, cap: int) -> dict:
  """What the cached attention of one forward (all layers) must move and compute: the live K/V
  tiles (read once), each program's slot metadata, the queries, the per-program partial outputs
  (written by the kernel, read by the merge) and the new tokens' part; FLOPs of q.k and p.v."""
  L, K, H, G = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
  r = tokens * G
  rpad = max(16, 1 << (r - 1).bit_length())
  slots_read = -(-fill // tiles.block_k) * tiles.block_k
  programs = tiles.splits or -(-cap // tiles.split)
  kv = 2 * L * rows * slots_read * K * H * (1 if fp8 else 2)
  meta = 2 * 4 * L * rows * K * slots_read
  q = L * rows * K * rpad * H * 2
  partial = 2 * L * rows * K * programs * rpad * (H + 1) * 4
  new = 0 if tiles.fold_new else 2 * L * rows * K * r * (H + 1) * 4 * 2
  out = L * rows * tokens * K * G * H * 2
  flops = 4 * L * rows * K * r * (slots_read + tokens) * H
  return dict(kv=kv, total=kv + meta + q + partial + new + out, flops=flops, launches=L)


def random_cache(cfg, rows, cap, fill, tiles, dtype, seed=0):
  """A cache of `rows` rows filled to `fill` slots with N(0, 1) keys/values (slot s holds
  position s - b, as the sampler lays rows out)."""
  shape = (cfg.num_layers, rows, cap, cfg.num_kv_heads, cfg.head_dim)
  kk, kv = jax.random.split(jax.random.key(seed))
  k = jax.jit(lambda: jax.random.normal(kk, shape, jnp.bfloat16).astype(dtype))()
  v = jax.jit(lambda: jax.random.normal(kv, shape, jnp.bfloat16).astype(dtype))()
  slot = jnp.broadcast_to(jnp.arange(cap, dtype=jnp.int32) - 4, (rows, cap))
  return KVCache(
    k=k,
    v=v,
    positions=slot,
    segment_ids=(slot >= 0).astype(jnp.int32),
    block_ids=slot // 4,
    length=jnp.full((rows,), fill, jnp.int32),
    tiles=tiles,
  )


def new_inputs(cfg, rows, fill, tokens):
  """Tokens, positions `[rows, tokens]` right after the fill, and their block-causal spec."""
  pos = jnp.broadcast_to(jnp.arange(fill - 4, fill - 4 + tokens, dtype=jnp.int32), (rows, tokens))
  tok = jnp.full((rows, tokens), 5, jnp.int32)
  return tok, pos, AttentionSpec.block_causal(4, jnp.ones_like(pos), pos // 4)


def time_fn(fn, *args, iters=5):
  out = fn(*args)
  jax.block_until_ready(out)
  t0 = time.perf_counter()
  for _ in range(iters):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / iters, out


def compare(got, want) -> dict:
  g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return dict(
    max_abs_diff=float(np.abs(g - w).max()),
    max_abs=float(np.abs(w).max()),
    exact=bool(np.array_equal(g, w)),
  )


class Profiler:
  """The model, its split weights, the caches and the results table."""

  def __init__(self):
    self.cfg = get_config(
      FLAGS.config, dtype="bfloat16", param_dtype="bfloat16", attention_impl="flash"
    )
    mesh = sharding.make_mesh()
    self.model = sharding.create_sharded(lambda: Transformer(self.cfg, rngs=nnx.Rngs(0)), mesh)
    self.graphdef, self.state = nnx.split(self.model)
    self.weights = sampler.split_weights(self.graphdef, self.state)
    b = self.cfg.block_size
    self.cap = slots.cache_slots(b, FLAGS.prompt_len + FLAGS.new_tokens, 0, 64)
    self.caches = {}
    self.rows = []

  def cache(self, variant: Variant) -> KVCache:
    key = "fp8" if variant.fp8 else "bf16"
    if key not in self.caches:
      if key == "fp8" and "bf16" in self.caches:
        base = self.caches["bf16"]
        to8 = jax.jit(lambda a: a.astype(jnp.float8_e4m3fn))
        self.caches[key] = dataclasses.replace(base, k=to8(base.k), v=to8(base.v))
      else:
        dtype = jnp.float8_e4m3fn if variant.fp8 else jnp.bfloat16
        self.caches[key] = random_cache(
          self.cfg, FLAGS.rows, self.cap, FLAGS.fill, variant.tiles, dtype
        )
    return dataclasses.replace(self.caches[key], tiles=variant.tiles)

  def record(self, row: dict) -> None:
    row = dict(row, device=jax.devices()[0].device_kind, jax=jax.__version__)
    row["t_s"] = round(time.perf_counter() - _T0, 1)
    self.rows.append(row)
    print(json.dumps(row), flush=True)
    if FLAGS.out:
      os.makedirs(FLAGS.out, exist_ok=True)
      with open(os.path.join(FLAGS.out, "decode.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")

  def write_md(self, text: str) -> None:
    print(text, flush=True)
    if FLAGS.out:
      with open(os.path.join(FLAGS.out, "decode.md"), "a") as f:
        f.write(text + "\n")

  # --- the cached attention alone -------------------------------------------------------------

  def kernel(self, variants):
    cfg, rows, t = self.cfg, FLAGS.rows, FLAGS.tokens
    kq = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(kq[0], (rows, t, cfg.num_heads, cfg.head_dim), jnp.bfloat16)
    kn = jax.random.normal(kq[1], (rows, t, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16)
    vn = jax.random.normal(kq[2], (rows, t, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16)
    _, pos, spec = new_inputs(cfg, rows, FLAGS.fill, t)
    seg, blk = spec.segment_ids, spec.block_ids

    @jax.jit
    def all_layers(cache):
      def one(layer, acc):
        o = flash_decode.cached_attention(q, kn, vn, layer, spec, pos, seg, blk, cache)
        return acc + o.astype(jnp.float32)

      return jax.lax.fori_loop(0, cfg.num_layers, one, jnp.zeros(q.shape, jnp.float32))

    first = {}
    for v in variants:
      if time.perf_counter() - _T0 > FLAGS.deadline_s:
        self.record(dict(part="kernel", variant=v.name, skipped="deadline"))
        continue
      counts = attention_counts(cfg, rows, FLAGS.fill, t, v.tiles, v.fp8, self.cap)
      row = dict(part="kernel", variant=v.name, rows=rows, fill=FLAGS.fill, tokens=t)
      try:
        t0 = time.perf_counter()
        all_layers(self.cache(v)).block_until_ready()
        row["compile_s"] = round(time.perf_counter() - t0, 1)
        sec, out = time_fn(all_layers, self.cache(v), iters=FLAGS.iters)
        row.update(
          ms=round(1e3 * sec, 3),
          gb=round(counts["total"] / 1e9, 2),
          kv_gb=round(counts["kv"] / 1e9, 2),
          tb_s=round(counts["total"] / sec / 1e12, 2),
          kv_tb_s=round(counts["kv"] / sec / 1e12, 2),
          tflop_s=round(counts["flops"] / sec / 1e12, 1),
        )
        ref = first.setdefault(v.fp8, (v.name, out))
        if ref[0] != v.name:
          row.update(vs=ref[0], **compare(out, ref[1]))
      except Exception as e:  # a variant that does not build or run: report and go on
        row["failed"] = f"{type(e).__name__}: {str(e)[:600]}"
      self.record(row)

  # --- one decode forward ---------------------------------------------------------------------

  def forward(self, variants):
    cfg, rows, t = self.cfg, FLAGS.rows, FLAGS.tokens
    tok, pos, spec = new_inputs(cfg, rows, FLAGS.fill, t)
    graphdef = self.graphdef

    def fwd(state, weights, cache):
      m = sampler.decoding_model(graphdef, state, weights)
      h, _ = m(tok, pos, spec, cache=cache, update_cache=False, return_hidden=True)
      return m.logits_from_hidden(h)

    first, best = None, None
    for v in variants:
      if time.perf_counter() - _T0 > FLAGS.deadline_s:
        self.record(dict(part="forward", variant=v.name, skipped="deadline"))
        continue
      row = dict(part="forward", variant=v.name, rows=rows, fill=FLAGS.fill, tokens=t)
      try:
        cache = self.cache(v)
        t0 = time.perf_counter()
        compiled = jax.jit(fwd).lower(self.state, self.weights, cache).compile()
        row["compile_s"] = round(time.perf_counter() - t0, 1)
        sec, logits = time_fn(compiled, self.state, self.weights, cache, iters=FLAGS.iters)
        row["wall_ms"] = round(1e3 * sec, 3)
        summary = self.trace(compiled, cache, v)
        row.update(
          device_ms=summary["device_ms_per_call"],
          by_kind=summary["by_kind"],
          kind_rates=summary.get("kind_rates"),
        )
        if first is None:
          first = (v.name, logits)
        else:
          c = compare(logits, first[1])
          agree = np.mean(
            np.asarray(jnp.argmax(logits, -1)) == np.asarray(jnp.argmax(first[1], -1))
          )
          row.update(vs=first[0], argmax_agree=round(float(agree), 5), **c)
        exact = not v.fp8 and row.get("argmax_agree", 1.0) >= 0.98  # not a broken variant
        if exact and (best is None or sec < best[0]):
          best = (sec, v)
        self.write_md(f"\n## forward `{v.name}` ({t} tokens, fill {FLAGS.fill})\n")
        self.write_md(trace_summary.markdown(summary))
      except Exception as e:  # report and go on
        row["failed"] = f"{type(e).__name__}: {str(e)[:600]}"
      self.record(row)
    if best is not None and FLAGS.out:
      with open(os.path.join(FLAGS.out, "best_tiles.json"), "w") as f:
        json.dump(dataclasses.asdict(best[1].tiles), f)

  def trace(self, compiled, cache, v: Variant, calls: int = 3) -> dict:
    """Device time by kernel of `calls` calls, each kernel with its bytes and FLOPs."""
    costs = hlo_costs.instruction_costs(compiled.as_text())
    counts = attention_counts(
      self.cfg, FLAGS.rows, FLAGS.fill, FLAGS.tokens, v.tiles, v.fp8, self.cap
    )
    launches = counts["launches"] * (2 if v.tiles.halves else 1)
    kernel = hlo_costs.Cost(
      "pallas", counts["total"] // launches, counts["flops"] // launches
    )  # the partial-output merges are XLA fusions, counted again there: a small overcount
    tmp = tempfile.mkdtemp(prefix="decode_trace_")
    try:
      with jax.profiler.trace(tmp, create_perfetto_trace=True):
        for _ in range(calls):
          jax.block_until_ready(compiled(self.state, self.weights, cache))
      return trace_summary.summarize(
        tmp, calls, top=40, costs=costs, overrides={"flash_decode_cache": kernel}
      )
    finally:
      shutil.rmtree(tmp, ignore_errors=True)


def main(argv):
  del argv
  kernel_variants = [parse_variant(s) for s in FLAGS.kernel_variants]
  forward_variants = [parse_variant(s) for s in FLAGS.forward_variants]
  unknown = set(FLAGS.parts) - {"kernel", "forward"}
  if unknown:
    raise app.UsageError(f"--parts: unknown {sorted(unknown)} (kernel, forward)")
  if FLAGS.tokens < 1:
    raise app.UsageError(f"--tokens must be >= 1, got {FLAGS.tokens}")
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

  _cli.quiet_missing_tpu()
  _cli.run(main)
