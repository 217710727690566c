r"""Block-sampler throughput with random weights: generated tokens/s, forwards/s, model-FLOP use.

  python -m experiments.bench_sampler --config=sdar_4b --batch=128 --prompt_len=1024 \
      --new_tokens=1024 --strategies=low_confidence_static --steps=4 --block_size=4 \
      --attention_impl=flash

One table row per (attention impl, new_tokens, strategy). Stop ids are off (random weights would
stop at random), so every row generates exactly `new_tokens`. Times are wall-clock for one call of
the compiled sampler (prefill included), after an AOT compile; `--breakdown` also times one
prefill and single decode forwards to show where the time goes.
MFU counts 2 * (matmul params) FLOPs per token-forward (+ LM head only for the active block) and
4 * q * k * N * H * L for attention against the filled cache, over `--peak_tflops`.
"""

import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from dice_jax import sharding
from dice_jax.diffusion import sampler
from dice_jax.model import AttentionSpec, KVCache, Transformer, get_config

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "sdar_4b", "Model preset.")
flags.DEFINE_integer("batch", 128, "Sequences per batch.")
flags.DEFINE_integer("prompt_len", 1024, "Prompt tokens per sequence.")
flags.DEFINE_list("new_tokens", ["1024"], "Generation lengths to run.")
flags.DEFINE_list("strategies", ["low_confidence_static"], "Remasking strategies to run.")
flags.DEFINE_list("attention_impl", ["flash"], "Cached-attention implementations (dense|flash).")
flags.DEFINE_integer("block_size", 4, "Block size.")
flags.DEFINE_integer("steps", 4, "Denoising steps per block.")
flags.DEFINE_float("threshold", 0.9, "low_confidence_dynamic threshold.")
flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0 = greedy).")
flags.DEFINE_integer("prefill_chunk", 16, "Rows per prefill chunk.")
flags.DEFINE_float("peak_tflops", 790.0, "bf16 matmul TFLOP/s used for MFU (measured H200).")
flags.DEFINE_bool("breakdown", False, "Also time prefill and single decode forwards.")
flags.DEFINE_string("out", "", "Optional JSONL file for the rows.")
flags.DEFINE_list(
  "runs",
  [],
  "Explicit runs impl:new_tokens:strategy (or impl:breakdown[:new]); "
  "default: every impl x new_tokens x strategy.",
)


def matmul_params(cfg):
  return cfg.num_params() - 2 * cfg.vocab_size * cfg.hidden_size  # embedding gather, LM head


def sample_flops(cfg, batch, prompt, new, block, forwards):
  """Model FLOPs of one sampler call: prefill + fused (2b) and plain (b) decode forwards."""
  n_blocks = -(-new // block)
  p = matmul_params(cfg)
  head = 2 * cfg.hidden_size * cfg.vocab_size
  attn = lambda q, k: 4 * q * k * cfg.num_heads * cfg.head_dim * cfg.num_layers
  flops = batch * (2 * p * prompt + attn(prompt, prompt / 2))
  mean_fill = prompt + new / 2
  fused, plain = n_blocks, max(forwards - n_blocks, 0)
  tok = batch * (fused * 2 * block + plain * block)
  flops += 2 * p * tok + head * batch * block * forwards + attn(tok, mean_fill)
  return flops


def build_model(impl, mesh):
  cfg = get_config(FLAGS.config, dtype="bfloat16", param_dtype="bfloat16", attention_impl=impl)
  return sharding.create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh)


