"""Block decoding of independent rows ("slots") on one KV cache: admission and one block at a time.

SDAR inference (JetAstra/SDAR `generate.py`), JetEngine as DICE's RL rollouts use it (DICE,
github.com/deadlykitten4/DICE, `training/RL/sample/jetengine_ext`); BD3-LM (arXiv 2503.09573) §4. Both the static sampler
(`sampler.decode`) and the continuous-batching engine (`engine.ContinuousSampler`) are loops over
the two functions here:

  `admit`    prefills the prompts of some rows into their cache rows and resets their state;
  `advance`  decodes one block of every live row: a fused commit + first denoising forward, then
             up to `steps - 1` more denoising forwards while any live row has a [MASK] left
             (lockstep); or, with `cfg.ragged`, `steps` forwards in which each row commits and
             moves on as soon as its own block is decided (`advance_ragged`).

Rows are independent: each has its own positions (no left padding), its own cache region (row b of
the cache, slot = position + block_size), its own step counter and its own PRNG key; rows only
share the forwards. A row therefore decodes exactly the same tokens and step map whatever the
other rows are doing (batched, alone, or refilled mid-run).

Exact cheaper commit. SDAR/JetEngine spend one extra forward per block to write the final block's
K/V. Here block k-1 is committed by block k's first denoising forward, whose input is
[final block k-1 ; all-mask block k] (2b tokens) under the block-causal mask: block k-1 sees only
the cache and itself (exactly the commit pass) and block k sees the cache, block k-1 and itself
(exactly the first denoising pass). The cache keeps block k-1's rows and drops block k's
provisional ones (the row's `length` stops before them). `steps` forwards per block, not
`steps + 1`. The first block's "previous block" is the prompt's last b tokens before it (padding,
segment 0, where the prompt is shorter), so prefill covers positions [0, first_block - b).

Commit cap (`cfg.commit_rows` = R > 0, `advance_ragged`). A ragged forward is 2b tokens wide for
every row, but only a fresh row (one committing its previous block) needs its first b: a mid-block
row's are invisible. On an H200 (sdar_4b, 128 rows, b = 4) the matmuls of a forward (6.1 of
15.6 ms at 4 tokens a row) scale with its tokens and the cache attention (7.35 ms) does not; with
threshold 0.9 about 38 % of rows are fresh in a forward. With the cap at most R fresh rows commit
in a forward (those deferred longest first, then by slot index: `_choose_commits`) and the
per-token work runs on N = S*b + R*b packed tokens (`_pack_index`); a fresh row not chosen is
deferred: that forward it is not live (no denoise, no state change, no step counted; its writes go
to its scratch slots) and it commits in a later one. Its tokens, step map and log-probs are
unchanged (its PRNG folds its own `steps_used`). With rows split over n devices (`groups` = n row
shards, in order) each shard packs its own rows with R/n commit places: no gather crosses shards.

Slot layout of a cache row: position p lives in slot p + b (positions -b..-1 are the padding of a
short prompt's first commit); before a block's fused forward `length = block_pos`, after it
`length = block_pos + b`. Admission rewrites the whole row's metadata, so a previous sequence's
slots become invisible (segment 0).

The cache is carried through every loop (never closed over by an inner loop that runs while the
outer one updates it: XLA would copy it) and updated in place; see `tests/diffusion/test_engine.py`
for the compiled-memory check.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dice_jax.diffusion import remasking
from dice_jax.model import masks as masks_lib
from dice_jax.model.kv_cache import KVCache, put_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Slots:
  """Per-row decoding state (arrays `[S, ...]`, row i = slot i)."""

  block: jax.Array  # [S, b] int32 tokens of the active block ([MASK] where undecided)
  block_steps: jax.Array  # [S, b] int32 step at which each token was unmasked (-1: not yet/prompt)
  block_logp: jax.Array  # [S, b] f32 log-prob of each unmasked token (0 elsewhere)
  prev: jax.Array  # [S, b] int32 tokens of the previous block (committed by the next forward)
  block_pos: jax.Array  # [S] int32 position of the active block's first token
  prompt_len: jax.Array  # [S] int32 prompt tokens (= position where the response starts)
  first_pos: jax.Array  # [S] int32 position of the first decoded block (out index 0)
  max_new: jax.Array  # [S] int32 token budget of the response
  steps_used: jax.Array  # [S] int32 denoising forwards with masks so far (= the next step id)
  forwards: jax.Array  # [S] int32 decode forwards the row took part in since admission
  done: jax.Array  # [S] bool: finished, or an empty slot
  fresh: jax.Array  # [S] bool: the active block's first forward (which commits `prev`) is next
  block_step: jax.Array  # [S] int32 forwards run on the active block (its in-block step)
  waited: jax.Array  # [S] int32 forwards a fresh row was deferred (`commit_rows`) before committing
  key: jax.Array  # [S] PRNG keys (typed), one per row
  out_tokens: jax.Array  # [S, W] int32 finished blocks, index = position - first_pos
  out_steps: jax.Array  # [S, W] int32 step map of out_tokens (-1: not generated)
  out_logp: jax.Array  # [S, W] f32 (or [S, 0] when log-probs are off)


def out_width(block_size: int, max_new_tokens: int) -> int:
  """Columns of `Slots.out_*`: the first decoded block may hold up to b - 1 prompt tokens and the
  last one up to b - 1 tokens past the budget."""
  b = block_size
  return -(-(max_new_tokens + 2 * b - 2) // b) * b


def cache_slots(block_size: int, max_prompt: int, max_new_tokens: int, multiple: int) -> int:
  """Cache slots a row needs: b leading slots, the prompt, the response and the provisional
  block, then 2b scratch slots (the ragged step's parked writes), rounded up to `multiple`.
  The scratch region is the last 2b slots of the row (`scratch_start`), above any row's length."""
  b = block_size
  need = b + max_prompt + max_new_tokens + 2 * b + 2 * b
  return -(-need // multiple) * multiple


def scratch_start(cache: KVCache, block_size: int) -> int:
  """First slot of every row's scratch region (never below a row's length: `cache_slots`)."""
  return cache.max_len - 2 * block_size


def empty_slots(rows: int, block_size: int, width: int, want_logp: bool, mask_id: int) -> Slots:
  z = lambda *shape: jnp.zeros(shape, jnp.int32)
  return Slots(
    block=jnp.full((rows, block_size), mask_id, jnp.int32),
    block_steps=jnp.full((rows, block_size), -1, jnp.int32),
    block_logp=jnp.zeros((rows, block_size), jnp.float32),
    prev=z(rows, block_size),
    block_pos=z(rows),
    prompt_len=z(rows),
    first_pos=z(rows),
    max_new=z(rows),
    steps_used=z(rows),
    forwards=z(rows),
    done=jnp.ones((rows,), bool),
    fresh=jnp.zeros((rows,), bool),
    block_step=z(rows),
    waited=z(rows),
    key=jax.random.split(jax.random.key(0), rows),
    out_tokens=z(rows, width),
    out_steps=jnp.full((rows, width), -1, jnp.int32),
    out_logp=jnp.zeros((rows, width if want_logp else 0), jnp.float32),
  )


def _set_rows(slots: Slots, rows, **values) -> Slots:
  return dataclasses.replace(
    slots, **{k: getattr(slots, k).at[rows].set(v, mode="drop") for k, v in values.items()}
  )


def admit(
  model,
  slots: Slots,
  cache: KVCache,
  rows,
  prompts,
  prompt_len,
  max_new,
  keys,
  cfg,
  placement=None,
  group: int = 1,
):
  """Starts sequences in slots `rows` `[R]`: prompts `[R, P]` (token ids from column 0, any
  padding after `prompt_len [R]`), budgets `max_new [R]`, PRNG keys `[R]`. Prefills their cache
  rows (positions [0, first block - b)) and resets their state. P is static (a width bucket);
  `b + P` must fit the cache. A row index >= the slot count admits nothing (padding).

  `group` > 1: the rows are consecutive groups of that many with equal prompts
  (`SamplerConfig.prefill_once_per_group`); each group's first row is prefilled and its keys and
  values are written to every member's row.

  With a `placement` (`placement.Placement`), the admitted rows are split over its row shards
  like the slots, in order (the j-th block of R/n rows in shard j's slots, or padding), and each
  device prefills and writes its own (`Placement.write_rows`)."""
  if placement is not None:
    rows, prompts, prompt_len, max_new, keys = placement.constrain_rows(
      (rows, prompts, prompt_len, max_new, keys)
    )
  grid, b = cfg.grid, cfg.block_size
  mask_id = model.cfg.mask_token_id
  r, width = prompts.shape
  col = jnp.arange(width, dtype=jnp.int32)[None, :]
  n = prompt_len.astype(jnp.int32)[:, None]
  first = grid.first_block_start(n)
  pre = jnp.maximum(first - b, 0)  # prefilled prompt positions
  seg = (col < pre).astype(jnp.int32)
  blk = grid.block_of(col, n).astype(jnp.int32)
  pos = jnp.broadcast_to(col, (r, width))
  lead = slice(None, None, group)  # each group's first row (every row when group is 1)
  spec = masks_lib.AttentionSpec.block_causal(b, seg[lead], blk[lead])
  k, v = model.prefill_kv(prompts[lead], pos[lead], spec)  # [L, R / group, T, K, H]
  slot_pos = jnp.broadcast_to(
    jnp.arange(cache.max_len, dtype=jnp.int32)[None] - b, (r, cache.max_len)
  )
  meta = (
    slot_pos,
    ((slot_pos >= 0) & (slot_pos < pre)).astype(jnp.int32),
    grid.block_of(slot_pos, n).astype(jnp.int32),
    first[:, 0],
  )
  # the j-th member of every group gets its leader's K/V: `group` writes of the leaders' rows, so no
  # [L, R, T, K, H] repeat of them is made (XLA on the GPU fused such a repeat into the write; the CPU
  # did not: docs/performance.md, issue 39 session 32)
  for j in range(group):
    member = slice(j, None, group)
    args = (rows[member], k, v, b, *(x[member] for x in meta))
    cache = cache.write_rows(*args) if placement is None else placement.write_rows(cache, *args)
  offs = jnp.arange(b, dtype=jnp.int32)[None, :]
  take = lambda p: jnp.take_along_axis(prompts, jnp.clip(p, 0, width - 1), axis=1)
  prev_pos, blk_pos = first - b + offs, first + offs
  prev = jnp.where(prev_pos >= 0, take(prev_pos), 0)
  block = jnp.where(blk_pos < n, take(blk_pos), mask_id)
  zeros = jnp.zeros((r,), jnp.int32)
  slots = _set_rows(
    slots,
    rows,
    block=block,
    block_steps=jnp.full((r, b), -1, jnp.int32),
    block_logp=jnp.zeros((r, b), jnp.float32),
    prev=prev,
    block_pos=first[:, 0],
    prompt_len=n[:, 0],
    first_pos=first[:, 0],
    max_new=max_new.astype(jnp.int32),
    steps_used=zeros,
    forwards=zeros,
    done=jnp.zeros((r,), bool),
    fresh=jnp.ones((r,), bool),
    block_step=zeros,
    waited=zeros,
    key=keys,
    out_tokens=jnp.zeros((r, slots.out_tokens.shape[1]), jnp.int32),
    out_steps=jnp.full((r, slots.out_steps.shape[1]), -1, jnp.int32),
  )
  if slots.out_logp.shape[1]:
    slots = _set_rows(slots, rows, out_logp=jnp.zeros((r, slots.out_logp.shape[1]), jnp.float32))
  return slots, cache


class _BlockInputs(NamedTuple):
  tokens2: jax.Array  # [S, 2b] [previous block ; active block]
  pos2: jax.Array  # [S, 2b] their positions
  spec2: masks_lib.AttentionSpec  # the fused forward's mask
  pos_blk: jax.Array  # [S, b] the active block's positions
  spec1: masks_lib.AttentionSpec  # a denoising forward's mask (the active block alone)
  gen: jax.Array  # [S, b] bool: active-block positions the row generates (not prompt)


def _block_inputs(slots: Slots, cfg, commit) -> _BlockInputs:
  """Inputs of the forwards on every row's active block. The fused forward's previous block is
  visible (and committed) only in rows `commit` `[S]`; the active block in every live row."""
  grid, b = cfg.grid, cfg.block_size
  live = ~slots.done
  pos_blk = slots.block_pos[:, None] + jnp.arange(b, dtype=jnp.int32)[None, :]
  pos_prev = pos_blk - b
  n = slots.prompt_len[:, None]
  seg_blk = jnp.broadcast_to(live[:, None], pos_blk.shape).astype(jnp.int32)
  seg_prev = (commit[:, None] & (pos_prev >= 0)).astype(jnp.int32)
  blk_blk = grid.block_of(pos_blk, n).astype(jnp.int32)
  blk2 = jnp.concatenate([grid.block_of(pos_prev, n).astype(jnp.int32), blk_blk], axis=1)
  seg2 = jnp.concatenate([seg_prev, seg_blk], axis=1)
  return _BlockInputs(
    tokens2=jnp.concatenate([slots.prev, slots.block], axis=1),
    pos2=jnp.concatenate([pos_prev, pos_blk], axis=1),
    spec2=masks_lib.AttentionSpec.block_causal(b, seg2, blk2),
    pos_blk=pos_blk,
    spec1=masks_lib.AttentionSpec.block_causal(b, seg_blk, blk_blk),
    gen=pos_blk >= n,
  )


def _denoise(slots: Slots, logits_bnv, s, gen, cfg, mask_id: int, schedule) -> Slots:
  """One denoising update of every live row's active block from its logits (in-block step s: a
  scalar, or one per row `[S]`)."""
  masked = (slots.block == mask_id) & gen & ~slots.done[:, None]
  keys = jax.vmap(jax.random.fold_in)(slots.key, slots.steps_used)
  cand = remasking.sample_candidates(
    keys,
    logits_bnv,
    temperature=cfg.temperature,
    top_k=cfg.top_k,
    top_p=cfg.top_p,
    confidence=cfg.confidence,
    mask_token_id=mask_id,
    want_entropy=cfg.strategy == "entropy_bounded",
    want_logprob=cfg.return_logprobs,
  )
  s = jnp.broadcast_to(s, masked.shape[:1])
  sel = remasking.select_transfer(
    cfg.strategy,
    masked,
    cand["confidence"],
    cand["entropy"],
    schedule[jnp.minimum(s, cfg.steps - 1)],
    threshold=cfg.threshold,
    eb_threshold=cfg.eb_threshold,
    flush=(s >= cfg.steps - 1)[:, None],
  )
  return dataclasses.replace(
    slots,
    block=jnp.where(sel, cand["token"], slots.block),
    block_steps=jnp.where(sel, slots.steps_used[:, None], slots.block_steps),
    block_logp=jnp.where(sel, cand["logprob"], slots.block_logp),
    steps_used=slots.steps_used + jnp.any(masked, axis=-1).astype(jnp.int32),
  )


def advance(model, slots: Slots, cache: KVCache, cfg, groups: int = 1):
  """Decodes at least one block of every live row. Returns (slots, cache, finished `[S]` bool:
  rows that stopped in this call (stop id or budget), forwards: decode forwards run).

  Lockstep (`cfg.ragged` off): one block of every row, a fused 2b-token forward then b-token
  forwards while any live row has a mask. Ragged: `cfg.steps` forwards of 2b tokens in which each
  row moves to its next block as soon as its own is decided (`advance_ragged`; `groups`: the row
  shards, each packing its own rows under `cfg.commit_rows`)."""
  if cfg.ragged:
    return advance_ragged(model, slots, cache, cfg, groups)
  b = cfg.block_size
  mask_id = model.cfg.mask_token_id
  schedule = jnp.asarray(remasking.transfer_schedule(b, cfg.steps))
  stop_ids = jnp.asarray(cfg.stop_ids if cfg.stop_ids else (-1,), jnp.int32)
  live = ~slots.done
  x = _block_inputs(slots, cfg, commit=live)
  gen = x.gen

  def logits_of(hidden):
    return model.logits_from_hidden(hidden[:, -b:])

  # Forward 1: commit the previous block and denoise the active one.
  cache = cache.with_length(slots.block_pos)
  hidden, cache = model(
    x.tokens2, x.pos2, x.spec2, cache=cache, update_cache=True, return_hidden=True
  )
  cache = cache.with_length(slots.block_pos + b)
  slots = _denoise(slots, logits_of(hidden), 0, gen, cfg, mask_id, schedule)

  # Forwards 2..steps while some live row still has a mask in its block.
  pos_blk, spec1 = x.pos_blk, x.spec1

  def has_mask(sl):
    return jnp.any((sl.block == mask_id) & gen & live[:, None])

  def cond(c):
    s, sl, _, _ = c
    return (s < cfg.steps) & has_mask(sl)

  def body(c):
    s, sl, cache_, fw = c
    hidden_, cache_ = model(
      sl.block, pos_blk, spec1, cache=cache_, update_cache=False, return_hidden=True
    )
    sl = _denoise(sl, logits_of(hidden_), s, gen, cfg, mask_id, schedule)
    return s + 1, sl, cache_, fw + 1

  _, slots, cache, forwards = jax.lax.while_loop(
    cond, body, (jnp.asarray(1), slots, cache, jnp.asarray(1))
  )

  slots = dataclasses.replace(slots, forwards=slots.forwards + forwards * live.astype(jnp.int32))
  slots, finished = _close_blocks(slots, live, gen, stop_ids, mask_id, b)
  return slots, cache, finished, forwards


def _close_blocks(slots: Slots, closing, gen, stop_ids, mask_id: int, b: int):
  """Closes the active block of rows `closing` `[S]`: records it, stops rows (a stop id in the
  response part, or the budget reached) and starts the next block of the others. Returns
  (slots, finished `[S]`)."""
  hit_stop = jnp.any(gen & jnp.isin(slots.block, stop_ids), axis=-1)
  budget = (slots.block_pos + b - slots.prompt_len) >= slots.max_new
  finished = closing & (hit_stop | budget)
  at = slots.block_pos - slots.first_pos
  record = lambda out, new: jnp.where(closing[:, None], put_rows(out, new, at, 0), out)
  steps = jnp.where(gen, slots.block_steps, -1)
  out_logp = slots.out_logp
  if out_logp.shape[1]:
    out_logp = record(out_logp, slots.block_logp)
  go = closing & ~finished
  slots = dataclasses.replace(
    slots,
    out_tokens=record(slots.out_tokens, slots.block),
    out_steps=record(slots.out_steps, steps),
    out_logp=out_logp,
    prev=jnp.where(go[:, None], slots.block, slots.prev),
    block=jnp.where(go[:, None], mask_id, slots.block),
    block_steps=jnp.where(go[:, None], -1, slots.block_steps),
    block_logp=jnp.where(go[:, None], 0.0, slots.block_logp),
    block_pos=slots.block_pos + b * go.astype(jnp.int32),
    fresh=slots.fresh | go,
    block_step=jnp.where(go, 0, slots.block_step),
    done=slots.done | finished,
  )
  return slots, finished


def commit_cap(cfg, rows: int, groups: int = 1) -> int:
  """Fresh rows of each of `groups` row groups that may commit in one ragged forward:
  `cfg.commit_rows / groups` (at most a group's rows); 0 for no cap. `groups` divides both
  (`sampler.commit_groups` checks it where the rows are split)."""
  return min(cfg.commit_rows, rows) // groups if cfg.commit_rows else 0


def _choose_commits(fresh, waited, cap: int):
  """(rows `[cap]` whose previous block is packed, commit `[S]` bool) of one row group: the `cap`
  fresh rows deferred longest, ties by lowest slot index (first come, first served: a fresh row
  commits within ceil(S / cap) forwards); places left over go to other rows, whose previous block
  is computed but stays invisible (distinct indices, a static count)."""
  s = fresh.shape[0]
  idx = jnp.arange(s, dtype=jnp.int32)
  score = jnp.where(fresh, s + waited * s, 0) + (s - 1 - idx)  # distinct: a total order
  _, rows = jax.lax.top_k(score, cap)
  chosen = jnp.zeros((s,), bool).at[rows].set(True, unique_indices=True)
  return rows, fresh & chosen


def _pack_index(rows, s: int, b: int):
  """Flat indices `[s*b + cap*b]` into one row group's `[s, 2b]` forward tokens: every row's
  active block (row-major: the first s*b, whose hidden states give the logits), then the
  previous block of `rows` `[cap]`."""
  offs = jnp.arange(b, dtype=jnp.int32)[None, :]
  active = jnp.arange(s, dtype=jnp.int32)[:, None] * 2 * b + b + offs
  prev = rows.astype(jnp.int32)[:, None] * 2 * b + offs
  return jnp.concatenate([active.reshape(-1), prev.reshape(-1)])


def _commit_plan(fresh, waited, cap: int, groups: int, b: int):
  """(commit `[S]` bool, pack `[groups, M]`): `_choose_commits` and `_pack_index` in each of
  `groups` consecutive row groups (one per row shard), indices local to the group."""
  s = fresh.shape[0] // groups
  rows, commit = jax.vmap(_choose_commits, in_axes=(0, 0, None))(
    fresh.reshape(groups, s), waited.reshape(groups, s), cap
  )
  pack = jax.vmap(_pack_index, in_axes=(0, None, None))(rows, s, b)
  return commit.reshape(-1), pack


def _ragged_forward(model, slots: Slots, cache: KVCache, cfg, schedule, stop_ids, groups=1):
  """One forward of 2b tokens per row, each row at its own point (`advance_ragged`); with
  `cfg.commit_rows` on packed tokens (module docstring: commit cap)."""
  b = cfg.block_size
  mask_id = model.cfg.mask_token_id
  live = ~slots.done
  fresh = slots.fresh & live
  s = fresh.shape[0]
  cap = commit_cap(cfg, s, groups)
  pack = None
  if cap:
    commit, pack = _commit_plan(fresh, slots.waited, cap, groups, b)
    deferred = fresh & ~commit
    fresh, live = commit, live & ~deferred
    # A deferred row takes no part: as if done for this forward (its block invisible, no denoise).
    slots = dataclasses.replace(slots, done=slots.done | deferred)
  x = _block_inputs(slots, cfg, commit=fresh)  # a mid-block row's previous block is invisible
  gen = x.gen
  # A fresh row sees the cache below its previous block and writes [prev; block] from there (the
  # commit); a mid-block row sees its committed previous block and writes to its scratch slots.
  cache = cache.with_length(slots.block_pos + b * (~fresh).astype(jnp.int32))
  at = jnp.where(fresh, slots.block_pos, scratch_start(cache, b))
  hidden, cache = model(
    x.tokens2,
    x.pos2,
    x.spec2,
    cache=cache,
    update_cache=True,
    return_hidden=True,
    append_at=at,
    pack=pack,
  )
  cache = cache.with_length(slots.block_pos + b)
  hidden = hidden[:, -b:] if pack is None else hidden[:, : s // groups * b].reshape(s, b, -1)
  slots = _denoise(
    slots,
    model.logits_from_hidden(hidden),
    slots.block_step,
    gen,
    cfg,
    mask_id,
    schedule,
  )
  step = live.astype(jnp.int32)
  slots = dataclasses.replace(
    slots,
    fresh=slots.fresh & ~live,
    block_step=slots.block_step + step,
    forwards=slots.forwards + step,
  )
  if cap:
    waited = jnp.where(deferred, slots.waited + 1, jnp.where(fresh, 0, slots.waited))
    slots = dataclasses.replace(slots, done=slots.done & ~deferred, waited=waited)
  decided = live & ~jnp.any((slots.block == mask_id) & gen, axis=-1)
  slots, finished = _close_blocks(slots, decided, gen, stop_ids, mask_id, b)
  return slots, cache, finished, decided


def advance_ragged(model, slots: Slots, cache: KVCache, cfg, groups: int = 1):
  """`cfg.steps` forwards (fewer when every row is done) in which every live row takes one step
  of its own: a row whose block was decided at the previous forward commits it and starts the
  next (its forward is the fused commit + first denoising pass), the others denoise their block
  further. So no row waits for the batch's slowest block: with a strategy that unmasks several
  tokens per forward (low_confidence_dynamic, entropy_bounded) every forward does useful work
  for every row. Every forward is 2b tokens wide (a mid-block row's first b are invisible and
  written to its scratch slots); a row's tokens, step map and log-probs are exactly those of the
  lockstep `advance`. Each call closes at least one block of every live row (a block takes at
  most `steps` forwards). Returns as `advance`.

  With `cfg.commit_rows` (a cap R on the rows committing per forward; R / `groups` in each row
  shard of S / `groups` rows) a fresh row may wait up to ceil(S / R) - 1 forwards, so a call runs `steps` forwards and then more, while some live row has
  closed no block in it (at most `steps + ceil(S / R) - 1`)."""
  schedule = jnp.asarray(remasking.transfer_schedule(cfg.block_size, cfg.steps))
  stop_ids = jnp.asarray(cfg.stop_ids if cfg.stop_ids else (-1,), jnp.int32)
  rows = slots.done.shape[0] // groups
  cap = commit_cap(cfg, rows * groups, groups)
  limit = cfg.steps + (-(-rows // cap) - 1 if cap else 0)

  def cond(c):
    s, sl, _, _, closed = c
    more = s < cfg.steps
    if cap:
      more = (more | jnp.any(~sl.done & ~closed)) & (s < limit)
    return more & ~jnp.all(sl.done)

  def body(c):
    s, sl, cache_, fin, closed = c
    sl, cache_, f, d = _ragged_forward(model, sl, cache_, cfg, schedule, stop_ids, groups)
    return s + 1, sl, cache_, fin | f, closed | d

  fin0 = jnp.zeros(slots.done.shape, bool)
  forwards, slots, cache, finished, _ = jax.lax.while_loop(
    cond, body, (jnp.asarray(0), slots, cache, fin0, fin0)
  )
  return slots, cache, finished, forwards


def response_lengths(slots: Slots, stop_ids) -> jax.Array:
  """`[S]` response tokens of each row up to and including its first stop id, within budget."""
  w = slots.out_tokens.shape[1]
  idx = jnp.arange(w)[None, :] - (slots.prompt_len - slots.first_pos)[:, None]
  decoded = (idx >= 0) & (slots.out_steps >= 0)
  stop_ids = jnp.asarray(stop_ids if stop_ids else (-1,), jnp.int32)
  stop = decoded & jnp.isin(slots.out_tokens, stop_ids)
  first_stop = jnp.min(jnp.where(stop, idx, w), axis=-1)
  generated = jnp.sum(decoded, axis=-1)
  return jnp.minimum(jnp.minimum(first_stop + 1, generated), slots.max_new)
