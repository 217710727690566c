"""The Qwen3 / SDAR transformer in Flax NNX.

Architecture (Qwen3 dense, as SDAR keeps it: JetAstra/SDAR `modeling_sdar.py`): pre-norm decoder layers with RMSNorm, grouped-query attention with
per-head q/k RMSNorm and half-split RoPE, a SwiGLU MLP, no biases; an untied (or tied) LM head.
The logits at position i predict the token *at* position i (SDAR: no shift).

Layers are stored stacked (a leading `layers` axis on every per-layer parameter) and applied with
`jax.lax.scan`, so compile time does not grow with depth (`scan_layers=False` unrolls the loop:
static weight slices, a longer compile). Every parameter carries its logical axis
names in the `logical_axes` metadata; `dice_jax.sharding` maps them onto a mesh.

Call contract (docs/architecture.md):
  logits = model(tokens[B,T], positions[B,T], attention: AttentionSpec)
  logits, cache = model(tokens, positions, attention, cache=cache, update_cache=True|False)
With a cache, the new tokens attend to the cache's filled slots and to each other; with
`update_cache=True` their keys/values are appended at each row's `cache.length[b]` (or at
`append_at[b]`, a per-row slot offset: the ragged sampler parks rows' writes in a scratch region).
`model.prefill_kv(tokens, positions, attention)` gives the stacked keys/values of a cache-free
forward (the sampler's prefill writes them into cache rows).

Packed tokens (`pack=` `[G, M]`: in each of G groups of B/G consecutive rows, M flat indices into
the group's `B/G * T` tokens): the per-token work (embedding, norms, projections, RoPE, MLP, final
norm, LM head) runs on those G*M tokens only; the attention still runs on the `[B, T]` layout (the
packed q/k/v scattered back, zeros elsewhere, which must be invisible: segment 0). A group is a
row shard on a mesh, so no gather crosses devices. The ragged sampler's 2b-token forward needs only b tokens of a mid-block
row (`slots.py`, `SamplerConfig.commit_rows`): on an H200 (sdar_4b, 128 rows) the matmuls are
6.1 of a 15.6 ms 4-token forward and scale with tokens; the cache attention (7.35 ms) does not.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from dice_jax.model import fp8 as fp8_lib
from dice_jax.model import masks as masks_lib
from dice_jax.model import platform as platform_lib
from dice_jax.model.config import ModelConfig
from dice_jax.model.kv_cache import KVCache

_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)
ATTENTION_OUT = "attention_out"  # the attention's output, for the `_attn` remat policies


def rms_norm(x, weight, eps):
  """Qwen3RMSNorm: normalise in float32, scale, cast back."""
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (weight.astype(jnp.float32) * xf).astype(x.dtype)


def rope(x, positions, theta):
  """Half-split rotary embedding of `x[B,T,N,H]` at integer `positions[B,T]` (HF rotate_half)."""
  h = x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
  ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B,T,H/2]
  cos = jnp.cos(ang)[:, :, None, :]
  sin = jnp.sin(ang)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def _param(rngs, shape, axes, dtype, scale=0.02):
  return nnx.Param(scale * jax.random.normal(rngs.params(), shape, dtype), logical_axes=axes)


def _ones(shape, axes, dtype):
  return nnx.Param(jnp.ones(shape, dtype), logical_axes=axes)


class DecoderLayers(nnx.Module):
  """All decoder layers, parameters stacked on a leading `layers` axis (HF names in comments)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    dt = cfg.weight_dtype
    self.input_norm = _ones((L, D), ("layers", "norm"), dt)  # input_layernorm
    self.q_proj = _param(rngs, (L, D, N, H), ("layers", "embed", "q_heads", "head_dim"), dt)
    self.k_proj = _param(rngs, (L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"), dt)
    self.v_proj = _param(rngs, (L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"), dt)
    self.o_proj = _param(rngs, (L, N, H, D), ("layers", "q_heads", "head_dim", "embed"), dt)
    self.q_norm = _ones((L, H), ("layers", "norm"), dt)
    self.k_norm = _ones((L, H), ("layers", "norm"), dt)
    self.post_attn_norm = _ones((L, D), ("layers", "norm"), dt)  # post_attention_layernorm
    self.gate_proj = _param(rngs, (L, D, F), ("layers", "embed", "mlp"), dt)
    self.up_proj = _param(rngs, (L, D, F), ("layers", "embed", "mlp"), dt)
    self.down_proj = _param(rngs, (L, F, D), ("layers", "mlp", "embed"), dt)

  def weights(self) -> dict:
    return {k: v[...] for k, v in vars(self).items() if isinstance(v, nnx.Param)}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeWeights:
  """What a decoding forward reads, split per layer and cast to the compute dtype
  (`Transformer.decode_weights`). Made once per weight update, outside a compiled sampler: inside
  it no layer's weights are sliced out of the stacked parameters (XLA materialises such a slice, a
  copy of the layer's weights, on every forward: 3.3 ms of a 23.4 ms sdar_4b forward on an H200)
  and none is cast (fp32 master weights would be converted on every forward).

  Projections that read the same input are stored fused, as one matrix per layer: `qkv_proj`
  `[D, (N + 2K) H]` and `gate_up_proj` `[D, 2F]`. Given separate weights, XLA's GPU dot merger
  concatenates them on every forward before one GEMM (2.3 of an 18.2 ms sdar_4b forward on an
  H200, session 9 profile); fused once here, the forward runs the same GEMMs without the copies.
  On a mesh with a `tensor` axis they stay apart (`decode_weights(fuse=False)`), each sharded by
  head / MLP column as the stacked parameters are (a fused matrix's column shards would mix q with
  k/v and gate with up).

  With `weights_dtype="float8_e4m3fn"` (`SamplerConfig.weights_dtype`, approximate) the fused
  projections (`qkv_proj`, `gate_up_proj`) and `o_proj` (as `[N*H, D]`) and `down_proj` are
  `fp8.Fp8Weight`s (e4m3fn, per-output-column scales) and the decode forward runs them as
  float8 x float8 GEMMs (`fp8.matmul`); norms and the LM head stay in the compute dtype."""

  layers: tuple  # one dict per layer: `DecoderLayers.weights()` keys, q/k/v and gate/up fused
  head: jax.Array  # [D, V] LM head (the embedding's transpose when tied)


class Transformer(nnx.Module):
  """SDAR / Qwen3 block-diffusion language model."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    dt = cfg.weight_dtype
    self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dt)
    self.layers = DecoderLayers(cfg, rngs=rngs)
    self.final_norm = _ones((cfg.hidden_size,), ("norm",), dt)
    if not cfg.tie_word_embeddings:
      self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dt)

  def __call__(
    self,
    tokens,
    positions,
    attention: masks_lib.AttentionSpec,
    cache: KVCache | None = None,
    *,
    update_cache: bool = False,
    return_hidden: bool = False,
    append_at=None,
    weights: DecodeWeights | None = None,
    pack=None,
  ):
    """Hidden states or logits `[B, T, ...]` (with `pack` `[G, M]`: of the packed tokens,
    `[G, M, ...]`; module docstring), and with a cache the updated cache (every `[B, T]` token's
    K/V written)."""
    cfg = self.cfg
    seg, blk = masks_lib.token_segments_and_blocks(attention, positions)
    x, new_kv = self._layers(tokens, positions, attention, seg, blk, cache, weights, pack)
    x = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)
    out = x if return_hidden else self.logits_from_hidden(x, weights)
    if cache is None:
      return out
    if update_cache:
      cache = cache.append(new_kv[0], new_kv[1], positions, seg, blk, at=append_at)
    return out, cache

  def prefill_kv(
    self,
    tokens,
    positions,
    attention: masks_lib.AttentionSpec,
    weights: DecodeWeights | None = None,
  ):
    """Keys and values `[L, B, T, K, H]` of every layer for a cache-free forward (prefill: the
    self-attention path, flash when `attention_impl='flash'`; no final norm, no LM head)."""
    seg, blk = masks_lib.token_segments_and_blocks(attention, positions)
    _, (k, v) = self._layers(tokens, positions, attention, seg, blk, None, weights)
    return k, v

  def decode_weights(self, fuse: bool = True, weights_dtype: str | None = None) -> DecodeWeights:
    """The layers' weights split per layer and the LM head, in the compute dtype (`DecodeWeights`);
    pass them as `weights=` (or use `DecodeView`). Call it under `jax.jit`: one pass of copies.
    `fuse=False` keeps q/k/v and gate/up apart (each stays head/column-shardable over `tensor`).
    `weights_dtype="float8_e4m3fn"`: the projections quantised (`quantize_projections`)."""
    cfg, dt = self.cfg, self.cfg.compute_dtype
    check_weights_dtype(weights_dtype, fuse)
    stacked = self.layers.weights()
    layers = tuple(_layer_weights(stacked, i, dt, fuse) for i in range(cfg.num_layers))
    if weights_dtype is not None:
      layers = tuple(quantize_projections(w) for w in layers)
    head = self.embed[...].T if cfg.tie_word_embeddings else self.lm_head[...]
    return DecodeWeights(layers=layers, head=head.astype(dt))

  def decode_weight_axes(self, fuse: bool = True) -> tuple[dict, tuple]:
    """(logical axes of each per-layer weight of `decode_weights(fuse)` by name, of the LM head):
    the stacked parameters' axes without `layers`; a fused matrix keeps `embed` and leaves its
    concatenated columns unnamed (replicated: its parts' column shards would not line up)."""
    axes = {
      k: tuple(v.get_metadata()["logical_axes"])[1:]
      for k, v in vars(self.layers).items()
      if isinstance(v, nnx.Param)
    }
    if fuse:
      for parts, name in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), _GATE_UP):
        for p in parts:
          del axes[p]
        axes[name] = ("embed", None)
    return axes, ("embed", "vocab")

  def _layers(self, tokens, positions, attention, seg, blk, cache, weights=None, pack=None):
    """Embedding and the decoder layers: (hidden `[B,T,D]`, stacked (k, v) `[L,B,T,K,H]`). With
    `weights` (`DecodeWeights`) the layers are unrolled over those per-layer weights. With `pack`
    `[G, M]` the hidden states are the packed tokens' `[G,M,D]` (K/V still `[B,T]`, zeros where
    not packed)."""
    cfg = self.cfg
    x = jnp.take(self.embed[...], packed(tokens, pack), axis=0).astype(cfg.compute_dtype)
    layer_fn = functools.partial(
      _layer,
      cfg=cfg,
      attention=attention,
      positions=positions,
      seg=seg,
      blk=blk,
      cache=cache,
      pack=pack,
    )
    layer_fn = remat_layer(layer_fn, cfg.remat_policy)

    def body(h, xs):
      w, ck, cv, layer = xs
      h, kv = layer_fn(h, w, ck, cv, layer)
      return h, kv

    halves = cache is not None and cache.tiles.halves and cfg.attention_impl == "flash"
    if halves and pack is not None and pack.shape[0] % 2:
      raise ValueError(
        f"DecodeTiles.halves packs each row half apart: packed tokens need an even number of "
        f"row groups, got {pack.shape[0]}"
      )
    if halves and (weights is not None or not cfg.scan_layers):
      per_layer = weights.layers if weights is not None else None
      return self._unrolled_halves(x, per_layer, cache, attention, positions, seg, blk, pack)
    if halves:
      raise ValueError(
        "DecodeTiles.halves needs the unrolled decode forward (decode weights, or scan_layers=False)"
      )
    materialise_kv = pack is None  # `_unrolled`'s barrier: where it pays (its comment)
    if weights is not None:
      return self._unrolled(x, weights.layers, cache, layer_fn, materialise_kv)
    layer_ids = jnp.arange(cfg.num_layers)
    if cache is None or cfg.attention_impl == "flash":  # flash reads the stacked cache by layer
      xs = (self.layers.weights(), None, None, layer_ids)
    else:
      xs = (self.layers.weights(), cache.k, cache.v, layer_ids)
    if cfg.scan_layers:
      return jax.lax.scan(body, x, xs)
    # Unrolled: layer l's weights are static slices of the stacked parameters.
    per_layer = [jax.tree.map(lambda a, i=i: a[i], xs[0]) for i in range(cfg.num_layers)]
    return self._unrolled(x, per_layer, cache, layer_fn, materialise_kv)

  def _unrolled(self, x, per_layer, cache, layer_fn, materialise_kv: bool = True):
    dense_cache = cache is not None and self.cfg.attention_impl != "flash"
    kvs = []
    for i, w in enumerate(per_layer):
      ck, cv = (cache.k[i], cache.v[i]) if dense_cache else (None, None)
      x, kv = layer_fn(x, w, ck, cv, jnp.asarray(i))
      if cache is None or materialise_kv:
        # Materialise this layer's K/V now. Prefill: V is a slice of the fused q/k/v output; fused
        # into the stack below, that slice would keep every layer's whole output alive until the
        # stack (+4.4 GiB compiled temp for a 16 x 1024-token chunk of sdar_4b, H200 session 9).
        # Decode: fused into the stack, every layer's K norm, RoPE and head transpose became one
        # ~90-operand transpose kernel, 1.9 ms for 75 MB once a block (static loop; H100, session
        # 41: 0.983x its device time a batch forward with the barrier). With packed tokens XLA
        # fuses the stack into the cache scatter instead (0.36 ms), and the barrier costs 1.004x.
        kv = jax.lax.optimization_barrier(kv)
      kvs.append(kv)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *kvs)

  def _unrolled_halves(self, x, per_layer, cache, attention, positions, seg, blk, pack=None):
    """The cached forward on two row halves (`DecodeTiles.halves`): each layer runs its
    projections and MLP on each half on the main stream, and each half's cache attention as a
    call on GPU stream 1, so XLA may run one half's attention beside the other half's matmuls.
    Rows are independent, so each row's values are those of `_unrolled` (a half's matmuls have
    half the rows). `per_layer`: the decode weights' layers, None for slices of the stacked
    parameters. With `pack` `[G, M]` (G even) `x` is the packed tokens `[G, M, D]`, and half h
    is row groups [h G/2, (h+1) G/2): the groups are consecutive rows, so each half packs its own."""
    cfg = self.cfg
    b = positions.shape[0]
    if b % 2:
      raise ValueError(f"DecodeTiles.halves needs an even number of rows, got {b}")
    if per_layer is None:
      stacked = self.layers.weights()
      per_layer = [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(cfg.num_layers)]
    n = b // 2
    attend = _side_stream_attention(masks_lib.AttentionSpec(attention.kind, attention.block_size))
    halves = (slice(0, n), slice(n, b))
    g = x.shape[0] // 2 if pack is not None else n  # x's leading axis: row groups or rows
    parts = (slice(0, g), slice(g, 2 * g))
    packs = [None if pack is None else pack[p] for p in parts]
    xs = [x[p] for p in parts]
    kvs = ([], [])
    for i, w in enumerate(per_layer):
      for h, sl in enumerate(halves):
        q, k, v = _attention_inputs(xs[h], w, cfg, packed(positions[sl], packs[h]))
        q, k, v = (unpacked(a, packs[h], positions[sl].shape) for a in (q, k, v))
        o = attend(
          q, k, v, jnp.asarray(i, jnp.int32), positions[sl], seg[sl], blk[sl], cache, sl.start
        )
        xs[h] = _layer_output(xs[h], packed(o, packs[h]), w, cfg)
        kvs[h].append((k, v))
    stack = lambda half: jax.tree.map(lambda *a: jnp.stack(a), *half)
    kv = jax.tree.map(lambda a, c: jnp.concatenate([a, c], axis=1), stack(kvs[0]), stack(kvs[1]))
    return jnp.concatenate(xs, axis=0), kv

  def logits_from_hidden(self, hidden, weights: DecodeWeights | None = None):
    cfg = self.cfg
    if weights is not None:
      head = weights.head
    else:
      head = self.embed[...].T if cfg.tie_word_embeddings else self.lm_head[...]
    return jnp.einsum(
      "...d,dv->...v", hidden, head.astype(cfg.compute_dtype), preferred_element_type=jnp.float32
    )


class DecodeView:
  """`model` with its `DecodeWeights` bound: the three calls a sampler makes (`__call__`,
  `prefill_kv`, `logits_from_hidden`) read the split weights; `cfg` is the model's."""

  def __init__(self, model: Transformer, weights: DecodeWeights):
    self.model, self.weights, self.cfg = model, weights, model.cfg

  def __call__(self, *args, **kw):
    return self.model(*args, weights=self.weights, **kw)

  def prefill_kv(self, tokens, positions, attention):
    return self.model.prefill_kv(tokens, positions, attention, self.weights)

  def logits_from_hidden(self, hidden):
    return self.model.logits_from_hidden(hidden, self.weights)


_GATE_UP = (("gate_proj", "up_proj"), "gate_up_proj")
WEIGHTS_DTYPES = (None, "float8_e4m3fn")
FP8_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def check_weights_dtype(weights_dtype, fuse: bool = True) -> None:
  """Raises unless `weights_dtype` is one of `WEIGHTS_DTYPES` and, when float8, the projections are
  fused (no `tensor` axis: an fp8 matrix's transposed layout has no per-head shard rule)."""
  if weights_dtype not in WEIGHTS_DTYPES:
    raise ValueError(f"weights_dtype must be one of {WEIGHTS_DTYPES}, got {weights_dtype!r}")
  if weights_dtype is not None and not fuse:
    raise ValueError(
      f"weights_dtype={weights_dtype!r} needs fused decode weights (a mesh without a `tensor` axis)"
    )


def quantize_projections(w: dict) -> dict:
  """One layer of fused decode weights with its projection matrices as `fp8.Fp8Weight`s
  (`o_proj` `[N, H, D]` as `[N*H, D]`); the norms as they are."""
  w = dict(w)
  w["o_proj"] = w["o_proj"].reshape(-1, w["o_proj"].shape[-1])
  for name in FP8_PROJECTIONS:
    w[name] = fp8_lib.quantize_weight(w[name])
  return w


def _project(h, w, cfg, spec: str):
  """`h @ w` in the compute dtype: the einsum `spec` on a plain matrix, a float8 GEMM
  (`fp8.matmul`) on an `Fp8Weight`."""
  dt = cfg.compute_dtype
  if isinstance(w, fp8_lib.Fp8Weight):
    return fp8_lib.matmul(h, w, dt)
  return jnp.einsum(spec, h, w.astype(dt))


def _layer_weights(stacked: dict, i: int, dt, fuse: bool) -> dict:
  """Layer `i` of the stacked weights in dtype `dt`; with `fuse`, q/k/v fused into `qkv_proj`
  `[D, (N + 2K) H]` and gate/up into `gate_up_proj` `[D, 2F]` (`DecodeWeights`)."""
  w = {name: a[i].astype(dt) for name, a in stacked.items()}
  if not fuse:
    return w
  q, k, v = (w.pop(n) for n in ("q_proj", "k_proj", "v_proj"))
  flat = lambda a: a.reshape(a.shape[0], -1)
  w["qkv_proj"] = jnp.concatenate([flat(q), flat(k), flat(v)], axis=1)
  w["gate_up_proj"] = jnp.concatenate([w.pop("gate_proj"), w.pop("up_proj")], axis=1)
  return w


def _qkv(h, w, cfg):
  """Queries `[B,T,N,H]`, keys and values `[B,T,K,H]`: one GEMM on fused weights, else three."""
  dt = cfg.compute_dtype
  N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  if "qkv_proj" in w:
    qkv = _project(h, w["qkv_proj"], cfg, "btd,de->bte")
    q, k, v = jnp.split(qkv, [N * H, (N + K) * H], axis=-1)
    b, t = h.shape[:2]
    return q.reshape(b, t, N, H), k.reshape(b, t, K, H), v.reshape(b, t, K, H)
  q = jnp.einsum("btd,dnh->btnh", h, w["q_proj"].astype(dt))
  k = jnp.einsum("btd,dkh->btkh", h, w["k_proj"].astype(dt))
  v = jnp.einsum("btd,dkh->btkh", h, w["v_proj"].astype(dt))
  return q, k, v


def _gate_up(h, w, cfg):
  """The MLP's gate and up projections `[B,T,F]` each: one GEMM on fused weights, else two."""
  dt = cfg.compute_dtype
  if "gate_up_proj" in w:
    return jnp.split(_project(h, w["gate_up_proj"], cfg, "btd,df->btf"), 2, axis=-1)
  g = jnp.einsum("btd,df->btf", h, w["gate_proj"].astype(dt))
  u = jnp.einsum("btd,df->btf", h, w["up_proj"].astype(dt))
  return g, u


def _attention_inputs(x, w, cfg, positions):
  """A layer's pre-norm and projections: queries `[B,T,N,H]`, keys and values `[B,T,K,H]`
  (q/k RMS-normed, RoPE at `positions`)."""
  h = rms_norm(x, w["input_norm"], cfg.rms_norm_eps)
  q, k, v = _qkv(h, w, cfg)
  q = rope(rms_norm(q, w["q_norm"], cfg.rms_norm_eps), positions, cfg.rope_theta)
  k = rope(rms_norm(k, w["k_norm"], cfg.rms_norm_eps), positions, cfg.rope_theta)
  return q, k, v


def _layer_output(x, o, w, cfg):
  """The rest of a layer after attention `o` `[B,T,N,H]`: output projection, residual, the
  SwiGLU MLP and its residual."""
  if isinstance(w["o_proj"], fp8_lib.Fp8Weight):
    o = o.reshape(*o.shape[:-2], -1)  # [B,T,N*H] against the [N*H, D] matrix
  x = x + _project(o, w["o_proj"], cfg, "btnh,nhd->btd")
  h = rms_norm(x, w["post_attn_norm"], cfg.rms_norm_eps)
  g, u = _gate_up(h, w, cfg)
  return x + _project(jax.nn.silu(g) * u, w["down_proj"], cfg, "btf,fd->btd")


def packed(x, pack):
  """The packed tokens of `x` `[B, T, ...]` as `[G, M, ...]` (`pack` `[G, M]`: flat indices into
  each group of B/G rows' tokens); `x` itself when `pack` is None."""
  if pack is None:
    return x
  take = lambda a, i: a.at[i].get(mode="promise_in_bounds")
  return jax.vmap(take)(x.reshape(pack.shape[0], -1, *x.shape[2:]), pack)


def unpacked(x, pack, bt):
  """`x` `[G, M, ...]` of the packed tokens back on the `[B, T, ...]` layout `bt = (B, T)`, zeros
  at the tokens not packed; `x` itself when `pack` is None. A gather through the inverse of `pack`
  (M, out of bounds, where a token is not packed: filled with 0): a scatter into zeros made XLA:GPU
  copy a zero buffer first, for q, k and v of every layer (H100, session 41)."""
  if pack is None:
    return x
  g, m = pack.shape
  n = bt[0] * bt[1] // g
  inverse = (
    jnp.full((g, n), m, jnp.int32)
    .at[jnp.arange(g)[:, None], pack]
    .set(jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), (g, m)), unique_indices=True)
  )
  take = lambda a, i: a.at[i].get(mode="fill", fill_value=0)
  return jax.vmap(take)(x, inverse).reshape(*bt, *x.shape[2:])