def run_one(model, impl, new, strategy, rng):
  cfg = model.cfg
  scfg = sampler.SamplerConfig(
    block_size=FLAGS.block_size,
    steps=FLAGS.steps,
    strategy=strategy,
    threshold=FLAGS.threshold,
    temperature=FLAGS.temperature,
    max_new_tokens=new,
    stop_ids=(),
    prefill_chunk=FLAGS.prefill_chunk,
  )
  prompts = rng.randint(2, cfg.vocab_size - 2, (FLAGS.batch, FLAGS.prompt_len)).tolist()
  layout = sampler.layout_prompts(prompts, scfg, cfg.mask_token_id)
  layout = jax.tree.map(jnp.asarray, layout)
  graphdef, state = nnx.split(model)
  key = jax.random.key(0)
  t0 = time.perf_counter()
  compiled = sampler._decode_jit.lower(
    graphdef, state, layout, jnp.array(layout.tokens), key, cfg=scfg
  ).compile()
  compile_s = time.perf_counter() - t0
  canvas = jnp.array(layout.tokens)
  jax.block_until_ready(canvas)
  t0 = time.perf_counter()
  out = compiled(state, layout, canvas, key)
  jax.block_until_ready(out.tokens)
  run_s = time.perf_counter() - t0
  generated = int(np.asarray(out.response_lengths).sum())
  forwards = int(out.forwards)
  flops = sample_flops(cfg, FLAGS.batch, FLAGS.prompt_len, new, FLAGS.block_size, forwards)
  row = dict(
    impl=impl,
    config=FLAGS.config,
    batch=FLAGS.batch,
    prompt=FLAGS.prompt_len,
    new=new,
    strategy=strategy,
    steps=FLAGS.steps,
    block=FLAGS.block_size,
    compile_s=round(compile_s, 1),
    run_s=round(run_s, 3),
    tok_s=generated / run_s,
    forwards=forwards,
    fwd_s=forwards / run_s,
    tok_per_fwd=generated / forwards,
    mfu=flops / run_s / (FLAGS.peak_tflops * 1e12),
    mean_steps_per_row=float(np.asarray(out.steps_used).mean()),
    device=jax.devices()[0].device_kind,
    jax=jax.__version__,
  )
  del out
  return row


def time_fn(fn, *args, iters=5):
  out = fn(*args)
  jax.block_until_ready(out)
  t0 = time.perf_counter()
  for _ in range(iters):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / iters


