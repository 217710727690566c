"""The sampler's first call on a GPU host (`python3 -m pytest -m gpu`): nothing it runs changes JAX's
trace context once `trace_context.settle` has run, so nothing traced before it compiles again (issue
39, sessions 27-28: on jax 0.11.2 the first call imported the Pallas fuser, whose state made the RL
rollout's first timed call trace and compile the whole sampler a second time, 20-35 s)."""

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

_FIRST_CALL = textwrap.dedent(
  """
  import json
  import jax
  from flax import nnx
  from dice_jax import trace_context
  from dice_jax.diffusion import sampler
  from dice_jax.model import flash_decode, transformer
  from dice_jax.model.config import get_config

  model = transformer.Transformer(
    get_config("tiny", dtype="bfloat16", attention_impl="flash"), rngs=nnx.Rngs(0)
  )
  cfg = sampler.SamplerConfig(
    strategy="low_confidence_dynamic",
    threshold=0.9,
    temperature=1.0,
    max_new_tokens=8,
    return_logprobs=True,
    decode_tiles=flash_decode.DecodeTiles(split=32, block_k=16, share_prompts=True),
  )
  added_by_settle = trace_context.settle()
  before = trace_context.names()
  out = sampler.generate(model, [[5, 6, 7]] * 2 + [[8, 9, 10, 11]] * 2, cfg)
  print(json.dumps({
    "backend": jax.default_backend(),
    "added_by_settle": list(added_by_settle),
    "added_by_first_call": [n for n in trace_context.names() if n not in before],
    "tokens": int(out.tokens.size),
    "names": len(before),
  }))
  """
)


def test_the_sampler_first_call_adds_no_trace_context_state_after_settling(gpu):
  """A fresh interpreter: `settle()`, then the sampler's first call on the flash-decode kernel
  (Triton) with the RL rollout's options adds no trace-context state."""
  out = subprocess.run(
    [sys.executable, "-c", _FIRST_CALL], capture_output=True, text=True, timeout=600, check=True
  )
  got = json.loads(out.stdout.strip().splitlines()[-1])
  assert got["backend"] == "gpu"
  assert got["names"] > 10  # this JAX lists its trace context (else the test would prove nothing)
  assert got["tokens"] > 0
  assert got["added_by_first_call"] == [], (got, out.stderr[-2000:])
