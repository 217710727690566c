"""SFT packing: every sample lands exactly once, segments never mix, positions restart, resume is exact."""

import collections

import numpy as np
import pytest

pytest.importorskip("grain", reason="the data pipelines need grain (not on the GPU image)")

from dice_jax.data.prompts import SFTSample
from dice_jax.data.sft_pipeline import (
  FEATURES,
  PackingStats,
  SFTPipelineConfig,
  make_sft_dataset,
  packing_efficiency,
  sft_texts,
  tokenize_sample,
)
from dice_jax.diffusion.blocks import BlockGrid


def _samples(n=60, seed=0):
  rng = np.random.default_rng(seed)
  return [
    SFTSample(
      prompt=f"task {i}: " + "the code " * int(rng.integers(1, 12)),
      response=f"answer {i} " + "def " * int(rng.integers(0, 25)),
      sample_id=f"s{i}",
    )
    for i in range(n)
  ]


def _expected(samples, tok, block):
  out = {}
  for s in samples:
    p, r = sft_texts(s, tok)
    out[s.sample_id] = tokenize_sample(
      tok.encode(p), tok.encode(r), BlockGrid(block), tok.pad_token_id
    )
  return out


def _segments(batches):
  """(tokens, loss_mask, positions) of every packed segment, read back from batches."""
  for b in batches:
    for row in range(b["tokens"].shape[0]):
      seg = b["segment_ids"][row]
      ids = [int(i) for i in np.unique(seg) if i > 0]
      assert ids == list(range(1, len(ids) + 1))  # 1, 2, 3, ... per row
      for i in ids:
        where = np.flatnonzero(seg == i)
        assert np.array_equal(where, np.arange(where[0], where[-1] + 1)), (
          "segment is not contiguous"
        )
        yield b["tokens"][row, where], b["loss_mask"][row, where], b["positions"][row, where]
      pad = seg == 0
      assert not b["loss_mask"][row, pad].any() and (b["positions"][row, pad] == 0).all()


def test_sample_tokenization_pads_to_block_and_masks_prompt():
  # default: blocks start at the response, so the response is padded to whole blocks
  out = tokenize_sample([5, 6, 7], [8, 9], BlockGrid(4), pad_id=0)
  assert out["tokens"].tolist() == [5, 6, 7, 8, 9, 0, 0]
  assert out["loss_mask"].tolist() == [False, False, False, True, True, True, True]
  # SDAR's absolute grid: the whole sample is padded to whole blocks
  out = tokenize_sample([5, 6, 7], [8, 9], BlockGrid(4, "absolute"), pad_id=0)
  assert out["tokens"].tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
  assert out["loss_mask"].tolist() == [False, False, False, True, True, True, True, True]
  assert tokenize_sample([1, 2, 3], [4, 5, 6, 7], BlockGrid(4), 0)["tokens"].tolist() == [
    1,
    2,
    3,
    4,
    5,
    6,
    7,
  ]
  with pytest.raises(ValueError, match="alignment"):
    BlockGrid(4, "left")


def test_response_text_follows_chat_template(sdar_tokenizer):
  p, r = sft_texts(SFTSample("write x", "```python\nx\n```"), sdar_tokenizer)
  assert p == "<|im_start|>user\nwrite x<|im_end|>\n<|im_start|>assistant\n"
  assert r == "<think>\n\n</think>\n\n```python\nx\n```<|im_end|>\n"


@pytest.mark.parametrize("bins", [1, 8])
def test_epoch_packs_every_token_exactly_once(tiny_tokenizer, bins):
  samples = _samples()
  cfg = SFTPipelineConfig(
    seq_len=48, grid=BlockGrid(4), batch_size=3, num_packing_bins=bins, drop_remainder=False
  )
  stats = PackingStats()
  batches = list(make_sft_dataset(samples, tiny_tokenizer, cfg, stats))
  assert all(b["tokens"].shape == (b["tokens"].shape[0], 48) for b in batches)
  assert {k: batches[0][k].dtype for k in FEATURES} == {
    "tokens": np.int32,
    "positions": np.int32,
    "segment_ids": np.int32,
    "loss_mask": np.bool_,
  }
  expected = _expected(samples, tiny_tokenizer, 4)
  too_long = {k for k, v in expected.items() if len(v["tokens"]) > 48}
  assert too_long and set(stats.dropped_ids) == too_long  # drops are reported, not silent
  assert stats.tokens_dropped == sum(len(expected[k]["tokens"]) for k in too_long)
  want = collections.Counter(
    tuple(v["tokens"].tolist()) for k, v in expected.items() if k not in too_long
  )
  got = collections.Counter()
  by_tokens = {tuple(v["tokens"].tolist()): v for v in expected.values()}
  for toks, loss, pos in _segments(batches):
    got[tuple(toks.tolist())] += 1
    assert loss.sum() % 4 == 0  # blocks start at the response: the response fills whole blocks
    assert pos.tolist() == list(range(len(toks)))  # positions restart per segment
    assert np.array_equal(loss, by_tokens[tuple(toks.tolist())]["loss_mask"])
  assert got == want
  assert sum(len(k) for k in got.elements()) + stats.tokens_dropped == sum(
    len(v["tokens"]) for v in expected.values()
  )