def breakdown(model, impl, new):
  """Times of one decode forward (b and 2b tokens) at a half-filled cache, prefill, and sampling."""
  cfg = model.cfg
  b, rows, prompt = FLAGS.block_size, FLAGS.batch, FLAGS.prompt_len
  total = -(-(prompt + new + b) // 512) * 512
  fill = prompt + new // 2
  graphdef, state = nnx.split(model)
  cache = KVCache.empty(cfg, rows, total)
  ids = jnp.broadcast_to(jnp.arange(total, dtype=jnp.int32), (rows, total))
  cache = dataclasses.replace(
    cache,
    k=cache.k + 0.01,
    v=cache.v + 0.01,
    positions=ids,
    segment_ids=jnp.ones_like(ids),
    block_ids=ids // b,
    length=jnp.asarray(fill, jnp.int32),
  )
  res = {}
  for width, update in ((b, False), (2 * b, True)):
    tok = jnp.full((rows, width), 5, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(fill, fill + width, dtype=jnp.int32), (rows, width))
    spec = AttentionSpec.block_causal(b, jnp.ones_like(pos), pos // b)

    @jax.jit
    def fwd(state, cache, tok=tok, pos=pos, spec=spec, update=update):
      m = nnx.merge(graphdef, state)
      h, c = m(tok, pos, spec, cache=cache, update_cache=update, return_hidden=True)
      return m.logits_from_hidden(h[:, -b:]), c.length

    res[f"fwd_{width}tok_ms"] = 1e3 * time_fn(fwd, state, cache)
  if impl == "flash":  # the Pallas kernel alone on one layer's cache, times the layer count
    from dice_jax.model import flash_decode

    g = cfg.num_heads // cfg.num_kv_heads
    q = jnp.ones((rows, cfg.num_kv_heads, b * g, cfg.head_dim), jnp.bfloat16)
    one = jax.jit(
      lambda q, k, v, s, r: flash_decode.cache_part(
        q,
        k,
        v,
        0,
        jnp.ones((rows, b * g), jnp.int32),
        jnp.full((rows, b * g), 10**6, jnp.int32),
        s,
        r,
      )[0]
    )
    kseg = (ids < fill).astype(jnp.int32)
    res["kernel_all_layers_ms"] = (
      1e3 * cfg.num_layers * time_fn(one, q, cache.k, cache.v, kseg, ids)
    )
  logits = jax.random.normal(jax.random.key(0), (rows, b, cfg.vocab_size), jnp.float32)
  from dice_jax.diffusion import remasking

  cand = jax.jit(lambda l: remasking.sample_candidates(None, l)["token"])
  res["candidates_ms"] = 1e3 * time_fn(cand, logits)
  del cache
  # Prefill of the prompt (all rows, in chunks).
  scfg = sampler.SamplerConfig(block_size=b, max_new_tokens=b, prefill_chunk=FLAGS.prefill_chunk)
  prompts = np.full((rows, prompt), 7).tolist()
  layout = jax.tree.map(jnp.asarray, sampler.layout_prompts(prompts, scfg, cfg.mask_token_id))
  c0 = layout.first_block_column

  @jax.jit
  def prefill(state, layout):
    m = nnx.merge(graphdef, state)
    cache = sampler._prefill(m, layout, c0 - b, FLAGS.prefill_chunk, c0 + b * 32, b)
    return cache.k, cache.v  # returned so that nothing is dead code

  res["prefill_ms"] = 1e3 * time_fn(prefill, state, layout, iters=2)
  kv_bytes = 2 * cfg.num_layers * rows * fill * cfg.num_kv_heads * cfg.head_dim * 2
  res["kv_read_gb_per_fwd"] = kv_bytes / 1e9
  return res


def main(argv):
  del argv
  mesh = sharding.make_mesh()
  print(
    f"device: {jax.devices()[0].device_kind} x{jax.device_count()}, jax {jax.__version__}; "
    f"{FLAGS.config} bf16 random weights, batch {FLAGS.batch}, prompt {FLAGS.prompt_len}, "
    f"block {FLAGS.block_size}, steps {FLAGS.steps}",
    flush=True,
  )
  rng = np.random.RandomState(0)
  rows = []
  header = (
    f"{'impl':<6}{'new':>6} {'strategy':<24}{'compile s':>10}{'run s':>8}{'tok/s':>9}"
    f"{'fwd/s':>8}{'tok/fwd':>8}{'MFU':>7}"
  )
  fmt = lambda r: (
    f"{r['impl']:<6}{r['new']:>6} {r['strategy']:<24}{r['compile_s']:>10.1f}"
    f"{r['run_s']:>8.2f}{r['tok_s']:>9,.0f}{r['fwd_s']:>8.1f}"
    f"{r['tok_per_fwd']:>8.1f}{r['mfu']:>7.1%}"
  )
  runs = FLAGS.runs or [
    f"{i}:{n}:{s}" for i in FLAGS.attention_impl for n in FLAGS.new_tokens for s in FLAGS.strategies
  ]
  model = build_model("dense", mesh)
  for run in runs:
    impl, new, strategy = (run.split(":") + ["", ""])[:3]
    t0 = time.perf_counter()
    try:
      model.cfg = model.cfg.replace(attention_impl=impl)  # static attribute: new graph, same params
      if new == "breakdown":
        res = breakdown(model, impl, int(strategy or FLAGS.new_tokens[0]))
        print(
          f"breakdown ({impl}): " + json.dumps({k: round(v, 3) for k, v in res.items()}), flush=True
        )
        continue
      r = run_one(model, impl, int(new), strategy, rng)
    except Exception as e:  # report and go on
      print(
        f"{run} failed after {time.perf_counter() - t0:.0f} s: {type(e).__name__}: {str(e)[:600]}",
        flush=True,
      )
      continue
    rows.append(r)
    print(header + "\n" if len(rows) == 1 else "", end="")
    print(fmt(r), flush=True)
    if FLAGS.out:
      with open(FLAGS.out, "a") as f:
        f.write(json.dumps(r) + "\n")
  if rows:
    print("\n" + header)
    for r in rows:
      print(fmt(r))


if __name__ == "__main__":
  app.run(main)
