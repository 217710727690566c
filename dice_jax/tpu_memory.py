"""The learner's programs at a recipe's settings compiled for a named TPU slice: per-chip memory
from the compiler, the attention it runs, and the project's own estimates beside it.

One `Row` per (model, slice, program): the SFT step, the TraceRL update, the sampler's prefill and
decode step (`tpu_lowering`), on a mesh of the slice's compile-only devices (`tpu_topology`) with
the docs' layout (parameters and optimizer state over every chip: `fsdp=-1`, `tensor=1`). A program
the compiler refuses (more than the chip's HBM) is a row too, with the compiler's message. The
estimates: the RL update planner (`rl.memory.update_estimate`) for the update and the sampler's
check (`diffusion.memory.estimate`) for the sampler's steps.
"""

from __future__ import annotations

import dataclasses
import re
import time

import jax
import jax.numpy as jnp

from dice_jax import tpu_lowering, tpu_topology
from dice_jax.diffusion import memory as sampler_memory
from dice_jax.diffusion.sampler import SamplerConfig
from dice_jax.model.config import get_config
from dice_jax.model.flash_decode import DecodeTiles
from dice_jax.rl import memory as rl_memory

PROGRAMS = ("sft", "rl", "prefill", "decode")


@dataclasses.dataclass(frozen=True)
class Recipe:
  """The settings of docs/tpu.md's recipes: SFT rows of `sft_seq_len` tokens (a 2L input of twice
  that) and TraceRL rows of `rl_row_len`, `rows_per_chip` of each per chip; the sampler's `slots`
  rows with prompts of `prompt_width`, `max_new_tokens` new tokens, `prefill_rows` per prefill."""

  rows_per_chip: int = 1
  sft_seq_len: int = 4096
  rl_row_len: int = 24576
  slots: int = 64
  prompt_width: int = 2048
  max_new_tokens: int = 4096
  prefill_rows: int = 16

  def sampler_config(self, mcfg) -> SamplerConfig:
    tiles = DecodeTiles(split=1024, block_k=128)  # the GPU kernel's; the TPU kernel ignores them
    return SamplerConfig(max_new_tokens=self.max_new_tokens, decode_tiles=tiles).for_model(mcfg)

  def shape(self, program: str, chips: int) -> str:
    rows = self.rows_per_chip * chips
    return {
      "sft": f"{rows} x {self.sft_seq_len} (2L {2 * self.sft_seq_len})",
      "rl": f"{rows} x {self.rl_row_len}",
      "prefill": f"{self.prefill_rows} prompts of {self.prompt_width}, {self.slots} slots",
      "decode": f"{self.slots} slots, cache {self.cache_len()}",
    }[program]

  def cache_len(self, block_size: int = 4) -> int:
    """The sampler's cache length as `tpu_lowering.sampler_steps` sizes it (prompt, budget and
    two blocks, in 512s)."""
    b = block_size
    return -(-(self.prompt_width + b + self.max_new_tokens + b) // 512) * 512


def model_config(name: str, **overrides):
  """A preset as the recipes train it: bf16 compute, fp32 master weights, flash attention, remat."""
  base = dict(dtype="bfloat16", param_dtype="float32", attention_impl="flash", remat=True)
  return get_config(name, **{**base, **overrides})


def programs(mcfg, mesh, recipe: Recipe, which=PROGRAMS) -> dict[str, tpu_lowering.Program]:
  """The named programs at the recipe's settings on `mesh`."""
  rows = recipe.rows_per_chip * mesh.size
  out = {}
  if "sft" in which:
    out["sft"] = tpu_lowering.sft_step(mcfg, mesh, batch=rows, seq_len=recipe.sft_seq_len)
  if "rl" in which:
    out["rl"] = tpu_lowering.rl_step(mcfg, mesh, batch=rows, row_len=recipe.rl_row_len)
  if {"prefill", "decode"} & set(which):
    steps = tpu_lowering.sampler_steps(
      mcfg,
      mesh,
      recipe.sampler_config(mcfg),
      slots=recipe.slots,
      prompt_width=recipe.prompt_width,
      prefill_rows=recipe.prefill_rows,
    )
    out.update({k: v for k, v in steps.items() if k in which})
  return out


def attention_lengths(program: str, recipe: Recipe, block_size: int = 4) -> tuple[int, int]:
  """(query length T, key length S) of the program's attention (a dense one's `[T, S]` scores)."""
  return {
    "sft": (2 * recipe.sft_seq_len,) * 2,
    "rl": (recipe.rl_row_len,) * 2,
    "prefill": (recipe.prompt_width,) * 2,
    "decode": (2 * block_size, recipe.cache_len(block_size)),
  }[program]


def estimate_bytes(program: str, mcfg, recipe: Recipe, chips: int) -> float | None:
  """The project's own per-chip estimate: the RL planner for the update (parameters and rows over
  the chips); for prefill and decode the sampler's check (`diffusion.memory.estimate` for TPU):
  weights, cache and that step's activations, split over the chips as `diffusion/placement.py`
  splits weights, cache and rows on an fsdp mesh. None for SFT (no estimate in the code)."""
  if program == "rl":
    est = rl_memory.update_estimate(
      mcfg,
      micro_rows=recipe.rows_per_chip * chips,
      row_len=recipe.rl_row_len,
      accum_steps=1,
      param_shards=chips,
      row_shards=chips,
      platform="tpu",
    )
    return est["total"]
  if program in ("prefill", "decode"):
    scfg = recipe.sampler_config(mcfg)
    est = sampler_memory.estimate(
      mcfg,
      rows=recipe.slots,
      cache_len=recipe.cache_len(scfg.block_size),
      block_size=scfg.block_size,
      prefill_rows=recipe.prefill_rows,
      prefill_width=recipe.prompt_width,
      decode_weights=scfg.splits_weights(mcfg),
      cache_dtype=scfg.cache_dtype(mcfg),
      row_shards=chips,
      param_shards=chips,
    )
    return est["weights"] + est["kv_cache"] + est[program] - _unread_master_bytes(mcfg, scfg, chips)
  return None


def _unread_master_bytes(mcfg, scfg, chips: int) -> float:
  """The fp32 master parameters a sampler step with split decode weights does not read (all but
  the embedding): the estimate counts them (a run holds them on the device beside the decode
  copy), the compiled step does not (jit drops unused arguments)."""
  if not scfg.splits_weights(mcfg):
    return 0.0
  embed = 0 if mcfg.tie_word_embeddings else mcfg.vocab_size * mcfg.hidden_size
  return (mcfg.num_params() - embed) * jnp.dtype(mcfg.weight_dtype).itemsize / chips


@dataclasses.dataclass(frozen=True)
class Row:
  """One compiled program: memory per chip (None when refused, with the compiler's `refusal`),
  its Pallas kernels, any `[T, S]` score shapes, the estimate, and the CPU seconds this process
  spent lowering and compiling it."""

  model: str
  slice: tpu_topology.Slice
  program: str
  shape: str
  memory: tpu_topology.ChipMemory | None
  refusal: str
  kernels: dict
  scores: list
  estimate: float | None
  compile_cpu_s: float

  def fits(self) -> bool:
    return self.memory is not None and self.memory.gib() <= self.slice.hbm_gib


def _refusal(e: Exception) -> str:
  """The compiler's out-of-memory message, shortened to what it needed against what there is."""
  text = str(e)
  m = re.search(
    r"required for HLO temporaries \(([\d.]+G)\) exceeds available HBM \(([\d.]+G)\)", text
  )
  if m:
    return f"refused: {m.group(1)} of temporaries > {m.group(2)} HBM"
  m = re.search(r"RESOURCE_EXHAUSTED: ([^\n]{0,160})", text)
  if m:
    return f"refused: {m.group(1)}"
  raise e


def compile_row(model: str, mcfg, slice_, program: str, prog, recipe: Recipe) -> Row:
  """Compiles one program for the slice; an out-of-memory refusal is a row, any other error
  raises."""
  t0 = time.process_time()
  mem, refusal, kernels, scores = None, "", {}, []
  try:
    compiled = tpu_topology.compile_program(prog)
  except jax.errors.JaxRuntimeError as e:
    refusal = _refusal(e)
  else:
    mem = tpu_topology.ChipMemory.of(compiled)
    text = compiled.as_text()
    kernels = tpu_topology.attention_kernels(text)
    b = recipe.sampler_config(mcfg).block_size
    lengths = attention_lengths(program, recipe, b)
    scores = tpu_topology.score_shapes(text, *lengths, width=mcfg.hidden_size)
  return Row(
    model=model,
    slice=slice_,
    program=program,
    shape=recipe.shape(program, slice_.chips),
    memory=mem,
    refusal=refusal,
    kernels=kernels,
    scores=scores,
    estimate=estimate_bytes(program, mcfg, recipe, slice_.chips),
    compile_cpu_s=time.process_time() - t0,
  )


def compile_rows(model: str, slice_name: str, recipe: Recipe, which=PROGRAMS, **overrides):
  """Yields the `Row` of each program of `which` for `model` on the slice, as each compiles."""
  slice_ = tpu_topology.get_slice(slice_name)
  mcfg = model_config(model, **overrides)
  mesh = tpu_topology.mesh(slice_)
  for name, prog in programs(mcfg, mesh, recipe, which).items():
    yield compile_row(model, mcfg, slice_, name, prog, recipe)


def compile_one(model: str, slice_name: str, program: str, recipe: Recipe) -> Row:
  """The `Row` of one program (a unit of work for a process pool)."""
  (row,) = compile_rows(model, slice_name, recipe, (program,))
  return row
