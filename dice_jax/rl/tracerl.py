"""The TraceRL objective on block diffusion (DICE's BiC-RL policy update; TraceRL, Gen-Verse/dLLM-RL `train/rl_sdar.py`).

Rows. Each response is replayed from its step map (`diffusion/trace.py`): in round k every block
trains the tokens of its k-th (shrunk) step group, reading a noisy copy of the block in which the
tokens of that group and later ones are [MASK] (the exact state the sampler saw), next to the
prompt and the final earlier blocks. Two layouts give the same loss and gradients:

  per_round  DICE's rows: one row per (response, round), `[prompt | x0 | xt]`; xt covers the whole
             response (a block with no k-th group keeps its clean tokens there, as in dLLM-RL).
  packed     one row per response: `[prompt | x0 | noisy copies]`, holding only the (round,
             block) pairs that train a token, block-major (block 0 round 1, block 0 round 2, ...,
             block 1 round 1, ...), so the prompt and the clean copy are not repeated per round.
The `trace` attention kind (model/masks.py) makes every noisy block see the prompt, the clean
earlier blocks and itself, and nothing else. Rounds and (round, block) pairs that train no token
(only tokens after the first stop id, outside `loss_mask`) are left out of both layouts.

Objective (dLLM-RL `train/rl_sdar.py::forward_process`), per trained token j of a row with
advantage A, Δ_j = logp_new_j − logp_old_j (log-probs at the same position, no shift):

  ρ_j  = exp(clamp(Δ_j, −c, c))                       c = ratio_clamp = 10
  pg_j = −min(ρ_j A, clip(ρ_j, 1 − ε, 1 + ε) A)          ε = clip_eps = 0.2
  kl_j = exp(clamp(−Δ_j, −c, c)) − 1 + Δ_j              (k3, against the rollout policy)
  L    = Σ_j (pg_j + β kl_j) / D                        β = kl_beta = 0.01

with D = L1 × (rows of the step counted as (response, round) pairs) for `dice` (DICE: per row
1/L1, L1 the padded max response length of the RL step, mean over rows) or D = trained tokens for
`tokens`. Both are defined per round, not per row, so the packed layout (one row, R rounds) and
the per-round layout (R rows) give the same D. `tracerl_loss` returns (Σ_j ..., metrics with D as
`denominator`) for `train/train_step.make_train_step`, which divides once per optimizer step.

Mini-batches (`build_batches`): `rows_per_update` counts rows of the layout (`batch_units='rows'`:
responses when packed) or (response, round) pairs (`'rounds'`: DICE's rows, whatever the layout).
With `rounds` and the packed layout, the rounds of a response that fall in one mini-batch share
one packed row: DICE's optimizer steps (the same pairs in each, the same D) on packed rows.

Old log-probs (`logp_old`, `TraceRLConfig.old_logp`): `sampler` takes the rollout's own
(`Trajectory.sampler_logp`: the log-prob of each token under the unfiltered model at the forward
that unmasked it, i.e. at the state its row replays, with the rollout parameters: the same value
a trainer forward gives, to float rounding; tests/rl/test_tracerl.py); `trainer` computes them
with `token_logprobs` and the pre-update parameters, once per RL step for every mini-batch before
the first update (`jit_token_logprobs`), as DICE does (its sampler returns no log-probs).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dice_jax import trace_context
from dice_jax.diffusion import trace
from dice_jax.model import masks as masks_lib
from dice_jax.rl.trajectory import Trajectory
from dice_jax.train import train_step as ts

NORMALIZATIONS = ("dice", "tokens")
LAYOUTS = ("packed", "per_round")
BATCH_UNITS = ("rows", "rounds")
OLD_LOGP = ("sampler", "trainer")
TAIL_ROWS = ("apply", "drop", "even_batches")  # `tail_units`


@dataclasses.dataclass(frozen=True)
class TraceRLConfig:
  clip_eps: float = 0.2
  ratio_clamp: float = 10.0
  kl_beta: float = 0.01
  normalization: str = "dice"  # "dice" | "tokens"
  layout: str = "packed"  # "packed" | "per_round" | "auto" (the RL loop picks by memory)
  shrink: int = 1
  logit_chunk: int = 2048  # tokens per chunk of the LM head + log-softmax (bounds [B, T, V])
  # Gather the trained positions (`trained_index`, built on the host) before the LM head: the
  # vocabulary projection then runs on them only, not on every position of a chunk that holds
  # one (packed rows: ~1 in 4 noisy positions is trained). Same values and gradients.
  gather_trained: bool = True
  batch_units: str = "rows"  # what rows_per_update counts: layout rows | (response, round) pairs
  # old log-probs: "trainer" (a forward with the rollout parameters; exact at any precision) or
  # "sampler" (the rollout's own; the RL loop's default, RLConfig.tracerl): module docstring
  old_logp: str = "trainer"

  def __post_init__(self):
    if self.normalization not in NORMALIZATIONS:
      raise ValueError(
        f"TraceRLConfig.normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}"
      )
    if self.layout not in LAYOUTS + ("auto",):
      raise ValueError(
        f"TraceRLConfig.layout must be one of {LAYOUTS + ('auto',)}, got {self.layout!r}"
      )
    if not isinstance(self.shrink, int) or self.shrink < 1:
      raise ValueError(f"TraceRLConfig.shrink must be a positive int, got {self.shrink!r}")
    if not 0.0 <= self.clip_eps < 1.0:
      raise ValueError(f"TraceRLConfig.clip_eps must be in [0, 1), got {self.clip_eps}")
    if self.ratio_clamp <= 0 or self.kl_beta < 0:
      raise ValueError(
        f"TraceRLConfig: ratio_clamp must be > 0 and kl_beta >= 0, got "
        f"{self.ratio_clamp}, {self.kl_beta}"
      )
    if self.logit_chunk < 1:
      raise ValueError(f"TraceRLConfig.logit_chunk must be >= 1, got {self.logit_chunk}")
    if not isinstance(self.gather_trained, bool):
      raise ValueError(
        f"TraceRLConfig.gather_trained must be True or False, got {self.gather_trained!r}"
      )
    if self.batch_units not in BATCH_UNITS:
      raise ValueError(
        f"TraceRLConfig.batch_units must be one of {BATCH_UNITS}, got {self.batch_units!r}"
      )
    if self.old_logp not in OLD_LOGP:
      raise ValueError(f"TraceRLConfig.old_logp must be one of {OLD_LOGP}, got {self.old_logp!r}")
    if self.old_logp == "sampler" and self.shrink != 1:
      raise ValueError(
        f"TraceRLConfig.old_logp='sampler' needs shrink=1 (got {self.shrink}): a merged step "
        f"group trains from its earliest state, the sampler's log-probs are of later ones; "
        f"use old_logp='trainer'"
      )


METRIC_MEANS = {  # for train_step.make_train_step(means=...)
  "pg_loss": ("pg_sum", "denominator"),
  "kl": ("kl_sum", "trained_tokens"),
  "clip_fraction": ("clipped_tokens", "trained_tokens"),
  "entropy": ("entropy_sum", "trained_tokens"),
  "ratio_mean": ("ratio_sum", "trained_tokens"),
}

# Per-token arrays of a batch ([B, T]) and per-row constants ([B, 1]).
TOKEN_FIELDS = (
  "tokens",
  "positions",
  "segment_ids",
  "block_ids",
  "round_ids",
  "targets",
  "p_mask",
  "advantages",
  "sampler_logp",
)
ROW_FIELDS = ("norm_rounds", "norm_length", "traj_index")


# --- rows (host numpy) ---------------------------------------------------------------------------


def _clean_part(t: Trajectory, block_size: int) -> dict:
  """[prompt | x0]: positions from 0, response-aligned blocks (negative in the prompt), round 0."""
  p, n = t.prompt_ids.size, t.response_ids.size
  pos = np.arange(p + n, dtype=np.int32)
  zeros_i, zeros_f = np.zeros(p + n, np.int32), np.zeros(p + n, np.float32)
  return dict(
    tokens=np.concatenate([t.prompt_ids, t.response_ids]),
    positions=pos,
    block_ids=np.floor_divide(pos - p, block_size).astype(np.int32),
    round_ids=zeros_i,
    targets=zeros_i,
    p_mask=np.zeros(p + n, bool),
    advantages=zeros_f,
    sampler_logp=zeros_f,
  )


def _noisy_part(t: Trajectory, rounds, round_k, cols_kb, block_size: int, mask_token_id: int):
  """Noisy copies of K whole blocks: block k at response columns `cols_kb[k]`, round `round_k[k]`."""
  r = np.asarray(round_k, np.int32)[:, None]
  trained = (rounds[cols_kb] == r) & t.loss_mask[cols_kb]
  flat = lambda x: np.ascontiguousarray(x).reshape(-1)
  return dict(
    tokens=flat(trace.noisy_copy(t.response_ids[cols_kb], rounds[cols_kb], r, mask_token_id)),
    positions=flat(t.prompt_ids.size + cols_kb).astype(np.int32),
    block_ids=flat(cols_kb // block_size).astype(np.int32),
    round_ids=flat(np.broadcast_to(r, cols_kb.shape)),
    targets=flat(t.response_ids[cols_kb]),
    p_mask=flat(trained),
    advantages=flat(np.where(trained, np.float32(t.advantage), 0.0)).astype(np.float32),
    sampler_logp=flat(np.where(trained, t.sampler_logp[cols_kb], 0.0)).astype(np.float32),
  )


def _concat(parts: Sequence[dict]) -> dict:
  return {k: np.concatenate([part[k] for part in parts]) for k in parts[0]}


def _round_table(t: Trajectory, cfg: TraceRLConfig, block_size: int):
  """(t on the response grid, each token's round, trains[r, b]: round r of block b trains a token)."""
  t.check_grid(block_size)
  fixed = t.fixed_prefix(block_size)
  t = t.on_response_grid(block_size)
  rounds = trace.token_rounds(t.step_map, block_size, cfg.shrink)
  rounds[:fixed] = 0  # the prompt's tail: never masked, never trained
  n_blocks = t.response_ids.size // block_size
  trains = np.zeros((int(rounds.max(initial=0)) + 1, n_blocks), bool)
  trains[rounds[t.loss_mask], np.nonzero(t.loss_mask)[0] // block_size] = True
  return t, rounds, trains


def trained_rounds(t: Trajectory, cfg: TraceRLConfig, *, block_size: int) -> list[int]:
  """The rounds of a response that train at least one token, in order (its per_round rows)."""
  return [int(r) for r in np.nonzero(_round_table(t, cfg, block_size)[2].any(axis=1))[0]]


def trajectory_rows(
  t: Trajectory,
  cfg: TraceRLConfig,
  *,
  block_size: int,
  mask_token_id: int,
  rounds: Optional[Sequence[int]] = None,
) -> list[tuple[dict, int]]:
  """The rows of one response under `cfg.layout`, each with the number of rounds it holds.

  Rounds that train no token are left out, and with `rounds` given, every round not in it; a
  response with no trained token gives no row. On the absolute grid the rows are those of the
  same rollout seen on the response grid with the prompt's tail at the front of the first block
  (`Trajectory.on_response_grid`), visible in every round: the states the sampler saw.
  """
  if cfg.layout not in LAYOUTS:
    raise ValueError(
      f"TraceRL layout {cfg.layout!r}: build rows with a concrete layout {LAYOUTS} (the RL loop "
      f"resolves 'auto' with rl/memory.resolve_update)"
    )
  t, token_round, trains = _round_table(t, cfg, block_size)
  if rounds is not None:
    keep = np.zeros(trains.shape[0], bool)
    keep[[r for r in rounds if r < keep.size]] = True
    trains &= keep[:, None]
  live = np.nonzero(trains.any(axis=1))[0]
  if not live.size:
    return []
  n_blocks = trains.shape[1]
  clean = _clean_part(t, block_size)
  blocks = np.arange(n_blocks * block_size).reshape(n_blocks, block_size)
  if cfg.layout == "per_round":
    return [
      (
        _concat(
          [
            clean,
            _noisy_part(t, token_round, np.full(n_blocks, r), blocks, block_size, mask_token_id),
          ]
        ),
        1,
      )
      for r in live
    ]
  # Block-major (block 0's rounds, then block 1's, ...): a tile of noisy queries then spans few
  # blocks, so the flash kernel's rank bounds skip the noisy keys of other blocks.
  pair_block, pair_round = np.nonzero(trains.T)
  noisy = _noisy_part(t, token_round, pair_round, blocks[pair_block], block_size, mask_token_id)
  return [(_concat([clean, noisy]), int(live.size))]


def bucket_length(n: int, multiple: int, cap: Optional[int] = None) -> int:
  """`n` rounded up to `multiple` x {1, 2, 3, 4, 6, 8, 12, 16, ...} (two lengths per octave), but
  not past `cap` rounded up to `multiple` (the longest row there can be: padding to the next
  bucket would be pure waste; `n` above `cap` is rounded up to `multiple`)."""
  if multiple < 1:
    raise ValueError(f"length_multiple must be >= 1, got {multiple}")
  units, size = max(1, -(-n // multiple)), 1
  while size < units:
    size = size // 3 * 4 if size % 3 == 0 else max(2, size * 3 // 2)
  if cap is not None:
    size = min(size, max(units, -(-cap // multiple)))
  return size * multiple


def _pad_batch(rows: list, length: int, pad_id: int, norm_length: float) -> dict:
  n = len(rows)
  out = {k: np.zeros((n, length), np.int32) for k in TOKEN_FIELDS}
  out["tokens"][:] = pad_id
  out["p_mask"] = np.zeros((n, length), bool)
  for k in ("advantages", "sampler_logp"):
    out[k] = np.zeros((n, length), np.float32)
  out["norm_rounds"] = np.zeros((n, 1), np.float32)
  out["norm_length"] = np.full((n, 1), norm_length, np.float32)
  out["traj_index"] = np.full((n, 1), -1, np.int32)
  for i, row in enumerate(rows):
    if row is None:
      continue
    fields, rounds, index = row
    m = fields["tokens"].size
    for k, v in fields.items():
      out[k][i, :m] = v
    out["segment_ids"][i, :m] = 1
    out["norm_rounds"][i, 0] = rounds
    out["traj_index"][i, 0] = index
  return out


def build_batches(
  trajs: list[Trajectory],
  cfg: TraceRLConfig,
  *,
  block_size: int,
  mask_token_id: int,
  rows_per_batch: int,
  pad_id: int = 0,
  length_multiple: int = 128,
  rng: Optional[np.random.Generator] = None,
  tail: str = "apply",
  even_batches_rows: int = 8,
  max_length: Optional[int] = None,
) -> list[dict[str, np.ndarray]]:
  """Host mini-batches of TraceRL rows, one per optimizer step, for `train_step.shard_batch`.

  Units (what `rows_per_batch` counts, `cfg.batch_units`): rows of the layout (responses when
  packed) or (response, round) pairs. `rng` shuffles the units (None keeps their order), `tail`
  says what becomes of the units after the last full batch (`tail_units`; `even_batches_rows` is
  used by "even_batches"), then every `rows_per_batch` consecutive units make a mini-batch. A
  batch's rows are its units' rows (packed: a response's rounds in the batch share one row, so a
  batch of pairs may hold fewer rows), filled up to `rows_per_batch` with empty rows (segment 0,
  no rounds) at the end. Each batch's length is the longest row rounded up by `bucket_length`
  (few distinct shapes, few compiles), never past `max_length` (the longest row the run can
  make) rounded up.

  Batch fields: `[B, T]` tokens, positions, segment_ids (1 / 0 = padding), block_ids, round_ids
  (0 = prompt / clean, r = noisy copy of round r), targets (the clean token at noisy positions),
  p_mask (trained positions), advantages (the response's advantage at p_mask), sampler_logp (the
  rollout's log-prob at p_mask); `[B, 1]` norm_rounds (rounds the row holds), norm_length (L1,
  the longest response of `trajs`), traj_index (index into `trajs`, -1 for an empty row);
  `[B, K]` trained_index with `cfg.gather_trained`. With `cfg.old_logp='trainer'` the loop adds
  `old_logp` (`[B, T]`, from `token_logprobs`) before training on a batch.
  """
  if rows_per_batch < 1:
    raise ValueError(f"rows_per_batch must be >= 1, got {rows_per_batch}")
  units = []  # (trajectory index, the rounds of one row; None: all of its trained rounds)
  for i, t in enumerate(trajs):
    live = trained_rounds(t, cfg, block_size=block_size)
    if cfg.batch_units == "rounds" or cfg.layout == "per_round":
      units += [(i, (r,)) for r in live]
    elif live:
      units.append((i, None))
  if not units:
    return []
  if rng is not None:
    units = [units[i] for i in rng.permutation(len(units))]
  norm_length = float(max(t.response_ids.size for t in trajs))
  units = tail_units(units, rows_per_batch, tail, even_batches_rows)
  batches = []
  for at in range(0, len(units), rows_per_batch):
    rows = []
    for i, rounds in _rows_of(units[at : at + rows_per_batch], cfg.layout):
      for fields, n in trajectory_rows(
        trajs[i], cfg, block_size=block_size, mask_token_id=mask_token_id, rounds=rounds
      ):
        rows.append((fields, n, i))
    longest = max(r[0]["tokens"].size for r in rows)
    length = bucket_length(longest, length_multiple, max_length)
    rows = rows + [None] * (rows_per_batch - len(rows))
    batches.append(_pad_batch(rows, length, pad_id, norm_length))
    if cfg.gather_trained:
      batches[-1]["trained_index"] = trained_index(batches[-1]["p_mask"], length_multiple)
  return batches


def _rows_of(units: list, layout: str) -> list:
  """A batch's units as rows: (trajectory index, rounds). Packed: the units of one response share
  a row (in the order of its first unit; a round met twice starts another row); per_round: one
  row per unit."""
  if layout == "per_round":
    return list(units)
  rows: list = []
  open_row: dict = {}  # trajectory index -> its row (an index into rows) still taking rounds
  for i, rounds in units:
    if rounds is None:
      rows.append((i, None))
      continue
    at = open_row.get(i)
    if at is None or set(rounds) & set(rows[at][1]):
      open_row[i] = at = len(rows)
      rows.append((i, ()))
    rows[at] = (i, rows[at][1] + tuple(rounds))
  return rows


def tail_units(units: list, rows_per_batch: int, tail: str, even_batches_rows: int = 8) -> list:
  """The units (rows or responses, in batching order) that the optimizer steps take, under `tail`:

  apply         all of them; the last batch is completed with empty rows (ours).
  drop          those of the whole batches only.
  even_batches  DICE's: accelerate's `even_batches=True` sharding completes the last round of
                `even_batches_rows` (processes x per-device batch; DICE: 8 x 1) with copies of
                the first units, cyclically; DeepSpeed then steps only at its accumulation
                boundaries, every `rows_per_batch` units, and never applies what is left. So the
                tail is trained, plus copies of the first units, exactly when the padding
                completes a batch: n mod 256 in 249..255 for DICE (docs/dice_recipe.md, item 3).
  """
  if tail not in TAIL_ROWS:
    raise ValueError(f"tail must be one of {TAIL_ROWS}, got {tail!r}")
  if tail == "even_batches" and units:
    units = units + [units[i % len(units)] for i in range(-len(units) % even_batches_rows)]
  if tail != "apply":
    units = units[: len(units) - len(units) % rows_per_batch]
  return units


def trained_index(p_mask: np.ndarray, multiple: int) -> np.ndarray:
  """`[B, K]` int32: each row's trained columns (p_mask) in order, then -1; K is the largest
  count, rounded up by `bucket_length(., multiple)` (few distinct shapes)."""
  counts = p_mask.sum(axis=1)
  k = bucket_length(int(counts.max(initial=0)), multiple)
  out = np.full((p_mask.shape[0], k), -1, np.int32)
  for i, row in enumerate(p_mask):
    cols = np.nonzero(row)[0]
    out[i, : cols.size] = cols
  return out


# --- log-probs and the objective (jax) -----------------------------------------------------------


def trace_spec(batch, block_size: int) -> masks_lib.AttentionSpec:
  return masks_lib.AttentionSpec.trace(
    block_size,
    jnp.asarray(batch["segment_ids"]).astype(jnp.int32),
    jnp.asarray(batch["block_ids"]).astype(jnp.int32),
    jnp.asarray(batch["round_ids"]).astype(jnp.int32),
  )


def _target_logprobs(logits_btv, targets_bt, p_mask_bt, want_entropy=True):
  """(log p(target), entropy or zeros) at p_mask positions, 0 elsewhere; float32."""
  logits = logits_btv.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets_bt[..., None].astype(jnp.int32), axis=-1)[..., 0]
  logp = jnp.where(p_mask_bt, picked - lse, 0.0)
  if not want_entropy:
    return logp, jnp.zeros_like(logp)
  probs = jax.nn.softmax(jax.lax.stop_gradient(logits), axis=-1)
  ent = jax.lax.stop_gradient(lse) - jnp.sum(probs * jax.lax.stop_gradient(logits), axis=-1)
  return logp, jnp.where(p_mask_bt, ent, 0.0)


def chunked_target_logprobs(
  model, hidden_btd, targets_bt, p_mask_bt, chunk: int, want_entropy: bool = True
):
  """`_target_logprobs(model.logits_from_hidden(h), ...)` one chunk of the sequence at a time.

  Each chunk's logits are recomputed in the backward pass (jax.checkpoint), so the peak is one
  `[B, chunk, V]`; chunks without a trained position (the prompt and clean copy) are skipped.
  """
  b, t, _ = hidden_btd.shape
  if t <= chunk:
    logits = model.logits_from_hidden(hidden_btd)
    return _target_logprobs(logits, targets_bt, p_mask_bt, want_entropy)
  n = -(-t // chunk)
  pad = n * chunk - t

  def split(x):  # [B, T, ...] -> [n, B, chunk, ...]
    x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
    return x.reshape(b, n, chunk, *x.shape[2:]).swapaxes(0, 1)

  @jax.checkpoint
  def one(h_c, y_c, m_c):
    live = lambda: _target_logprobs(model.logits_from_hidden(h_c), y_c, m_c, want_entropy)
    none = lambda: (jnp.zeros(m_c.shape, jnp.float32), jnp.zeros(m_c.shape, jnp.float32))
    return jax.lax.cond(jnp.any(m_c), live, none)

  _, (logp, ent) = jax.lax.scan(
    lambda c, xs: (c, one(*xs)), None, (split(hidden_btd), split(targets_bt), split(p_mask_bt))
  )
  merge = lambda x: x.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
  return merge(logp), merge(ent)


def _logprobs_and_entropy(model, batch, chunk: int, want_entropy: bool = True):
  tokens = jnp.asarray(batch["tokens"]).astype(jnp.int32)
  positions = jnp.asarray(batch["positions"]).astype(jnp.int32)
  p_mask = jnp.asarray(batch["p_mask"]).astype(bool) & (jnp.asarray(batch["segment_ids"]) > 0)
  spec = trace_spec(batch, model.cfg.block_size)
  hidden = model(tokens, positions, spec, return_hidden=True)
  targets = jnp.asarray(batch["targets"]).astype(jnp.int32)
  if "trained_index" not in batch:
    logp, ent = chunked_target_logprobs(model, hidden, targets, p_mask, chunk, want_entropy)
    return logp, ent, p_mask
  # The trained positions only: [B, K] gathered, log-probs scattered back to [B, T].
  index = jnp.asarray(batch["trained_index"]).astype(jnp.int32)
  valid = index >= 0
  safe = jnp.where(valid, index, 0)
  take = lambda x: jnp.take_along_axis(x, safe, axis=1)  # noqa: E731
  h = jnp.take_along_axis(hidden, safe[..., None], axis=1)
  mask = valid & take(p_mask)
  logp_k, ent_k = chunked_target_logprobs(model, h, take(targets), mask, chunk, want_entropy)
  rows = jnp.arange(index.shape[0])[:, None]
  back = lambda v: (
    jnp.zeros(p_mask.shape, jnp.float32)
    .at[rows, safe]
    .add(  # noqa: E731
      jnp.where(mask, v, 0.0)
    )
  )
  return back(logp_k), back(ent_k), p_mask


def token_logprobs(model, batch, *, chunk: int = 2048) -> jax.Array:
  """`[B, T]` log p(target) at trained positions (p_mask), 0 elsewhere; float32."""
  return _logprobs_and_entropy(model, batch, chunk, want_entropy=False)[0]


def policy_terms(logp_new, logp_old, advantages, p_mask, *, clip_eps: float, ratio_clamp: float):
  """Per-token PPO-clip and k3 terms (module docstring); zero outside `p_mask`.

  Returns dict of `[B, T]` arrays: pg (−min(ρA, clip(ρ)A)), kl (k3), ratio (ρ, 1 outside
  p_mask), clipped (bool: the clipped branch is the minimum, so the token has no gradient).
  """
  delta = jnp.where(p_mask, logp_new - logp_old, 0.0)
  ratio = jnp.exp(jnp.clip(delta, -ratio_clamp, ratio_clamp))
  clipped_ratio = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
  unclipped_obj, clipped_obj = ratio * advantages, clipped_ratio * advantages
  pg = jnp.where(p_mask, -jnp.minimum(unclipped_obj, clipped_obj), 0.0)
  kl = jnp.where(p_mask, jnp.exp(jnp.clip(-delta, -ratio_clamp, ratio_clamp)) - 1.0 + delta, 0.0)
  clipped = p_mask & (clipped_obj < unclipped_obj)
  return dict(pg=pg, kl=kl, ratio=ratio, clipped=clipped)


def is_empty(batch) -> jax.Array:
  """True when a (micro-)batch holds no row (padding only): `train_step`'s `is_empty`."""
  return ~jnp.any(jnp.asarray(batch["segment_ids"]) > 0)


def normalizer(batch, normalization: str, p_mask=None) -> jax.Array:
  """D of the module docstring for one (micro-)batch: L1 x rounds (`dice`) or trained tokens."""
  if normalization == "dice":
    rounds = jnp.asarray(batch["norm_rounds"], jnp.float32)
    return jnp.sum(rounds * jnp.asarray(batch["norm_length"], jnp.float32))
  if normalization == "tokens":
    p_mask = jnp.asarray(batch["p_mask"]) if p_mask is None else p_mask
    return jnp.sum(p_mask).astype(jnp.float32)
  raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")


def tracerl_loss(model, batch, rng, cfg: TraceRLConfig) -> tuple[jax.Array, dict]:
  """(loss_sum, metrics) of one (micro-)batch; the loss is loss_sum / metrics["denominator"].

  The old log-probs are `batch["sampler_logp"]` (`cfg.old_logp='sampler'`) or `batch["old_logp"]`
  (`'trainer'`: from `token_logprobs` with the rollout parameters), which must then be present.
  Metrics are sums (exact under accumulation) except `ratio_max`; see `METRIC_MEANS`.
  """
  del rng  # the objective is deterministic
  old_key = "sampler_logp" if cfg.old_logp == "sampler" else "old_logp"
  if old_key not in batch:
    raise KeyError(
      f"tracerl_loss: batch has no {old_key!r} (old_logp={cfg.old_logp!r}); with 'trainer', "
      f"compute it with token_logprobs (or jit_token_logprobs) before the first update of the RL "
      f"step"
    )
  logp, ent, p_mask = _logprobs_and_entropy(model, batch, cfg.logit_chunk)
  old = jnp.asarray(batch[old_key], jnp.float32)
  adv = jnp.asarray(batch["advantages"], jnp.float32)
  terms = policy_terms(logp, old, adv, p_mask, clip_eps=cfg.clip_eps, ratio_clamp=cfg.ratio_clamp)
  pg_sum, kl_sum = jnp.sum(terms["pg"]), jnp.sum(terms["kl"])
  loss_sum = pg_sum + cfg.kl_beta * kl_sum
  sg = jax.lax.stop_gradient
  ratio = sg(terms["ratio"])
  metrics = dict(
    denominator=normalizer(batch, cfg.normalization, p_mask),
    trained_tokens=jnp.sum(p_mask).astype(jnp.float32),
    rounds=jnp.sum(jnp.asarray(batch["norm_rounds"], jnp.float32)),
    pg_sum=sg(pg_sum),
    kl_sum=sg(kl_sum),
    clipped_tokens=jnp.sum(terms["clipped"]).astype(jnp.float32),
    entropy_sum=jnp.sum(ent),
    ratio_sum=jnp.sum(jnp.where(p_mask, ratio, 0.0)),
    ratio_max=jnp.max(jnp.where(p_mask, ratio, 0.0)),
  )
  return loss_sum, metrics


def jit_token_logprobs(graphdef, param_shardings, mesh: Mesh, accum_steps: int = 1, chunk=2048):
  """`run(params, batch) -> old_logp`, jitted and sharded like the train step's batch.

  `batch` is what `train_step.shard_batch(b, mesh, accum_steps)` returns (`[B, T]`, or
  `[accum, micro, T]` processed one micro-batch at a time, empty ones skipped); the result has the
  same layout, ready to be stored as `batch["old_logp"]`.
  """
  batch_sh = ts.batch_shardings(mesh, accum_steps)

  def fn(params, batch):
    model = nnx.merge(graphdef, params)
    batch = {k: v for k, v in batch.items() if k != "old_logp"}
    if accum_steps == 1:
      return token_logprobs(model, batch, chunk=chunk)

    def one(mb):
      zeros = lambda: jnp.zeros(mb["tokens"].shape, jnp.float32)  # noqa: E731
      return jax.lax.cond(is_empty(mb), zeros, lambda: token_logprobs(model, mb, chunk=chunk))

    return jax.lax.map(one, batch)

  trace_context.settle()  # else the first call's kernels change the context (trace_context.py)
  jitted = jax.jit(fn, in_shardings=(param_shardings, batch_sh), out_shardings=batch_sh)

  def run(params, batch):
    with jax.set_mesh(mesh):
      return jitted(params, batch)

  run.jitted = jitted
  return run