def _layer(x, w, cache_k, cache_v, layer, *, cfg, attention, positions, seg, blk, cache, pack=None):
  """One pre-norm decoder layer. Returns (x, (k, v)) with this call's keys/values (`[B, T]`
  layout). With `pack`, `x` holds the packed tokens only and the attention runs on `[B, T]`."""
  q, k, v = _attention_inputs(x, w, cfg, packed(positions, pack))
  q, k, v = (unpacked(a, pack, positions.shape) for a in (q, k, v))
  if cache is None:
    o = self_attention(
      q,
      k,
      v,
      attention,
      positions,
      impl=cfg.attention_impl,
      flash_tiles=cfg.flash_tiles,
      flash_tpu_tiles=cfg.flash_tpu_tiles,
      flash_live_only=cfg.flash_live_only,
    )
    if cfg.attention_impl != "flash":  # the flash kernels name their output themselves (a
      o = checkpoint_name(o, ATTENTION_OUT)  # second name would keep a second stacked copy)
  else:
    o = cached_attention(
      q,
      k,
      v,
      cache_k,
      cache_v,
      attention,
      positions,
      seg,
      blk,
      cache,
      impl=cfg.attention_impl,
      layer=layer,
    )
  return _layer_output(x, packed(o, pack), w, cfg), (k, v)


