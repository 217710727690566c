"""Each mask function against a brute-force, loop-by-loop construction."""

import itertools

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
