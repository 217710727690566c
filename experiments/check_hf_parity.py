r"""Load one HF directory in JAX and in `transformers` (float32) and compare logits.

  python -m experiments.check_hf_parity --hf_dir=DIR [--tolerance=1e-4]

Prints max |logit difference| under a causal and a block-causal mask; exits 1 above tolerance.
"""

import sys

from absl import flags

from dice_jax.hf.parity import check_parity
from experiments import _cli

FLAGS = flags.FLAGS
flags.DEFINE_string("hf_dir", None, "HF directory.", required=True)
flags.DEFINE_float("tolerance", 1e-4, "Maximum allowed |logit difference|.")
flags.DEFINE_integer("batch", 2, "Batch size of the random test input.")
flags.DEFINE_integer("seq_len", 24, "Sequence length of the random test input.")
flags.DEFINE_integer("block_size", None, "Block size for the block-causal mask (default: config).")


def main(argv):
  del argv
  results = check_parity(
    FLAGS.hf_dir, batch=FLAGS.batch, seq_len=FLAGS.seq_len, block_size=FLAGS.block_size
  )
  print(f"{'mask':<14}{'max |dlogit|':>14}{'max |logit|':>14}")
  for r in results:
    print(f"{r.mask:<14}{r.max_abs_diff:>14.3e}{r.max_abs_logit:>14.3f}")
  worst = max(r.max_abs_diff for r in results)
  ok = worst <= FLAGS.tolerance
  print(f"{'PASS' if ok else 'FAIL'}: max |dlogit| {worst:.3e} vs tolerance {FLAGS.tolerance:.1e}")
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  _cli.run(main)
