r"""What the cache-attention kernel's dots compile to (issue 39): its Triton IR's `tt.dot` operand
and result types and, on a GPU, its PTX's instruction counts (tensor-core `mma`/`wgmma` against
float32 `fma`), for a bf16 and a float8 cache at sdar_4b's per-program shapes.

A dot whose operands are bf16 (`tensor<16x128xbf16> * tensor<128x64xbf16> -> ...xf32`) is given
to tensor cores by Triton (`mma.sync` for 16 query rows, `wgmma` from 64); float32 operands would
be `fma.rn.f32` on the CUDA cores. Lowering for `cuda` needs no GPU (jaxlib <= 0.10.2 carries the
Triton IR as bytecode, which is read here); on a GPU its PTX is read too where jaxlib's Triton
module can compile it (jaxlib <= 0.10). jaxlib 0.11 has no such hook and compiles the Triton IR
inside XLA, which shows its PTX nowhere: checked on the H200 (jax 0.11.2, 2026-12-04), neither
`--xla_dump_to` (with `--xla_gpu_dump_llvmir`) writes a .ptx or .ll file for the module nor does
its serialized executable hold PTX. There each row says `ptx_source: null` and only the dot types
are read.

  python -m experiments.kernel_code --out=DIR   # DIR/kernel_code.json, a line per variant
"""

from __future__ import annotations

import functools
import json
import os
import re
import zlib

import jax
import jax.numpy as jnp
from absl import flags

from dice_jax.model import flash_decode, get_config

_DOT = re.compile(r"tt\.dot .*?: tensor<([^>]*)> \* tensor<([^>]*)> -> tensor<([^>]*)>")
PTX_OPS = ("mma.sync", "wgmma.mma_async", "fma.rn.f32", "cvt.", "ex2.approx")


def _custom_calls(op):
  for region in op.regions:
    for block in region.blocks:
      for inner in block.operations:
        if inner.operation.name == "stablehlo.custom_call":
          yield inner.operation
        yield from _custom_calls(inner.operation)


def triton_code(lowered) -> list[str]:
  """The text of each Triton kernel in `lowered` (a `jax.stages.Lowered` for cuda): the Triton
  IR, and where the lowering compiled it (newer jaxlibs on a GPU) the PTX beside it."""
  from jax._src.lib.mlir import ir

  out = []
  for call in _custom_calls(lowered.compiler_ir("stablehlo").operation):
    if "mhlo.backend_config" not in call.attributes:
      continue
    config = ir.DictAttr(call.attributes["mhlo.backend_config"])
    if "ir" in config:  # Triton IR bytecode, compiled by XLA
      bytecode = ir.StringAttr(config["ir"]).value_bytes
      warps, stages = (ir.IntegerAttr(config[k]).value for k in ("num_warps", "num_stages"))
      out.append(_ttir_text(bytecode) + _ptx(bytecode, warps, stages))
    elif "opaque" in config:  # a kernel record: zlib of a proto holding its IR
      raw = zlib.decompress(ir.StringAttr(config["opaque"]).value_bytes)
      out.append(raw.decode("latin-1"))
  return out


def _ttir_text(bytecode: bytes) -> str:
  from jax._src.lib.mlir import ir
  from jaxlib.triton import dialect

  with ir.Context() as ctx:
    dialect.register_dialect(ctx)
    return str(ir.Module.parse(bytecode))


def _gpus() -> list:
  return [d for d in jax.devices() if d.platform == "gpu"]


def _ptx(bytecode: bytes, num_warps: int, num_stages: int) -> str:
  """The PTX of Triton IR `bytecode` where this jaxlib's Triton module can compile it (a GPU's,
  jaxlib <= 0.10), else "" (module docstring)."""
  from jax._src.lib import triton

  gpus = _gpus()
  has_handler = getattr(triton, "has_compilation_handler", None)  # gone in jaxlib 0.11
  if not gpus or has_handler is None or not has_handler("CUDA"):
    return ""
  arch = str(gpus[0].compute_capability)
  done = triton.compile(
    "CUDA", bytecode, arch, num_warps=num_warps, num_ctas=1, num_stages=num_stages
  )
  return "\n" + done.asm


