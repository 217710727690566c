r"""What one decode forward's token sampling costs (`remasking.sample_candidates`), by PRNG impl.

  python -m experiments.bench_sampling --rows=128 --tokens=4 --vocab=151936 --out=DIR/sampling.json

The RL rollout samples at temperature 1 with log-probs: a Gumbel draw over the whole vocabulary for
every position (`jax.random.categorical`), i.e. `rows x tokens x vocab` random numbers a forward
(78 M at sdar_1p7b's RL shape). This times that call alone on random bf16 logits, jitted, after one
compiling call, for each `--impls` PRNG implementation (`jax.random.key(0, impl=...)`, one key a
row as the sampler keeps them), beside greedy decoding (argmax: no random numbers) as the floor.
Each row: ms a call (median of `--iters`), and the ms above greedy.

Caveat: under `vmap`, JAX batches `rng_bit_generator` (rbg, unsafe_rbg) by drawing every row's bits
from the first row's key, so those impls would break the sampler's contract that row i's draws
depend on its own key only; they are timed here as the cost of a cheaper generator, not as a drop-in.
"""

from __future__ import annotations

import json
import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("rows", 128, "rows (sequences) a forward")
flags.DEFINE_integer("tokens", 4, "positions a row samples a forward (the block)")
flags.DEFINE_integer("vocab", 151936, "vocabulary size (Qwen3's)")
flags.DEFINE_list("impls", ["threefry2x32", "rbg", "unsafe_rbg"], "PRNG implementations to time")
flags.DEFINE_integer("iters", 30, "timed calls per variant")
flags.DEFINE_string("out", "", "JSON file for the results")


def _time(fn, *args) -> float:
  """Median ms of `FLAGS.iters` calls of `fn(*args)` after a compiling call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(FLAGS.iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times)


def main(argv):
  del argv
  from dice_jax.diffusion.remasking import sample_candidates
  from dice_jax.diffusion.sampler import row_keys

  shape = (FLAGS.rows, FLAGS.tokens, FLAGS.vocab)
  logits = jax.random.normal(jax.random.key(1), shape, jnp.float32).astype(jnp.bfloat16) * 4

  def sample(keys, x, temperature):
    return sample_candidates(keys, x, temperature=temperature, want_logprob=True)

  rows = []
  greedy = jax.jit(lambda x: sample(None, x, 0.0))
  floor = _time(greedy, logits)
  rows.append(dict(variant="greedy", ms=floor, over_greedy_ms=0.0))
  for impl in FLAGS.impls:
    keys = row_keys(jax.random.key(0, impl=impl), FLAGS.rows)  # the sampler's own per-row keys
    fn = jax.jit(lambda k, x: sample(k, x, 1.0))
    ms = _time(fn, keys, logits)
    rows.append(dict(variant=f"temperature 1, {impl}", ms=ms, over_greedy_ms=ms - floor))
  result = dict(
    shape=list(shape),
    random_numbers=FLAGS.rows * FLAGS.tokens * FLAGS.vocab,
    device=str(jax.devices()[0]),
    jax=jax.__version__,
    rows=rows,
  )
  for r in rows:
    print(f"{r['variant']:<32} {r['ms']:8.3f} ms  (+{r['over_greedy_ms']:.3f} over greedy)")
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  app.run(main)