def _side_stream_attention(spec: masks_lib.AttentionSpec):
  """The flash cached attention of some rows as a call on GPU stream 1 (`platform.on_gpu_stream`:
  XLA runs it asynchronously beside the main stream, other backends ignore the annotation):
  `(q, k, v, layer, positions, seg, blk, cache, row_offset) -> o`, `row_offset` a Python int."""
  from dice_jax.model import flash_decode

  def attend(q, k, v, layer, positions, seg, blk, cache, *, row_offset):
    tgt = platform_lib.check("flash", q.shape[1], cache.max_len + k.shape[1])
    if tgt.platform == "tpu":
      raise ValueError("DecodeTiles.halves is a GPU schedule (its row offset is a Triton option)")
    return flash_decode.cached_attention(
      q,
      k,
      v,
      layer,
      spec,
      positions,
      seg,
      blk,
      cache,
      interpret=tgt.interpret,
      row_offset=row_offset,
    )

  calls = {}  # one stream call per row offset: the offset is static, every argument of it traced

  def call(q, k, v, layer, positions, seg, blk, cache, row_offset: int):
    if row_offset not in calls:
      calls[row_offset] = platform_lib.on_gpu_stream(
        functools.partial(attend, row_offset=row_offset), 1
      )
    return calls[row_offset](q, k, v, layer, positions, seg, blk, cache)

  return call