def dot_types(text: str) -> list[tuple[str, str, str]]:
  """Element types (lhs, rhs, result) of each `tt.dot` in Triton IR text."""
  return [tuple(t.split("x")[-1] for t in m.groups()) for m in _DOT.finditer(text)]


def ptx_counts(text: str) -> dict:
  """How often each of `PTX_OPS` occurs in `text` (all 0 without PTX)."""
  return {op: text.count(op) for op in PTX_OPS}


def cache_kernel_lowered(cfg, tiles, cache_dtype, tokens: int = 4, fill: int = 1536):
  """`flash_decode.cache_part` lowered for cuda at `cfg`'s per-program shapes (2 rows)."""
  b, kh, h = 2, cfg.num_kv_heads, cfg.head_dim
  r, s = tokens * (cfg.num_heads // kh), -(-fill // 1024) * 1024
  q = jnp.zeros((b, kh, r, h), jnp.bfloat16)
  kv = jnp.zeros((2, b, s, kh * h), cache_dtype)  # the stored layout: heads fused
  rows, slots = jnp.ones((b, r), jnp.int32), jnp.ones((b, s), jnp.int32)
  fills = jnp.full((b,), fill, jnp.int32)
  new = {}
  if tiles.fold_new:
    nk = jnp.zeros((b, tokens, kh, h), jnp.bfloat16)
    nt = jnp.ones((b, tokens), jnp.int32)
    new = dict(new_kv=(nk, nk, nt, nt))
  f = functools.partial(flash_decode.cache_part, tiles=tiles, interpret=False, **new)
  return (
    jax.jit(f)
    .trace(q, kv, kv, 0, rows, rows, slots, slots, fills)
    .lower(lowering_platforms=("cuda",))
  )


VARIANTS = {
  "base": (flash_decode.DecodeTiles(), jnp.bfloat16),
  "fold_new=1": (flash_decode.DecodeTiles(fold_new=True), jnp.bfloat16),
  "cache=fp8": (flash_decode.DecodeTiles(), jnp.float8_e4m3fn),
  "cache=fp8+fp8_widen=asm": (flash_decode.DecodeTiles(fp8_widen="asm"), jnp.float8_e4m3fn),
  "cache=fp8+fp8_widen=f16": (flash_decode.DecodeTiles(fp8_widen="f16"), jnp.float8_e4m3fn),
}


def report(config: str = "sdar_4b") -> list[dict]:
  """A row per `VARIANTS` entry: its dots' types and PTX counts (or the error of its lowering)."""
  cfg = get_config(config)
  rows = []
  for name, (tiles, dtype) in VARIANTS.items():
    row = dict(variant=name, backend=jax.default_backend())
    try:
      lowered = cache_kernel_lowered(cfg, tiles, dtype)
      texts = triton_code(lowered)
      has_ptx = any(".target sm_" in t for t in texts)
      row.update(
        kernels=len(texts),
        dots=[list(d) for t in texts for d in dot_types(t)],
        ptx_source="jaxlib triton" if has_ptx else None,
        ptx=ptx_counts("".join(texts)),
      )
    except Exception as e:  # report and go on
      row["failed"] = f"{type(e).__name__}: {str(e)[:400]}"
    rows.append(row)
  return rows


FLAGS = flags.FLAGS


def define_flags() -> None:
  """The launcher's flags, defined when it runs (a test imports this module beside launchers)."""
  flags.DEFINE_string("out", "", "Directory for kernel_code.json (printed only when empty).")
  flags.DEFINE_string("config", "sdar_4b", "Model preset whose shapes the kernel is lowered at.")


def main(argv):
  from experiments import _cli

  del argv
  with _cli.user_errors_from(ValueError):  # an unknown preset
    get_config(FLAGS.config)
  rows = report(FLAGS.config)
  for row in rows:
    print(json.dumps(row))
  if FLAGS.out:
    os.makedirs(FLAGS.out, exist_ok=True)
    with open(os.path.join(FLAGS.out, "kernel_code.json"), "w") as f:
      f.write("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
  from experiments import _cli

  define_flags()
  _cli.run(main)
