"""Continuous batching for block-diffusion rollouts (DICE's JetEngine `max_active`, DICE `training/RL/` configs).

    engine = ContinuousSampler(model, cfg, slots=128, max_prompt_len=2048)
    for done in engine.run(requests):          # Request(id, prompt_ids, key, max_new_tokens)
      send_to_verifier(done)                   # Completion, as soon as its row stops

A fixed number of slots decode together, at least one block per jitted `slots.advance` call (in
lockstep, or ragged: each row moves on as soon as its block is decided, `SamplerConfig.ragged`); the KV cache
(one region per slot) stays on device and is donated to every call. When a row stops (a stop id, or
its token budget) its slot takes the next request of the queue: `slots.admit` prefills the prompt
into the slot's cache region, whose old contents become invisible. Each row is independent (own
positions, cache row, step counter and PRNG key: `slots.py`), so a request gets exactly the tokens
and step map it gets alone.

The host loop is pipelined: it dispatches block k+1 before it reads which rows finished at block k,
so the device never waits for the host (a finished row idles for one block before its refill).
`stats` reports forwards, blocks, prefills, and the host time spent outside device waits.

On a mesh (`placement.py`) the slots and their cache are split over the data axes: each device
decodes its slots, and an admission gives every row shard its own rows (`FreeSlots`), which that
device prefills and writes. Several processes run the same host loop on the same requests (the
same decisions everywhere: the finished flags come back replicated), each process's devices
decoding their share of the slots; finished rows are gathered to every process.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Hashable, Iterable, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dice_jax import distributed, trace_context
from dice_jax.diffusion import memory
from dice_jax.diffusion import sampler as sampler_lib
from dice_jax.diffusion import slots as slots_lib
from dice_jax.diffusion.placement import Placement
from dice_jax.diffusion.sampler import SamplerConfig
from dice_jax.model import platform
from dice_jax.model.kv_cache import KVCache


@dataclasses.dataclass(frozen=True)
class Request:
  """One prompt to decode. `key`: its own PRNG key (default `jax.random.key(0)`; unused when
  greedy); `max_new_tokens`: its budget (default and maximum: the config's)."""

  id: Hashable
  prompt_ids: Sequence[int]
  key: Optional[jax.Array] = None
  max_new_tokens: Optional[int] = None


@dataclasses.dataclass
class Completion:
  """A finished request (numpy). What `rl.trajectory.Trajectory` needs:

  prompt_ids      [P]  the prompt.
  response_ids    [L]  every generated token of the decoded blocks (after the prompt; tokens after
                       the first stop id inside the last block are kept: the model saw them).
  step_map        [L]  the row's denoising step at which each token was unmasked (>= 0).
  logprobs        [L]  unfiltered log-probability of each token at its step (None when off).
  response_length      tokens up to and including the first stop id, within the budget
                       (the loss mask is `arange(L) < response_length`).
  steps_used           the row's denoising forwards; `forwards`: decode forwards it took part in.
  """

  id: Hashable
  prompt_ids: np.ndarray
  response_ids: np.ndarray
  step_map: np.ndarray
  logprobs: Optional[np.ndarray]
  response_length: int
  steps_used: int
  forwards: int
  slot: int

  @property
  def response(self) -> np.ndarray:
    return self.response_ids[: self.response_length]


def empty_state(model_cfg, cfg: SamplerConfig, slots: int, cache_len: int):
  """(Slots, KVCache) of an engine holding no request: every slot done, the cache empty."""
  b = cfg.block_size
  width = slots_lib.out_width(b, cfg.max_new_tokens)
  return (
    slots_lib.empty_slots(slots, b, width, cfg.return_logprobs, model_cfg.mask_token_id),
    KVCache.empty(
      model_cfg, slots, cache_len, dtype=cfg.cache_dtype(model_cfg), tiles=cfg.decode_tiles
    ),
  )


@dataclasses.dataclass(frozen=True)
class Steps:
  """The engine's compiled programs: `init` () -> (slots, cache); `advance` (state, weights,
  slots, cache) -> (slots, cache, finished, forwards, lengths); `admit` (state, weights, slots,
  cache, rows, prompts, prompt_len, max_new, keys) -> (slots, cache). Slots and cache in and out
  on `placement` (rows over the data axes), the cache donated; host inputs as they come (split
  over the rows inside); the per-row outputs the host reads replicated."""

  init: Callable
  advance: Callable
  admit: Callable


def build_steps(
  graphdef,
  model_cfg,
  cfg: SamplerConfig,
  placement: Placement,
  slots: int,
  cache_len: int,
  options: tuple = (),
) -> Steps:
  """The engine's jitted steps for one (model graph and config, sampler config, placement, shape,
  XLA options `((name, value), ...)`), freshly made (`compiled_steps` shares them; a fresh one is
  what tracing for another platform needs: `platform.lowering_for` is read at trace time)."""
  groups = sampler_lib.commit_groups(cfg, placement, slots)
  init = functools.partial(empty_state, model_cfg, cfg, slots, cache_len)
  sl, cache = jax.eval_shape(init)
  sl_sh, cache_sh = placement.row_tree(sl), placement.cache(cache)
  repl = placement.replicated

  def advance(st, weights, sl, cache):
    model = sampler_lib.decoding_model(graphdef, st, weights)
    sl, cache, finished, fw = slots_lib.advance(model, sl, cache, cfg, groups)
    return sl, cache, finished, fw, slots_lib.response_lengths(sl, cfg.stop_ids)

  def admit(st, weights, sl, cache, rows, prompts, n, new, keys):
    model = sampler_lib.decoding_model(graphdef, st, weights)
    return slots_lib.admit(model, sl, cache, rows, prompts, n, new, keys, cfg, placement)

  opts = dict(options) or None
  return Steps(
    init=jax.jit(init, out_shardings=(sl_sh, cache_sh)),
    advance=jax.jit(
      advance,
      in_shardings=(None, None, sl_sh, cache_sh),
      out_shardings=(sl_sh, cache_sh, repl, repl, repl),
      donate_argnums=(3,),
      compiler_options=opts,
    ),
    admit=jax.jit(
      admit,
      in_shardings=(None, None, sl_sh, cache_sh) + (None,) * 5,
      out_shardings=(sl_sh, cache_sh),
      donate_argnums=(3,),
      compiler_options=opts,
    ),
  )


@functools.lru_cache(maxsize=16)
def compiled_steps(*key) -> Steps:
  """`build_steps(*key)`, shared by every engine built on the same key, so a new engine per RL
  step (new weights, the same graph) reuses the compiled programs instead of compiling again."""
  trace_context.settle()  # else the first call's kernels change the context (trace_context.py)
  return build_steps(*key)


def _bucket(n: int, multiple: int) -> int:
  return max(multiple, -(-n // multiple) * multiple)


class FreeSlots:
  """The engine's free slots by row shard (shard j holds slots `[j * S/n, (j + 1) * S/n)`), and the
  rows of an admission call: `width` per shard, the j-th block in shard j's slots
  (`slots.admit` with a placement: each device prefills the rows it decodes), the slot count
  (padding, nothing admitted) where a shard has no free slot or no request is left."""

  def __init__(self, slots: int, shards: int):
    self.slots, self.shards, per = slots, shards, slots // shards
    self._free = [list(range(j * per, (j + 1) * per)) for j in range(shards)]

  def __len__(self) -> int:
    return sum(map(len, self._free))

  def release(self, slot: int) -> None:
    self._free[slot // (self.slots // self.shards)].append(slot)

  def _placed(self, width: int, requests: int) -> int:
    return min(requests, sum(min(width, len(f)) for f in self._free))

  def take(self, requests: int, prefill_rows: int) -> list[int]:
    """The rows of the next admission of (some of) `requests` waiting requests: `prefill_rows`
    rows in all (rounded up to the shards) when that many can be placed, else one per shard
    (two compiled shapes, as prefilling one by one on one device)."""
    width = -(-prefill_rows // self.shards)
    if self._placed(width, requests) < width * self.shards:
      width = 1
    rows, placed = [], 0
    for f in self._free:
      for _ in range(width):
        if f and placed < requests:
          rows.append(f.pop(0))
          placed += 1
        else:
          rows.append(self.slots)
    return rows


class ContinuousSampler:
  """Fixed `slots` decoding rows, refilled from a request queue (module docstring).

  `max_prompt_len` bounds the prompts (sizes the cache: slots x (prompt + max_new_tokens + 3b));
  prompts are prefilled `prefill_rows` at a time (else one by one), padded to a multiple of
  `prompt_bucket` tokens (one compile per width). `device_bytes`: memory to check the setting
  against before compiling (default: the device's limit; no check where unknown).
  `compiler_options`: XLA options for the two compiled steps (e.g. from `bench_sampler`).
  """

  def __init__(
    self,
    model,
    cfg: SamplerConfig,
    *,
    slots: int,
    max_prompt_len: int,
    prefill_rows: int = 16,
    prompt_bucket: int = 128,
    device_bytes: Optional[int] = None,
    compiler_options: Optional[dict] = None,
  ):
    cfg = cfg.for_model(model.cfg)
    for name, v in (("slots", slots), ("max_prompt_len", max_prompt_len)):
      if v < 1:
        raise ValueError(f"ContinuousSampler: {name} must be >= 1, got {v}")
    self.model, self.cfg, self.num_slots = model, cfg, slots
    self.prefill_rows = max(1, min(prefill_rows, slots))
    flash = model.cfg.attention_impl == "flash"
    self.prompt_bucket = _bucket(prompt_bucket, 128) if flash else max(prompt_bucket, 1)
    self.max_prompt_len = max_prompt_len
    b = cfg.block_size
    multiple = platform.cache_multiple(cfg.decode_tiles.block_k) if flash else 16
    self.cache_len = _bucket(
      max(
        slots_lib.cache_slots(b, max_prompt_len, cfg.max_new_tokens, multiple),
        b + _bucket(max_prompt_len, self.prompt_bucket),
      ),
      multiple,
    )
    self.out_width = slots_lib.out_width(b, cfg.max_new_tokens)
    graphdef, self._state = nnx.split(model)
    self.placement = Placement.of(self._state)
    split = cfg.splits_weights(model.cfg)
    self.estimate = memory.estimate(
      model.cfg,
      rows=slots,
      cache_len=self.cache_len,
      block_size=b,
      prefill_rows=self.prefill_rows,
      prefill_width=_bucket(max_prompt_len, self.prompt_bucket),
      decode_weights=split,
      cache_dtype=cfg.cache_dtype(model.cfg),
      weights_dtype=cfg.weights_dtype,
      **self.placement.shards(model.cfg, slots),
    )
    memory.check_fits(self.estimate, device_bytes, what=f"ContinuousSampler(slots={slots})")
    self._weights = None
    if split:
      self._weights = sampler_lib.split_weights(graphdef, self._state, None, cfg.weights_dtype)
    options = tuple(sorted((compiler_options or {}).items()))
    self._steps = compiled_steps(
      graphdef, model.cfg, cfg, self.placement, slots, self.cache_len, options
    )
    self.stats = {}

  def _call(self, step, *args):
    """A compiled step, dispatched (and traced, the first time) under the placement's mesh."""
    with self.placement.context():
      return step(*args)

  def _request_arrays(self, group: Sequence[Optional[Request]]):
    """Host arrays of an admission: (prompts `[R, width]`, lengths, budgets, keys); a None entry
    (a padding row) gets a one-token prompt that is written nowhere."""
    cfg = self.cfg
    pad = Request(None, [0], max_new_tokens=1)
    reqs = [pad if r is None else r for r in group]
    lens = [len(r.prompt_ids) for r in reqs]
    for r, n in zip(reqs, lens):
      if not 1 <= n <= self.max_prompt_len:
        raise ValueError(
          f"request {r.id!r}: prompt of {n} tokens, expected 1..{self.max_prompt_len} "
          f"(max_prompt_len)"
        )
      new = cfg.max_new_tokens if r.max_new_tokens is None else r.max_new_tokens
      if not 1 <= new <= cfg.max_new_tokens:
        raise ValueError(
          f"request {r.id!r}: max_new_tokens {new} outside 1..{cfg.max_new_tokens} "
          f"(SamplerConfig.max_new_tokens)"
        )
    width = _bucket(max(lens), self.prompt_bucket)
    prompts = np.zeros((len(reqs), width), np.int32)
    for i, r in enumerate(reqs):
      prompts[i, : lens[i]] = np.asarray(r.prompt_ids, np.int32)
    new = [cfg.max_new_tokens if r.max_new_tokens is None else r.max_new_tokens for r in reqs]
    keys = jnp.stack([jax.random.key(0) if r.key is None else r.key for r in reqs])
    return prompts, np.asarray(lens, np.int32), np.asarray(new, np.int32), keys

  def _completion(self, req: Request, slot: int, row: dict) -> Completion:
    n = len(req.prompt_ids)
    first = int(row["first_pos"])
    start = n - first
    steps = row["out_steps"][start:]
    decoded = int((steps >= 0).sum())
    logp = row["out_logp"][start : start + decoded] if row["out_logp"].size else None
    return Completion(
      id=req.id,
      prompt_ids=np.asarray(req.prompt_ids, np.int32),
      response_ids=row["out_tokens"][start : start + decoded],
      step_map=steps[:decoded],
      logprobs=logp,
      response_length=int(row["length"]),
      steps_used=int(row["steps_used"]),
      forwards=int(row["forwards"]),
      slot=slot,
    )

  def run(self, requests: Iterable[Request]) -> Iterator[Completion]:
    """Decodes every request, yielding each `Completion` as soon as its row has stopped."""
    sl, cache = self._call(self._steps.init)
    queue = iter(requests)
    free = FreeSlots(self.num_slots, self.placement.shard_rows(self.num_slots))
    owner: dict[int, Request] = {}
    pending = None  # (slots after block k, finished flags of block k)
    stats = dict(blocks=0, forwards=0, prefill_calls=0, admitted=0, completed=0)
    host_s = wait_s = 0.0
    t_start = time.perf_counter()
    exhausted = False
    while True:
      t0 = time.perf_counter()
      # Refill free slots from the queue.
      new_reqs = []
      while free and not exhausted and len(new_reqs) < len(free):
        try:
          new_reqs.append(next(queue))
        except StopIteration:
          exhausted = True
      while new_reqs:
        rows = free.take(len(new_reqs), self.prefill_rows)
        group = [new_reqs.pop(0) if r < self.num_slots else None for r in rows]
        prompts, lens, new, keys = self._request_arrays(group)
        sl, cache = self._call(
          self._steps.admit,
          self._state,
          self._weights,
          sl,
          cache,
          jnp.asarray(rows, jnp.int32),
          prompts,
          lens,
          new,
          keys,
        )
        owner.update((r, q) for r, q in zip(rows, group) if q is not None)
        stats["prefill_calls"] += 1
        stats["admitted"] += sum(q is not None for q in group)
      if not owner:
        host_s += time.perf_counter() - t0
        break
      # Dispatch the next block, then harvest the rows that finished at the previous one.
      sl, cache, finished, fw, lengths = self._call(
        self._steps.advance, self._state, self._weights, sl, cache
      )
      stats["blocks"] += 1
      host_s += time.perf_counter() - t0
      if pending is not None:
        wait_s += yield from self._harvest(pending, owner, free, stats)
      pending = (sl, finished, fw, lengths)
    stats["wall_s"] = time.perf_counter() - t_start
    stats["host_s"] = host_s
    stats["wait_s"] = wait_s
    self.stats = stats

  def _harvest(self, pending, owner, free, stats):
    """Yields the completions of the rows finished at a dispatched block; returns the seconds
    spent waiting for that block. Small per-slot arrays come to the host whole (no per-shape
    gathers to compile)."""
    sl, finished, fw, lengths = pending
    t0 = time.perf_counter()
    flags = distributed.to_host(finished)
    waited = time.perf_counter() - t0
    stats["forwards"] += int(fw)
    rows = [int(i) for i in np.nonzero(flags)[0] if int(i) in owner]
    if rows:
      host = distributed.tree_to_host(
        dict(
          out_tokens=sl.out_tokens,
          out_steps=sl.out_steps,
          out_logp=sl.out_logp,
          first_pos=sl.first_pos,
          steps_used=sl.steps_used,
          forwards=sl.forwards,
          length=lengths,
        )
      )
      for slot in rows:
        req = owner.pop(slot)
        free.release(slot)
        stats["completed"] += 1
        yield self._completion(req, slot, {k: v[slot] for k, v in host.items()})
    return waited
