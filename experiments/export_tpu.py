r"""Lowers the learner's programs for a TPU pod from this host and prints what was exported.

  python -m experiments.export_tpu --configs=sdar_1p7b,sdar_8b --programs=sft,rl,sampler
  python -m experiments.export_tpu --memory   # a per-chip memory formula (docs/tpu.md's table
                                              # is the compiler's: experiments.tpu_memory_table)

For each preset: the SFT train step (rows of --sft_seq_len tokens, a 2L input of twice that), the
TraceRL update (rows of --rl_row_len tokens) and the sampler's prefill and decode step
(`tpu_lowering`), traced on abstract shapes (no weights are made) with `attention_impl='flash'`
under the sharding rules on a mesh of --fsdp x --tensor fake CPU devices and exported with
`platforms=['tpu']`. One row per program: seconds to trace and lower, size of the serialized
module, its custom calls and the Mosaic kernels inside them.
"""

import os
import sys

if "jax" not in sys.modules:  # fake devices for the mesh; must precede JAX's initialisation
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import math  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
from absl import flags  # noqa: E402

from dice_jax import (
  sharding,  # noqa: E402
  tpu_lowering,  # noqa: E402
)
from dice_jax.diffusion import memory  # noqa: E402
from dice_jax.diffusion.sampler import SamplerConfig  # noqa: E402
from dice_jax.errors import UserError  # noqa: E402
from dice_jax.model.config import PRESETS, get_config  # noqa: E402
from dice_jax.model.flash_decode import DecodeTiles  # noqa: E402
from experiments import _cli  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("configs", ["sdar_1p7b", "sdar_8b"], "Model presets.")
flags.DEFINE_list("programs", ["sft", "rl", "sampler"], "Programs to export: sft, rl, sampler.")
flags.DEFINE_integer("fsdp", 4, "Mesh fsdp axis.")
flags.DEFINE_integer("tensor", 2, "Mesh tensor axis.")
flags.DEFINE_integer("sft_batch", 8, "SFT rows per step (global).")
flags.DEFINE_integer("sft_seq_len", 4096, "SFT tokens per row (DICE: 4,096; the 2L input is 2x).")
flags.DEFINE_integer("rl_batch", 8, "TraceRL rows per update (global).")
flags.DEFINE_integer("rl_row_len", 24576, "TraceRL row length (DICE: 12,288-24,576).")
flags.DEFINE_integer("slots", 64, "Sampler slots (rows decoded together).")
flags.DEFINE_integer("prompt_width", 2048, "Sampler prompt width (DICE prompts <= 1,672 tokens).")
flags.DEFINE_integer("max_new_tokens", 4096, "Sampler budget (DICE: 4,096).")
flags.DEFINE_integer("prefill_rows", 16, "Prompts per prefill call.")
flags.DEFINE_bool("memory", False, "Print the per-chip memory table instead of exporting.")

HBM_GIB = {"v5e": 16, "v5p": 95, "v6e": 32}


def _model(name):
  return get_config(
    name, dtype="bfloat16", param_dtype="float32", attention_impl="flash", remat=True
  )


def _export_rows(name, mesh):
  mcfg = _model(name)
  scfg = SamplerConfig(
    max_new_tokens=FLAGS.max_new_tokens, decode_tiles=DecodeTiles(split=1024, block_k=128)
  ).for_model(mcfg)
  jobs = {
    "sft": lambda: {
      "sft step": tpu_lowering.export_sft_step(
        mcfg, mesh, batch=FLAGS.sft_batch, seq_len=FLAGS.sft_seq_len
      )
    },
    "rl": lambda: {
      "rl update": tpu_lowering.export_rl_step(
        mcfg, mesh, batch=FLAGS.rl_batch, row_len=FLAGS.rl_row_len
      )
    },
    "sampler": lambda: {
      f"sampler {k}": v
      for k, v in tpu_lowering.export_sampler_steps(
        mcfg,
        mesh,
        scfg,
        slots=FLAGS.slots,
        prompt_width=FLAGS.prompt_width,
        prefill_rows=FLAGS.prefill_rows,
      ).items()
    },
  }
  for prog in FLAGS.programs:
    t0 = time.perf_counter()
    out = jobs[prog]()
    dt = time.perf_counter() - t0
    for i, (what, exported) in enumerate(out.items()):
      s = tpu_lowering.summary(exported)
      secs = f"{dt:>7.1f}" if i == 0 else f"{'(same)':>7}"
      calls = ", ".join(f"{k} x{v}" for k, v in s["custom_calls"].items())
      kernels = ", ".join(f"{k} x{v}" for k, v in s["mosaic_kernels"].items())
      print(
        f"{name:<10} {what:<16} {secs} {s['serialized_bytes'] / 2**20:>9.2f}  {calls} | {kernels}",
        flush=True,
      )


