r"""Sampler throughput with random weights: every H200 measurement of issue 13 in one process.

  python -m experiments.bench_sampler --out=DIR \
      --runs=static,breakdown,sweep,best,dynamic,long,mixed,mixed_static

Runs (in the order given; each writes rows to DIR/results.jsonl and rewrites DIR/results.md):
  static        static batch (`sampler.decode`): `--batch` prompts of `--prompt_len` +
                `--new_tokens`, greedy, low_confidence_static, no stop ids (every row generates
                every token). If the cache kernel fails to build, retried with its masked loop.
  static_fp8    `static` on a float8_e4m3fn K/V cache (`SamplerConfig.kv_cache_dtype`: half the
                cache bytes each forward reads; approximate decoding), with `vs_static`.
  profile       device time by kernel (profiler trace) of one decode forward (on the split
                weights, as the sampler decodes) and of a short static call; DIR/profile.md.
  profile_loop  one iteration of each `--profile_loops` loop (static, dynamic_capped, the float8
                cache...), by kind and kernel, per batch forward: the difference of one program
                run with budgets 2b and `--loop_tokens` (experiments/decode_loop_profile.py);
                DIR/profile_loop.md, each loop's optimised HLO in DIR/loop_NAME_hlo.txt.gz.
  breakdown     one decode forward (b tokens, cache filled to prompt + new/2) with and without
                XLA's dynamic-slice fusion (the layer scan slices every layer's weights), with the
                layers unrolled (`scan_layers=False`), on `decode_weights()` split before the
                call (what the sampler does: no slicing at all), and the prefill of one chunk;
                picks dynamic-slice fusion for the compile options if it is faster.
  sweep         the cache attention (kernel + split merge, all layers) over `DecodeTiles`
                settings; picks the fastest.
  best          `static` again with the picked tiles and compile options (skipped if unchanged).
  options       `static` once per named set of XLA compile options in `--option_sets` (JSON), each
                with `vs_static`: e.g. command buffers (CUDA graphs) for the decode loops.
  dynamic       `static` with low_confidence_dynamic (threshold 0.9) on the model with its LM head
                scaled by `--lm_head_scale`, so that confidences pass the threshold; ragged rows
                (each moves to its next block as soon as its own is decided).
  dynamic_fp8w  `dynamic` on float8 projection weights (`SamplerConfig.weights_dtype`: e4m3fn
                weights with per-column scales, float8 x float8 GEMMs on per-token quantised
                activations; the LM head stays bf16; approximate decoding), with `vs_dynamic` and
                `token_agreement`: the fraction of the bf16 `dynamic` run's decoded tokens it
                matches on its first `--agree_prompts` prompts (the sharpened model; `dynamic` runs
                first when it has not). `static_fp8w`: the same on `static` (model not sharpened),
                `dynamic_capped_fp8w`: on `dynamic_capped` (each `--commit_rows`), against
                `dynamic` (the cap is exact in either dtype).
  dynamic_lockstep  the same with lockstep blocks (every row waits for the batch's slowest block).
  dynamic_capped  `dynamic` with at most R rows committing per forward, once for each R of `--commit_rows`
                (`SamplerConfig.commit_rows`): the per-token work on rows*b + commit_rows*b packed
                tokens instead of 2b per row (`fwd_tokens`), and its rate over `dynamic`'s.
                Estimate, not measured (H200, sdar_4b, 128 rows, fill 1,536, b = 4; issue 39):
                R = 64 packs 6 tokens a row, not 8: matmuls 9.2 of 12.2 ms, -3 ms a forward of
                ~26.3 ms (+~0.5 ms of gathers/scatters); ~49 rows commit per forward, so R = 64
                defers few (CPU tiny model at 1.41 tokens per row-forward: +4 % forwards at
                R = 64, +20 % at R = 48): ~8,000-8,300 tok/s against 7,494, short of 9,000.
  dynamic_capped_fp8  `dynamic_capped` on a float8_e4m3fn K/V cache (approximate; `--decode_tiles`
                picks its widening, e.g. '{"fp8_widen": "f16"}').
  long          continuous engine, `--batch` slots, `--batch` requests of `--long_tokens` new
                tokens each (no stop): the no-stop rate, and the 1024 + 4096 memory.
  mixed         the same engine on `--mixed_requests` prompts whose budgets are uniform in
                [`--mixed_min`, `--mixed_max`] (rows stop at random lengths): useful tokens/s,
                beside `long`'s no-stop rate, and the host time.
  mixed_static  the first `--batch` requests of `mixed` as one static batch (`sampler.decode`,
                cache sized for `--mixed_max`): waits for its longest row.
  options_forward, options_exact, options_rates  the `--decode_options` variants of the decode
                forward (`DecodeTiles`: splits, fold_new, fp8_widen, halves) against the default:
                per-kernel forward account, tokens on a small model, full-size rates of
                `--rate_options`; experiments/decode_options.py. They start nothing past
                `--deadline_s`.
  mixed_longest_first  `mixed` with the queue ordered longest budget first (the budgets are the
                lengths here). Mixed rows carry `schedule_bound`: the slot occupancy the order allows
                (`diffusion.schedule.occupancy`), beside the measured `tok_per_row_fwd`.
Times are wall-clock of compiled calls (compile reported apart; prefill included). The roofline of
a forward is K/V + weight bytes at `--hbm_tbs` plus matmul FLOPs at `--peak_tflops` (a sum).
"""

