r"""Export a model to an HF directory loadable by `transformers`.

python -m experiments.export_hf --init=random --config=tiny --seed=0 --out=/tmp/tiny_hf
python -m experiments.export_hf --init=hf --hf_dir=IN --out=OUT          # re-export (e.g. to bf16)
python -m experiments.export_hf --init=checkpoint --workdir=RUN --out=OUT  # from an SFT/RL run
"""

from absl import app, flags, logging

from dice_jax.hf import checkpoint as hf_ckpt

FLAGS = flags.FLAGS
flags.DEFINE_enum("init", "random", ["random", "hf", "checkpoint"], "Where the weights come from.")
flags.DEFINE_string("config", "tiny", "Model preset for --init=random.")
flags.DEFINE_integer("seed", 0, "Seed for --init=random.")
flags.DEFINE_string("hf_dir", None, "Source HF directory for --init=hf.")
flags.DEFINE_string("workdir", None, "Training run directory for --init=checkpoint.")
flags.DEFINE_string("tokenizer_dir", None, "Directory whose tokenizer files are copied.")
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
    return model, FLAGS.tokenizer_dir or FLAGS.hf_dir
  if not FLAGS.workdir:
    raise app.UsageError("--init=checkpoint needs --workdir")
  from dice_jax.train.checkpoint import restore_model

  model, tokenizer_dir, step = restore_model(FLAGS.workdir)
  logging.info("restored step %d of %s", step, FLAGS.workdir)
  return model, FLAGS.tokenizer_dir or tokenizer_dir


def main(argv):
  del argv
  model, tok_dir = load_model()
  out = hf_ckpt.export_hf(
    model,
    FLAGS.out,
    dtype=FLAGS.dtype,
    tokenizer_dir=tok_dir,
    max_shard_bytes=FLAGS.max_shard_mb << 20,
    overwrite=FLAGS.overwrite,
  )
  logging.info("wrote %s", out)
  print(out)


if __name__ == "__main__":
  app.run(main)
