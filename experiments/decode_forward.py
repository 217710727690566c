r"""One decode forward of the sampler's model per `DecodeTiles` variant: its inputs, its compiled
program and where its device time goes (`experiments.decode_profile`, bench_sampler's `options_*`
runs). No flags: the launchers own those.

A variant is `base` or `key=value` items joined by `+`: `DecodeTiles` fields (split, block_k,
num_warps, num_stages, dynamic_loop, splits, fold_new, fp8_widen, halves), `cache=bf16|fp8`
(the K/V cache's element type) and `weights=bf16|fp8` (`SamplerConfig.weights_dtype`: float8
projections), e.g. `splits=3+fold_new=1`, `cache=fp8+fp8_widen=asm`, `weights=fp8`. A variant is
compared with its reference: the first variant given with the same cache type (so `weights=fp8`
against bf16 weights: one forward's logits and argmax beside a rounding-order control such as
`split=64`).
"""

from __future__ import annotations

import concurrent.futures
import gzip
import os
import dataclasses
import shutil
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from dice_jax.diffusion import sampler
from dice_jax.model import AttentionSpec, KVCache, flash_decode
from experiments import hlo_costs, trace_summary

_TILE_FIELDS = {f.name: f.type for f in dataclasses.fields(flash_decode.DecodeTiles)}
FP8 = "float8_e4m3fn"


@dataclasses.dataclass(frozen=True)
class Variant:
  name: str
  tiles: flash_decode.DecodeTiles
  fp8: bool
  weights8: bool = False  # float8 projections (`SamplerConfig.weights_dtype`)

  @property
  def kv_cache_dtype(self):
    """`SamplerConfig.kv_cache_dtype` of this variant."""
    return FP8 if self.fp8 else None

  @property
  def weights_dtype(self):
    """`SamplerConfig.weights_dtype` of this variant."""
    return FP8 if self.weights8 else None


def parse_variant(spec: str) -> Variant:
  """`base` or `key=value+key=value` -> Variant; ValueError naming what is wrong."""
  fields, fp8, weights8 = {}, False, False
  for item in [] if spec == "base" else spec.split("+"):
    key, sep, value = item.partition("=")
    if not sep:
      raise ValueError(f"variant item {item!r} is not key=value (in {spec!r})")
    if key in ("cache", "weights"):
      if value not in ("bf16", "fp8"):
        raise ValueError(f"{key} must be bf16 or fp8, got {value!r} (in {spec!r})")
      if key == "cache":
        fp8 = value == "fp8"
      else:
        weights8 = value == "fp8"
    elif key in _TILE_FIELDS:
      kind = _TILE_FIELDS[key]
      if kind in ("bool", bool):
        fields[key] = value in ("1", "true", "True")
      elif kind in ("int", int):
        try:
          fields[key] = int(value)
        except ValueError:
          raise ValueError(f"{key} must be an int, got {value!r} (in {spec!r})") from None
      else:
        fields[key] = value
    else:
      raise ValueError(f"unknown variant key {key!r} (in {spec!r})")
  try:
    tiles = flash_decode.DecodeTiles(**fields)
  except (ValueError, TypeError) as e:
    raise ValueError(f"variant {spec!r}: {e}") from e
  return Variant(spec, tiles, fp8, weights8)


def parse_variants(specs) -> list[Variant]:
  """Variants of a list of specs: distinct names, at least one."""
  variants = [parse_variant(s) for s in specs]
  if not variants or len({v.name for v in variants}) != len(variants):
    raise ValueError(f"need one or more distinct variants, got {list(specs)}")
  return variants


def references(variants) -> dict:
  """{variant name: its reference's name} (the first variant of the same cache type)."""
  first = {}
  for v in variants:
    first.setdefault(v.fp8, v.name)
  return {v.name: first[v.fp8] for v in variants}


def peers(variants) -> dict:
  """{variant name: the earlier variants of its cache type other than its reference}: a variant
  is also compared with each of them (e.g. `splits=3` with `split=512`, the base kernel on the
  same partition at fill 1,536, which it should equal bit for bit)."""
  refs, seen, out = references(variants), {}, {}
  for v in variants:
    out[v.name] = [n for n in seen.get(v.fp8, []) if n != refs[v.name]]
    seen.setdefault(v.fp8, []).append(v.name)
  return out


def attention_counts(cfg, rows: int, fill: int, tokens: int, tiles, fp8: bool, cap: int) -> dict:
  """What the cached attention of one forward (all layers) must move and compute: the live K/V
  tiles (read once), each program's slot metadata, the queries, the per-program partial outputs
  (written by the kernel, read by the merge) and the new tokens' part; FLOPs of q.k and p.v.
  `launches`: the kernel's launches per forward."""
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
  launches = L * (2 if tiles.halves else 1)
  return dict(kv=kv, total=kv + meta + q + partial + new + out, flops=flops, launches=launches)