def remat_layer(layer_fn, policy: str):
  """`layer_fn` under the rematerialisation `policy` (config.REMAT_POLICIES): unchanged for
  "none", `jax.checkpoint` keeping only its inputs for "full", keeping the weight matmuls'
  outputs for "dots", and with `_attn` also the attention's output (the flash kernels, GPU and
  TPU, name their output and log-sum-exp themselves: `flash_bd.OUT_NAME`, `LSE_NAME`). The
  values are the same; only what the backward pass stores differs."""
  if policy == "none":
    return layer_fn
  from dice_jax.model import flash_bd

  cp = jax.checkpoint_policies
  attention = cp.save_only_these_names(ATTENTION_OUT, flash_bd.OUT_NAME, flash_bd.LSE_NAME)
  keep = {
    "full": None,
    "dots": cp.dots_with_no_batch_dims_saveable,
    "dots_attn": cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable, attention),
    "full_attn": attention,
  }
  if policy not in keep:
    raise ValueError(f"unknown remat policy {policy!r}")
  return jax.checkpoint(layer_fn, prevent_cse=False, policy=keep[policy])


def _grouped(q, num_kv):
  b, t, n, h = q.shape
  return q.reshape(b, t, num_kv, n // num_kv, h)


def _scores(qg, k, mask):
  s = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32)
  s = s * (qg.shape[-1] ** -0.5)
  return jnp.where(mask[:, None, None], s, _NEG)


