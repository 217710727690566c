"""The rollout -> TraceRL contract: trajectories cut from a real sampler output."""

import numpy as np
import pytest
from flax import nnx

from dice_jax.diffusion import sampler
from dice_jax.model.config import get_config
from dice_jax.model.transformer import Transformer
from dice_jax.rl.trajectory import Trajectory, from_sample_output


def test_trajectories_hold_whole_blocks_with_their_step_maps_and_logprobs():
  model = Transformer(get_config("tiny", dtype="float32"), rngs=nnx.Rngs(0))
  cfg = sampler.SamplerConfig(
    max_new_tokens=10,
    temperature=1.0,
    strategy="low_confidence_dynamic",
    return_logprobs=True,
    stop_ids=(7,),
  )
  prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
  out = sampler.generate(model, prompts, cfg)
  trajs = from_sample_output(out, prompts, block_size=cfg.block_size)
  assert [t.prompt_ids.tolist() for t in trajs] == prompts
  for i, t in enumerate(trajs):
    assert t.response_ids.size % cfg.block_size == 0 and t.response_ids.size >= 4
    assert t.step_map.min() == 0 and t.step_map.max() == int(out.steps_used[i]) - 1
    assert t.trained_tokens == int(out.response_lengths[i])
    assert np.all(t.sampler_logp <= 0) and np.any(t.sampler_logp < 0)


def test_a_trajectory_whose_blocks_overlap_in_steps_is_refused():
  t = Trajectory([1, 2], [3, 4, 5, 6, 7, 8, 9, 10], [0, 1, 1, 2, 2, 3, 3, 3], [True] * 8, [0.0] * 8)
  with pytest.raises(ValueError, match="before the previous block finished"):
    t.check_grid(4)
  with pytest.raises(ValueError, match="not a multiple of the block size"):
    Trajectory([1], [3, 4, 5], [0, 0, 1], [True] * 3, [0.0] * 3).check_grid(4)
  with pytest.raises(ValueError, match="loss_mask has shape"):
    Trajectory([1], [3, 4], [0, 0], [True], [0.0, 0.0])
