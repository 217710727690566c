"""Each mask function against a brute-force, loop-by-loop construction."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dice_jax.model import masks


def _random_layout(rng, batch=2, length=13, block=4):
  pos, seg, blk = [], [], []
  for _ in range(batch):
    # two or three packed segments, then padding (segment 0); positions restart per segment
    cuts = sorted(rng.choice(np.arange(2, length - 1), size=2, replace=False))
    lens = [cuts[0], cuts[1] - cuts[0], length - cuts[1]]
    p, s, b = [], [], []
    for i, n in enumerate(lens):
      sid = 0 if i == 2 and rng.random() < 0.5 else i + 1
      start = rng.integers(0, n)  # response start inside the segment
      p += list(range(n))
      s += [sid] * n
      b += [int(np.floor((q - start) / block)) for q in range(n)]
    pos.append(p)
    seg.append(s)
    blk.append(b)
  return np.array(pos), np.array(seg), np.array(blk)


def brute(kind, pos, seg, blk):
  B, T = pos.shape
  out = np.zeros((B, T, T), bool)
  for b, i, j in itertools.product(range(B), range(T), range(T)):
    same = seg[b, i] == seg[b, j] and seg[b, i] != 0
    if kind == "causal":
      out[b, i, j] = same and pos[b, j] <= pos[b, i]
    elif kind == "block_causal":
      out[b, i, j] = same and blk[b, j] <= blk[b, i]
    else:
      out[b, i, j] = same
  return out


def brute_block_diffusion(seg, blk):
  B, T = seg.shape
  out = np.zeros((B, 2 * T, 2 * T), bool)
  for b, i, j in itertools.product(range(B), range(2 * T), range(2 * T)):
    qi, kj = i % T, j % T
    q_clean, k_clean = i >= T, j >= T
    same = seg[b, qi] == seg[b, kj] and seg[b, qi] != 0
    if not q_clean and not k_clean:
      ok = blk[b, qi] == blk[b, kj]  # M_BD: noisy block sees itself
    elif not q_clean and k_clean:
      ok = blk[b, kj] < blk[b, qi]  # M_OBC: noisy sees earlier clean blocks
    elif q_clean and k_clean:
      ok = blk[b, kj] <= blk[b, qi]  # M_BC: clean is block-causal
    else:
      ok = False  # clean never sees noisy
    out[b, i, j] = same and ok
  return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kind", ["causal", "block_causal", "full"])
def test_self_attention_masks_match_brute_force(seed, kind):
  pos, seg, blk = _random_layout(np.random.default_rng(seed))
  spec = masks.AttentionSpec(kind, 4, jnp.asarray(seg), jnp.asarray(blk))
  got = np.asarray(masks.dense_mask(spec, jnp.asarray(pos)))
  np.testing.assert_array_equal(got, brute(kind, pos, seg, blk))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_diffusion_mask_matches_brute_force(seed):
  pos, seg, blk = _random_layout(np.random.default_rng(seed))
  spec = masks.AttentionSpec.block_diffusion(4, jnp.asarray(seg), jnp.asarray(blk))
  both = jnp.asarray(np.concatenate([pos, pos], 1))
  got = np.asarray(masks.dense_mask(spec, both))
  np.testing.assert_array_equal(got, brute_block_diffusion(seg, blk))


def test_default_block_ids_are_absolute_positions_over_block_size():
  pos = jnp.arange(10)[None]
  got = np.asarray(masks.dense_mask(masks.AttentionSpec.block_causal(4), pos))
  blk = np.arange(10) // 4
  np.testing.assert_array_equal(got[0], blk[None, :] <= blk[:, None])


def test_response_aligned_block_ids_count_backwards_into_the_prompt():
  pos = jnp.arange(9)[None]
  got = np.asarray(masks.block_ids_from_response_start(pos, 3, 4))
  np.testing.assert_array_equal(got[0], [-1, -1, -1, 0, 0, 0, 0, 1, 1])


def test_bad_spec_is_rejected_with_a_clear_error():
  with pytest.raises(ValueError, match="kind must be one of"):
    masks.AttentionSpec("diagonal", 4)
  with pytest.raises(ValueError, match="block_size"):
    masks.AttentionSpec("block_causal", 0)


# --- the TraceRL layout ------------------------------------------------------------------------


def _trace_layout(rng, packed: bool, block=4, length=48):
  """Rows of 1-2 responses (segments) laid out as [prompt | x0 | noisy copies], then padding.

  Each token is described independently of any mask code: (segment, kind, block, round), kind in
  {prompt, clean, noisy}; prompt blocks count back from the response start. `packed`: several
  rounds of one response in the row (a random subset of its (round, block) pairs); otherwise one
  round per segment covering every response block (DICE's `[prompt | x0 | xt]`).
  """
  rows = []
  for _ in range(2):
    toks = []
    for sid in (1, 2)[: int(rng.integers(1, 3))]:
      p, nb = int(rng.integers(1, 8)), int(rng.integers(1, 4))
      toks += [(sid, "prompt", (i - p) // block, 0, i) for i in range(p)]
      toks += [(sid, "clean", i // block, 0, p + i) for i in range(nb * block)]
      if packed:
        pairs = [(r, b) for r in (1, 2, 3) for b in range(nb) if rng.random() < 0.6]
      else:
        pairs = [(int(rng.integers(1, 4)), b) for b in range(nb)]
      for r, b in pairs:
        toks += [(sid, "noisy", b, r, p + b * block + i) for i in range(block)]
    if len(toks) > length:
      toks = toks[:length]  # a truncated row is still a valid set of tokens to test
    toks += [(0, "pad", 0, 0, 0)] * (length - len(toks))
    rows.append(toks)
  arr = lambda j: np.array([[t[j] for t in row] for row in rows])
  return rows, arr(0), arr(2), arr(3), arr(4)


def brute_trace(rows):
  B, T = len(rows), len(rows[0])
  out = np.zeros((B, T, T), bool)
  for b, i, j in itertools.product(range(B), range(T), range(T)):
    (sq, kq, bq, rq, _), (sk, kk, bk, rk, _) = rows[b][i], rows[b][j]
    if sq == 0 or sq != sk:
      continue
    if kq in ("prompt", "clean") and kk in ("prompt", "clean"):
      out[b, i, j] = bk <= bq  # block-causal, bidirectional inside a block
    elif kq == "noisy" and kk in ("prompt", "clean"):
      out[b, i, j] = bk < bq  # earlier blocks, final tokens
    elif kq == "noisy" and kk == "noisy":
      out[b, i, j] = rq == rk and bq == bk  # its own noisy block of its own round
  return out


def _trace_spec(seg, blk, rnd):
  return masks.AttentionSpec.trace(4, jnp.asarray(seg), jnp.asarray(blk), jnp.asarray(rnd))


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_trace_mask_and_its_flash_vectors_match_brute_force(seed, packed):
  from dice_jax.model import flash_bd

  rows, seg, blk, rnd, pos = _trace_layout(np.random.default_rng(seed), packed)
  want = brute_trace(rows)
  spec = _trace_spec(seg, blk, rnd)
  np.testing.assert_array_equal(np.asarray(masks.dense_mask(spec, jnp.asarray(pos))), want)
  vectors = flash_bd.mask_vectors(spec, jnp.asarray(pos))
  np.testing.assert_array_equal(np.asarray(flash_bd.mask_from_vectors(*vectors)), want)


def _masked_attention_np(q, k, v, mask):
  """Softmax attention with a boolean mask in float64; rows with nothing visible give 0."""
  b, t, n, h = q.shape
  g = n // k.shape[2]
  k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  s = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(h)
  s = np.where(mask[:, None], s, -np.inf)
  m = np.max(s, axis=-1, keepdims=True)
  p = np.where(mask[:, None], np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
  p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
  return np.einsum("bnts,bsnh->btnh", p, v)


@pytest.mark.parametrize("impl", ["dense", "xla", "flash"])
def test_trace_attention_matches_brute_force_on_every_implementation(impl):
  from dice_jax.model import flash_bd
  from dice_jax.model.transformer import self_attention

  rows, seg, blk, rnd, pos = _trace_layout(np.random.default_rng(7), packed=True, length=32)
  mask = brute_trace(rows)
  rng = np.random.default_rng(0)
  q, k, v = (rng.normal(size=(2, 32, m, 16)).astype(np.float32) for m in (4, 2, 2))
  spec = _trace_spec(seg, blk, rnd)
  if impl == "flash":
    fn = lambda q, k, v: flash_bd.attention(
      q, k, v, spec, jnp.asarray(pos), block_q=16, block_k=8, block_bwd=16, interpret=True
    )
  else:
    fn = lambda q, k, v: self_attention(q, k, v, spec, jnp.asarray(pos), impl=impl)
  got = np.asarray(fn(*map(jnp.asarray, (q, k, v))))
  assert np.all(np.isfinite(got))  # padding rows (nothing visible) give no NaN
  live = seg > 0
  want = _masked_attention_np(*(x.astype(np.float64) for x in (q, k, v)), mask)
  np.testing.assert_allclose(got[live], want[live], atol=2e-5)
  if impl == "flash":  # the kernel's own backward against the dense path on the brute-force mask
    from dice_jax.model.transformer import dense_attention

    ct = jnp.asarray(rng.normal(size=q.shape) * live[:, :, None, None], jnp.float32)
    ref = lambda *a: (dense_attention(*a, jnp.asarray(mask)) * ct).sum()
    fla = lambda *a: (fn(*a) * ct).sum()
    args = tuple(map(jnp.asarray, (q, k, v)))
    for g_ref, g_fla in zip(jax.grad(ref, (0, 1, 2))(*args), jax.grad(fla, (0, 1, 2))(*args)):
      np.testing.assert_allclose(np.asarray(g_fla), np.asarray(g_ref), atol=2e-5)


def test_trace_spec_needs_round_and_block_ids_and_takes_no_cache():
  ids = jnp.zeros((1, 4), jnp.int32)
  with pytest.raises(ValueError, match="round_ids are required for kind 'trace'"):
    masks.AttentionSpec("trace", 4, ids, ids)
  with pytest.raises(ValueError, match="only for it"):
    masks.AttentionSpec("block_causal", 4, ids, ids, ids)
  with pytest.raises(ValueError, match="explicit"):
    masks.AttentionSpec("trace", 4, ids, None, ids)
  from dice_jax.model.transformer import cached_attention

  with pytest.raises(ValueError, match="trace attention is a training layout"):
    cached_attention(*(None,) * 5, masks.AttentionSpec.trace(4, ids, ids, ids), *(None,) * 4)
