"""KV-cached block-diffusion sampler (SDAR, JetAstra/SDAR `generate.py`; DICE's JetEngine rollouts; BD3-LM §4 "Sampling").

Blocks are decoded in parallel inside and autoregressively across: a block starts all-[MASK]; each
denoising forward runs the active block against the KV cache of the committed prefix, draws a
candidate per position and unmasks some of them (`remasking.py`); after at most `steps` forwards
the block is final and its keys/values are committed by the next block's first forward (the exact
cheaper commit of `slots.py`: `steps` forwards per block instead of SDAR's `steps + 1`).

This module is the static API: a batch of prompts in, a `SampleOutput` canvas out, one compiled
call (`decode` runs `slots.admit` and a `lax.while_loop` of `slots.advance` on device). Rows are
independent (own positions, cache row, step counter and PRNG key), so a row's tokens and step map
do not depend on the other rows. `engine.ContinuousSampler` runs the same steps with refills.

Block grid: `SamplerConfig.grid` (`blocks.BlockGrid`; its size must be the model's block size).
`response` alignment (default) starts blocks at the response, the training convention;
`absolute` (block = position // b) reproduces SDAR's and DICE's published decoding.

Layout (what `SampleOutput` holds; the RL engineer builds the TraceRL mask from it):
  * Rows are sequences. Columns are a shared canvas of C = P + n_blocks * b slots.
  * Prompts are LEFT-padded into the first P columns (P a multiple of b, >= 2b). `pad_columns[i]`
    columns of padding (segment 0) precede prompt i. Positions restart at 0 at the first prompt
    token: position = column - pad_columns[i].
  * `response_start[i]` is the first generated column of row i. With the default `response`
    block alignment every row's response starts at column P (= `response_start`), block ids are
    (column - P) // b for every row, and blocks are column-aligned across the batch. With
    `absolute` alignment (block = position // b, SDAR's `generate.py`), pads are multiples of b and
    a row's response can start inside the first decoded block, after its prompt's tail.
  * `tokens[i, c]`: prompt, then generated tokens; slots never generated (after the row stopped)
    hold `pad_id`. Tokens after the first stop id inside the last decoded block are kept: the
    model saw them. `response_lengths[i]` counts response tokens up to and including the first
    stop id, capped at max_new_tokens[i]. No generated token is ever the mask id.
  * `step_map[i, c]` int32: the per-row denoising step (0, 1, 2, ... counting this row's forwards
    that had masks in its active block, across blocks) at which token (i, c) was unmasked; -1 for
    prompt, padding and never-generated slots. Replay: `state_before_step` in `trace.py`.
  * `logprobs[i, c]`: log-probability of the chosen token under the unfiltered model distribution
    (temperature 1, mask included) at the forward that unmasked it (0 where step_map is -1), when
    `return_logprobs`.

Randomness: row i draws from its own key (`keys[i]`, default `fold_in(rng, i)`) folded with its
step id, so a request decodes the same alone, batched, or in the continuous engine.

Compilation: one jit per (model graph, config, mesh, batch size, canvas width); blocks and steps
are `lax.while_loop`s. The KV cache is created inside the call, exactly once (no copy: the loops
carry it).

Mesh (`placement.py`): rows and their KV cache are split over the mesh's data axes, K/V heads over
`tensor`, the weights as training shards them; each device prefills and decodes its own rows, so
N devices hold ~1/N of the cache each and a row decodes the same tokens on any mesh.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dice_jax import trace_context
from dice_jax.diffusion import blocks as blocks_lib
from dice_jax.diffusion import memory, remasking
from dice_jax.diffusion import slots as slots_lib
from dice_jax.diffusion.placement import Placement
from dice_jax.model import platform
from dice_jax.model.flash_decode import DecodeTiles
from dice_jax.model.kv_cache import KVCache
from dice_jax.model.transformer import WEIGHTS_DTYPES, DecodeView, DecodeWeights

KV_CACHE_DTYPES = (None, "float8_e4m3fn")


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  """Decoding settings (static under jit)."""

  block_size: int = 4  # 0: the model's (`for_model` resolves it); another must equal the model's
  steps: int = 4  # max denoising forwards per block
  strategy: str = "low_confidence_static"
  threshold: float = 0.9  # low_confidence_dynamic
  eb_threshold: float = 0.35  # entropy_bounded
  temperature: float = 0.0  # 0 = greedy
  top_k: int = 0  # 0 = off
  top_p: float = 1.0  # 1 = off
  max_new_tokens: int = 256
  stop_ids: tuple[int, ...] = ()
  block_alignment: str = "response"  # see diffusion/blocks.py
  return_logprobs: bool = False
  pad_id: int = 0
  prefill_chunk: int = 0  # rows per prefill chunk (bounds prefill attention memory); 0 = all
  # Rows in contiguous groups of m sharing a prompt (an RL group: `prompt_group`) prefill it once: the
  # group's first row runs the prefill forward and its keys/values go to every member's cache row
  # (m times fewer prefill FLOPs and activations). The values equal the members' own prefill's up
  # to the GEMMs' rounding at another batch shape (CPU, tiny model: log-probs within 4e-6, the same
  # tokens). One row shard, prefill chunks of whole groups (`_prefill_plan`); elsewhere every row
  # prefills its own prompt.
  prefill_once_per_group: bool = True
  confidence: str = "filtered"  # "filtered" (JetEngine) | "unfiltered" (SDAR eval); remasking.py
  decode_tiles: DecodeTiles = DecodeTiles()  # flash cache-attention kernel tiling
  # Rows move to their next block as soon as their own is decided (`slots.advance_ragged`: every
  # forward is 2b tokens wide) instead of waiting for the batch's slowest block. None: on for the
  # strategies whose forwards per block vary (low_confidence_dynamic, entropy_bounded). Exact
  # either way: the same tokens, step map and log-probs.
  ragged: Optional[bool] = None
  # Ragged only: at most this many rows commit their previous block in one forward (0: no cap),
  # and the forward's per-token work (projections, MLP) runs on S*b + commit_rows*b packed tokens
  # instead of 2b per row (`slots.py`, "Commit cap"). A fresh row past the cap waits a forward;
  # exact either way. With rows split over devices each row shard packs its own rows (a multiple of
  # the shards: `commit_groups`); with DecodeTiles.halves each row half packs its own (even).
  commit_rows: int = 0
  # With flash attention, decode on `Transformer.decode_weights()` (per layer, compute dtype, made
  # once per call) rather than the stacked parameters: no per-forward copy of each layer's weights
  # (H200, sdar_4b: a forward 20.2 ms against 23.4 ms); costs one copy of the weights in memory,
  # and the layers are unrolled in the compiled program (a longer compile). Not on the dense path
  # (CPU reference), whose per-layer cache slices an unrolled program would keep alive together.
  presplit_weights: bool = True
  # Element type of the K/V cache: None = the model's compute dtype (exact); "float8_e4m3fn" halves
  # the cache and what each decode forward reads of it (flash attention only: the kernel widens each
  # tile as it reads it; values saturate at +-448). Committed blocks are then seen at fp8 precision,
  # so decoding is no longer exactly the uncached model's (vLLM's `kv_cache_dtype="fp8"`, scale 1).
  # Pair it with `DecodeTiles(fp8_widen="f16", num_stages=3)`: the default "cast" widening is bound
  # by the conversion pipe and reads no faster than a bf16 cache (docs/performance.md, issue 39
  # sessions 22, 24, 25).
  kv_cache_dtype: Optional[str] = None
  # Element type of the decode weights' projection matrices: None = the compute dtype (exact);
  # "float8_e4m3fn" stores q/k/v, o, gate/up and down as e4m3fn with a float32 scale per output
  # column (made once with the split weights) and runs each projection as a float8 x float8 GEMM
  # on activations quantised per token (`model/fp8.py`: W8A8 as in FP8-LM / vLLM's fp8). The LM
  # head stays in the compute dtype (its logits pick the tokens; vLLM's fp8 keeps it too).
  # Approximate: tokens differ from the exact decoding's (bench_sampler `dynamic_fp8w` reports the
  # agreement). Needs the split weights (flash attention, `presplit_weights`) on a mesh without a
  # `tensor` axis; prefill runs on the same weights.
  weights_dtype: Optional[str] = None

  def splits_weights(self, model_cfg) -> bool:
    """Whether decoding `model_cfg` runs on split weights (`presplit_weights`, flash only)."""
    return self.presplit_weights and model_cfg.attention_impl == "flash"

  def __post_init__(self):
    blocks_lib.check_alignment(self.block_alignment)
    if self.confidence not in remasking.CONFIDENCES:
      raise ValueError(
        f"SamplerConfig.confidence must be one of {remasking.CONFIDENCES}, got {self.confidence!r}"
      )
    if self.strategy not in remasking.STRATEGIES:
      raise ValueError(
        f"SamplerConfig.strategy must be one of {remasking.STRATEGIES}, got {self.strategy!r}"
      )
    for name in ("steps", "max_new_tokens"):
      if getattr(self, name) < 1:
        raise ValueError(f"SamplerConfig.{name} must be >= 1, got {getattr(self, name)}")
    if self.block_size < 0:
      raise ValueError(
        f"SamplerConfig.block_size must be >= 0 (0: the model's), got {self.block_size}"
      )
    if self.temperature < 0 or self.top_k < 0 or not 0.0 < self.top_p <= 1.0:
      raise ValueError(
        f"SamplerConfig: bad temperature/top_k/top_p "
        f"({self.temperature}, {self.top_k}, {self.top_p})"
      )
    if not isinstance(self.stop_ids, tuple):
      object.__setattr__(self, "stop_ids", tuple(self.stop_ids))
    if self.kv_cache_dtype not in KV_CACHE_DTYPES:
      raise ValueError(
        f"SamplerConfig.kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
      )
    if self.weights_dtype not in WEIGHTS_DTYPES:
      raise ValueError(
        f"SamplerConfig.weights_dtype must be one of {WEIGHTS_DTYPES}, got {self.weights_dtype!r}"
      )
    if self.weights_dtype is not None and not self.presplit_weights:
      raise ValueError(
        f"SamplerConfig.weights_dtype={self.weights_dtype!r} quantises the split decode weights: "
        "set presplit_weights=True"
      )
    if self.ragged is None:
      varies = self.strategy in ("low_confidence_dynamic", "entropy_bounded")
      object.__setattr__(self, "ragged", varies)
    if self.commit_rows < 0:
      raise ValueError(f"SamplerConfig.commit_rows must be >= 0, got {self.commit_rows}")
    if self.commit_rows and not self.ragged:
      raise ValueError("SamplerConfig.commit_rows caps ragged decoding's commits: set ragged=True")

  @property
  def grid(self) -> blocks_lib.BlockGrid:
    """The block grid this config decodes on (size + alignment; resolved: see `for_model`)."""
    return blocks_lib.BlockGrid(self.resolved_block_size, self.block_alignment)

  @property
  def resolved_block_size(self) -> int:
    if self.block_size == blocks_lib.MODEL_BLOCK_SIZE:
      raise ValueError(
        "SamplerConfig.block_size 0 (the model's) is not resolved yet: use cfg.for_model(model.cfg)"
      )
    return self.block_size

  @classmethod
  def on_grid(cls, grid: blocks_lib.BlockGrid, **kw) -> "SamplerConfig":
    """A config decoding on `grid` (e.g. the training run's `ObjectiveConfig.grid`)."""
    return cls(block_size=grid.size, block_alignment=grid.alignment, **kw)

  def for_model(self, model_cfg) -> "SamplerConfig":
    """This config with the model's block size (when 0); raises unless the model decodes blocks
    of this size (`blocks.resolve_block_size`) and can read this cache dtype."""
    b = blocks_lib.resolve_block_size(self.block_size, model_cfg, "SamplerConfig")
    if self.kv_cache_dtype == "float8_e4m3fn" and model_cfg.attention_impl != "flash":
      raise ValueError(
        "SamplerConfig.kv_cache_dtype='float8_e4m3fn' needs attention_impl='flash' "
        f"(the model has {model_cfg.attention_impl!r})"
      )
    if self.weights_dtype is not None and not self.splits_weights(model_cfg):
      raise ValueError(
        f"SamplerConfig.weights_dtype={self.weights_dtype!r} needs the split decode weights: "
        f"attention_impl='flash' (the model has {model_cfg.attention_impl!r})"
      )
    return self if b == self.block_size else dataclasses.replace(self, block_size=b)

  def cache_dtype(self, model_cfg):
    """The K/V cache's element type for `model_cfg`."""
    return jnp.dtype(self.kv_cache_dtype or model_cfg.compute_dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Layout:
  """The canvas before decoding (module docstring). Arrays `[B, C]` unless noted."""

  tokens: jax.Array  # prompt tokens, [MASK] on generation slots, pad elsewhere
  positions: jax.Array
  segment_ids: jax.Array  # 1 on prompt and generation slots, 0 on padding
  block_ids: jax.Array
  is_generation: jax.Array  # bool: slot is generated (column >= response_start)
  response_start: jax.Array  # [B] first generated column
  pad_columns: jax.Array  # [B] left padding before the prompt
  max_new_tokens: jax.Array  # [B]
  prompt_source: jax.Array  # [B] the first row with this row's prompt (the row itself if none)
  first_block_column: int = dataclasses.field(metadata=dict(static=True))  # c0


def layout_prompts(
  prompts: Sequence[Sequence[int]],
  cfg: SamplerConfig,
  mask_token_id: int,
  max_new_tokens: Optional[Sequence[int]] = None,
  prompt_width: int = 0,
) -> Layout:
  """Left-pads `prompts` onto a canvas (numpy, host side). See the module docstring.

  `prompt_width`: minimum P (rounded up to a multiple of b), to share one compile across batches.
  """
  b = cfg.resolved_block_size
  if not prompts:
    raise ValueError("layout_prompts: no prompts")
  lens = np.array([len(p) for p in prompts], np.int64)
  if lens.min() < 1:
    raise ValueError("layout_prompts: every prompt needs at least one token")
  rows = len(prompts)
  new = (
    np.full(rows, cfg.max_new_tokens, np.int64)
    if max_new_tokens is None
    else np.asarray(max_new_tokens, np.int64)
  )
  if new.shape != (rows,) or new.min() < 1 or new.max() > cfg.max_new_tokens:
    raise ValueError(
      f"layout_prompts: max_new_tokens must be {rows} values in "
      f"[1, {cfg.max_new_tokens}], got {new.tolist()}"
    )
  if cfg.block_alignment == "response":
    width = max(int(lens.max()), prompt_width, 2 * b)
    width = -(-width // b) * b
    pad = width - lens
    start = np.full(rows, width)
    c0 = width
  else:  # absolute: pads are multiples of b so that blocks stay column-aligned
    blocks_needed = -(-lens // b)
    width = max(int(blocks_needed.max()) * b, -(-prompt_width // b) * b, 2 * b)
    pad = width - blocks_needed * b
    start = pad + lens
    c0 = width - b if (lens % b).any() else width
    if c0 < 2 * b:  # keep one full block before the first decoded block
      width, pad, start, c0 = width + b, pad + b, start + b, c0 + b
  n_blocks = -(-(int(start.max()) + int(new.max()) - c0) // b)
  total = c0 + n_blocks * b
  col = np.arange(total)[None, :]
  tokens = np.full((rows, total), cfg.pad_id, np.int32)
  for i, p in enumerate(prompts):
    tokens[i, pad[i] : pad[i] + lens[i]] = np.asarray(p, np.int32)
  is_gen = col >= start[:, None]
  tokens = np.where(is_gen, mask_token_id, tokens).astype(np.int32)
  positions = np.maximum(col - pad[:, None], 0).astype(np.int32)
  segment_ids = (col >= pad[:, None]).astype(np.int32)
  if cfg.block_alignment == "response":
    block_ids = np.floor_divide(col - start[:, None], b)
  else:
    block_ids = np.floor_divide(col - pad[:, None], b)
  block_ids = np.broadcast_to(block_ids, (rows, total)).astype(np.int32)
  return Layout(
    tokens=tokens,
    positions=positions,
    segment_ids=segment_ids,
    block_ids=block_ids,
    is_generation=is_gen,
    response_start=start.astype(np.int32),
    pad_columns=pad.astype(np.int32),
    max_new_tokens=new.astype(np.int32),
    prompt_source=prompt_sources(prompts),
    first_block_column=int(c0),
  )


def prompt_group(sources) -> int:
  """The group size m when the rows are contiguous groups of m >= 2 sharing a prompt (`sources`
  of `prompt_sources`: row b's is b // m * m), else 0 (`DecodeTiles.cascade`)."""
  src = np.asarray(sources)
  m = int(np.sum(src == 0))
  if m < 2 or len(src) % m or not np.array_equal(src, np.arange(len(src)) // m * m):
    return 0
  return m


def prompt_sources(prompts: Sequence[Sequence[int]]) -> np.ndarray:
  """`[B]` int32: for each prompt, the first row with the same tokens (an RL group's members all
  point at its first row; `DecodeTiles.share_prompts`)."""
  first: dict[tuple, int] = {}
  return np.array(
    [first.setdefault(tuple(map(int, p)), i) for i, p in enumerate(prompts)], np.int32
  )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleOutput:
  tokens: jax.Array  # [B, C] int32
  step_map: jax.Array  # [B, C] int32, -1 = prompt / pad / not generated
  logprobs: Optional[jax.Array]  # [B, C] f32 or None
  response_start: jax.Array  # [B] first generated column
  response_lengths: jax.Array  # [B] response tokens incl. the first stop id, <= max_new_tokens
  steps_used: jax.Array  # [B] denoising forwards of each row (= its step_map max + 1)
  forwards: jax.Array  # [] decode forwards of the batch (excl. prefill)
  prefill_columns: int = dataclasses.field(metadata=dict(static=True))

  def responses(self) -> list[list[int]]:
    """Host-side list of each row's response tokens (up to `response_lengths`)."""
    toks, start, n = (
      np.asarray(x) for x in (self.tokens, self.response_start, self.response_lengths)
    )
    return [toks[i, start[i] : start[i] + n[i]].tolist() for i in range(toks.shape[0])]


def _prompt_rows(layout: Layout, width: int):
  """(prompts `[B, width]` from column 0, prompt lengths `[B]`) read off the canvas."""
  n = layout.response_start - layout.pad_columns
  col = jnp.arange(width, dtype=jnp.int32)[None, :]
  idx = jnp.clip(layout.pad_columns[:, None] + col, 0, layout.tokens.shape[1] - 1)
  prompts = jnp.take_along_axis(layout.tokens, idx, axis=1)
  return jnp.where(col < n[:, None], prompts, 0), n


def _prefill_width(model, layout: Layout, cfg: SamplerConfig) -> int:
  """Static prefill width: every prompt fits (flash prefill tiles by 128). Response alignment:
  prompts end by column c0; absolute: by c0 + b (c0 may sit inside the last prompt block)."""
  width = layout.first_block_column + (cfg.block_size if cfg.block_alignment == "absolute" else 0)
  tile = 128 if model.cfg.attention_impl == "flash" else 8
  return -(-width // tile) * tile


def _cache_len(model, cfg: SamplerConfig, total: int, prefill: int) -> int:
  b = cfg.block_size
  flash = model.cfg.attention_impl == "flash"
  multiple = platform.cache_multiple(cfg.decode_tiles.block_k) if flash else 16
  return slots_lib.cache_slots(b, max(total, prefill), 0, multiple)


def _prefill_rows(cfg: SamplerConfig, rows: int) -> int:
  return cfg.prefill_chunk if cfg.prefill_chunk and rows % cfg.prefill_chunk == 0 else rows


def _prefill_plan(cfg: SamplerConfig, placement, rows: int) -> tuple[int, int, int]:
  """(rows a prefill chunk admits, row shards it is split over, rows one prefill forward stands
  for): the last is the layout's prompt group (`prefill_once_per_group`, `DecodeTiles.prompt_group`
  set by `decode`) where every chunk holds whole groups on one row shard, else 1."""
  chunk = _prefill_rows(cfg, rows)
  shards = placement.shard_rows(rows)
  shards = shards if chunk % shards == 0 else 1
  m = cfg.decode_tiles.prompt_group
  grouped = cfg.prefill_once_per_group and m > 1 and shards == 1 and chunk % m == 0
  return chunk, shards, m if grouped else 1


def with_prompt_group(cfg: SamplerConfig, layout: Layout) -> SamplerConfig:
  """`cfg` with `DecodeTiles.prompt_group` set to the layout's group size (`prompt_group`; static
  in the compiled sampler) where the cascade or the grouped prefill reads it."""
  if not (cfg.decode_tiles.cascade or cfg.prefill_once_per_group):
    return cfg
  m = prompt_group(layout.prompt_source)
  return dataclasses.replace(
    cfg, decode_tiles=dataclasses.replace(cfg.decode_tiles, prompt_group=m)
  )


def memory_estimate(model, layout: Layout, cfg: SamplerConfig, placement=None) -> dict:
  """`memory.estimate` of `decode(model, layout, cfg)` (bytes by part, per device of the model's
  mesh or `placement`)."""
  cfg = with_prompt_group(cfg, layout)
  rows, total = layout.tokens.shape
  prefill = _prefill_width(model, layout, cfg)
  placement = placement or Placement.of(nnx.state(model))
  chunk, _, group = _prefill_plan(cfg, placement, rows)
  return memory.estimate(
    model.cfg,
    rows=rows,
    cache_len=_cache_len(model, cfg, total, prefill),
    block_size=cfg.block_size,
    prefill_rows=chunk,
    prefill_width=prefill,
    prefill_group=group,
    decode_weights=cfg.splits_weights(model.cfg),
    cache_dtype=cfg.cache_dtype(model.cfg),
    weights_dtype=cfg.weights_dtype,
    **placement.shards(model.cfg, rows),
  )


@functools.partial(jax.jit, static_argnames=("graphdef", "placement", "weights_dtype"))
def _split_weights(graphdef, state, placement: Placement, weights_dtype=None) -> DecodeWeights:
  model = nnx.merge(graphdef, state)
  weights = model.decode_weights(placement.fuses_projections, weights_dtype)
  return jax.lax.with_sharding_constraint(weights, placement.decode_weights(model, weights))


def split_weights(
  graphdef, state, placement: Optional[Placement] = None, weights_dtype: Optional[str] = None
) -> DecodeWeights:
  """`Transformer.decode_weights()` of the model `(graphdef, state)`, compiled (one pass of
  copies), laid out on the model's mesh (or `placement`) as the training rules lay out the
  parameters (`Placement.decode_weights`): each device holds its share. `weights_dtype`:
  `SamplerConfig.weights_dtype` (float8 projections)."""
  placement = placement or Placement.of(state)
  with placement.context():
    return _split_weights(graphdef, state, placement, weights_dtype)


def decoding_model(graphdef, state, weights: Optional[DecodeWeights]):
  """The model a compiled sampler step runs: with its split weights bound when it has them."""
  model = nnx.merge(graphdef, state)
  return model if weights is None else DecodeView(model, weights)


def commit_groups(cfg: SamplerConfig, placement: Placement, rows: int) -> int:
  """The row groups `cfg.commit_rows` packs apart: one per row shard of `placement` (each device
  packs its own rows: no gather crosses devices), two per shard with `DecodeTiles.halves` (each
  row half's forward packs its own). Raises unless commit_rows divides into them."""
  shards = placement.shard_rows(rows)
  n = shards * (2 if cfg.decode_tiles.halves else 1)
  if cfg.commit_rows % n:
    what = f"{shards} row shards" + (" x 2 row halves" if cfg.decode_tiles.halves else "")
    raise ValueError(
      f"SamplerConfig.commit_rows ({cfg.commit_rows}) must be a multiple of the {what} "
      f"the {rows} rows are split into (each packs commit_rows / {n} of its own rows)"
    )
  return n


def _chunk_rows(rows: int, chunk: int, shards: int, i):
  """The rows prefill chunk `i` admits: `chunk / shards` of every row shard's `rows / shards`
  (row shard j's in the j-th block: each device prefills rows it holds; `slots.admit`)."""
  per, c = rows // shards, chunk // shards
  ids = jnp.arange(shards)[:, None] * per + i * c + jnp.arange(c)[None, :]
  return ids.reshape(-1).astype(jnp.int32)


def _decode(graphdef, state, weights, layout: Layout, keys, *, cfg: SamplerConfig, placement):
  model = decoding_model(graphdef, state, weights)
  layout, keys = placement.constrain_rows((layout, keys))
  b = cfg.block_size
  rows, total = layout.tokens.shape
  groups = commit_groups(cfg, placement, rows)
  width = slots_lib.out_width(b, total)
  prefill = _prefill_width(model, layout, cfg)
  cache = KVCache.empty(
    model.cfg,
    rows,
    _cache_len(model, cfg, total, prefill),
    dtype=cfg.cache_dtype(model.cfg),
    tiles=cfg.decode_tiles,
  )
  cache = placement.constrain_cache(cache)
  sl = slots_lib.empty_slots(rows, b, width, cfg.return_logprobs, model.cfg.mask_token_id)
  sl = placement.constrain_rows(sl)
  prompts, n = _prompt_rows(layout, prefill)
  chunk, shards, group = _prefill_plan(cfg, placement, rows)

  def admit_chunk(i, carry):
    sl_, cache_ = carry
    ids = _chunk_rows(rows, chunk, shards, i)
    pick = lambda x: jnp.take(x, ids, axis=0)
    return slots_lib.admit(
      model,
      sl_,
      cache_,
      ids,
      pick(prompts),
      pick(n),
      pick(layout.max_new_tokens),
      pick(keys),
      cfg,
      placement,
      group=group,
    )

  sl, cache = jax.lax.fori_loop(0, rows // chunk, admit_chunk, (sl, cache))
  tiles = cfg.decode_tiles
  if tiles.share_prompts or tiles.cascade:  # equal prompts prefilled alike: [0, first) are equal
    cache = cache.with_prompt_sources(layout.prompt_source, sl.first_pos)

  def block_cond(c):
    k_blk, sl_, _, _ = c
    return (k_blk < width // b) & ~jnp.all(sl_.done)

  def block_body(c):
    k_blk, sl_, cache_, forwards = c
    sl_, cache_, _, fw = slots_lib.advance(model, sl_, cache_, cfg, groups)
    return k_blk + 1, sl_, cache_, forwards + fw

  _, sl, _, forwards = jax.lax.while_loop(
    block_cond, block_body, (jnp.asarray(0), sl, cache, jnp.asarray(0))
  )

  # Canvas columns from each row's output buffer (index = position - first decoded position).
  col = jnp.arange(total, dtype=jnp.int32)[None, :]
  j = col - layout.pad_columns[:, None] - sl.first_pos[:, None]
  jj = jnp.clip(j, 0, width - 1)
  gen = col >= layout.response_start[:, None]
  steps = jnp.take_along_axis(sl.out_steps, jj, axis=1)
  decoded = gen & (j >= 0) & (j < width) & (steps >= 0)
  tokens = jnp.take_along_axis(sl.out_tokens, jj, axis=1)
  canvas = jnp.where(gen, jnp.where(decoded, tokens, cfg.pad_id), layout.tokens)
  logp = None
  if cfg.return_logprobs:
    logp = jnp.where(decoded, jnp.take_along_axis(sl.out_logp, jj, axis=1), 0.0)
  return SampleOutput(
    tokens=canvas,
    step_map=jnp.where(decoded, steps, -1),
    logprobs=logp,
    response_start=layout.response_start,
    response_lengths=slots_lib.response_lengths(sl, cfg.stop_ids),
    steps_used=sl.steps_used,
    forwards=forwards,
    prefill_columns=layout.first_block_column - b,
  )


@functools.lru_cache(maxsize=16)
def compiled_decode(graphdef, cfg: SamplerConfig, placement: Placement, options: tuple = ()):
  """The static sampler for one (model graph, config, placement, XLA options `((name, value),
  ...)`), jitted: (state, weights, layout, keys) -> SampleOutput. The parameters and their
  decode copy as they are laid out; the layout and keys as they come (host values, the same on
  every process, or arrays on the mesh), split over the rows inside; the outputs row-split. The
  KV cache is made inside, row-split, exactly once (the loops carry it). Call (and lower) it
  under `placement.context()`."""
  return jax.jit(
    functools.partial(_decode, graphdef, cfg=cfg, placement=placement),
    compiler_options=dict(options) or None,
  )


def row_keys(rng, rows: int):
  """Default per-row keys: row i gets `fold_in(rng, i)`."""
  rng = jax.random.key(0) if rng is None else rng
  return jax.vmap(lambda i: jax.random.fold_in(rng, i))(jnp.arange(rows))


def decode(
  model, layout: Layout, cfg: SamplerConfig, rng=None, keys=None, device_bytes=None
) -> SampleOutput:
  """Runs the compiled sampler on a prepared `Layout` (see `layout_prompts`).

  `keys`: one PRNG key per row (typed `[B]`); default `row_keys(rng, B)`. Before compiling, the
  setting's memory (`memory_estimate`) is checked against `device_bytes` (default: the device's
  limit), with a clear error when it cannot fit.
  """
  trace_context.settle()  # else the first call's kernels change the context (trace_context.py)
  cfg = with_prompt_group(cfg.for_model(model.cfg), layout)
  graphdef, state = nnx.split(model)
  placement = Placement.of(state)
  memory.check_fits(
    memory_estimate(model, layout, cfg, placement),
    device_bytes,
    what=f"sampler.decode (batch {layout.tokens.shape[0]}, {layout.tokens.shape[1]} columns)",
  )
  rows = layout.tokens.shape[0]
  keys = row_keys(rng, rows) if keys is None else keys
  if keys.shape != (rows,):
    raise ValueError(f"decode: keys must be {rows} typed PRNG keys, got shape {keys.shape}")
  weights = None
  if cfg.splits_weights(model.cfg):
    weights = split_weights(graphdef, state, placement, cfg.weights_dtype)
  with placement.context(), trace_context.watched("sampler.decode"):
    return compiled_decode(graphdef, cfg, placement)(state, weights, layout, keys)


def generate(
  model,
  prompts: Sequence[Sequence[int]],
  cfg: SamplerConfig,
  rng=None,
  max_new_tokens: Optional[Sequence[int]] = None,
  prompt_width: int = 0,
  keys=None,
  device_bytes=None,
) -> SampleOutput:
  """Samples continuations of token-id `prompts` (list of lists, any lengths)."""
  cfg = cfg.for_model(model.cfg)
  layout = layout_prompts(prompts, cfg, model.cfg.mask_token_id, max_new_tokens, prompt_width)
  return decode(model, layout, cfg, rng, keys, device_bytes)
