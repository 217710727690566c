r"""Export a model to an HF directory loadable by `transformers`.

python -m experiments.export_hf --init=random --config=tiny --seed=0 --out=/tmp/tiny_hf
python -m experiments.export_hf --init=hf --hf_dir=IN --out=OUT          # re-export (e.g. to bf16)
python -m experiments.export_hf --init=checkpoint --workdir=RUN --out=OUT  # from an SFT/RL run
"""

import os

from absl import app, flags, logging

from dice_jax.errors import UserError
from dice_jax.hf import checkpoint as hf_ckpt
from experiments import _cli

FLAGS = flags.FLAGS
flags.DEFINE_enum("init", "random", ["random", "hf", "checkpoint"], "Where the weights come from.")
flags.DEFINE_string("config", "tiny", "Model preset for --init=random (dice_jax.model PRESETS).")
flags.DEFINE_integer("seed", 0, "Seed for --init=random.")
flags.DEFINE_string("hf_dir", None, "Source HF directory for --init=hf.")
flags.DEFINE_string("workdir", None, "Training run directory for --init=checkpoint.")
flags.DEFINE_string(
  "tokenizer_dir",
  None,
  "Directory whose tokenizer files are copied (checked against the model). Default: --hf_dir's "
  "tokenizer for --init=hf, the run's for --init=checkpoint, none for --init=random.",
)
flags.DEFINE_string("out", None, "Output HF directory.", required=True)
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"], "Saved dtype.")
flags.DEFINE_integer("max_shard_mb", 4096, "Maximum safetensors shard size in MiB.")
flags.DEFINE_bool("overwrite", False, "Replace --out if it exists.")


def load_model():
  if FLAGS.init == "random":
    from flax import nnx

    from dice_jax.model import Transformer, get_config

    cfg = get_config(FLAGS.config)
    return Transformer(cfg, rngs=nnx.Rngs(FLAGS.seed)), FLAGS.tokenizer_dir
  if FLAGS.init == "hf":
    if not FLAGS.hf_dir:
      raise app.UsageError("--init=hf needs --hf_dir")
    model, _ = hf_ckpt.import_hf(FLAGS.hf_dir)
    own = FLAGS.hf_dir if hf_ckpt.has_tokenizer(FLAGS.hf_dir) else None
    return model, FLAGS.tokenizer_dir or own
  if not FLAGS.workdir:
    raise app.UsageError("--init=checkpoint needs --workdir")
  from dice_jax.train.checkpoint import restore_model

  model, tokenizer_dir, step = restore_model(FLAGS.workdir)
  logging.info("restored step %d of %s", step, FLAGS.workdir)
  return model, FLAGS.tokenizer_dir or tokenizer_dir


def check_args():
  """Argument errors that need no model: reported before anything is loaded or written."""
  if os.path.exists(FLAGS.out) and not FLAGS.overwrite:
    raise UserError(f"--out {FLAGS.out} already exists (pass --overwrite to replace it)")
  if FLAGS.tokenizer_dir is not None and not os.path.isdir(FLAGS.tokenizer_dir):
    raise UserError(f"--tokenizer_dir {FLAGS.tokenizer_dir}: no such directory")
  if FLAGS.init == "random":
    from dice_jax.model.config import PRESETS

    if FLAGS.config not in PRESETS:
      raise UserError(f"--config: unknown model preset {FLAGS.config!r}; known: {sorted(PRESETS)}")


def main(argv):
  del argv
  check_args()
  model, tok_dir = load_model()
  out = hf_ckpt.export_hf(
    model,
    FLAGS.out,
    dtype=FLAGS.dtype,
    tokenizer_dir=tok_dir,
    max_shard_bytes=FLAGS.max_shard_mb << 20,
    overwrite=FLAGS.overwrite,
  )
  if tok_dir:
    logging.info("wrote %s with the tokenizer of %s", out, tok_dir)
  else:
    logging.warning(
      "wrote %s WITHOUT a tokenizer (pass --tokenizer_dir=DIR to include one; "
      "generate then needs --tokenizer_dir or --prompt_ids)",
      out,
    )
  print(out)


if __name__ == "__main__":
  _cli.run(main)