def _state_bytes(mcfg):
  """Bytes of the train state (fp32 params + AdamW moments + step) from its abstract shapes."""
  from dice_jax.train import optimizer as optim_lib

  params = tpu_lowering.abstract_model(mcfg, sharding.make_mesh(fsdp=-1))[1]
  tx = optim_lib.make_optimizer(optim_lib.OptimizerConfig(), 1000)
  state = (params, jax.eval_shape(tx.init, params))
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state))


def _train_activations(mcfg, rows, tokens):
  """Remat checkpoints (every layer's bf16 input) + one layer's working set (memory.estimate's
  per-token term) + the attention statistics (lse/delta, f32, 128 lanes) of one layer + one
  2,048-token chunk of f32 logits and their gradient (the chunked CE of SFT and TraceRL)."""
  act = 2
  per_token = act * (4 * mcfg.hidden_size + 3 * mcfg.intermediate_size + 2 * mcfg.num_heads * 128)
  ckpt = mcfg.num_layers * rows * tokens * mcfg.hidden_size * act
  stats = 2 * rows * mcfg.num_heads * tokens * 128 * 4
  logits = 2 * rows * min(2048, tokens) * mcfg.vocab_size * 4
  return ckpt + rows * tokens * per_token + stats + logits


def _memory_table():
  gib = 2**30
  print(
    f"GiB per chip ('!' = over 90% of HBM); SFT: 1 row of {FLAGS.sft_seq_len} (2L "
    f"{2 * FLAGS.sft_seq_len}) per chip; RL: 1 row of {FLAGS.rl_row_len} per chip; sampler: "
    f"{FLAGS.slots} slots, prompts {FLAGS.prompt_width}, {FLAGS.max_new_tokens} new, per chip of a "
    "tensor-parallel replica"
  )
  print(f"{'config':<10} {'slice':<9} {'chips':>5} {'HBM':>5}  {'SFT':>7} {'RL':>7} {'sampler':>8}")
  for name in FLAGS.configs:
    mcfg = _model(name)
    state = _state_bytes(mcfg)
    b = 4
    cache_len = -(-(FLAGS.prompt_width + 2 * b + FLAGS.max_new_tokens) // 512) * 512
    for gen, chips in (("v5e", 16), ("v5e", 64), ("v5p", 8), ("v5p", 32), ("v6e", 8), ("v6e", 32)):
      # One row per chip (global batch = chips), state fully sharded (fsdp x tensor).
      sft = state / chips + _train_activations(mcfg, 1, 2 * FLAGS.sft_seq_len)
      rl = state / chips + _train_activations(mcfg, 1, FLAGS.rl_row_len)
      # Sampler: one replica per `tensor` chips (weights + cache split by heads over tensor = 8
      # chips or the slice), the engine's estimate for its slots.
      tp = min(8, chips, mcfg.num_kv_heads)
      est = memory.estimate(
        mcfg,
        rows=FLAGS.slots,
        cache_len=cache_len,
        block_size=b,
        prefill_rows=FLAGS.prefill_rows,
        prefill_width=FLAGS.prompt_width,
        decode_weights=True,
      )
      samp = est["total"] / tp
      hbm = HBM_GIB[gen]
      cell = lambda x: f"{x / gib:>6.1f}{'!' if x / gib > 0.9 * hbm else ' '}"
      # Cloud TPU names count TensorCores for v5p (2 per chip: v5p-16 is 8 chips), chips for v5e/v6e
      slice_name = f"{gen}-{2 * chips if gen == 'v5p' else chips}"
      print(
        f"{name:<10} {slice_name:<9} {chips:>5} {hbm:>5}  {cell(sft)} {cell(rl)} {cell(samp)} "
        f"(tp {tp})",
        flush=True,
      )


def main(argv):
  del argv
  unknown = [name for name in FLAGS.configs if name not in PRESETS]
  if unknown:
    raise UserError(f"--configs: unknown model preset(s) {unknown}; known: {sorted(PRESETS)}")
  if FLAGS.memory:
    _memory_table()
    return
  mesh = sharding.make_mesh(data=1, fsdp=FLAGS.fsdp, tensor=FLAGS.tensor)
  print(
    f"jax {jax.__version__}, mesh {dict(mesh.shape)} of {jax.devices()[0].platform} devices; "
    f"SFT {FLAGS.sft_batch} x {FLAGS.sft_seq_len} (2L {2 * FLAGS.sft_seq_len}), RL "
    f"{FLAGS.rl_batch} x {FLAGS.rl_row_len}, sampler {FLAGS.slots} slots, prompts "
    f"{FLAGS.prompt_width}, {FLAGS.max_new_tokens} new, prefill {FLAGS.prefill_rows} rows",
    flush=True,
  )
  print(f"{'config':<10} {'program':<16} {'lower_s':>7} {'MiB':>9}  custom calls | Mosaic kernels")
  for name in FLAGS.configs:
    _export_rows(name, mesh)


if __name__ == "__main__":
  _cli.run(main)