def random_cache(cfg, rows, cap, fill, tiles, dtype, seed=0) -> KVCache:
  """A cache of `rows` rows filled to `fill` slots with N(0, 1) keys/values (slot s holds
  position s - b, as the sampler lays rows out)."""
  shape = (cfg.num_layers, rows, cap, cfg.num_kv_heads * cfg.head_dim)
  kk, kv = jax.random.split(jax.random.key(seed))
  k = jax.jit(lambda: jax.random.normal(kk, shape, jnp.bfloat16).astype(dtype))()
  v = jax.jit(lambda: jax.random.normal(kv, shape, jnp.bfloat16).astype(dtype))()
  b = cfg.block_size
  slot = jnp.broadcast_to(jnp.arange(cap, dtype=jnp.int32) - b, (rows, cap))
  return KVCache(
    k=k,
    v=v,
    positions=slot,
    segment_ids=(slot >= 0).astype(jnp.int32),
    block_ids=slot // b,
    length=jnp.full((rows,), fill, jnp.int32),
    head_dim=cfg.head_dim,
    tiles=tiles,
  )


def as_fp8(cache: KVCache) -> KVCache:
  """`cache` with its K/V cast to float8_e4m3fn (what a float8 cache holds: saturating casts)."""
  to8 = jax.jit(lambda a: a.astype(jnp.float8_e4m3fn))
  return dataclasses.replace(cache, k=to8(cache.k), v=to8(cache.v))


