"""The Pallas TPU attention kernels (interpreter on CPU) at the settings they run at: bf16 inputs,
the default 512 x 512 tiles, rows of thousands of tokens (packed segments, left padding, prompts
ending inside a block), grouped-query heads; the decode cache kernel over several key tiles at
different fills. Each check is shown to catch a planted bug (mutants of flash_tpu's own source).

Tolerance: errors are measured against an fp32 dense reference computed from the same bf16 values
(input rounding is shared) and bounded by a multiple of the error of the dense path run in bf16
(`transformer.dense_attention` / `cached_attention`: fp32 scores and softmax, bf16 probabilities,
bf16 output), in max and RMS norm. The kernel rounds the same intermediates; its backward also
rounds dS to bf16 before dS @ K (the dense path's transpose keeps it fp32) and takes
D = rowsum(O * dO) from the bf16 output (flash attention's D term; the dense path differentiates
the fp32 softmax), so its gradient errors may exceed the dense path's (measured 2026-12-03:
0.35-1.5x in max, 0.67-1.5x in RMS): bounds 3x (max) and 2x (RMS). A planted bug gives 10x-1000x.
~60 s for the whole file on the 2-core dev VM."""

import collections
import functools
import inspect
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from dice_jax.model import flash_tpu, masks, platform, transformer
from dice_jax.model.kv_cache import KVCache

H = 128  # the TPU lane width: the kernels' head width
SLACK = np.array([3.0, 2.0])  # (max, RMS) error over the bf16 dense path's
# (query heads, K/V heads) per mask: grouped-query attention as sdar_1p7b (16 over 8) where it is
# cheap; one head on the longest rows (the head mapping does not depend on the mask).
HEADS = {"block_causal": (4, 2), "causal": (1, 1), "block_diffusion": (1, 1), "trace": (1, 1)}


def _segments(t, lead_pad, segs, block=4):
  """One row of `t` columns: `lead_pad` padding columns (the sampler's left padding), then
  segments `(length, response start)` with positions from 0 and response-aligned blocks (a prompt
  ending inside a block puts blocks across the 512-column tile edges), then padding."""
  seg, pos, blk = (np.zeros((1, t), np.int32) for _ in range(3))
  at = lead_pad
  for i, (n, start) in enumerate(segs):
    sl = slice(at, at + n)
    seg[0, sl], pos[0, sl] = i + 1, np.arange(n)
    blk[0, sl] = np.floor_divide(np.arange(n) - start, block)
    at += n
  assert at <= t
  return seg, pos, blk


