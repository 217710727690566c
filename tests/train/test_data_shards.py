"""The global SFT batch comes from `data_shards` streams and does not depend on how many processes
read it: simulated processes (each with its rows of the batch) see the rows one process sees,
read only their own streams, and restore a state saved on another process count."""

import dataclasses

import numpy as np
import pytest

from dice_jax.errors import UserError
from dice_jax.train import sft_data
from dice_jax.train.config import SFTConfig
from dice_jax.train.run_config import RunConfig
from dice_jax.train.run_setup import load_tokenizer

from ._helpers import write_cuke_file

BATCH = 4


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  path = write_cuke_file(tmp_path_factory.mktemp("data") / "cuke.jsonl", n=30)
  cfg = SFTConfig(
    data_source="cuke",
    data_path=path,
    seq_len=256,
    batch_size=BATCH,
    data_shards=2,
    run=RunConfig(seed=3),
  )
  return cfg, sft_data.load_samples(cfg), load_tokenizer(cfg.run.tokenizer)


def _processes(data, n, cfg=None):
  """n simulated processes, process p holding the global rows [p*B/n, (p+1)*B/n)."""
  cfg = cfg or data[0]
  per = BATCH // n
  return [
    sft_data.make_iterator(cfg, data[1], data[2], rows=np.arange(p * per, (p + 1) * per))
    for p in range(n)
  ]


def _global_batch(its):
  parts = [next(it) for it in its]
  return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _merged_state(its):
  """What `data_shards.global_state` gathers from the processes."""
  merged = {}
  for it in its:
    merged.update(it.get_state()["streams"])
  return {"streams": merged}


def test_any_process_count_sees_the_batches_of_one_process(data):
  one = _processes(data, 1)
  want = [_global_batch(one) for _ in range(4)]
  assert len({w["tokens"].tobytes() for w in want}) == 4  # the batches move on
  for n in (2, 4):
    its = _processes(data, n)
    assert [it.shards for it in its] == ([[0], [1]] if n == 2 else [[0], [0], [1], [1]])
    for step, w in enumerate(want):
      got = _global_batch(its)
      for k in w:
        np.testing.assert_array_equal(got[k], w[k], err_msg=f"{k} at step {step}, {n} processes")
  assert one[0].shards == [0, 1]


def test_a_state_saved_on_two_processes_restores_on_one_and_on_four(data):
  uninterrupted = _processes(data, 1)
  want = [_global_batch(uninterrupted) for _ in range(3)][-1]
  two = _processes(data, 2)
  for _ in range(2):
    _global_batch(two)
  saved = _merged_state(two)
  assert sorted(saved["streams"]) == ["0", "1"]
  for n in (1, 4):
    its = _processes(data, n)
    for it in its:
      it.set_state(saved)
    got = _global_batch(its)
    np.testing.assert_array_equal(got["tokens"], want["tokens"], err_msg=f"{n} processes")
    np.testing.assert_array_equal(got["loss_mask"], want["loss_mask"])


def test_a_state_of_another_shard_count_is_refused_and_a_pre_shard_state_restores(data):
  cfg, samples, tok = data
  single = dataclasses.replace(cfg, data_shards=1)
  old = sft_data.make_iterator(single, samples, tok)
  next(old)
  legacy = old.get_state()["streams"]["0"]  # what checkpoints held before data shards
  want = next(old)
  resumed = sft_data.make_iterator(single, samples, tok)
  resumed.set_state(legacy)
  np.testing.assert_array_equal(next(resumed)["tokens"], want["tokens"])
  with pytest.raises(UserError, match=r"streams \['0'\] but this run reads \[0, 1\]: data_shards"):
    _processes(data, 1)[0].set_state({"streams": {"0": legacy}})
  with pytest.raises(ValueError, match="multiple of data_shards"):
    SFTConfig(batch_size=6, data_shards=4)