def new_inputs(cfg, rows, fill, tokens, fresh: int | None = None):
  """Tokens, positions `[rows, tokens]` right after the fill's last committed block, and their
  block-causal spec (the in-block forward: `tokens` = b; the fused one: 2b). With `fresh` (2b
  tokens only) the rows from `fresh` on are mid-block rows of the capped loop: their first b tokens
  invisible (segment 0), as `slots.py` lays them out."""
  b = cfg.block_size
  pos = jnp.broadcast_to(jnp.arange(fill - b, fill - b + tokens, dtype=jnp.int32), (rows, tokens))
  tok = jnp.full((rows, tokens), 5, jnp.int32)
  seg = jnp.ones_like(pos)
  if fresh is not None and tokens == 2 * b:
    mid = (jnp.arange(rows) >= fresh)[:, None] & (jnp.arange(tokens) < b)[None, :]
    seg = jnp.where(mid, 0, seg)
  return tok, pos, AttentionSpec.block_causal(b, seg, pos // b)


def forward_fn(graphdef, tok, pos, spec):
  """(state, weights, cache) -> f32 logits `[rows, tokens, V]`: the sampler's decode forward
  (split weights, cache read only)."""

  def fwd(state, weights, cache):
    m = sampler.decoding_model(graphdef, state, weights)
    h, _ = m(tok, pos, spec, cache=cache, update_cache=False, return_hidden=True)
    return m.logits_from_hidden(h)

  return fwd


def time_fn(fn, *args, iters=5):
  """(seconds per call after one warm-up call, the last output)."""
  out = fn(*args)
  jax.block_until_ready(out)
  t0 = time.perf_counter()
  for _ in range(iters):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / iters, out


def lower_each(lower, items) -> list:
  """`lower(item)` of each item, or the exception it raised (a variant that does not trace)."""
  out = []
  for item in items:
    try:
      out.append(lower(item))
    except Exception as e:  # reported by the caller, beside the variants that do lower
      out.append(e)
  return out


def compile_all(lowered: list, threads: int = 8, first_alone: bool = True) -> list:
  """`Lowered.compile()` of each (an exception in `lowered` stays as it is): with `first_alone`
  the first alone (XLA's autotuning results for its kernels are then cached for the others), the
  rest in `threads` threads (XLA compiles without Python's lock). Each entry is the compiled
  program or the exception its compile raised."""

  def one(low):
    if isinstance(low, Exception):
      return low
    try:
      return low.compile()
    except Exception as e:  # a variant that does not build: reported by the caller
      return e

  if not lowered:
    return []
  first = [one(lowered[0])] if first_alone else []
  with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
    return first + list(pool.map(one, lowered[len(first) :]))


def compare(got, want) -> dict:
  """max |got - want|, max |want|, bit-for-bit equality."""
  g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return dict(
    max_abs_diff=float(np.abs(g - w).max()),
    max_abs=float(np.abs(w).max()),
    exact=bool(np.array_equal(g, w)),
  )


def compare_logits(got, want) -> dict:
  """`compare` plus the fraction of (row, token) whose argmax agrees."""
  agree = np.mean(np.asarray(jnp.argmax(got, -1)) == np.asarray(jnp.argmax(want, -1)))
  return dict(compare(got, want), argmax_agree=round(float(agree), 5))


def measure_forwards(
  variants,
  fwd,
  state,
  weights,
  cache_of,
  counts_of,
  *,
  iters=5,
  threads=8,
  late=lambda v: False,
  hlo_dir="",
):
  """One forward per variant (`fwd` jitted, `cache_of(v)` its cache, `counts_of(v)` its
  `attention_counts`; `weights` the split weights, or a function of the variant giving them);
  yields (variant, row, trace summary or None): wall ms, device ms by kind
  (and per kernel in the summary, `forward_account`), the logits against the variant's reference.
  The first variant is compiled and measured alone first (its numbers are out before any other
  variant builds); the others are compiled together. A variant `late(v)` says to skip is yielded
  with `skipped`; one that fails, with `failed`. With `hlo_dir`, the first variant's optimised
  HLO goes to `hlo_dir/forward_hlo.txt.gz` (what each kernel of its account computes)."""
  refs, others, logits = references(variants), peers(variants), {}
  weights_of = weights if callable(weights) else lambda v: weights
  for group in (variants[:1], variants[1:]):
    t0 = time.perf_counter()
    lowered = lower_each(lambda v: fwd.lower(state, weights_of(v), cache_of(v)), group)
    compiled = compile_all(lowered, threads, first_alone=False)
    compile_s = round(time.perf_counter() - t0, 1)
    for v, prog in zip(group, compiled):
      row = dict(variant=v.name, compile_s=compile_s)
      if late(v):
        yield v, dict(row, skipped="deadline"), None
        continue
      summary = None
      try:
        if isinstance(prog, Exception):
          raise prog
        args = (state, weights_of(v), cache_of(v))
        if hlo_dir and v is variants[0]:
          with gzip.open(os.path.join(hlo_dir, "forward_hlo.txt.gz"), "wt") as f:
            f.write(prog.as_text())
        sec, logits[v.name] = time_fn(prog, *args, iters=iters)
        summary = forward_account(prog, args, counts_of(v))
        row.update(
          wall_ms=round(1e3 * sec, 3),
          device_ms=summary["device_ms_per_call"],
          by_kind=summary["by_kind"],
          kind_rates=summary.get("kind_rates"),
        )
        ref = refs[v.name]
        if ref != v.name and ref in logits:
          row.update(vs=ref, **compare_logits(logits[v.name], logits[ref]))
        done = [o for o in others[v.name] if o in logits]
        if done:
          row["vs_others"] = {o: compare_logits(logits[v.name], logits[o]) for o in done}
      except Exception as e:  # a variant that does not build or run: report and go on
        row["failed"] = f"{type(e).__name__}: {str(e)[:600]}"
      yield v, row, summary


def fastest(variants, rows: dict, agree: float = 0.99, exclude=()):
  """The bf16-cache variant of least `wall_ms` among `rows` ({name: row} of `measure_forwards`)
  whose argmax agrees with its reference on >= `agree` of the tokens, not in `exclude`; None if
  none ran."""
  ok = [
    v
    for v in variants
    if not v.fp8
    and not v.weights8
    and v.name not in exclude
    and "wall_ms" in rows.get(v.name, {})
    and rows[v.name].get("argmax_agree", 1.0) >= agree
  ]
  return min(ok, key=lambda v: rows[v.name]["wall_ms"], default=None)


def forward_account(compiled, args, counts: dict, calls: int = 3) -> dict:
  """Device time by kernel of `calls` calls of `compiled(*args)` (a profiler trace, summarised
  and deleted), each kernel with its bytes and FLOPs from the compiled HLO and so its GB/s and
  TFLOP/s; the cache-attention kernel's from `counts` (`attention_counts`: the HLO would count
  its whole cache operand). `trace_summary.summarize`'s dict."""
  costs = hlo_costs.instruction_costs(compiled.as_text())
  n = counts["launches"]
  kernel = hlo_costs.Cost("pallas", counts["total"] // n, counts["flops"] // n)
  tmp = tempfile.mkdtemp(prefix="decode_trace_")
  try:
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      for _ in range(calls):
        jax.block_until_ready(compiled(*args))
    return trace_summary.summarize(
      tmp, calls, top=40, costs=costs, overrides={"flash_decode_cache": kernel}
    )
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
