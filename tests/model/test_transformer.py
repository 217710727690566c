"""Behaviour of the NNX transformer: cache consistency, the 2L layout, dtypes, scan, sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dice_jax import sharding
from dice_jax.model import AttentionSpec, KVCache, Transformer, get_config
from dice_jax.model.flash_decode import DecodeTiles
from dice_jax.model.transformer import DecodeView, packed, unpacked

CFG = get_config("tiny", dtype="float32")
B, T = 2, 12


@pytest.fixture(scope="module")
def model():
  return Transformer(CFG, rngs=nnx.Rngs(0))


def _inputs(seed=1):
  tok = jax.random.randint(jax.random.key(seed), (B, T), 0, CFG.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  return tok, pos


@pytest.mark.parametrize("kind", ["causal", "block_causal"])
def test_prefill_then_cached_block_equals_full_forward(model, kind):
  tok, pos = _inputs()
  spec = AttentionSpec(kind, 4)
  full = model(tok, pos, spec)
  cache = KVCache.empty(CFG, B, 16)
  first, cache = model(tok[:, :8], pos[:, :8], spec, cache=cache, update_cache=True)
  second, cache2 = model(tok[:, 8:], pos[:, 8:], spec, cache=cache, update_cache=False)
  np.testing.assert_allclose(first, full[:, :8], atol=1e-5)
  np.testing.assert_allclose(second, full[:, 8:], atol=1e-5)
  assert (np.asarray(cache.length) == 8).all() and (
    np.asarray(cache2.length) == 8
  ).all()  # read-only


def test_cache_slots_of_other_segments_are_invisible(model):
  """Left padding (segment 0) in the cache does not change the logits of later tokens."""
  tok, pos = _inputs()
  spec = AttentionSpec.block_causal(4)
  ref = model(tok[:, :8], pos[:, :8], spec)
  pad_tok = jnp.concatenate([jnp.full((B, 4), 7), tok[:, :8]], 1)
  pad_pos = jnp.concatenate([jnp.zeros((B, 4), jnp.int32), pos[:, :8]], 1)
  seg = jnp.concatenate([jnp.zeros((B, 4), jnp.int32), jnp.ones((B, 8), jnp.int32)], 1)
  got = model(pad_tok, pad_pos, AttentionSpec.block_causal(4, seg))[:, 4:]
  np.testing.assert_allclose(got, ref, atol=1e-5)


def test_clean_half_of_the_2L_input_equals_the_block_causal_forward(model):
  tok, pos = _inputs()
  noisy = jnp.where(jax.random.bernoulli(jax.random.key(3), 0.5, tok.shape), CFG.mask_token_id, tok)
  out = model(
    jnp.concatenate([noisy, tok], 1),
    jnp.concatenate([pos, pos], 1),
    AttentionSpec.block_diffusion(4),
  )
  np.testing.assert_allclose(out[:, T:], model(tok, pos, AttentionSpec.block_causal(4)), atol=1e-5)


def test_noisy_block_sees_only_its_own_block_and_earlier_clean_blocks(model):
  tok, pos = _inputs()
  noisy = tok.at[:, :].set(CFG.mask_token_id)
  spec = AttentionSpec.block_diffusion(4)
  x = jnp.concatenate([noisy, tok], 1)
  p2 = jnp.concatenate([pos, pos], 1)
  base = model(x, p2, spec)
  # change the clean tokens of block 1 (4..7): noisy blocks 0 and 1 must not change, noisy
  # block 2 (which conditions on clean blocks 0-1) must
  x_changed = x.at[:, T + 4 : T + 8].set(5)
  changed = model(x_changed, p2, spec)
  np.testing.assert_allclose(changed[:, :8], base[:, :8], atol=1e-6)
  assert np.abs(np.asarray(changed[:, 8:T] - base[:, 8:T])).max() > 1e-4


def test_bf16_compute_is_close_to_fp32(model):
  tok, pos = _inputs()
  spec = AttentionSpec.block_causal(4)
  ref = model(tok, pos, spec)
  bf = Transformer(CFG.replace(dtype="bfloat16"), rngs=nnx.Rngs(0))
  out = bf(tok, pos, spec)
  assert out.dtype == jnp.float32  # logits are accumulated in fp32
  np.testing.assert_allclose(out, ref, atol=0.05)
  assert bf.layers.q_proj[...].dtype == jnp.float32  # fp32 master parameters


def test_program_size_does_not_grow_with_depth():
  def eqns(num_layers):
    cfg = CFG.replace(num_layers=num_layers)
    m = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    tok, pos = _inputs()
    jaxpr = jax.make_jaxpr(lambda m, t, p: m(t, p, AttentionSpec.block_causal(4)))(m, tok, pos)
    return str(jaxpr).count("dot_general")

  assert eqns(2) == eqns(12) > 0


def test_sharded_forward_on_8_devices_equals_single_device(model):
  assert jax.device_count() == 8, "conftest sets 8 fake CPU devices"
  mesh = sharding.make_mesh(fsdp=4, tensor=2)
  sharded = sharding.create_sharded(lambda: Transformer(CFG, rngs=nnx.Rngs(0)), mesh)
  q = sharded.layers.q_proj[...]
  assert q.sharding.spec == jax.P(None, "fsdp", "tensor", None)
  tok, pos = (
    jax.random.randint(jax.random.key(1), (4, T), 0, CFG.vocab_size),
    jnp.broadcast_to(jnp.arange(T), (4, T)),
  )
  spec = AttentionSpec.block_causal(4)
  bs = jax.NamedSharding(mesh, jax.P(("data", "fsdp")))  # rows over data x fsdp
  got = jax.jit(lambda m, t, p: m(t, p, spec))(
    sharded, jax.device_put(tok, bs), jax.device_put(pos, bs)
  )
  np.testing.assert_allclose(got, model(tok, pos, spec), atol=1e-5)
  sharding.assert_sufficiently_sharded(nnx.state(sharded), mesh)


def test_unsharded_guard_fires_when_rules_shard_nothing():
  mesh = sharding.make_mesh(fsdp=4, tensor=2)
  state = nnx.state(nnx.eval_shape(lambda: Transformer(CFG, rngs=nnx.Rngs(0))))
  with pytest.raises(ValueError, match="unsharded"):
    sharding.assert_sufficiently_sharded(state, mesh, rules={})


@pytest.mark.parametrize("impl", ["dense", "flash"])
def test_unrolled_layers_equal_the_scan_with_and_without_a_cache(impl):
  """`scan_layers=False` (static per-layer weight slices, for decoding) computes what the scan does:
  the same logits, the same cache writes, the same prefill K/V."""
  cfg = CFG.replace(attention_impl=impl)
  scan = Transformer(cfg, rngs=nnx.Rngs(0))
  unrolled = Transformer(cfg.replace(scan_layers=False), rngs=nnx.Rngs(0))
  tok, pos = _inputs()
  spec = AttentionSpec.block_causal(4)
  k0, v0 = scan.prefill_kv(tok, pos, spec)
  k1, v1 = unrolled.prefill_kv(tok, pos, spec)
  np.testing.assert_allclose(k1, k0, atol=1e-5)  # fp32: XLA may order the sums apart
  np.testing.assert_allclose(v1, v0, atol=1e-6)
  outs = []
  tiles = DecodeTiles(split=16, block_k=16)
  for m in (scan, unrolled):
    cache = KVCache.empty(m.cfg, B, 16, tiles=tiles)
    _, cache = m(tok[:, :8], pos[:, :8], spec, cache=cache, update_cache=True)
    logits, _ = m(tok[:, 8:], pos[:, 8:], spec, cache=cache)
    outs.append((logits, cache.k))
  np.testing.assert_allclose(outs[1][0], outs[0][0], atol=1e-5)
  np.testing.assert_allclose(outs[1][1], outs[0][1], atol=1e-6)
  assert np.abs(np.asarray(outs[0][0])).max() > 0


def test_decode_weights_are_per_layer_fused_in_the_compute_dtype_and_give_the_same_forward():
  """`decode_weights()` (what the sampler decodes on): one dict per layer and the LM head, cast
  to the compute dtype once, q/k/v and gate/up fused into one matrix each (no per-forward
  concatenation by XLA's dot merger); a forward on them equals the forward on the stacked
  parameters."""
  cfg = CFG.replace(dtype="bfloat16", param_dtype="float32", tie_word_embeddings=True)
  m = Transformer(cfg, rngs=nnx.Rngs(0))
  w = m.decode_weights()
  assert len(w.layers) == cfg.num_layers
  assert all(a.dtype == jnp.bfloat16 for layer in w.layers for a in layer.values())
  D, N, K, H, F = (
    cfg.hidden_size,
    cfg.num_heads,
    cfg.num_kv_heads,
    cfg.head_dim,
    cfg.intermediate_size,
  )
  layer = w.layers[1]
  assert not {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"} & set(layer)
  assert layer["qkv_proj"].shape == (D, (N + 2 * K) * H)
  assert layer["gate_up_proj"].shape == (D, 2 * F)
  bf = lambda a: a[...][1].astype(jnp.bfloat16).reshape(D, -1)
  np.testing.assert_array_equal(layer["qkv_proj"][:, : N * H], bf(m.layers.q_proj))
  np.testing.assert_array_equal(layer["qkv_proj"][:, N * H : (N + K) * H], bf(m.layers.k_proj))
  np.testing.assert_array_equal(layer["qkv_proj"][:, (N + K) * H :], bf(m.layers.v_proj))
  np.testing.assert_array_equal(layer["gate_up_proj"][:, :F], bf(m.layers.gate_proj))
  np.testing.assert_array_equal(layer["gate_up_proj"][:, F:], bf(m.layers.up_proj))
  np.testing.assert_array_equal(w.head, m.embed[...].T.astype(jnp.bfloat16))  # tied
  tok, pos = _inputs()
  spec = AttentionSpec.block_causal(4)
  for m in (m, Transformer(CFG.replace(tie_word_embeddings=True), rngs=nnx.Rngs(0))):
    tol = 2e-2 if m.cfg.dtype == "bfloat16" else 1e-5  # bf16: XLA fuses the two paths apart
    cache = KVCache.empty(m.cfg, B, 16)
    ref, ref_cache = m(tok[:, :8], pos[:, :8], spec, cache=cache, update_cache=True)
    view = DecodeView(m, m.decode_weights())
    got, got_cache = view(tok[:, :8], pos[:, :8], spec, cache=cache, update_cache=True)
    f32 = lambda a: np.asarray(a, np.float32)
    np.testing.assert_allclose(f32(got), f32(ref), atol=tol, rtol=tol)
    np.testing.assert_allclose(f32(got_cache.k), f32(ref_cache.k), atol=tol, rtol=tol)
    k_ref, _ = m.prefill_kv(tok, pos, spec)
    np.testing.assert_allclose(f32(view.prefill_kv(tok, pos, spec)[0]), f32(k_ref), atol=tol)


@pytest.mark.parametrize("m", [1, 5, 16])
def test_unpacked_puts_each_packed_token_back_and_zeros_the_rest(m):
  """`unpacked` (a gather through the pack's inverse) against a scatter into zeros, for packs in
  any order, and `packed` its left inverse."""
  rng = np.random.default_rng(m)
  rows, t, g = 4, 8, 2
  n = rows * t // g
  pack = np.stack([rng.permutation(n)[:m] for _ in range(g)]).astype(np.int32)
  x = rng.normal(size=(rows, t, 3, 2)).astype(np.float32)
  small = packed(jnp.asarray(x), jnp.asarray(pack))
  want = np.zeros((g, n, 3, 2), np.float32)
  for i in range(g):
    want[i, pack[i]] = x.reshape(g, n, 3, 2)[i, pack[i]]
  got = np.asarray(unpacked(small, jnp.asarray(pack), (rows, t)))
  np.testing.assert_array_equal(got, want.reshape(rows, t, 3, 2))
  np.testing.assert_array_equal(np.asarray(packed(jnp.asarray(got), jnp.asarray(pack))), small)


@pytest.mark.parametrize(
  "impl, path", [("dense", "scan"), ("dense", "decode_weights"), ("flash", "decode_weights")]
)
def test_packed_tokens_give_the_hidden_states_and_cache_writes_of_the_full_forward(impl, path):
  """`pack=` (the ragged sampler's commit cap): the per-token work on the packed tokens only gives
  those tokens' hidden states and K/V of the unpacked forward; the tokens left out write zeros.
  One group: every row's second block and the first block of row 0 (the only row it is visible
  in); one group per row (a row shard each): each row's two blocks, its second first."""
  model = Transformer(CFG.replace(attention_impl=impl), rngs=nnx.Rngs(0))
  rows, b = 3, 4
  tok = jax.random.randint(jax.random.key(5), (rows, 2 * b), 0, CFG.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(8, 16), (rows, 2 * b))
  seg = jnp.ones((rows, 2 * b), jnp.int32).at[1:, :b].set(0)  # rows 1, 2: first block invisible
  spec = AttentionSpec.block_causal(b, seg, pos // b)
  ptok = jax.random.randint(jax.random.key(6), (rows, 8), 0, CFG.vocab_size)
  ppos = jnp.broadcast_to(jnp.arange(8), (rows, 8))
  cache = KVCache.empty(CFG, rows, 32, tiles=DecodeTiles(split=16, block_k=16))
  _, cache = model(ptok, ppos, AttentionSpec.block_causal(b), cache=cache, update_cache=True)
  run = model if path == "scan" else DecodeView(model, model.decode_weights())
  full, full_cache = run(tok, pos, spec, cache=cache, update_cache=True, return_hidden=True)
  second = (jnp.arange(rows)[:, None] * 2 * b + b + jnp.arange(b)).reshape(-1)
  one_group = jnp.concatenate([second, jnp.arange(b)])[None]
  per_row = jnp.broadcast_to(jnp.concatenate([jnp.arange(b, 2 * b), jnp.arange(b)]), (rows, 2 * b))
  new_k = lambda c: np.asarray(c.k)[:, :, 8:16]  # [L, rows, 2b, K*H]: this forward's writes
  for pack in (one_group, per_row):
    got, got_cache = run(
      tok, pos, spec, cache=cache, update_cache=True, return_hidden=True, pack=pack
    )
    g, m = pack.shape
    flat = (jnp.arange(g)[:, None] * (rows // g) * 2 * b + pack).reshape(-1)
    assert got.shape == (g, m, CFG.hidden_size)
    want = full.reshape(-1, CFG.hidden_size)[flat]
    np.testing.assert_allclose(got.reshape(-1, CFG.hidden_size), want, rtol=1e-5, atol=1e-5)
    kept = np.zeros(rows * 2 * b, bool)
    kept[np.asarray(flat)] = True
    kept = kept.reshape(rows, 2 * b)
    np.testing.assert_allclose(new_k(got_cache)[:, kept], new_k(full_cache)[:, kept], atol=1e-5)
    assert not new_k(got_cache)[:, ~kept].any()
    np.testing.assert_array_equal(got_cache.length, full_cache.length)
  assert (~kept).sum() == 0 and new_k(full_cache)[:, 1:, :b].any()  # per row: all of them