def dense_attention(q, k, v, mask):
  """Reference attention: q[B,T,N,H], k/v[B,S,K,H], mask[B,T,S] -> [B,T,N,H] (softmax in fp32)."""
  p = jax.nn.softmax(_scores(_grouped(q, k.shape[2]), k, mask), axis=-1).astype(v.dtype)
  return jnp.einsum("bkgts,bskh->btkgh", p, v).reshape(q.shape)


def self_attention(
  q,
  k,
  v,
  spec,
  positions,
  *,
  impl="dense",
  flash_tiles=None,
  flash_tpu_tiles=(512, 512),
  flash_live_only=True,
):
  """Attention of a cache-free forward by `impl` (`platform.check` refuses one the target
  platform has no kernel for). `flash` on TPU is `flash_tpu` (`flash_tpu_tiles`), else `flash_bd`
  (`flash_tiles`, `flash_live_only`)."""
  tgt = platform_lib.check(impl, q.shape[1], k.shape[1])
  if impl == "flash" and tgt.platform == "tpu":
    from dice_jax.model import flash_tpu

    bq, bk = flash_tpu_tiles
    return flash_tpu.attention(
      q, k, v, spec, positions, block_q=bq, block_k=bk, interpret=tgt.interpret
    )
  if impl == "flash":  # mask-aware Pallas kernel: skips masked tiles, no [T, T] mask in memory
    from dice_jax.model import flash_bd

    tiles = (
      {} if flash_tiles is None else dict(zip(("block_q", "block_k", "block_bwd"), flash_tiles))
    )
    return flash_bd.attention(
      q, k, v, spec, positions, interpret=tgt.interpret, live_only=flash_live_only, **tiles
    )
  mask = masks_lib.dense_mask(spec, positions)
  if impl == "dense":
    return dense_attention(q, k, v, mask)
  return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation=impl)