def _trace_row(rng, prompt=1029, response=1504, block=4, rounds=3, multiple=512):
  """One TraceRL row as `tracerl.trajectory_rows` packs it: [prompt | x0 | noisy copies], each
  block's noisy rounds (a random subset of 1..`rounds`, never empty) block-major, then padding to
  a multiple of the tile. Returns seg, blk, rnd, pos `[1, T]`."""
  parts = [  # (blocks, round, positions)
    (np.floor_divide(np.arange(prompt) - prompt, block), 0, np.arange(prompt)),
    (np.arange(response) // block, 0, prompt + np.arange(response)),
  ]
  for b in range(response // block):
    chosen = np.flatnonzero(rng.random(rounds) < 0.5) + 1
    for r in chosen if chosen.size else [rounds]:
      parts.append((np.full(block, b), r, prompt + b * block + np.arange(block)))
  col = lambda i: np.concatenate([np.broadcast_to(p[i], p[2].shape) for p in parts])
  blk, rnd, pos = col(0), col(1), col(2)
  t = -(-blk.size // multiple) * multiple
  pad = lambda a: np.pad(a, (0, t - a.size))[None].astype(np.int32)
  return pad(np.ones_like(blk)), pad(blk), pad(rnd), pad(pos)


def _interpret():
  """The Pallas interpreter off a TPU; on one (`JAX_PLATFORMS=tpu pytest ...`) the same checks
  run the compiled Mosaic kernels."""
  return jax.default_backend() != "tpu"


def _layout(kind):
  """(spec, positions `[1, S]`, live queries `[1, S]`) of one row of thousands of tokens."""
  j = jnp.asarray
  if kind == "trace":  # ~4,600 tokens, padded to 5,120
    seg, blk, rnd, pos = _trace_row(np.random.default_rng(38))
    return masks.AttentionSpec.trace(4, j(seg), j(blk), j(rnd)), j(pos), seg > 0
  if kind == "block_diffusion":  # an SFT row of 4,096 tokens: a 2L input of 8,192
    seg, pos, blk = _segments(4096, 0, [(2301, 1100), (1700, 517)])
    spec = masks.AttentionSpec.block_diffusion(4, j(seg), j(blk))
    return spec, j(np.concatenate([pos, pos], 1)), np.concatenate([seg, seg], 1) > 0
  # Left padding to 3 columns before the first tile edge: the first block (4 keys) straddles it.
  seg, pos, blk = _segments(4096, 509, [(1531, 1020), (1678, 700), (378, 13)])
  return masks.AttentionSpec(kind, 4, j(seg), j(blk)), j(pos), seg > 0


def _errors(got, want):
  """(max, RMS) of |got - want|."""
  d = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
  return np.array([d.max(), np.sqrt(np.mean(d**2))])


def _dense_by_query_chunks(q, k, v, mask, chunk=1024):
  """`transformer.dense_attention` on `chunk` query rows at a time (rows are independent; each
  chunk rematerialised in the backward pass): the same values with [N, chunk, S] scores in memory
  instead of [N, S, S] (an 8,192-token row would need 1 GiB per head and tensor)."""
  b, s, n, h = q.shape
  qc = q.reshape(b, s // chunk, chunk, n, h).swapaxes(0, 1)
  mc = mask.reshape(b, s // chunk, chunk, s).swapaxes(0, 1)
  one = jax.checkpoint(lambda qm: transformer.dense_attention(qm[0], k, v, qm[1]))
  return lax.map(one, (qc, mc)).swapaxes(0, 1).reshape(q.shape)


@jax.jit
def _dense_and_grads(q, k, v, ct, mask):
  o, vjp = jax.vjp(lambda q, k, v: _dense_by_query_chunks(q, k, v, mask), q, k, v)
  return (o, *vjp(ct.astype(o.dtype)))


@functools.lru_cache(maxsize=None)
def _case(kind):
  """Inputs of one mask at real settings and its references, once per session: the fp32 dense
  output and gradients, and the bf16 dense path's (max, RMS) error against them."""
  spec, positions, valid = _layout(kind)
  s = positions.shape[1]
  rng = np.random.default_rng(list(kind.encode()))
  bf = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
  n, kh = HEADS[kind]
  q, k, v = bf(1, s, n, H), bf(1, s, kh, H), bf(1, s, kh, H)
  ct = bf(1, s, n, H) * jnp.asarray(valid[..., None, None], jnp.bfloat16)  # none on padding
  mask = masks.dense_mask(spec, positions)
  f32 = lambda x: x.astype(jnp.float32)
  with jax.default_matmul_precision("highest"):  # fp32 products on a TPU too
    want = [np.asarray(x)[0] for x in _dense_and_grads(f32(q), f32(k), f32(v), f32(ct), mask)]
  pick = [valid[0], slice(None), slice(None), slice(None)]  # o: live queries; grads: all
  bf16 = _dense_and_grads(q, k, v, ct, mask)
  base = [_errors(np.asarray(g, np.float32)[0][p], w[p]) for g, w, p in zip(bf16, want, pick)]
  return dict(
    spec=spec,
    positions=positions,
    valid=valid[0],
    args=(q, k, v, ct),
    want=want,
    pick=pick,
    base=base,
  )


def _kernel_ratios(kind, grads=True):
  """`flash_tpu.attention` (interpreter, default tiles) on `_case(kind)`: its error against the
  fp32 reference over the bf16 dense path's, rows (o, dq, dk, dv) x columns (max, RMS)."""
  c = _case(kind)
  fn = lambda q, k, v: flash_tpu.attention(
    q, k, v, c["spec"], c["positions"], interpret=_interpret()
  )

  def run(q, k, v, ct):
    o, vjp = jax.vjp(fn, q, k, v)
    return (o, *vjp(ct)) if grads else (o,)

  got = [np.asarray(x, np.float32)[0] for x in jax.jit(run)(*c["args"])]
  assert np.all(np.isfinite(got[0])) and np.all(got[0][~c["valid"]] == 0)  # padding: 0, no NaN
  return np.stack(
    [_errors(g[p], w[p]) / b for g, w, p, b in zip(got, c["want"], c["pick"], c["base"])]
  )


def _within_bf16(ratios):
  return bool(np.all(ratios <= SLACK))


@pytest.mark.parametrize(
  "kind",
  ["block_causal", "causal", "trace", "block_diffusion"],
)
def test_kernel_in_bf16_at_real_settings_is_as_close_as_bf16_dense(kind):
  """One row of 4,096 tokens (the 2L SFT input of 8,192; a TraceRL row of 5,120), 512 x 512
  tiles, bf16: the output and dq, dk, dv within SLACK x the bf16 dense path's error."""
  ratios = _kernel_ratios(kind)
  print(kind, "error / bf16 dense error (o, dq, dk, dv) x (max, rms):", ratios.round(2).tolist())
  assert _within_bf16(ratios), ratios


# --- the decode cache kernel over several key tiles --------------------------------------------

CACHE = dict(s=2048, t=4, n=4, kh=2, pad=[100, 0, 0, 0, 0], fill=[1337, 2048, 700, 0, 900])
# rows: left padding then a fill into the 3rd of 4 tiles (partial); full; 2 tiles (partial);
# an empty cache; a finished slot (no live query). Slots above the fill hold stale segment ids.


@functools.lru_cache(maxsize=None)
def _cache_case(kind):
  """Inputs (bf16, layer 1 of a 2-layer stacked cache) and references, once per session."""
  s, t, n, kh = CACHE["s"], CACHE["t"], CACHE["n"], CACHE["kh"]
  pad, fill = np.array(CACHE["pad"]), np.array(CACHE["fill"])
  b = pad.size
  rng = np.random.default_rng(11)
  bf = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
  q, kn, vn = bf(b, t, n, H), bf(b, t, kh, H), bf(b, t, kh, H)
  ck, cv = bf(2, b, s, kh * H), bf(2, b, s, kh * H)  # the stored layout: heads fused
  col = np.arange(s)[None]
  cpos = (col - pad[:, None]).astype(np.int32)
  cseg = (col >= pad[:, None]).astype(np.int32)
  pos = (fill - pad)[:, None] + np.arange(t)[None]
  seg = np.repeat([[1], [1], [1], [1], [0]], t, 1).astype(np.int32)
  j = jnp.asarray
  spec = masks.AttentionSpec(kind, 4, j(seg), j(pos // 4))
  cache = lambda k, v: KVCache(k, v, j(cpos), j(cseg), j(cpos // 4), j(fill, jnp.int32), H)
  args = lambda q, kn, vn, ck, cv: (q, kn, vn, ck[1], cv[1], spec, j(pos), j(seg), j(pos // 4))
  dense = lambda *x: transformer.cached_attention(*args(*x), cache(x[3], x[4]), impl="dense")
  f32 = lambda x: x.astype(jnp.float32)
  inputs = (q, kn, vn, ck, cv)
  with jax.default_matmul_precision("highest"):
    want = np.asarray(dense(*map(f32, inputs)))[:4]
  base = _errors(np.asarray(dense(*inputs), np.float32)[:4], want)
  return dict(inputs=inputs, want=want, base=base, args=args, cache=cache)


def _cache_ratios(kind):
  """The TPU cache kernel (`attention_impl='flash'` traced for TPU, interpreted): its (max, RMS)
  error on the live rows against the fp32 reference over the bf16 dense path's."""
  c = _cache_case(kind)
  flash = lambda *x: transformer.cached_attention(  # a new function: traced anew (mutants)
    *c["args"](*x), c["cache"](x[3], x[4]), impl="flash", layer=1
  )
  with platform.lowering_for("tpu", interpret=_interpret()):
    got = np.asarray(jax.jit(flash)(*c["inputs"]), np.float32)
  assert np.all(np.isfinite(got))  # the finished slot too
  return (_errors(got[:4], c["want"]) / c["base"])[None]


@pytest.mark.parametrize("kind", ["block_causal", "causal"])
def test_cache_kernel_over_several_tiles_is_as_close_as_bf16_dense(kind):
  """bf16, a 2,048-slot cache in 512-slot tiles: rows filled into a partial 3rd tile after left
  padding, to the end, into a partial 2nd tile, not at all, and a finished slot."""
  ratios = _cache_ratios(kind)
  print(kind, "error / bf16 dense error (max, rms):", ratios.round(2).tolist())
  assert _within_bf16(ratios), ratios


# --- mutants: each check above catches a planted bug --------------------------------------------


def _mutate(monkeypatch, name, old, new):
  """Replace `flash_tpu.<name>` (for this test) by its own source with `old` changed to `new`."""
  src = textwrap.dedent(inspect.getsource(getattr(flash_tpu, name)))
  assert src.count(old) == 1, f"mutation site {old!r} is not in flash_tpu.{name} exactly once"
  scope = dict(vars(flash_tpu))
  exec(compile(src.replace(old, new), f"<mutant of flash_tpu.{name}>", "exec"), scope)
  monkeypatch.setattr(flash_tpu, name, scope[name])


Mutant = collections.namedtuple("Mutant", "function old new check kind grads")
A, C = "attention", "cache"
MUTANTS = {  # a one-token bug in flash_tpu's source, and the check (and mask) that must catch it
  # the mask: a query no longer sees its own rank / a noisy token its own block
  "mask_rank_off_by_one": Mutant(
    "_tile_mask", "k_rank <= q_rank", "k_rank < q_rank", A, "causal", 0
  ),
  "mask_klo_off_by_one": Mutant("_tile_mask", "k_lo >= q_rank", "k_lo > q_rank", A, "trace", 0),
  # the tile plan skips a live tile: the next tile's first block straddling the tile edge
  "plan_drops_a_tile": Mutant(
    "tile_plan", "k_(kr_lo) <= q_", "k_(kr_lo) < q_", A, "block_causal", 0
  ),
  # query head -> K/V head interleaved instead of grouped (equal when there is one K/V head)
  "kv_head_interleaved": Mutant(
    "forward", "lax.div(hi, g)", "lax.rem(hi, kh_h // h)", A, "block_causal", 0
  ),
  # online softmax: the accumulator not rescaled when the running max moves
  "no_rescale": Mutant(
    "_fwd_kernel", "acc_sc[...] * _lane_tile(alpha, h)", "acc_sc[...]", A, "causal", 0
  ),
  # backward: dq keeps only the last live key tile; dS without the softmax scale
  "dq_keeps_the_last_tile": Mutant("_dq_kernel", "dq_sc[...] +=", "dq_sc[...] =", A, "causal", 1),
  "ds_not_scaled": Mutant(
    "_p_ds", "_lane_tile(di, block_k)) * scale", "_lane_tile(di, block_k))", A, "causal", 1
  ),
  # decode over several key tiles: no rescale; each live tile fetched as its predecessor; an
  # empty row's 0 / 0
  "cache_no_rescale": Mutant(
    "_fwd_kernel", "acc_sc[...] * _lane_tile(alpha, h)", "acc_sc[...]", C, "block_causal", 0
  ),
  "cache_fetch_off_by_one": Mutant(
    "_fetch_index", "jnp.int32), -1", "jnp.int32) - 1, -1", C, "causal", 0
  ),
  "cache_empty_row_0_over_0": Mutant(
    "_fwd_kernel", "jnp.where(empty, 1.0, l)", "l", C, "block_causal", 0
  ),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_each_check_catches_its_mutant(mutant, monkeypatch):
  m = MUTANTS[mutant]
  (_case if m.check == A else _cache_case)(m.kind)  # references before the mutation
  _mutate(monkeypatch, m.function, m.old, m.new)
  try:
    ratios = _kernel_ratios(m.kind, m.grads) if m.check == A else _cache_ratios(m.kind)
  except AssertionError:  # NaN or non-zero padding: caught
    return
  print(mutant, ratios.round(1).tolist())
  assert not _within_bf16(ratios), f"{mutant} survived: {ratios}"