def test_no_attention_across_segments_with_model_masks(tiny_tokenizer):
  from dice_jax.model import masks

  cfg = SFTPipelineConfig(seq_len=48, grid=BlockGrid(4), batch_size=2, num_packing_bins=4)
  b = next(iter(make_sft_dataset(_samples(), tiny_tokenizer, cfg)))
  spec = masks.AttentionSpec.block_diffusion(4, segment_ids=b["segment_ids"])
  pos2 = np.concatenate([b["positions"], b["positions"]], axis=1)  # [x_t ; x_0] share positions
  m = np.asarray(masks.dense_mask(spec, pos2))  # [B, 2T, 2T]
  seg2 = np.concatenate([b["segment_ids"], b["segment_ids"]], axis=1)
  cross = seg2[:, :, None] != seg2[:, None, :]
  assert not (m & cross).any()
  assert m.any()


def test_sharding_over_processes_partitions_the_samples(tiny_tokenizer):
  samples = _samples(30)
  seen = []
  for p in range(3):
    cfg = SFTPipelineConfig(
      seq_len=128,
      grid=BlockGrid(4),
      batch_size=1,
      num_packing_bins=2,
      process_index=p,
      process_count=3,
      drop_remainder=False,
    )
    seen += [
      tuple(t.tolist()) for t, _, _ in _segments(make_sft_dataset(samples, tiny_tokenizer, cfg))
    ]
  want = [
    tuple(v["tokens"].tolist())
    for v in _expected(samples, tiny_tokenizer, 4).values()
    if len(v["tokens"]) <= 128
  ]
  assert len(want) >= 20
  assert collections.Counter(seen) == collections.Counter(want)


def test_resume_from_saved_state_gives_identical_batches(tiny_tokenizer):
  cfg = SFTPipelineConfig(
    seq_len=48, grid=BlockGrid(4), batch_size=2, num_packing_bins=4, num_epochs=None, seed=7
  )
  ds = make_sft_dataset(_samples(), tiny_tokenizer, cfg)
  it = iter(ds)
  for _ in range(5):
    next(it)
  state = it.get_state()
  after = [next(it) for _ in range(6)]  # crosses an epoch boundary (60 samples ~ 20 rows/epoch)
  fresh = iter(make_sft_dataset(_samples(), tiny_tokenizer, cfg))
  fresh.set_state(state)
  again = [next(fresh) for _ in range(6)]
  for a, b in zip(after, again):
    for k in FEATURES:
      np.testing.assert_array_equal(a[k], b[k])
  assert not np.array_equal(after[0]["tokens"], next(iter(ds))["tokens"])
  assert 0.5 < packing_efficiency(after[0]) <= 1.0


def test_repeating_pipeline_where_nothing_fits_fails_instead_of_hanging(tiny_tokenizer):
  samples = [
    SFTSample(prompt="p " * 40, response="r " * 40, sample_id=f"long{i}") for i in range(3)
  ]
  cfg = SFTPipelineConfig(
    seq_len=16, grid=BlockGrid(4), batch_size=1, num_epochs=None, read_threads=1
  )
  with pytest.raises(ValueError, match="no SFT sample fits seq_len=16"):
    next(iter(make_sft_dataset(samples, tiny_tokenizer, cfg)))


