"""One block grid (size + alignment) for the objective, SFT packing, the sampler and configs."""

import numpy as np
import pytest
from flax import nnx

from dice_jax.data.sft_pipeline import tokenize_sample
from dice_jax.diffusion import blocks, objective, sampler
from dice_jax.model.config import get_config
from dice_jax.model.transformer import Transformer
from dice_jax.train.config import SFTConfig, apply_overrides


def test_block_ids_on_both_alignments():
  pos = np.arange(12)
  resp = blocks.BlockGrid(4, "response")
  absolute = blocks.BlockGrid(4, "absolute")
  # a prompt of 6 tokens: response blocks start at 6, the prompt is cut backwards from there
  np.testing.assert_array_equal(resp.block_of(pos, 6), [-2, -2, -1, -1, -1, -1, 0, 0, 0, 0, 1, 1])
  np.testing.assert_array_equal(absolute.block_of(pos, 6), [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
  assert resp.first_block_start(6) == 6 and absolute.first_block_start(6) == 4
  assert resp.padded_length(3, 2) == 7 and absolute.padded_length(3, 2) == 8
  # packed training rows: the response start of a segment is its first loss token
  seg = np.array([[1, 1, 1, 1, 1, 2, 2, 2, 2, 0]])
  pos_t = np.array([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0]])
  loss = np.array([[0, 0, 1, 1, 1, 0, 1, 1, 1, 0]], bool)
  np.testing.assert_array_equal(
    np.asarray(resp.token_block_ids(pos_t, seg, loss)), [[-1, -1, 0, 0, 0, -1, 0, 0, 0, 0]]
  )
  np.testing.assert_array_equal(
    np.asarray(blocks.block_ids(pos_t, seg, loss, 2)), [[-1, -1, 0, 0, 1, -1, 0, 0, 1, 0]]
  )
  for bad in (dict(size=0), dict(alignment="left"), dict(size=True)):
    with pytest.raises(ValueError, match="BlockGrid"):
      blocks.BlockGrid(**bad)


def test_one_grid_drives_packing_objective_and_sampler():
  grid = blocks.BlockGrid(4, "absolute")
  assert tokenize_sample([5, 6, 7], [8, 9], grid, 0)["tokens"].tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
  scfg = sampler.SamplerConfig.on_grid(grid, steps=2)
  assert scfg.grid == grid and scfg.block_alignment == "absolute"
  cfg = apply_overrides(SFTConfig(), ["objective.grid.alignment=absolute", "objective.eps=0.01"])
  assert cfg.objective.grid == grid and cfg.objective.eps == 0.01
  assert SFTConfig.from_json(cfg.to_json()) == cfg
  # a config saved before the objective section (flat fields) still loads
  old = {k: v for k, v in SFTConfig().to_json().items() if k != "objective"}
  old.update(eps=0.02, per_block_t=True, block_alignment="absolute")
  migrated = SFTConfig.from_json(old)
  assert migrated.objective == objective.ObjectiveConfig(
    eps=0.02, per_block_t=True, grid=blocks.BlockGrid(4, "absolute")
  )


def test_objective_and_sampler_refuse_a_grid_other_than_the_models():
  model = Transformer(get_config("tiny", dtype="float32"), rngs=nnx.Rngs(0))
  batch = dict(
    tokens=np.ones((1, 8), np.int32),
    positions=np.arange(8, dtype=np.int32)[None],
    segment_ids=np.ones((1, 8), np.int32),
    loss_mask=np.arange(8)[None] >= 4,
  )
  cfg = objective.ObjectiveConfig(grid=blocks.BlockGrid(8))
  with pytest.raises(ValueError, match="ObjectiveConfig.grid: block size 8 differs"):
    objective.block_diffusion_loss(model, batch, None, cfg)
  with pytest.raises(ValueError, match="SamplerConfig: block size 2 differs"):
    sampler.generate(model, [[1, 2, 3]], sampler.SamplerConfig(block_size=2))


def test_the_model_is_the_source_of_the_block_size():
  from dice_jax.model.config import get_config

  mcfg = get_config("tiny")
  unset = sampler.SamplerConfig(block_size=0)
  assert unset.for_model(mcfg).block_size == mcfg.block_size
  assert sampler.SamplerConfig(block_size=mcfg.block_size).for_model(mcfg).block_size == (
    mcfg.block_size
  )
  with pytest.raises(ValueError, match="not resolved yet"):
    unset.grid
  other = mcfg.block_size * 2
  with pytest.raises(ValueError, match=f"block size {other} differs from the model's block_size"):
    sampler.SamplerConfig(block_size=other).for_model(mcfg)