import dataclasses
import functools
import glob
import gzip
import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from dice_jax import sharding
from dice_jax.diffusion import engine as engine_lib
from dice_jax.diffusion import memory, sampler, schedule
from dice_jax.diffusion.placement import Placement
from dice_jax.model import AttentionSpec, KVCache, Transformer, flash_decode, get_config
from dice_jax.model.transformer import DecodeWeights
from experiments import bench_common, decode_forward, decode_options, trace_summary
from experiments import decode_loop_profile as loop_profile

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "sdar_4b", "Model preset.")
flags.DEFINE_integer("batch", 128, "Rows of a static batch.")
flags.DEFINE_integer("prompt_len", 1024, "Prompt tokens per row.")
flags.DEFINE_integer("new_tokens", 1024, "New tokens of the static runs.")
flags.DEFINE_integer("long_tokens", 4096, "New tokens of the long run.")
flags.DEFINE_integer("steps", 4, "Denoising steps per block.")
flags.DEFINE_integer("prefill_chunk", 16, "Rows per prefill chunk.")
flags.DEFINE_float("threshold", 0.9, "low_confidence_dynamic threshold.")
flags.DEFINE_float("lm_head_scale", 40.0, "LM-head scale of the dynamic run.")
flags.DEFINE_list(
  "commit_rows", ["64"], "Rows committing per forward in dynamic_capped: one run for each."
)
flags.DEFINE_integer(
  "agree_prompts", 64, "Prompts whose tokens the *_fp8w runs compare with bf16 decoding's."
)
flags.DEFINE_integer("mixed_requests", 512, "Requests of the mixed workload.")
flags.DEFINE_integer("mixed_slots", 128, "Slots of the continuous engine.")
flags.DEFINE_integer("mixed_min", 64, "Shortest budget of the mixed workload.")
flags.DEFINE_integer("mixed_max", 4096, "Longest budget of the mixed workload.")
flags.DEFINE_integer("profile_tokens", 64, "New tokens of the profiled static call.")
flags.DEFINE_list(
  "profile_loops",
  ["static", "dynamic_capped", "dynamic_capped_fp8"],
  "Loops of profile_loop (experiments/decode_loop_profile.LOOPS; capped: the first --commit_rows).",
)
flags.DEFINE_integer("loop_tokens", 128, "New tokens of profile_loop's long call (its short: 2b).")
flags.DEFINE_float("peak_tflops", 790.0, "bf16 matmul TFLOP/s (measured H200).")
flags.DEFINE_float("hbm_tbs", 4.3, "HBM TB/s (measured H200 copy bandwidth).")
flags.DEFINE_string("out", "", "Directory for results.jsonl / results.md.")
flags.DEFINE_list(
  "runs",
  [
    "static",
    "breakdown",
    "sweep",
    "best",
    "dynamic",
    "long",
    "mixed",
    "mixed_static",
    "mixed_longest_first",
  ],
  "Measurements, in order.",
)
flags.DEFINE_string("attention_impl", "flash", "Model attention implementation.")
flags.DEFINE_string(
  "decode_tiles",
  "",
  "DecodeTiles of every run, as JSON or a JSON file's path (e.g. the best_tiles.json of "
  "experiments.decode_profile); empty: the default.",
)
flags.DEFINE_string(
  "option_sets",
  json.dumps(
    {
      "cmdbuf_off": {"xla_gpu_enable_command_buffer": ""},
      "cmdbuf_while": {
        "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
      },
    }
  ),
  "JSON {name: {XLA option: value}}: the compile options the `options` run tries.",
)

flags.DEFINE_list(
  "decode_options",
  [
    "base",
    "splits=3",
    "fold_new=1",
    "halves=1",
    "splits=3+fold_new=1+halves=1",
    "cache=fp8",
    "cache=fp8+fp8_widen=asm",
  ],
  "Variants of the options_* runs (experiments/decode_forward.py); the first of each cache type "
  "is the others' reference.",
)
flags.DEFINE_list(
  "rate_options", ["base", "best"], "Variants options_rates measures (`best`: decode_options.py)."
)
flags.DEFINE_list(
  "rate_strategies",
  ["dynamic", "static"],
  "Strategies of options_rates, in order: static, dynamic, dynamic_capped (the first --commit_rows).",
)
flags.DEFINE_integer("exact_layers", 2, "Layers of options_exact's model (the preset's shapes).")
flags.DEFINE_integer("exact_rows", 16, "Prompts of options_exact.")
flags.DEFINE_integer("exact_tokens", 64, "Prompt and new tokens of each options_exact row.")
flags.DEFINE_integer(
  "forward_tokens",
  0,
  "options_forward: tokens a row (0: the block size; 2b: a capped loop's width)",
)
flags.DEFINE_float("deadline_s", 1e9, "The options_* runs start nothing after this many seconds.")
flags.DEFINE_integer("compile_threads", 8, "Programs the options_* runs compile at once.")

DSF = {"xla_gpu_enable_dynamic_slice_fusion": True}
_T0 = time.perf_counter()


