"""KV-cached block-diffusion sampler (reference §2.4, §1.7; BD3-LM §4 "Sampling").

Blocks are decoded in parallel inside and autoregressively across: a block starts all-[MASK]; each
denoising forward runs the active block against the KV cache of the committed prefix, draws a
candidate per position and unmasks some of them (`remasking.py`); after at most `steps` forwards
the block is final and its keys/values are committed.

Exact cheaper commit. SDAR/JetEngine spend one extra forward per block to write the final block's
K/V. Here the commit of block k-1 is fused into block k's first denoising forward: the input is
[final block k-1 ; all-mask block k] (2b tokens) under the block-causal mask, so block k-1 sees only
the cache and itself (exactly the commit pass) and block k sees the cache, block k-1 and itself
(exactly the first denoising pass). Its 2b K/V rows are appended, then the cache length is rolled
back by b so that block k's provisional rows are overwritten later. Per block this costs `steps`
forwards (one of 2b tokens) instead of `steps + 1`; the last block needs no commit at all.

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
    stop id, capped at max_new_tokens[i].
  * `step_map[i, c]` int32: the per-row denoising step (0, 1, 2, ... counting this row's forwards
    that had masks in its active block, across blocks) at which token (i, c) was unmasked; -1 for
    prompt, padding and never-generated slots. Replay: `state_before_step` in `trace.py`.
  * `logprobs[i, c]`: log-probability of the chosen token under the unfiltered model distribution
    at the forward that unmasked it (0 where step_map is -1), when `return_logprobs`.

Compilation: one jit per (model graph, config, batch size, prompt width); blocks and steps are
`lax.while_loop`s, so nothing recompiles per block or step. The cache and the canvas live inside
the compiled loop (updated in place); the initial canvas passed in is donated to the output.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dice_jax.diffusion import blocks as blocks_lib
from dice_jax.diffusion import remasking
from dice_jax.model import masks as masks_lib
from dice_jax.model.kv_cache import KVCache


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  """Decoding settings (static under jit)."""

  block_size: int = 4
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

  def __post_init__(self):
    blocks_lib.check_alignment(self.block_alignment)
    if self.strategy not in remasking.STRATEGIES:
      raise ValueError(
        f"SamplerConfig.strategy must be one of {remasking.STRATEGIES}, got {self.strategy!r}"
      )
    for name in ("block_size", "steps", "max_new_tokens"):
      if getattr(self, name) < 1:
        raise ValueError(f"SamplerConfig.{name} must be >= 1, got {getattr(self, name)}")
    if self.temperature < 0 or self.top_k < 0 or not 0.0 < self.top_p <= 1.0:
      raise ValueError(
        f"SamplerConfig: bad temperature/top_k/top_p "
        f"({self.temperature}, {self.top_k}, {self.top_p})"
      )
    if not isinstance(self.stop_ids, tuple):
      object.__setattr__(self, "stop_ids", tuple(self.stop_ids))


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
  b = cfg.block_size
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
    first_block_column=int(c0),
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


def _slice_cols(x, start, width):
  return jax.lax.dynamic_slice_in_dim(x, start, width, axis=1)


def _prefill(
  model, layout: Layout, width: int, chunk: int, max_len: int, block_size: int
) -> KVCache:
  """Cache holding the first `width` columns, computed `chunk` rows at a time."""
  cfg = model.cfg
  rows = layout.tokens.shape[0]
  chunk = chunk if chunk and rows % chunk == 0 else rows
  cache = KVCache.empty(cfg, rows, max_len)
  if width == 0:
    return cache
  small_len = -(-width // 16) * 16  # flash_decode tiles the cache in multiples of 16
  tok, pos = layout.tokens[:, :width], layout.positions[:, :width]
  seg, blk = layout.segment_ids[:, :width], layout.block_ids[:, :width]

  def one(i, kv):
    k_all, v_all = kv
    sl = lambda x: jax.lax.dynamic_slice_in_dim(x, i * chunk, chunk, axis=0)
    spec = masks_lib.AttentionSpec.block_causal(block_size, sl(seg), sl(blk))
    small = KVCache.empty(cfg, chunk, small_len)
    _, small = model(sl(tok), sl(pos), spec, cache=small, update_cache=True, return_hidden=True)
    k_all = jax.lax.dynamic_update_slice(k_all, small.k, (0, i * chunk, 0, 0, 0))
    v_all = jax.lax.dynamic_update_slice(v_all, small.v, (0, i * chunk, 0, 0, 0))
    return k_all, v_all

  k, v = jax.lax.fori_loop(0, rows // chunk, one, (cache.k, cache.v))
  pad = lambda x: jnp.pad(x, ((0, 0), (0, max_len - width)))
  return KVCache(
    k=k,
    v=v,
    positions=pad(pos),
    segment_ids=pad(seg),
    block_ids=pad(blk),
    length=jnp.asarray(width, jnp.int32),
  )


class _Carry(NamedTuple):
  """Decoding state carried through the block and step loops."""

  canvas: jax.Array  # [B, C] tokens
  step_map: jax.Array  # [B, C]
  logp: Optional[jax.Array]  # [B, C] or None
  steps_used: jax.Array  # [B] per-row denoising forwards so far (the next step id)
  done: jax.Array  # [B] row stopped
  key: jax.Array


def _decode(graphdef, state, layout: Layout, canvas, rng, *, cfg: SamplerConfig):
  model = nnx.merge(graphdef, state)
  mcfg = model.cfg
  b, steps = cfg.block_size, cfg.steps
  rows, total = layout.tokens.shape
  c0 = layout.first_block_column
  n_blocks = (total - c0) // b
  mask_id = mcfg.mask_token_id
  schedule = jnp.asarray(remasking.transfer_schedule(b, steps))
  tile = 512 if mcfg.attention_impl == "flash" else 16  # flash_decode: whole cache splits
  cache_len = -(-total // tile) * tile
  cache = _prefill(model, layout, c0 - b, cfg.prefill_chunk, cache_len, b)
  stop_ids = jnp.asarray(cfg.stop_ids if cfg.stop_ids else (-1,), jnp.int32)

  def masked_in_block(carry: _Carry, col):
    cur = _slice_cols(carry.canvas, col, b)
    gen = _slice_cols(layout.is_generation, col, b)
    return cur, (cur == mask_id) & gen & ~carry.done[:, None]

  def denoise(carry: _Carry, logits_bnv, col, s_in_block) -> _Carry:
    """One denoising update of the active block at `col` from its logits (in-block step s)."""
    canvas, step_map, logp, steps_used, done, key = carry
    key, sub = jax.random.split(key)
    cur, masked = masked_in_block(carry, col)
    cand = remasking.sample_candidates(
      sub,
      logits_bnv,
      temperature=cfg.temperature,
      top_k=cfg.top_k,
      top_p=cfg.top_p,
      want_entropy=cfg.strategy == "entropy_bounded",
      want_logprob=cfg.return_logprobs,
    )
    k = jnp.broadcast_to(schedule[jnp.minimum(s_in_block, steps - 1)], (rows,))
    sel = remasking.select_transfer(
      cfg.strategy,
      masked,
      cand["confidence"],
      cand["entropy"],
      k,
      threshold=cfg.threshold,
      eb_threshold=cfg.eb_threshold,
      flush=s_in_block >= steps - 1,
    )
    had_mask = jnp.any(masked, axis=-1)
    canvas = jax.lax.dynamic_update_slice_in_dim(
      canvas, jnp.where(sel, cand["token"], cur), col, axis=1
    )
    sm = jnp.where(sel, steps_used[:, None], _slice_cols(step_map, col, b))
    step_map = jax.lax.dynamic_update_slice_in_dim(step_map, sm, col, axis=1)
    if logp is not None:
      lp = jnp.where(sel, cand["logprob"], _slice_cols(logp, col, b))
      logp = jax.lax.dynamic_update_slice_in_dim(logp, lp, col, axis=1)
    steps_used = steps_used + had_mask.astype(jnp.int32)
    return _Carry(canvas, step_map, logp, steps_used, done, key)

  def forward(canvas, cache, col, width, update):
    """Logits of the last b of `width` columns from `col`, against (and maybe into) the cache."""
    cols = lambda x: _slice_cols(x, col, width)
    spec = masks_lib.AttentionSpec.block_causal(b, cols(layout.segment_ids), cols(layout.block_ids))
    hidden, cache = model(
      cols(canvas),
      cols(layout.positions),
      spec,
      cache=cache,
      update_cache=update,
      return_hidden=True,
    )
    return model.logits_from_hidden(hidden[:, -b:]), cache

  def block_body(state_):
    k_blk, cache, carry, forwards = state_
    col = c0 + k_blk * b
    # Step 0: commit block k-1 and denoise block k in one forward of 2b tokens; keep only block
    # k-1's K/V (block k's provisional rows are overwritten by the next append).
    logits, cache = forward(carry.canvas, cache, col - b, 2 * b, True)
    cache = dataclasses.replace(cache, length=cache.length - b)
    carry = denoise(carry, logits, col, jnp.asarray(0))

    def step_cond(s_state):
      s, carry_, _ = s_state
      return (s < steps) & jnp.any(masked_in_block(carry_, col)[1])

    def step_body(s_state):
      s, carry_, fw = s_state
      logits_, _ = forward(carry_.canvas, cache, col, b, False)
      carry_ = denoise(carry_, logits_, col, s)
      return s + 1, carry_, fw + 1

    _, carry, forwards = jax.lax.while_loop(
      step_cond, step_body, (jnp.asarray(1), carry, forwards + 1)
    )
    # Stop rows that emitted a stop id in this block or reached their token budget.
    cur = _slice_cols(carry.canvas, col, b)
    gen = _slice_cols(layout.is_generation, col, b)
    hit_stop = jnp.any(gen & jnp.isin(cur, stop_ids), axis=-1)
    budget = (col + b - layout.response_start) >= layout.max_new_tokens
    carry = carry._replace(done=carry.done | hit_stop | budget)
    return k_blk + 1, cache, carry, forwards

  def block_cond(state_):
    k_blk, _, carry, _ = state_
    return (k_blk < n_blocks) & ~jnp.all(carry.done)

  step_map = jnp.full((rows, total), -1, jnp.int32)
  logp = jnp.zeros((rows, total), jnp.float32) if cfg.return_logprobs else None
  carry = _Carry(
    canvas, step_map, logp, jnp.zeros((rows,), jnp.int32), jnp.zeros((rows,), bool), rng
  )
  _, _, carry, forwards = jax.lax.while_loop(
    block_cond, block_body, (jnp.asarray(0), cache, carry, jnp.asarray(0))
  )
  canvas, step_map, logp, steps_used, _, _ = carry

  never = layout.is_generation & (step_map < 0)
  canvas = jnp.where(never, cfg.pad_id, canvas)
  idx = jnp.arange(total)[None, :] - layout.response_start[:, None]
  stop_hit = layout.is_generation & (step_map >= 0) & jnp.isin(canvas, stop_ids)
  first_stop = jnp.min(jnp.where(stop_hit, idx, total), axis=-1)
  generated = jnp.sum(layout.is_generation & (step_map >= 0), axis=-1)
  lengths = jnp.minimum(jnp.minimum(first_stop + 1, generated), layout.max_new_tokens)
  return SampleOutput(
    tokens=canvas,
    step_map=step_map,
    logprobs=logp,
    response_start=layout.response_start,
    response_lengths=lengths,
    steps_used=steps_used,
    forwards=forwards,
    prefill_columns=c0 - b,
  )


_decode_jit = jax.jit(_decode, static_argnames=("graphdef", "cfg"), donate_argnames=("canvas",))


def decode(model, layout: Layout, cfg: SamplerConfig, rng=None) -> SampleOutput:
  """Runs the compiled sampler on a prepared `Layout` (see `layout_prompts`)."""
  graphdef, state = nnx.split(model)
  rng = jax.random.key(0) if rng is None else rng
  layout = jax.tree.map(jnp.asarray, layout)
  canvas = jnp.array(layout.tokens)  # a fresh buffer, donated to the output tokens
  return _decode_jit(graphdef, state, layout, canvas, rng, cfg=cfg)


def generate(
  model,
  prompts: Sequence[Sequence[int]],
  cfg: SamplerConfig,
  rng=None,
  max_new_tokens: Optional[Sequence[int]] = None,
  prompt_width: int = 0,
) -> SampleOutput:
  """Samples continuations of token-id `prompts` (list of lists, any lengths)."""
  layout = layout_prompts(prompts, cfg, model.cfg.mask_token_id, max_new_tokens, prompt_width)
  return decode(model, layout, cfg, rng)
