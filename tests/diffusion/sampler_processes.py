"""One process of the two-process sampler test (`test_sampler_mesh.py`), started by
`experiments.local_cluster` (which appends the cluster arguments): the continuous engine with the
tiny model on the global mesh (rows over the devices of both processes) and, for reference, the
same requests on this process's first device alone; writes what it saw to
`--out/process_I.json`."""

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dice_jax import distributed, sharding
from dice_jax.diffusion import engine, sampler
from dice_jax.model.config import get_config
from dice_jax.model.transformer import Transformer

STOP = 238
CFG = sampler.SamplerConfig(
  strategy="low_confidence_dynamic",
  threshold=0.5,
  temperature=1.0,
  max_new_tokens=10,
  stop_ids=(STOP,),
  return_logprobs=True,
)


def requests(n=7):
  rs = np.random.RandomState(0)
  return [
    engine.Request(i, rs.randint(2, 250, rs.randint(1, 12)).tolist(), jax.random.key(100 + i))
    for i in range(n)
  ]


def sharpened(model):
  model.lm_head[...] = model.lm_head[...] * 60.0
  return model


def rows_held(x) -> list[list[int]]:
  """The [start, stop) row ranges of `x` (rows on axis 1 for K/V, else 0) this process holds."""
  axis = 1 if x.ndim == 4 else 0
  spans = {s.index[axis].indices(x.shape[axis])[:2] for s in x.addressable_shards}
  return sorted(list(s) for s in spans)


def main():
  p = argparse.ArgumentParser()
  for name in ("out", "coordinator_address"):
    p.add_argument(f"--{name}", required=True)
  p.add_argument("--num_processes", type=int, required=True)
  p.add_argument("--process_id", type=int, required=True)
  args = p.parse_args()
  distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
  mcfg = get_config("tiny", dtype="float32")
  make = lambda: Transformer(mcfg, rngs=nnx.Rngs(0))
  mesh = sharding.make_mesh(data=1, fsdp=-1, tensor=1)  # rows over the devices of both
  reqs = requests()
  seen = {"process": jax.process_index(), "devices": jax.device_count()}
  # The engine on the global mesh: 4 slots, one per device, refilled.
  eng = engine.ContinuousSampler(
    sharpened(sharding.create_sharded(make, mesh)), CFG, slots=4, max_prompt_len=12
  )
  done = {c.id: c for c in eng.run(reqs)}
  seen["mesh"] = [
    [getattr(done[r.id], f).tolist() for r in reqs]
    for f in ("response_ids", "step_map", "logprobs")
  ]
  _, cache = eng._steps.init()
  seen["cache rows held"] = rows_held(cache.k)
  seen["cache bytes per device"] = [s.data.nbytes for s in cache.k.addressable_shards]
  seen["cache bytes"] = cache.k.nbytes
  # The same requests on this process's first device alone (the static sampler: the engine
  # decodes what it decodes, `test_engine.py`).
  with jax.default_device(jax.local_devices()[0]):
    alone = sampler.generate(
      sharpened(make()), [r.prompt_ids for r in reqs], CFG, keys=jnp.stack([r.key for r in reqs])
    )
  tokens, steps, logp = (np.asarray(x) for x in (alone.tokens, alone.step_map, alone.logprobs))
  gen = steps >= 0
  seen["alone"] = [[x[i][gen[i]].tolist() for i in range(len(reqs))] for x in (tokens, steps, logp)]
  with open(os.path.join(args.out, f"process_{jax.process_index()}.json"), "w") as f:
    json.dump(seen, f)
  distributed.barrier("sampler_processes done")


if __name__ == "__main__":
  main()