def cached_attention(
  q, k, v, cache_k, cache_v, spec, positions, seg, blk, cache: KVCache, *, impl="dense", layer=None
):
  """Attention of new tokens over (cache slots, new tokens) with one joint softmax.

  `impl='flash'` streams layer `layer` of the stacked cache in place with a Pallas kernel
  (model/flash_decode.py, its cache part `flash_tpu.cache_part` on TPU; `cache_k/v` unused): same
  result, no `[B, K, G, T, S]` score tensor and no per-layer copy of the cache.

  Cache keys are visible when their slot is filled, their segment matches and the kind's rule
  holds (pos_k <= pos_q for causal, block_k <= block_q for block-causal). The new tokens see each
  other under the same rule. Scores are computed per part, so the cache is never concatenated
  with the new keys (the dense path still reads a per-layer slice `[B, S, K*H]` of the stacked
  cache, `cache_k/v`).
  """
  if spec.kind in ("block_diffusion", "trace"):
    raise ValueError(f"{spec.kind} attention is a training layout; it takes no KV cache")
  tgt = platform_lib.check(impl, q.shape[1], cache.max_len + k.shape[1])
  if impl == "flash":
    from dice_jax.model import flash_decode, flash_tpu

    part = flash_tpu.cache_part if tgt.platform == "tpu" else None  # None: the Triton kernel
    return flash_decode.cached_attention(
      q, k, v, layer, spec, positions, seg, blk, cache, interpret=tgt.interpret, cache_part_fn=part
    )
  filled = jnp.arange(cache.max_len)[None, :] < cache.length[:, None]  # [B,S]
  if spec.kind == "causal":
    m_cache = masks_lib.causal_mask(positions, cache.positions, seg, cache.segment_ids)
    m_self = masks_lib.causal_mask(positions, positions, seg, seg)
  elif spec.kind == "block_causal":
    m_cache = masks_lib.block_causal_mask(blk, cache.block_ids, seg, cache.segment_ids)
    m_self = masks_lib.block_causal_mask(blk, blk, seg, seg)
  else:
    m_cache = masks_lib.full_mask(seg, cache.segment_ids)
    m_self = masks_lib.full_mask(seg, seg)
  m_cache = m_cache & filled[:, None, :]
  qg = _grouped(q, k.shape[2])
  # one layer `[B, S, K*H]` of the stored cache, heads apart (a free reshape off TPU)
  cache_k, cache_v = cache.heads(cache_k).astype(k.dtype), cache.heads(cache_v).astype(v.dtype)
  s = jnp.concatenate([_scores(qg, cache_k, m_cache), _scores(qg, k, m_self)], axis=-1)
  p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
  p_cache, p_self = p[..., : cache.max_len], p[..., cache.max_len :]
  o = jnp.einsum("bkgts,bskh->btkgh", p_cache, cache_v) + jnp.einsum("bkgts,bskh->btkgh", p_self, v)
  return o.reshape(q.shape)
