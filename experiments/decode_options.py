r"""The decode forward's options (`DecodeTiles`: splits, fold_new, fp8_widen, halves) against the
default, in one process: bench_sampler's `options_forward`, `options_exact` and `options_rates` runs
(one model, one split of its weights, every program of a run compiled together).

  forward  one decode forward per variant (`experiments.decode_forward`; b new tokens per row, the
           cache filled to prompt + new / 2 with random values): wall ms, device ms by kind, and
           per kernel the bytes, FLOPs, GB/s and TFLOP/s (DIR/options_forward.md); the logits
           against the variant's reference (the first variant of its cache type).
  exact    the static sampler on a model of the preset's shapes with `exact_layers` layers and an
           LM head sharpened as the dynamic run's, `exact_rows` prompts of `exact_tokens` tokens
           and as many new: every variant's tokens and step map against its reference's, for
           low_confidence_static and low_confidence_dynamic.
  rates    the static sampler at full size (`--batch` x (`--prompt_len` + `--new_tokens`)) for
           each `rate_options` variant and `rate_strategies` strategy (static, dynamic, or
           dynamic_capped: at most `commit_rows` rows committing a forward): tok/s, tokens per
           row-forward, and against the first variant its rate and token agreement. `best` is
           the fastest bf16-cache forward whose argmax agrees with its reference and whose exact
           check found the same tokens. Only the programs that fit before the deadline (at the
           costs in `RATE_COSTS_S`) are lowered and compiled.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dice_jax import sharding
from dice_jax.diffusion import sampler, slots
from dice_jax.diffusion.placement import Placement
from dice_jax.model import Transformer, get_config, platform
from experiments import decode_forward as df
from experiments import trace_summary

STRATEGIES = {"static": "low_confidence_static", "dynamic": "low_confidence_dynamic"}
# The rates also run `dynamic_capped`: dynamic with at most `Settings.commit_rows` rows committing per
# forward (`SamplerConfig.commit_rows`), the fastest exact dynamic decoding measured (session 21).
RATE_STRATEGIES = dict(STRATEGIES, dynamic_capped="low_confidence_dynamic")
# Seconds per sampler program at full size on one H200 (sdar_4b, 128 x (1024 + 1024); docs/log.md
# sessions 9-10): lowering (sequential), compile (in parallel), one run at ~5,500 tok/s.
RATE_COSTS_S = dict(lower=12.0, compile=45.0, tok_s=5500.0)
# Seconds the forward and exact runs need at least (lowering, compiling together, measuring).
MIN_S = dict(forward=60.0, exact=45.0)


@dataclasses.dataclass(frozen=True)
class Settings:
  config: str  # the model preset
  variants: tuple  # decode_forward.Variant, the reference of each cache type first
  rate_options: tuple  # variant names or "best"
  rate_strategies: tuple  # keys of RATE_STRATEGIES
  exact_layers: int
  exact_rows: int
  exact_tokens: int
  lm_head_scale: float
  deadline_s: float  # from `t0`
  t0: float
  compile_threads: int = 8
  out: str = ""
  commit_rows: int = 0  # the cap of the `dynamic_capped` rates
  # tokens a row in `options_forward` (0: the block size b; 2b: the fused width of a ragged, capped
  # forward, whose cache kernel then has 2b x G query rows a program; the rows past `commit_rows`
  # then have their first b tokens invisible, as mid-block rows do)
  forward_tokens: int = 0


def sharpened(weights, scale: float):
  """Split weights whose LM head is x `scale` (what the dynamic run decodes: confidences pass its
  threshold); the layers are shared."""
  return dataclasses.replace(weights, head=(weights.head * scale).astype(weights.head.dtype))


def token_agreement(got, want) -> dict:
  """(tokens, step map) against the reference's: equal, and the fraction of the reference's decoded
  positions (step >= 0) holding the same token."""
  (tok, steps), (ref_tok, ref_steps) = got, want
  decoded = ref_steps >= 0
  return dict(
    tokens_equal=bool(np.array_equal(tok, ref_tok)),
    step_map_equal=bool(np.array_equal(steps, ref_steps)),
    token_agreement=round(float(np.mean(tok[decoded] == ref_tok[decoded])), 5),
  )


class OptionRuns:
  """The three runs over one `bench_sampler.Bench` (its model, `prepare`, `measure`, `record`)."""

  def __init__(self, bench, settings: Settings):
    self.bench, self.s = bench, settings
    self.by_name = {v.name: v for v in settings.variants}
    self.forward_rows = {}  # variant name -> options_forward row
    self.inexact = set()  # variants whose exact check differed from the reference or failed
    self._weights = {}

  def left(self) -> float:
    return self.s.deadline_s - (time.perf_counter() - self.s.t0)

  def skip(self, row: dict, need: float = 0.0) -> bool:
    """Records `row` as skipped when less than `need` seconds are left before the deadline."""
    if self.left() > need:
      return False
    self.bench.record(dict(row, skipped="deadline"))
    return True

  def weights(self, v: df.Variant | None = None):
    """The model's split weights (float8 projections for a `weights=fp8` variant `v`), each kind
    made once for the options runs."""
    kind = v.weights_dtype if v is not None else None
    if kind not in self._weights:
      graphdef, state = nnx.split(self.bench.model)
      self._weights[kind] = sampler.split_weights(graphdef, state, weights_dtype=kind)
    return self._weights[kind]

  # --- one decode forward per variant --------------------------------------------------------

  def forward(self, rows: int, prompt: int, new: int) -> None:
    if self.skip(dict(run="options_forward"), MIN_S["forward"]):
      return
    cfg = self.bench.model.cfg
    b = cfg.block_size
    t = self.s.forward_tokens or b
    # one cache for every variant, as long as the sampler's would be for the largest key tile
    # (`block_k=128` failed on session 22's 2,112 slots: the sampler rounds to its tile)
    multiple = max(platform.cache_multiple(v.tiles.block_k) for v in self.s.variants)
    fill, cap = prompt + new // 2, slots.cache_slots(b, prompt + new, 0, max(64, multiple))
    graphdef, state = nnx.split(self.bench.model)
    caches = {}

    def cache_of(v):
      if "bf16" not in caches:
        caches["bf16"] = df.random_cache(cfg, rows, cap, fill, v.tiles, jnp.bfloat16)
      if v.fp8 and "fp8" not in caches:
        caches["fp8"] = df.as_fp8(caches["bf16"])
      return dataclasses.replace(caches["fp8" if v.fp8 else "bf16"], tiles=v.tiles)

    counts_of = lambda v: df.attention_counts(cfg, rows, fill, t, v.tiles, v.fp8, cap)
    # at 2b tokens, the capped loop's layout: rows past the cap are mid-block (first b invisible)
    fresh = self.s.commit_rows or None
    fwd = jax.jit(df.forward_fn(graphdef, *df.new_inputs(cfg, rows, fill, t, fresh)))
    for v, row, summary in df.measure_forwards(
      list(self.s.variants),
      fwd,
      state,
      self.weights,
      cache_of,
      counts_of,
      threads=self.s.compile_threads,
      late=lambda v: self.left() <= 0,
      hlo_dir=self.s.out,
    ):
      self.forward_rows[v.name] = row
      self.bench.record(dict(run="options_forward", rows=rows, fill=fill, tokens=t, **row))
      if summary is not None and self.s.out:
        with open(os.path.join(self.s.out, "options_forward.md"), "a") as f:
          f.write(f"\n## `{v.name}`: one {t}-token forward, {rows} rows, fill {fill}\n\n")
          f.write(trace_summary.markdown(summary))

  # --- exactness on a small model ------------------------------------------------------------

  def exact(self, steps: int, threshold: float) -> None:
    if self.skip(dict(run="options_exact"), MIN_S["exact"]):
      return
    s = self.s
    cfg = get_config(
      s.config,
      num_layers=s.exact_layers,
      dtype="bfloat16",
      param_dtype="bfloat16",
      attention_impl="flash",
    )
    model = sharding.create_sharded(
      lambda: Transformer(cfg, rngs=nnx.Rngs(1)), sharding.make_mesh()
    )
    graphdef, state = nnx.split(model)
    kinds = {v.weights_dtype for v in s.variants}
    weights = {
      k: sharpened(sampler.split_weights(graphdef, state, weights_dtype=k), s.lm_head_scale)
      for k in kinds
    }
    n, hi = s.exact_tokens, min(151000, cfg.mask_token_id)
    prompts = np.random.RandomState(2).randint(2, hi, (s.exact_rows, n)).tolist()
    keys = sampler.row_keys(jax.random.key(0), s.exact_rows)
    lay = Placement.of(state)
    programs = []
    for label, strategy in STRATEGIES.items():
      for v in s.variants:
        scfg = sampler.SamplerConfig(
          steps=steps,
          strategy=strategy,
          threshold=threshold,
          max_new_tokens=n,
          decode_tiles=v.tiles,
          kv_cache_dtype=v.kv_cache_dtype,
          weights_dtype=v.weights_dtype,
        ).for_model(cfg)
        layout = jax.tree.map(jnp.asarray, sampler.layout_prompts(prompts, scfg, cfg.mask_token_id))
        programs.append((v, label, scfg, layout))

    def lower(program):
      v, _, scfg, layout = program
      with lay.context():
        fn = sampler.compiled_decode(graphdef, scfg, lay)
        return fn.lower(state, weights[v.weights_dtype], layout, keys)

    compiled = df.compile_all(df.lower_each(lower, programs), s.compile_threads)
    refs, others, outs = df.references(s.variants), df.peers(s.variants), {}
    for (v, label, _, layout), prog in zip(programs, compiled):
      row = dict(
        run="options_exact",
        variant=v.name,
        strategy=label,
        layers=s.exact_layers,
        rows=s.exact_rows,
        prompt=n,
        new=n,
      )
      if self.skip(row):
        continue
      try:
        if isinstance(prog, Exception):
          raise prog
        out = prog(state, weights[v.weights_dtype], layout, keys)
        outs[v.name, label] = (np.asarray(out.tokens), np.asarray(out.step_map))
        row["generated"] = int(np.asarray(out.response_lengths).sum())
        ref = refs[v.name]
        if ref != v.name and (ref, label) in outs:
          row.update(vs=ref, **token_agreement(outs[v.name, label], outs[ref, label]))
          if not row["tokens_equal"]:
            self.inexact.add(v.name)
        done = [o for o in others[v.name] if (o, label) in outs]
        if done:
          agree = lambda o: token_agreement(outs[v.name, label], outs[o, label])["token_agreement"]
          row["agreement_with_others"] = {o: agree(o) for o in done}
      except Exception as e:  # report and go on
        row["failed"] = f"{type(e).__name__}: {str(e)[:600]}"
        self.inexact.add(v.name)
      self.bench.record(row)

  # --- rates at full size --------------------------------------------------------------------

  def rate_names(self) -> list:
    """`rate_options` resolved (`best`: see the module doc), without repeats."""
    names = []
    for name in self.s.rate_options:
      if name == "best":
        best = df.fastest(self.s.variants, self.forward_rows, exclude=self.inexact)
        name = best.name if best is not None else None
      if name is not None and name not in names:
        names.append(name)
    return names

  def plan(self, items: list, rows: int, new: int) -> list:
    """The first of `items` whose lowering, compile and runs fit in the time left."""
    c, run_s = RATE_COSTS_S, rows * new / RATE_COSTS_S["tok_s"]
    n = 0
    while n < len(items) and c["lower"] * (n + 1) + c["compile"] + run_s * (n + 1) < self.left():
      n += 1
    for label, name in items[n:]:
      self.bench.record(dict(run="options_rates", variant=name, strategy=label, skipped="deadline"))
    return items[:n]

  def rates(self, rows: int, new: int) -> None:
    names = self.rate_names()
    items = [(label, name) for label in self.s.rate_strategies for name in names]
    items = self.plan(items, rows, new)

    sharp = {}  # weights dtype -> the sharpened weights of the dynamic runs, made once

    def prepare(item):
      label, name = item
      v = self.by_name[name]
      weights = self.weights(v)
      if label.startswith("dynamic"):
        if v.weights_dtype not in sharp:
          sharp[v.weights_dtype] = sharpened(weights, self.s.lm_head_scale)
        weights = sharp[v.weights_dtype]
      return self.bench.prepare(
        "options_rates",
        new,
        RATE_STRATEGIES[label],
        kv_cache_dtype=v.kv_cache_dtype,
        tiles=v.tiles,
        weights=weights,
        weights_dtype=v.weights_dtype,
        commit_rows=self.s.commit_rows if label == "dynamic_capped" else 0,
      )

    programs = df.lower_each(prepare, items)
    t0 = time.perf_counter()
    lowered = [p if isinstance(p, Exception) else p["lowered"] for p in programs]
    compiled = df.compile_all(lowered, self.s.compile_threads)
    compile_s = time.perf_counter() - t0
    first = {}  # strategy -> (variant name, tok/s, (tokens, step map))
    for (label, name), p, prog in zip(items, programs, compiled):
      row = dict(run="options_rates", variant=name, strategy=label)
      if self.skip(row):
        continue
      try:
        if isinstance(prog, Exception):
          raise prog
        measured, decoded = self.bench.measure(p, prog, p["lower_s"] + compile_s)
        row = dict(measured, **row, compile_s_all=round(compile_s, 1))
        if label in first:
          ref, ref_tok_s, ref_decoded = first[label]
          row.update(vs=ref, vs_tok_s=round(row["tok_s"] / ref_tok_s, 3))
          row.update(token_agreement(decoded, ref_decoded))
        else:
          first[label] = (name, row["tok_s"], decoded)
      except Exception as e:  # report and go on
        row["failed"] = f"{type(e).__name__}: {str(e)[:600]}"
      self.bench.record(row)
    del programs, compiled