def test_max_sample_len_drops_what_llama_factory_packing_drops(tiny_tokenizer):
  """DICE (LLaMA-Factory, packing): a sample whose block-padded length exceeds cutoff_len - 1 is
  dropped, so rows of 16 take samples of at most 15 (12 once padded to blocks of 4)."""

  samples = _samples(40)
  grid = BlockGrid(4, "absolute")
  lengths = []
  for s in samples:
    prompt, response = sft_texts(s, tiny_tokenizer)
    ids = tokenize_sample(tiny_tokenizer.encode(prompt), tiny_tokenizer.encode(response), grid, 0)[
      "tokens"
    ]
    lengths.append(ids.size)
  seq = max(lengths)
  assert lengths.count(seq) >= 1 and seq % 4 == 0
  dropped = {}
  for limit in (0, seq - 1):
    stats = PackingStats()
    cfg = SFTPipelineConfig(
      seq_len=seq, max_sample_len=limit, grid=grid, batch_size=1, shuffle=False, read_threads=1
    )
    list(make_sft_dataset(samples, tiny_tokenizer, cfg, stats))
    dropped[limit] = stats.samples_dropped
  assert dropped == {0: 0, seq - 1: lengths.count(seq)}
  with pytest.raises(ValueError, match="max_sample_len"):
    SFTPipelineConfig(seq_len=16, max_sample_len=20)


def test_config_validation():
  with pytest.raises(ValueError, match="multiple of the block size"):
    SFTPipelineConfig(seq_len=50, grid=BlockGrid(4))
  with pytest.raises(ValueError, match="process_index"):
    SFTPipelineConfig(process_index=2, process_count=2)


def test_worker_processes_give_the_same_batches_and_resume(tiny_tokenizer):
  base = dict(
    seq_len=48, grid=BlockGrid(4), batch_size=2, num_packing_bins=4, num_epochs=None, seed=3
  )
  inproc = iter(make_sft_dataset(_samples(), tiny_tokenizer, SFTPipelineConfig(**base)))
  want = [next(inproc) for _ in range(6)]
  cfg = SFTPipelineConfig(**base, worker_count=1)
  it = iter(make_sft_dataset(_samples(), tiny_tokenizer, cfg))
  got = [next(it) for _ in range(3)]
  state = it.get_state()
  it2 = iter(make_sft_dataset(_samples(), tiny_tokenizer, cfg))
  it2.set_state(state)
  got += [next(it2) for _ in range(3)]
  for a, b in zip(want, got):
    for k in FEATURES:
      np.testing.assert_array_equal(a[k], b[k])


@pytest.mark.parametrize("workers", [1, 2])
def test_drops_made_in_worker_processes_are_counted_in_the_callers_stats(tiny_tokenizer, workers):
  """A grain worker filters on its own copy of the stats: its drops reach the caller's with its
  batches (before, `worker_count > 0` reported no drops at all)."""
  samples = _samples()
  base = dict(seq_len=88, grid=BlockGrid(4), batch_size=2, num_packing_bins=4, drop_remainder=False)
  inproc = PackingStats()
  list(make_sft_dataset(samples, tiny_tokenizer, SFTPipelineConfig(**base), inproc))
  stats = PackingStats()
  cfg = SFTPipelineConfig(**base, worker_count=workers)
  batches = list(make_sft_dataset(samples, tiny_tokenizer, cfg, stats))
  assert 20 < inproc.samples_dropped < 40  # about half of the 60 are longer than 88 tokens
  assert sorted(stats.dropped_ids) == sorted(inproc.dropped_ids)
  assert (stats.samples_dropped, stats.tokens_dropped) == (
    inproc.samples_dropped,
    inproc.tokens_dropped,
  )
  assert all(set(b) == set(FEATURES) for b in batches)  # the drops' key is gone


def test_real_kernel_pairs_pack_without_loss_with_sdar_tokenizer(sdar_tokenizer):
  from dice_jax.data import prompts, tasks

  from ._helpers import shared_path

  rows, _ = tasks.load_infilling_tasks(
    str(shared_path("dice_rl", "kernel_infilling_evaluation.json"))
  )
  samples = [
    prompts.sft_sample_from_pair(t.reference_code, t.cuda_code, sample_id=t.task_id) for t in rows
  ]
  cfg = SFTPipelineConfig(seq_len=6144, grid=BlockGrid(4), batch_size=4, drop_remainder=False)
  stats = PackingStats()
  batches = list(make_sft_dataset(samples, sdar_tokenizer, cfg, stats))
  expected = _expected(samples, sdar_tokenizer, 4)
  got = collections.Counter(tuple(t.tolist()) for t, _, _ in _segments(batches))
  assert stats.samples_dropped == 0 and sum(got.values()) == 99
  assert got == collections.Counter(tuple(v["tokens"].tolist()) for v in expected.values())
  im_end = sdar_tokenizer.token_to_id("<|im_end|>")
  for t, loss, _ in _segments(
    batches
  ):  # each response ends <|im_end|>\n, then block pads (trained)
    last = len(t) - 1 - np.flatnonzero(t[::-1] != sdar_tokenizer.pad_token_id)[0]
    assert t[last - 1] == im_end and loss[last:].all() and not loss[0]