class Bench:
  """The model, the picked settings and the results table."""

  def __init__(self):
    mesh = sharding.make_mesh()
    mcfg = get_config(
      FLAGS.config, dtype="bfloat16", param_dtype="bfloat16", attention_impl=FLAGS.attention_impl
    )
    t0 = time.perf_counter()
    self.model = sharding.create_sharded(lambda: Transformer(mcfg, rngs=nnx.Rngs(0)), mesh)
    jax.block_until_ready(nnx.state(self.model))
    self.build_s = time.perf_counter() - t0
    self.tiles = bench_common.decode_tiles(FLAGS.decode_tiles)
    self.options = {}
    self.rows = []
    self.rates = {}
    self.decoded = {}  # run name -> (tokens, step map) on the host, for the *_fp8w agreement

  # --- bookkeeping --------------------------------------------------------------------------

  def record(self, row: dict) -> None:
    row = dict(row, device=jax.devices()[0].device_kind, jax=jax.__version__)
    peak = memory.peak_bytes()
    if peak is not None:
      row["device_peak_gib"] = round(peak / memory.GIB, 2)
    self.rows.append(row)
    print(json.dumps(row), flush=True)
    if FLAGS.out:
      os.makedirs(FLAGS.out, exist_ok=True)
      with open(os.path.join(FLAGS.out, "results.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
      with open(os.path.join(FLAGS.out, "results.md"), "w") as f:
        f.write(markdown(self.rows))

  def prompts(self, rows, length=None):
    hi = min(151000, self.model.cfg.mask_token_id)
    rs = np.random.RandomState(0)  # the same prompts in every run: runs compare like with like
    return rs.randint(2, hi, (rows, length or FLAGS.prompt_len)).tolist()

  def scfg(self, new, strategy="low_confidence_static", tiles=None, **kw):
    return sampler.SamplerConfig(
      steps=FLAGS.steps,
      strategy=strategy,
      threshold=FLAGS.threshold,
      max_new_tokens=new,
      prefill_chunk=FLAGS.prefill_chunk,
      decode_tiles=tiles or self.tiles,
      **kw,
    ).for_model(self.model.cfg)  # the model's block size

  # --- static batch -------------------------------------------------------------------------

  def prepare(
    self,
    name,
    new,
    strategy="low_confidence_static",
    budgets=None,
    prompts=None,
    ragged=None,
    kv_cache_dtype=None,
    tiles=None,
    weights=None,
    commit_rows=0,
    weights_dtype=None,
    temperature=0.0,
    return_logprobs=False,
  ) -> dict:
    """One static-sampler call, lowered (not compiled): {name, scfg, args, est, lowered,
    lower_s}. `weights`: the split weights to decode on (default: split now)."""
    model = self.model
    mcfg = model.cfg
    scfg = self.scfg(
      new,
      strategy,
      tiles=tiles,
      ragged=ragged,
      kv_cache_dtype=kv_cache_dtype,
      commit_rows=commit_rows,
      weights_dtype=weights_dtype,
      temperature=temperature,
      return_logprobs=return_logprobs,
    )
    prompts = prompts or self.prompts(FLAGS.batch)
    layout = sampler.layout_prompts(prompts, scfg, mcfg.mask_token_id, budgets)
    est = sampler.memory_estimate(model, layout, scfg)
    memory.check_fits(est, what=name)
    layout = jax.tree.map(jnp.asarray, layout)
    graphdef, state = nnx.split(model)
    if weights is None and scfg.splits_weights(mcfg):
      weights = sampler.split_weights(graphdef, state, weights_dtype=scfg.weights_dtype)
    keys = sampler.row_keys(jax.random.key(0), len(prompts))
    lay = Placement.of(state)
    options = tuple(sorted((self.options or {}).items()))
    fn = sampler.compiled_decode(graphdef, scfg, lay, options)
    t0 = time.perf_counter()
    with lay.context():
      lowered = fn.lower(state, weights, layout, keys)
    args = (state, weights, layout, keys)
    return dict(
      name=name, scfg=scfg, args=args, est=est, lowered=lowered, lower_s=time.perf_counter() - t0
    )

  def measure(self, p: dict, compiled, compile_s: float) -> tuple[dict, tuple]:
    """Runs a `prepare`d call once on its `compiled` program: (its row, not yet recorded; (the
    tokens, the step map) on the host)."""
    mcfg, scfg = self.model.cfg, p["scfg"]
    ma = compiled.memory_analysis()
    t0 = time.perf_counter()
    out = compiled(*p["args"])
    jax.block_until_ready(out.tokens)
    run_s = time.perf_counter() - t0
    generated = int(np.asarray(out.response_lengths).sum())
    forwards = int(out.forwards)
    decoded = (np.asarray(out.tokens), np.asarray(out.step_map))
    rows, new = decoded[0].shape[0], scfg.max_new_tokens
    roof = roofline_fwd_s(mcfg, rows, FLAGS.prompt_len + new / 2, FLAGS.steps)
    row = dict(
      run=p["name"],
      rows=rows,
      prompt=FLAGS.prompt_len,
      new=new,
      strategy=scfg.strategy,
      tiles=dataclasses.asdict(scfg.decode_tiles),
      options=self.options,
      ragged=scfg.ragged,
      kv_cache_dtype=str(scfg.cache_dtype(mcfg)),
      weights_dtype=scfg.weights_dtype or str(jnp.dtype(mcfg.compute_dtype)),
      compile_s=round(compile_s, 1),
      run_s=round(run_s, 2),
      tok_s=round(generated / run_s),
      fwd_s=round(forwards / run_s, 1),
      forwards=forwards,
      tok_per_row_fwd=round(generated / forwards / rows, 3),
      commit_rows=scfg.commit_rows,
      fwd_tokens=fwd_tokens(scfg, rows),
      roofline_fwd_ms=round(1e3 * roof, 2),
      mfu=round(
        sample_flops(mcfg, rows, FLAGS.prompt_len, new, forwards)
        / run_s
        / 1e12
        / FLAGS.peak_tflops,
        3,
      ),
      est_gib=round(p["est"]["total"] / memory.GIB, 1),
      kv_cache_gib=round(p["est"]["kv_cache"] / memory.GIB, 1),
      compiled_temp_gib=round(ma.temp_size_in_bytes / memory.GIB, 2),
      compiled_args_gib=round(ma.argument_size_in_bytes / memory.GIB, 2),
      generated=generated,
    )
    return row, decoded

  def static(self, name, new, strategy="low_confidence_static", record=True, **kw):
    """`prepare` (same keywords), compile and `measure` one call; recorded (unless not `record`),
    with `vs_static`; its tokens and step map kept in `decoded`."""
    p = self.prepare(name, new, strategy, **kw)
    t0 = time.perf_counter()
    compiled = p["lowered"].compile()
    row, self.decoded[name] = self.measure(p, compiled, p["lower_s"] + time.perf_counter() - t0)
    del p, compiled
    if name != "static" and "static" in self.rates:
      row["vs_static"] = round(row["tok_s"] / self.rates["static"], 3)
    self.rates[name] = row["tok_s"]
    if record:
      self.record(row)
    return row

  # --- breakdown and tile sweep ---------------------------------------------------------------

  def filled_cache(self, rows, fill, cap):
    mcfg, b = self.model.cfg, 4
    shape = (mcfg.num_layers, rows, cap, mcfg.num_kv_heads * mcfg.head_dim)
    slot = jnp.broadcast_to(jnp.arange(cap, dtype=jnp.int32) - b, (rows, cap))
    return KVCache(
      k=jnp.full(shape, 0.01, mcfg.compute_dtype),
      v=jnp.full(shape, 0.02, mcfg.compute_dtype),
      positions=slot,
      segment_ids=(slot >= 0).astype(jnp.int32),
      block_ids=slot // b,
      length=jnp.full((rows,), fill + b, jnp.int32),
      head_dim=mcfg.head_dim,
      tiles=self.tiles,
    )

  def forward_inputs(self):
    """One decode forward's inputs: b new tokens per row over a cache filled to prompt + new/2
    (rows, fill, cap, cache, tokens, positions, attention spec)."""
    rows, b = FLAGS.batch, 4
    fill = FLAGS.prompt_len + FLAGS.new_tokens // 2
    cap = -(-(FLAGS.prompt_len + FLAGS.new_tokens + 3 * b) // 256) * 256
    cache = self.filled_cache(rows, fill, cap)
    tok = jnp.full((rows, b), 5, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(fill, fill + b, dtype=jnp.int32), (rows, b))
    spec = AttentionSpec.block_causal(b, jnp.ones_like(pos), pos // b)
    return rows, fill, cap, cache, tok, pos, spec

  def breakdown(self):
    model, mcfg, b = self.model, self.model.cfg, 4
    graphdef, state = nnx.split(model)
    rows, fill, cap, cache, tok, pos, spec = self.forward_inputs()

    def fwd(state, cache):
      m = nnx.merge(graphdef, state)
      h, _ = m(tok, pos, spec, cache=cache, update_cache=False, return_hidden=True)
      return m.logits_from_hidden(h)

    unrolled_def = nnx.graphdef(
      nnx.eval_shape(lambda: Transformer(mcfg.replace(scan_layers=False), rngs=nnx.Rngs(0)))
    )

    def fwd_unrolled(state, cache):
      m = nnx.merge(unrolled_def, state)
      h, _ = m(tok, pos, spec, cache=cache, update_cache=False, return_hidden=True)
      return m.logits_from_hidden(h)

    # The sampler's way (SamplerConfig.presplit_weights): weights split per layer before the call.
    weights = sampler.split_weights(graphdef, state)

    def fwd_presplit(state, weights, cache):
      m = sampler.decoding_model(graphdef, state, weights)
      h, _ = m(tok, pos, spec, cache=cache, update_cache=False, return_hidden=True)
      return m.logits_from_hidden(h)

    # The same split weights with q/k/v and gate/up kept apart (before session 9): XLA's dot merger
    # then concatenates them on every forward.
    @jax.jit
    def split_unfused(state):
      m, dt = nnx.merge(graphdef, state), mcfg.compute_dtype
      stacked = m.layers.weights()
      layers = tuple(
        {n: a[i].astype(dt) for n, a in stacked.items()} for i in range(mcfg.num_layers)
      )
      return DecodeWeights(layers=layers, head=m.decode_weights().head)

    res = dict(run="breakdown", rows=rows, fill=fill, cap=cap)
    variants = (
      ("fwd_ms", fwd, None, (state, cache)),
      ("fwd_dsf_ms", fwd, DSF, (state, cache)),
      ("fwd_unrolled_ms", fwd_unrolled, None, (state, cache)),
      ("fwd_presplit_unfused_ms", fwd_presplit, None, (state, split_unfused(state), cache)),
      ("fwd_presplit_ms", fwd_presplit, None, (state, weights, cache)),
    )
    for label, fn, opts, args in variants:
      try:
        f = jax.jit(fn, compiler_options=opts)
        res[label] = round(1e3 * time_fn(f, *args), 2)
      except Exception as e:  # report and go on
        res[label] = f"failed: {type(e).__name__}: {str(e)[:200]}"
    del weights
    res["kv_read_gb"] = round(kv_bytes(mcfg, rows, fill) / 1e9, 1)
    del cache
    # Prefill of one chunk: the cache-free (flash) forward that returns every layer's K/V.
    chunk = FLAGS.prefill_chunk
    ptok = jnp.asarray(self.prompts(chunk), jnp.int32)
    ppos = jnp.broadcast_to(jnp.arange(FLAGS.prompt_len, dtype=jnp.int32), ptok.shape)
    pspec = AttentionSpec.block_causal(b, jnp.ones_like(ppos), (ppos - FLAGS.prompt_len) // b)
    prefill = jax.jit(lambda st: nnx.merge(graphdef, st).prefill_kv(ptok, ppos, pspec))
    res["prefill_chunk_ms"] = round(1e3 * time_fn(prefill, state, iters=3), 1)
    res["prefill_batch_s_est"] = round(res["prefill_chunk_ms"] * rows / chunk / 1e3, 2)
    res["roofline_fwd_ms"] = round(1e3 * roofline_fwd_s(mcfg, rows, fill, FLAGS.steps), 2)
    a, d = res.get("fwd_ms"), res.get("fwd_dsf_ms")
    if isinstance(a, float) and isinstance(d, float) and d < 0.97 * a:
      self.options = dict(DSF)
    res["picked_options"] = self.options
    self.record(res)

  def profile(self):
    """Device time of one decode forward (b tokens, the picked settings) and of a short static
    call (`--profile_tokens`), by kernel, from a profiler trace (experiments/trace_summary.py)."""
    model = self.model
    mcfg = model.cfg
    graphdef, state = nnx.split(model)
    rows, fill, _, cache, tok, pos, spec = self.forward_inputs()

    weights = sampler.split_weights(graphdef, state)  # what the sampler decodes on

    @functools.partial(jax.jit, compiler_options=self.options or None)
    def fwd(state, weights, cache):
      m = sampler.decoding_model(graphdef, state, weights)
      h, _ = m(tok, pos, spec, cache=cache, update_cache=False, return_hidden=True)
      return m.logits_from_hidden(h)

    out_dir = FLAGS.out or "/tmp/bench_sampler"
    calls = 3
    jax.block_until_ready(fwd(state, weights, cache))
    with jax.profiler.trace(os.path.join(out_dir, "trace_fwd"), create_perfetto_trace=True):
      for _ in range(calls):
        jax.block_until_ready(fwd(state, weights, cache))
    fwd_sum = trace_summary.summarize(os.path.join(out_dir, "trace_fwd"), calls)
    del cache
    self.record(
      dict(
        run="profile_fwd",
        rows=rows,
        fill=fill,
        options=self.options,
        device_ms=fwd_sum["device_ms_per_call"],
        by_kind=fwd_sum["by_kind"],
      )
    )
    # A short static call: the sampler's own work (denoising, cache writes, loops) beside forwards.
    scfg = self.scfg(FLAGS.profile_tokens)
    layout = sampler.layout_prompts(self.prompts(rows), scfg, mcfg.mask_token_id)
    layout = jax.tree.map(jnp.asarray, layout)
    keys = sampler.row_keys(jax.random.key(0), rows)
    dec = jax.jit(
      sampler._decode,
      static_argnames=("graphdef", "cfg"),
      compiler_options=self.options or None,
    )
    run = lambda: dec(graphdef, state, weights, layout, jnp.array(layout.tokens), keys, cfg=scfg)
    jax.block_until_ready(run().tokens)
    with jax.profiler.trace(os.path.join(out_dir, "trace_static"), create_perfetto_trace=True):
      out = run()
      jax.block_until_ready(out.tokens)
    st_sum = trace_summary.summarize(os.path.join(out_dir, "trace_static"), 1)
    forwards = int(out.forwards)
    self.record(
      dict(
        run="profile_static",
        rows=rows,
        new=FLAGS.profile_tokens,
        forwards=forwards,
        device_ms=st_sum["device_ms_per_call"],
        by_kind={k: round(v / forwards, 3) for k, v in st_sum["by_kind"].items()},
        note="by_kind: ms per decode forward, prefill included",
      )
    )
    with open(os.path.join(out_dir, "profile.md"), "w") as f:
      f.write("## One decode forward\n\n" + trace_summary.markdown(fwd_sum))
      f.write("\n## Static call (whole, prefill included)\n\n" + trace_summary.markdown(st_sum))
    for p in glob.glob(os.path.join(out_dir, "trace_static", "**", "*.pb"), recursive=True):
      os.remove(p)  # keep the results small: the summary and the perfetto JSON stay

  def profile_loop(self):
    """Device time of one iteration of each `--profile_loops` decode loop, by kind and kernel: one
    program run with every row's budget 2b and then `--loop_tokens`, the difference per batch
    forward (experiments/decode_loop_profile.py); rows `profile_loop`, DIR/profile_loop.md."""
    mcfg = self.model.cfg
    b, big = mcfg.block_size, FLAGS.loop_tokens
    if big < 4 * b:
      raise ValueError(f"--loop_tokens must be at least 4 blocks ({4 * b}), got {big}")
    plen = loop_profile.loop_prompt_len(FLAGS.prompt_len, FLAGS.new_tokens, big, b)
    prompts = self.prompts(FLAGS.batch, plen)
    out_dir = FLAGS.out or "/tmp/bench_sampler"
    rows = []
    for name in FLAGS.profile_loops:
      kw, sharp = loop_profile.loop_settings(name, int(FLAGS.commit_rows[0]))
      strategy = kw.pop("strategy")
      head = self.model.lm_head[...]
      if sharp:
        self.model.lm_head[...] = head * FLAGS.lm_head_scale
      try:
        p = self.prepare(f"profile_loop_{name}", big, strategy, prompts=prompts, **kw)
      finally:
        self.model.lm_head[...] = head
      compiled = p["lowered"].compile()
      if FLAGS.out:  # what each kernel of the account computes: `python -m experiments.hlo_costs`
        with gzip.open(os.path.join(out_dir, f"loop_{name}_hlo.txt.gz"), "wt") as f:
          f.write(compiled.as_text())
      state, weights, layout, keys = p["args"]
      # the same canvas, every row's budget 2b (a budget is data: one program runs both calls)
      short = dataclasses.replace(
        layout, max_new_tokens=jnp.full_like(layout.max_new_tokens, 2 * b)
      )
      runs = {}
      for label, lay in (("short", short), ("long", layout)):
        jax.block_until_ready(compiled(state, weights, lay, keys).tokens)  # warm
        t0 = time.perf_counter()
        out = compiled(state, weights, lay, keys)
        jax.block_until_ready(out.tokens)
        wall = time.perf_counter() - t0
        trace = os.path.join(out_dir, f"trace_loop_{name}_{label}")
        with jax.profiler.trace(trace, create_perfetto_trace=True):
          jax.block_until_ready(compiled(state, weights, lay, keys).tokens)
        runs[label] = (int(out.forwards), wall, trace_summary.summarize(trace, 1, top=10**9))
        shutil.rmtree(trace, ignore_errors=True)  # keep the results small: the summary stays
      del compiled, p
      forwards = runs["long"][0] - runs["short"][0]
      it = loop_profile.per_forward(runs["long"][2], runs["short"][2], forwards)
      row = dict(
        run="profile_loop",
        loop=name,
        rows=len(prompts),
        prompt=plen,
        new=big,
        fill=f"{plen + 2 * b}-{plen + big}",
        forwards=forwards,
        wall_ms=round(1e3 * (runs["long"][1] - runs["short"][1]) / forwards, 2),
        # the short call alone: prefill and its 2b tokens' forwards (what the difference cancels)
        short_wall_ms=round(1e3 * runs["short"][1], 1),
        short_forwards=runs["short"][0],
        tiles=dataclasses.asdict(self.tiles),
        device_ms=it["device_ms"],
        by_kind=it["by_kind"],
        top=it["kernels"][:8],
        **{k: v for k, v in kw.items() if v},
      )
      self.record(row)
      rows.append(dict(row, kernels=it["kernels"]))
      with open(os.path.join(out_dir, "profile_loop.md"), "w") as f:
        f.write(loop_profile.markdown(rows))

  def kernel_time(self, cache, tiles):
    """Seconds of the cache attention (kernel + split merge) over all layers, 4 new tokens."""
    mcfg = self.model.cfg
    rows, kh, b = cache.k.shape[1], mcfg.num_kv_heads, 4
    g = mcfg.num_heads // kh
    q = jnp.ones((rows, kh, b * g, mcfg.head_dim), jnp.bfloat16)
    qseg = jnp.ones((rows, b * g), jnp.int32)
    qrank = jnp.full((rows, b * g), 10**6, jnp.int32)

    @jax.jit
    def all_layers(q, k, v, seg, rank, fill):
      def one(l, acc):
        o, _ = flash_decode.cache_part(q, k, v, l, qseg, qrank, seg, rank, fill, tiles=tiles)
        return acc + o[:, :, :1, :1].astype(jnp.float32)

      return jax.lax.fori_loop(0, mcfg.num_layers, one, jnp.zeros((rows, kh, 1, 1), jnp.float32))

    filled = jnp.arange(cache.max_len)[None, :] < cache.length[:, None]
    seg = jnp.where(filled, cache.segment_ids, 0)
    return time_fn(all_layers, q, cache.k, cache.v, seg, cache.block_ids, cache.length)

  def sweep(self):
    mcfg = self.model.cfg
    rows, fill, _, cache, *_ = self.forward_inputs()
    gb = kv_bytes(mcfg, rows, fill) / 1e9
    d = self.tiles  # the default, or its masked-loop fallback when the dynamic loop failed
    settings = [
      d,
      dataclasses.replace(d, split=512, block_k=128),
      dataclasses.replace(d, split=512),
      dataclasses.replace(d, split=2048),
      dataclasses.replace(d, block_k=32),
      dataclasses.replace(d, num_warps=8),
      dataclasses.replace(d, num_stages=3),
      dataclasses.replace(d, dynamic_loop=not d.dynamic_loop),
      dataclasses.replace(d, split=768),
      dataclasses.replace(d, split=256),
      dataclasses.replace(d, split=512, block_k=32),
      dataclasses.replace(d, num_warps=2),
      dataclasses.replace(d, num_stages=4),
      dataclasses.replace(d, split=768, num_stages=3),
    ]
    best = None
    for tiles in settings:
      res = dict(
        run="sweep", tiles=dataclasses.asdict(tiles), fill=fill, rows=rows, kv_gb=round(gb, 1)
      )
      try:
        t = self.kernel_time(cache, tiles)
        res.update(ms=round(1e3 * t, 2), tb_s=round(gb / 1e3 / t, 2))
        if best is None or t < best[0]:
          best = (t, tiles)
      except Exception as e:  # a setting that does not compile or run
        res["failed"] = f"{type(e).__name__}: {str(e)[:200]}"
      self.record(res)
    del cache
    first = next(
      (r for r in self.rows if r.get("run") == "sweep" and r["tiles"] == dataclasses.asdict(d)), {}
    )
    if best is not None and (
      not isinstance(first.get("ms"), float) or best[0] < 0.97e-3 * first["ms"]
    ):
      self.tiles = best[1]  # switch only for a clear (> 3%) gain over the default

  # --- continuous batching ------------------------------------------------------------------

  def mixed_requests(self):
    rs = np.random.RandomState(1)
    lengths = rs.randint(FLAGS.mixed_min, FLAGS.mixed_max + 1, FLAGS.mixed_requests)
    hi = min(151000, self.model.cfg.mask_token_id)
    prompts = rs.randint(2, hi, (FLAGS.mixed_requests, FLAGS.prompt_len))
    return [
      engine_lib.Request(i, prompts[i].tolist(), jax.random.key(i), int(lengths[i]))
      for i in range(FLAGS.mixed_requests)
    ]

  def engine(self):
    """One engine (compiled once) for `long` and `mixed`: slots = `--batch`, budgets up to
    max(`--long_tokens`, `--mixed_max`)."""
    if getattr(self, "_engine", None) is None:
      scfg = self.scfg(max(FLAGS.long_tokens, FLAGS.mixed_max))
      eng = engine_lib.ContinuousSampler(
        self.model,
        scfg,
        slots=FLAGS.mixed_slots,
        max_prompt_len=FLAGS.prompt_len,
        prefill_rows=FLAGS.prefill_chunk,
        compiler_options=self.options or None,
      )
      t0 = time.perf_counter()
      warm = [
        engine_lib.Request(f"w{i}", [7] * FLAGS.prompt_len, None, 4)
        for i in range(FLAGS.prefill_chunk + 1)
      ]
      for _ in eng.run(warm):
        pass
      self._engine, self._engine_warm_s = eng, time.perf_counter() - t0
    return self._engine

  def engine_run(self, name, reqs):
    eng = self.engine()
    t0 = time.perf_counter()
    useful = decoded = 0
    finish = []
    for c in eng.run(reqs):
      useful += c.response_length
      decoded += len(c.response_ids)
      finish.append(time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    st = eng.stats
    rows = FLAGS.mixed_slots
    fill = FLAGS.prompt_len + float(np.mean([r.max_new_tokens for r in reqs])) / 2
    row = dict(
      run=name,
      requests=len(reqs),
      slots=rows,
      prompt=FLAGS.prompt_len,
      budgets=f"{min(r.max_new_tokens for r in reqs)}..{max(r.max_new_tokens for r in reqs)}",
      tiles=dataclasses.asdict(self.tiles),
      options=self.options,
      warmup_compile_s=round(self._engine_warm_s, 1),
      wall_s=round(wall, 2),
      useful_tokens=useful,
      decoded_tokens=decoded,
      tok_s=round(useful / wall),
      blocks=st["blocks"],
      forwards=st["forwards"],
      fwd_s=round(st["forwards"] / wall, 1),
      tok_per_row_fwd=round(decoded / st["forwards"] / rows, 3),
      prefill_calls=st["prefill_calls"],
      host_s=round(st["host_s"], 2),
      host_frac=round(st["host_s"] / wall, 4),
      wait_s=round(st["wait_s"], 2),
      first_done_s=round(finish[0], 2),
      roofline_fwd_ms_nominal=round(
        1e3 * roofline_fwd_s(self.model.cfg, rows, fill, FLAGS.steps), 2
      ),
      est_gib=round(eng.estimate["total"] / memory.GIB, 1),
      kv_cache_gib=round(eng.estimate["kv_cache"] / memory.GIB, 1),
    )
    self.rates[name] = row["tok_s"]
    return row

  def long(self):
    hi = min(151000, self.model.cfg.mask_token_id)
    prompts = np.random.RandomState(0).randint(2, hi, (FLAGS.batch, FLAGS.prompt_len))
    reqs = [
      engine_lib.Request(i, prompts[i].tolist(), jax.random.key(i), FLAGS.long_tokens)
      for i in range(FLAGS.batch)
    ]
    self.record(self.engine_run("long", reqs))

  def mixed(self, name="mixed", order=None):
    reqs = self.mixed_requests()
    if order is not None:
      reqs = order(reqs)
    row = self.engine_run(name, reqs)
    b = self.scfg(FLAGS.mixed_max).block_size
    row["schedule_bound"] = round(
      schedule.occupancy([-(-r.max_new_tokens // b) for r in reqs], FLAGS.mixed_slots), 3
    )
    if "long" in self.rates:
      row["vs_no_stop_long"] = round(row["tok_s"] / self.rates["long"], 3)
    self.record(row)

  def mixed_longest_first(self):
    self.mixed("mixed_longest_first", schedule.longest_first)

  def mixed_static(self):
    reqs = self.mixed_requests()[: FLAGS.batch]
    row = self.static(
      "mixed_static",
      FLAGS.mixed_max,
      budgets=[r.max_new_tokens for r in reqs],
      prompts=[list(r.prompt_ids) for r in reqs],
    )
    if "mixed" in self.rates:
      self.record(
        dict(
          run="mixed_vs_static",
          continuous_useful_tok_s=self.rates["mixed"],
          static_useful_tok_s=row["tok_s"],
          continuous_over_static=round(self.rates["mixed"] / row["tok_s"], 2),
        )
      )

  def dynamic(self, ragged=True, commit_rows=0, weights_dtype=None, suffix="", **kw):
    ref = (
      f"dynamic_capped{commit_rows}" if commit_rows else "dynamic" if ragged else "dynamic_lockstep"
    ) + suffix
    if weights_dtype and ref not in self.decoded:  # the bf16 reference of the agreement
      self.dynamic(ragged, commit_rows, suffix=suffix, **kw)
    head = self.model.lm_head[...]
    self.model.lm_head[...] = head * FLAGS.lm_head_scale
    try:
      name = ref + ("_fp8w" if weights_dtype else "")
      row = self.static(
        name,
        FLAGS.new_tokens,
        strategy="low_confidence_dynamic",
        ragged=ragged,
        commit_rows=commit_rows,
        weights_dtype=weights_dtype,
        record=not weights_dtype,
        **kw,
      )
    finally:
      self.model.lm_head[...] = head
    if weights_dtype:
      self.record(self.agreement(row, ref, sharpened=True))
    elif commit_rows and "dynamic" in self.rates:
      # The same decoding (exact in float32) on other GEMM shapes: in bf16 its tokens differ from
      # `dynamic`'s only by rounding, the control an approximate mode's agreement is read against.
      n = min(FLAGS.agree_prompts, FLAGS.batch)
      got, want = (tuple(a[:n] for a in self.decoded[k]) for k in (name, "dynamic"))
      self.record(
        dict(
          run=f"{name}_vs_dynamic",
          commit_rows=commit_rows,
          ratio=round(row["tok_s"] / self.rates["dynamic"], 3),
          agree_prompts=n,
          **decode_options.token_agreement(got, want),
        )
      )

  def dynamic_lockstep(self):
    self.dynamic(ragged=False)

  def dynamic_fp8w(self):
    self.dynamic(weights_dtype="float8_e4m3fn")

  def dynamic_capped_fp8w(self):
    for r in FLAGS.commit_rows:
      self.dynamic(commit_rows=int(r), weights_dtype="float8_e4m3fn")

  def static_fp8w(self):
    if "static" not in self.decoded:
      self.static("static", FLAGS.new_tokens)
    row = self.static("static_fp8w", FLAGS.new_tokens, weights_dtype="float8_e4m3fn", record=False)
    self.record(self.agreement(row, "static", sharpened=False))

  def agreement(self, row: dict, ref: str, sharpened: bool) -> dict:
    """`row` of a float8-weights run with its rate over `ref`'s (`vs_<ref>`) and its tokens against
    `ref`'s (bf16 weights, the same prompts and keys) on the first `--agree_prompts` rows
    (`decode_options.token_agreement`), and the fraction of those rows identical throughout."""
    n = min(FLAGS.agree_prompts, FLAGS.batch)
    got, want = (tuple(a[:n] for a in self.decoded[k]) for k in (row["run"], ref))
    same = [np.array_equal(got[0][i], want[0][i]) for i in range(n)]
    return dict(
      row,
      **{f"vs_{ref}": round(row["tok_s"] / self.rates[ref], 3)},
      approximate=True,
      agree_vs=ref,
      agree_prompts=n,
      sharpened=sharpened,
      lm_head_scale=FLAGS.lm_head_scale if sharpened else 1.0,
      **decode_options.token_agreement(got, want),
      rows_identical=round(float(np.mean(same)), 4),
    )

  def dynamic_capped(self):
    for r in FLAGS.commit_rows:
      self.dynamic(commit_rows=int(r))

  def dynamic_capped_fp8(self):
    """`dynamic_capped` on a float8_e4m3fn K/V cache (approximate, as `static_fp8`)."""
    for r in FLAGS.commit_rows:
      self.dynamic(commit_rows=int(r), suffix="_fp8", kv_cache_dtype="float8_e4m3fn")


def fwd_tokens(scfg, rows: int):
  """Tokens a ragged forward runs its per-token work on: 2b a row, or rows*b + R*b packed with
  `commit_rows` R (`slots.py`); None for lockstep blocks (2b then b a row)."""
  if not scfg.ragged:
    return None
  b = scfg.block_size
  return rows * b + min(scfg.commit_rows, rows) * b if scfg.commit_rows else rows * 2 * b


def kv_bytes(mcfg, rows, fill):
  return 2 * mcfg.num_layers * rows * fill * mcfg.num_kv_heads * mcfg.head_dim * 2


def matmul_params(cfg):
  return cfg.num_params() - 2 * cfg.vocab_size * cfg.hidden_size  # embedding gather, LM head


def roofline_fwd_s(cfg, rows, fill, steps, block=4):
  """One decode forward at mean fill: K/V + weights at HBM bandwidth, plus matmul FLOPs (mean
  tokens per forward: one fused forward of 2b tokens per `steps`)."""
  tokens = rows * block * (steps + 1) / steps
  weights = 2 * (matmul_params(cfg) + cfg.vocab_size * cfg.hidden_size)
  flops = 2 * matmul_params(cfg) * tokens + 2 * cfg.hidden_size * cfg.vocab_size * rows * block
  return (kv_bytes(cfg, rows, fill) + weights) / (FLAGS.hbm_tbs * 1e12) + flops / (
    FLAGS.peak_tflops * 1e12
  )


def sample_flops(cfg, rows, prompt, new, forwards, block=4):
  """Model FLOPs of one sampler call: prefill + decode forwards (fused 2b and plain b)."""
  n_blocks = -(-new // block)
  p = matmul_params(cfg)
  head = 2 * cfg.hidden_size * cfg.vocab_size
  attn = lambda q, k: 4 * q * k * cfg.num_heads * cfg.head_dim * cfg.num_layers
  flops = rows * (2 * p * prompt + attn(prompt, prompt / 2))
  tok = rows * (n_blocks * 2 * block + max(forwards - n_blocks, 0) * block)
  return flops + 2 * p * tok + head * rows * block * forwards + attn(tok, prompt + new / 2)


def time_fn(fn, *args, iters=5):
  return decode_forward.time_fn(fn, *args, iters=iters)[0]


def markdown(rows) -> str:
  keys = []
  for r in rows:
    keys += [k for k in r if k not in keys and k not in ("device", "jax")]
  head = "| " + " | ".join(keys) + " |\n| " + " | ".join("---" for _ in keys) + " |\n"
  fmt = lambda v: json.dumps(v) if isinstance(v, (dict, list)) else ("" if v is None else str(v))
  body = "".join("| " + " | ".join(fmt(r.get(k)) for k in keys) + " |\n" for r in rows)
  dev = f"{rows[0].get('device')}, jax {rows[0].get('jax')}\n\n" if rows else ""
  return dev + head + body


def option_settings() -> decode_options.Settings:
  """The options_* runs' settings from the flags; a UsageError naming a bad one."""
  try:
    variants = decode_forward.parse_variants(FLAGS.decode_options)
  except ValueError as e:
    raise app.UsageError(f"--decode_options: {e}") from e
  names = {v.name for v in variants} | {"best"}
  if set(FLAGS.rate_options) - names:
    raise app.UsageError(f"--rate_options: not in --decode_options: {FLAGS.rate_options}")
  if set(FLAGS.rate_strategies) - set(decode_options.RATE_STRATEGIES):
    raise app.UsageError(
      f"--rate_strategies: {', '.join(decode_options.RATE_STRATEGIES)}; got {FLAGS.rate_strategies}"
    )
  if min(FLAGS.exact_layers, FLAGS.exact_rows, FLAGS.exact_tokens, FLAGS.compile_threads) < 1:
    raise app.UsageError("--exact_layers, --exact_rows, --exact_tokens, --compile_threads: >= 1")
  return decode_options.Settings(
    config=FLAGS.config,
    variants=tuple(variants),
    rate_options=tuple(FLAGS.rate_options),
    rate_strategies=tuple(FLAGS.rate_strategies),
    exact_layers=FLAGS.exact_layers,
    exact_rows=FLAGS.exact_rows,
    exact_tokens=FLAGS.exact_tokens,
    lm_head_scale=FLAGS.lm_head_scale,
    deadline_s=FLAGS.deadline_s,
    t0=_T0,
    compile_threads=FLAGS.compile_threads,
    out=FLAGS.out,
    commit_rows=int(FLAGS.commit_rows[0]),
    forward_tokens=FLAGS.forward_tokens,
  )


def main(argv):
  del argv
  settings = option_settings()
  if FLAGS.out:
    os.makedirs(FLAGS.out, exist_ok=True)
  bench = Bench()
  opts = decode_options.OptionRuns(bench, settings)
  print(
    f"device: {jax.devices()[0].device_kind} x{jax.device_count()}, jax {jax.__version__}; "
    f"{FLAGS.config} bf16 random weights built in {bench.build_s:.1f} s; runs {FLAGS.runs}",
    flush=True,
  )
  for run in FLAGS.runs:
    t0 = time.perf_counter()
    try:
      if run == "static":
        try:
          bench.static("static", FLAGS.new_tokens)
        except Exception as e:  # e.g. the kernel's dynamic loop does not lower: masked loop
          bench.record(dict(run="static", failed=f"{type(e).__name__}: {str(e)[:800]}"))
          bench.tiles = dataclasses.replace(bench.tiles, dynamic_loop=False)
          bench.static("static_masked_loop", FLAGS.new_tokens)
      elif run == "static_fp8":  # the static run on a float8 K/V cache (half the cache reads)
        bench.static("static_fp8", FLAGS.new_tokens, kv_cache_dtype="float8_e4m3fn")
      elif run == "options":  # static under each named set of compile options
        picked = bench.options
        for label, opts in json.loads(FLAGS.option_sets).items():
          bench.options = dict(picked, **opts)
          try:
            bench.static(f"static[{label}]", FLAGS.new_tokens)
          except Exception as e:  # report and go on
            bench.record(dict(run=f"static[{label}]", failed=f"{type(e).__name__}: {str(e)[:800]}"))
        bench.options = picked
      elif run == "best":
        if bench.tiles != flash_decode.DecodeTiles() or bench.options:
          bench.static("best", FLAGS.new_tokens)
      elif run == "options_forward":
        opts.forward(FLAGS.batch, FLAGS.prompt_len, FLAGS.new_tokens)
      elif run == "options_exact":
        opts.exact(FLAGS.steps, FLAGS.threshold)
      elif run == "options_rates":
        opts.rates(FLAGS.batch, FLAGS.new_tokens)
      elif run in (
        "breakdown",
        "profile",
        "profile_loop",
        "sweep",
        "dynamic",
        "dynamic_lockstep",
        "dynamic_capped",
        "dynamic_capped_fp8",
        "dynamic_fp8w",
        "dynamic_capped_fp8w",
        "static_fp8w",
        "long",
        "mixed",
        "mixed_static",
        "mixed_longest_first",
      ):
        getattr(bench, run)()
      else:
        raise ValueError(f"unknown run {run!r}")
    except Exception as e:  # report and go on
      bench.record(dict(run=run, failed=f"{type(e).__name__}: {str(e)[:800]}"))
    print(f"[{run}: {time.perf_counter() - t0:.0f} s]", flush=True)


if __name__ == "__main__":
  from experiments import _cli

  _cli.quiet_missing_tpu()
  app.run(main)
