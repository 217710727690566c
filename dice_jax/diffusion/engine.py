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
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Hashable, Iterable, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dice_jax import distributed
from dice_jax.diffusion import memory
from dice_jax.diffusion import sampler as sampler_lib
from dice_jax.diffusion import slots as slots_lib
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


def _replicated_on_model_mesh(state):
  """`NamedSharding(mesh, P())` on the mesh the model's parameters live on, else None."""
  for leaf in jax.tree.leaves(state):
    sh = getattr(leaf, "sharding", None)
    if isinstance(sh, jax.sharding.NamedSharding):
      return jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec())
  return None


@functools.lru_cache(maxsize=16)
def _compiled_steps(graphdef, cfg: SamplerConfig, options: tuple):
  """The engine's two jitted steps for one (model graph, config, XLA options): shared by every
  engine built on them, so a new engine per RL step (new weights, same graph) reuses the
  compiled programs instead of compiling again."""

  def advance(st, weights, sl, cache):
    model = sampler_lib.decoding_model(graphdef, st, weights)
    sl, cache, finished, fw = slots_lib.advance(model, sl, cache, cfg)
    return sl, cache, finished, fw, slots_lib.response_lengths(sl, cfg.stop_ids)

  def admit(st, weights, sl, cache, rows, prompts, n, new, keys):
    model = sampler_lib.decoding_model(graphdef, st, weights)
    return slots_lib.admit(model, sl, cache, rows, prompts, n, new, keys, cfg)

  opts = dict(options) or None
  return (
    jax.jit(advance, donate_argnums=(3,), compiler_options=opts),
    jax.jit(admit, donate_argnums=(3,), compiler_options=opts),
  )


def _bucket(n: int, multiple: int) -> int:
  return max(multiple, -(-n // multiple) * multiple)


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
    self.estimate = memory.estimate(
      model.cfg,
      rows=slots,
      cache_len=self.cache_len,
      block_size=b,
      prefill_rows=self.prefill_rows,
      prefill_width=_bucket(max_prompt_len, self.prompt_bucket),
      decode_weights=cfg.splits_weights(model.cfg),
      cache_dtype=cfg.cache_dtype(model.cfg),
    )
    memory.check_fits(self.estimate, device_bytes, what=f"ContinuousSampler(slots={slots})")
    graphdef, self._state = nnx.split(model)
    split = cfg.splits_weights(model.cfg)
    self._weights = sampler_lib.split_weights(graphdef, self._state) if split else None
    options = tuple(sorted((compiler_options or {}).items()))
    self._advance, self._admit = _compiled_steps(graphdef, cfg, options)
    # The initial state is made with the sharding the steps' outputs have (replicated on the
    # model's mesh), so that the steps see one kind of input and compile once per shape.
    mask_id = model.cfg.mask_token_id

    def init():
      return (
        slots_lib.empty_slots(slots, b, self.out_width, cfg.return_logprobs, mask_id),
        KVCache.empty(
          model.cfg, slots, self.cache_len, dtype=cfg.cache_dtype(model.cfg), tiles=cfg.decode_tiles
        ),
      )

    self._init = jax.jit(init, out_shardings=_replicated_on_model_mesh(self._state))
    self.stats = {}

  def _request_arrays(self, reqs: Sequence[Request]):
    cfg = self.cfg
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
    sl, cache = self._init()
    queue = iter(requests)
    free = list(range(self.num_slots))
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
        take = self.prefill_rows if len(new_reqs) >= self.prefill_rows else 1
        group, new_reqs = new_reqs[:take], new_reqs[take:]
        rows = [free.pop(0) for _ in group]
        prompts, lens, new, keys = self._request_arrays(group)
        sl, cache = self._admit(
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
        owner.update(zip(rows, group))
        stats["prefill_calls"] += 1
        stats["admitted"] += len(group)
      if not owner:
        host_s += time.perf_counter() - t0
        break
      # Dispatch the next block, then harvest the rows that finished at the previous one.
      sl, cache, finished, fw, lengths = self._advance(self._state, self._weights, sl, cache)
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
        free.append(slot)
        stats["completed"] += 1
        yield self._completion(req, slot, {k: v[slot] for k, v in host.items()})
    return waited
