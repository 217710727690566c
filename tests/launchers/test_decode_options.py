"""The pieces of the decode-option runs that need no model: variants, byte counts, the rates plan,
the pick of the fastest forward, token agreement, compiling together."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dice_jax.model import flash_decode, get_config
from experiments import decode_forward as df
from experiments import decode_options


def test_a_variant_names_tiles_and_cache_type():
  assert df.parse_variant("base") == df.Variant("base", flash_decode.DecodeTiles(), False)
  v = df.parse_variant("splits=3+fold_new=1+halves=true+cache=fp8+fp8_widen=asm")
  assert v.tiles == flash_decode.DecodeTiles(splits=3, fold_new=True, halves=True, fp8_widen="asm")
  assert v.fp8 and v.kv_cache_dtype == "float8_e4m3fn"
  assert df.parse_variant("cache=bf16+block_k=32").kv_cache_dtype is None
  w = df.parse_variant("weights=fp8+split=4096")
  assert w.weights8 and w.weights_dtype == "float8_e4m3fn" and not w.fp8
  assert w.tiles == flash_decode.DecodeTiles(split=4096)
  assert df.parse_variant("weights=bf16").weights_dtype is None


@pytest.mark.parametrize(
  "spec, message",
  [
    ("splits", "is not key=value"),
    ("warps=8", "unknown variant key 'warps'"),
    ("cache=int4", "cache must be bf16 or fp8"),
    ("weights=int8", "weights must be bf16 or fp8"),
    ("splits=three", "splits must be an int"),
    ("block_k=48", "must be a power of two"),
    ("fp8_widen=cvt", "fp8_widen must be one of"),
  ],
)
def test_a_bad_variant_is_named(spec, message):
  with pytest.raises(ValueError, match=message):
    df.parse_variant(spec)


def test_each_variant_is_compared_with_the_first_of_its_cache_type():
  variants = df.parse_variants(["base", "splits=3", "cache=fp8", "cache=fp8+fp8_widen=asm"])
  assert df.references(variants) == {
    "base": "base",
    "splits=3": "base",
    "cache=fp8": "cache=fp8",
    "cache=fp8+fp8_widen=asm": "cache=fp8",
  }
  # ... and also with the earlier ones of its cache type (a control such as the base's other split).
  variants.insert(1, df.parse_variant("split=512"))
  assert df.peers(variants) == {
    "base": [],
    "split=512": [],
    "splits=3": ["split=512"],
    "cache=fp8": [],
    "cache=fp8+fp8_widen=asm": [],
  }
  with pytest.raises(ValueError, match="distinct"):
    df.parse_variants(["base", "base"])


def test_attention_counts_follow_the_options():
  cfg = get_config("sdar_4b")
  count = lambda spec: df.attention_counts(
    cfg, 128, 1536, 4, df.parse_variant(spec).tiles, df.parse_variant(spec).fp8, 2112
  )
  base, fp8, fold, halves = (count(s) for s in ("base", "cache=fp8", "fold_new=1", "halves=1"))
  # 36 layers x 128 rows x 1536 slots x 8 heads x 128 x (K and V) x 2 bytes: the 29.0 GB of the
  # H200 analysis (docs/performance.md); float8 reads half.
  assert base["kv"] == 36 * 128 * 1536 * 8 * 128 * 2 * 2 == 2 * fp8["kv"]
  assert base["flops"] == fp8["flops"] and base["launches"] == 36 and halves["launches"] == 72
  assert fold["total"] < base["total"] and fold["kv"] == base["kv"]


def test_a_fused_forward_spans_the_last_committed_block_and_the_next():
  """`--forward_tokens=2b`: the capped loop's fused width (the finished block and the new one), so
  the cache kernel gets 2b x G query rows a program (32 at sdar_4b) and twice the q.k / p.v work."""
  cfg = get_config("sdar_4b")
  b = cfg.block_size
  tok, pos, spec = df.new_inputs(cfg, 2, 1536, 2 * b)
  assert tok.shape == (2, 2 * b)
  np.testing.assert_array_equal(pos[0], np.arange(1536 - b, 1536 + b))
  np.testing.assert_array_equal(spec.block_ids[0], np.arange(1536 - b, 1536 + b) // b)
  assert np.all(np.asarray(spec.segment_ids) == 1)
  # the capped loop's layout: rows past the fresh ones see nothing from their first b tokens
  _, _, capped = df.new_inputs(cfg, 3, 1536, 2 * b, fresh=1)
  np.testing.assert_array_equal(
    np.asarray(capped.segment_ids), [[1] * 8, [0] * 4 + [1] * 4, [0] * 4 + [1] * 4]
  )
  tiles = df.parse_variant("base").tiles
  one, fused = (df.attention_counts(cfg, 128, 1536, t, tiles, False, 2112) for t in (b, 2 * b))
  # twice the queries over the same K/V (plus the new tokens' own part, quadratic in them)
  assert 2 * one["flops"] < fused["flops"] < 2.01 * one["flops"] and fused["kv"] == one["kv"]


def test_token_agreement_counts_the_reference_decoded_positions():
  ref = (np.array([[1, 2, 3, 4]]), np.array([[-1, 0, 1, 1]]))
  same = decode_options.token_agreement(ref, ref)
  assert same == dict(tokens_equal=True, step_map_equal=True, token_agreement=1.0)
  got = (np.array([[9, 2, 3, 5]]), np.array([[-1, 0, 1, 2]]))
  assert decode_options.token_agreement(got, ref) == dict(
    tokens_equal=False, step_map_equal=False, token_agreement=round(2 / 3, 5)
  )


class _Bench:
  def __init__(self):
    self.rows = []

  def record(self, row):
    self.rows.append(row)


def _runs(deadline_s, variants=("base", "splits=3", "cache=fp8")):
  settings = decode_options.Settings(
    config="tiny",
    variants=tuple(df.parse_variants(list(variants))),
    rate_options=("base", "best"),
    rate_strategies=("dynamic", "static"),
    exact_layers=1,
    exact_rows=2,
    exact_tokens=4,
    lm_head_scale=40.0,
    deadline_s=deadline_s,
    t0=time.perf_counter(),
  )
  return decode_options.OptionRuns(_Bench(), settings)


def test_rates_plan_only_what_fits_before_the_deadline():
  runs = _runs(100.0)
  items = [("dynamic", "base"), ("dynamic", "splits=3"), ("static", "base"), ("static", "x")]
  # each program at full size: 12 s lowering, 23.8 s running, 45 s compiling them together
  assert runs.plan(items, 128, 1024) == items[:1]
  assert [(r["strategy"], r["variant"], r["skipped"]) for r in runs.bench.rows] == [
    (s, n, "deadline") for s, n in items[1:]
  ]
  assert _runs(1e9).plan(items, 128, 1024) == items


def test_best_is_the_fastest_exact_bf16_forward():
  runs = _runs(1e9, ("base", "splits=3", "cache=fp8", "weights=fp8"))
  assert runs.rate_names() == ["base"]  # nothing measured: `best` is nobody
  runs.forward_rows = {
    "base": dict(wall_ms=16.0),
    "splits=3": dict(wall_ms=14.0, argmax_agree=1.0),
    "cache=fp8": dict(wall_ms=9.0),
    "weights=fp8": dict(wall_ms=8.0, argmax_agree=1.0),  # approximate: never `best`
  }
  assert runs.rate_names() == ["base", "splits=3"]
  runs.inexact.add("splits=3")  # its tokens differed on the small model
  assert runs.rate_names() == ["base"]
  runs.inexact.clear()
  runs.forward_rows["splits=3"]["argmax_agree"] = 0.9
  assert runs.rate_names() == ["base"]


def test_programs_compile_together_and_a_failure_is_returned():
  lowered = [jax.jit(lambda x, i=i: x + i).lower(jnp.ones(3)) for i in range(3)]

  class Broken:
    def compile(self):
      raise RuntimeError("no kernel")

  out = df.compile_all(lowered + [Broken()], threads=2)
  assert [float(p(jnp.ones(3))[0]) for p in out[:3]] == [1.0, 2.0, 3.0]
  assert isinstance(out[3], RuntimeError)


def test_the_cache_kernels_dots_are_bf16_with_float32_accumulation():
  """The cache kernel's q.k and p.v dots, lowered for cuda at sdar_4b's shapes (no GPU needed), take
  bf16 operands with float32 results for a bf16 and for a float8 cache (widened to bf16 before
  the dot) and with the new keys folded in, float16 operands for a float8 cache widened to
  float16 (`fp8_widen='f16'`): Triton gives such dots to tensor cores. Where the
  jaxlib shows the PTX (its Triton compile hook, jaxlib <= 0.10 on a GPU) it holds `mma`/`wgmma`,
  not float32 `fma.rn.f32`; jaxlib 0.11 shows PTX nowhere (`experiments/kernel_code.py`)."""
  from experiments import kernel_code

  rows = {r["variant"]: r for r in kernel_code.report("sdar_4b")}
  assert set(rows) == set(kernel_code.VARIANTS)
  for name, row in rows.items():
    assert "failed" not in row, row
    want = 4 if name.startswith("fold_new") else 2
    dot = ["f16", "f16", "f32"] if name.endswith("fp8_widen=f16") else ["bf16", "bf16", "f32"]
    if jax.default_backend() == "gpu":  # the IR text sits in a compiled kernel's record
      assert row["dots"] and all(d == dot for d in row["dots"]), row
      if row["ptx_source"] is not None:
        assert row["ptx"]["mma.sync"] + row["ptx"]["wgmma.mma_async"] > 0, row
    else:
      assert row["dots"] == [dot] * want, row


def test_visible_half_lowers_to_triton_beside_an_unchanged_whole_tile():
  """`visible_half` at the capped loop's width (8 tokens x 4 heads: 32 query rows) lowers for cuda
  (no GPU needed) to one kernel holding both paths under an `scf.if`: the whole tile's two dots and
  the half's two; at 4 tokens (16 rows: no halves) it is the default kernel's IR, line for line."""
  from experiments import kernel_code

  cfg = get_config("sdar_4b")
  ir = lambda tiles, tokens: "\n".join(
    kernel_code.triton_code(kernel_code.cache_kernel_lowered(cfg, tiles, jnp.bfloat16, tokens))
  )
  half = flash_decode.DecodeTiles(visible_half=True)
  text = ir(half, 8)
  dots = kernel_code.dot_types(text)
  if jax.default_backend() == "gpu":  # the IR text sits in a compiled kernel's record
    assert dots and all(d == ("bf16", "bf16", "f32") for d in dots), dots
    return
  assert "scf.if" in text and dots == [("bf16", "bf16", "f32")] * 4
  strip = lambda t: "\n".join(line for line in t.splitlines() if "loc(" not in line)
  assert strip(ir(half, 4)) == strip(ir(flash_decode.DecodeTiles(), 4))
