"""The trace mask through the GPU attention paths (`pytest -m gpu tests/rl/test_tracerl_gpu.py`).

The compiled Triton flash kernel, cuDNN and XLA attention against the dense reference, on packed
TraceRL rows of a tiny float32 model: the old log-probs and the gradient of the TraceRL loss.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dice_jax.model.config import get_config
from dice_jax.model.transformer import Transformer
from dice_jax.rl import tracerl
from dice_jax.rl.trajectory import Trajectory

pytestmark = pytest.mark.gpu
B = 4


def _trajectories(rng, n=4):
  trajs = []
  for _ in range(n):
    prompt, blocks = int(rng.integers(20, 200)), int(rng.integers(16, 96))
    step, steps = 0, []
    for _ in range(blocks):
      k = int(rng.integers(1, B + 1))
      steps.append(
        step + rng.permutation(np.concatenate([np.arange(k), rng.integers(0, k, B - k)]))
      )
      step += k
    trajs.append(
      Trajectory(
        prompt_ids=rng.integers(1, 200, prompt),
        response_ids=rng.integers(1, 200, blocks * B),
        step_map=np.concatenate(steps),
        loss_mask=np.ones(blocks * B, bool),
        sampler_logp=np.zeros(blocks * B),
        advantage=float(rng.normal()),
      )
    )
  return trajs


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("impl", ["flash", "cudnn", "xla"])
def test_trace_rows_on_gpu_attention_match_the_dense_path(impl):
  cfg = tracerl.TraceRLConfig()
  (batch,) = tracerl.build_batches(
    _trajectories(np.random.default_rng(0)), cfg, block_size=B, mask_token_id=255, rows_per_batch=4
  )
  assert batch["tokens"].shape[1] % 128 == 0 and batch["tokens"].shape[1] >= 512

  def run(attention_impl):
    model = Transformer(
      get_config("tiny", dtype="float32", attention_impl=attention_impl), rngs=nnx.Rngs(0)
    )
    graphdef, params = nnx.split(model, nnx.Param)

    @jax.jit
    def f(params, batch):
      m = nnx.merge(graphdef, params)
      logp = tracerl.token_logprobs(m, batch)
      b = dict(batch, old_logp=jax.lax.stop_gradient(logp) - 0.1)  # ratios != 1
      loss = lambda p: tracerl.tracerl_loss(nnx.merge(graphdef, p), b, None, cfg)[0]
      return logp, jax.grad(loss)(params)

    return f(params, batch)

  with jax.default_matmul_precision("highest"):
    want_logp, want_g = run("dense")
    got_logp, got_g = run(impl)
  p_mask = batch["p_mask"]
  err = np.abs(np.asarray(got_logp) - np.asarray(want_logp))[p_mask].max()
  assert err < 2e-3, err
  assert np.all(np.isfinite(np.asarray(got_logp)))
  for a, b in zip(jax.tree.leaves(want_g), jax.tree.leaves(got_g)):
    rel = float(jnp.abs(a - b).max() / (jnp.abs(a).max() + 1e-12))
    assert rel < 2e-2, rel
