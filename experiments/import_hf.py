r"""Import an HF directory (qwen3 or sdar; single or sharded safetensors) and report what was loaded.

  python -m experiments.import_hf --hf_dir=DIR [--mesh_fsdp=-1 --mesh_tensor=1] [--param_dtype=bfloat16]

With --orbax_out, the imported parameters are also saved as an orbax checkpoint.
"""

import math

import jax
from absl import flags
from flax import nnx

from dice_jax import sharding
from dice_jax.hf import checkpoint as hf_ckpt
from experiments import _cli

FLAGS = flags.FLAGS
flags.DEFINE_string("hf_dir", None, "HF directory.", required=True)
flags.DEFINE_integer("mesh_data", 1, "Mesh data axis.")
flags.DEFINE_integer("mesh_fsdp", -1, "Mesh fsdp axis (-1 fills).")
flags.DEFINE_integer("mesh_tensor", 1, "Mesh tensor axis.")
flags.DEFINE_enum("param_dtype", "float32", ["float32", "bfloat16"], "Parameter dtype.")
flags.DEFINE_string("orbax_out", None, "Optional: save the parameters as an orbax checkpoint here.")


def main(argv):
  del argv
  mesh = sharding.make_mesh(FLAGS.mesh_data, FLAGS.mesh_fsdp, FLAGS.mesh_tensor)
  model, cfg = hf_ckpt.import_hf(FLAGS.hf_dir, mesh, param_dtype=FLAGS.param_dtype)
  state = nnx.state(model, nnx.Param)
  leaves = jax.tree.leaves(state)
  n = sum(math.prod(x.shape) for x in leaves)
  print(
    f"imported {FLAGS.hf_dir}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
    f"{n / 1e6:.1f}M parameters ({cfg.param_dtype}), block_size {cfg.block_size}, "
    f"mask_token_id {cfg.mask_token_id}"
  )
  print(
    f"mesh {dict(mesh.shape)}; unsharded fraction {sharding.unsharded_fraction(state, mesh):.2%}"
  )
  if FLAGS.orbax_out:
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save(FLAGS.orbax_out, state)
    print(f"saved orbax checkpoint to {FLAGS.orbax_out}")


if __name__ == "__main__":
  _cli.run(main)
