"""One process of the two-process sampler test (`test_sampler_mesh.py`), started by
`experiments.local_cluster` (which appends the cluster arguments): the tiny model on the global
mesh (rows over the devices of both processes), the continuous engine and the static sampler on
it and, for reference, on this process's first device alone; writes what it saw to
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
  axis = 1 if x.ndim == 5 else 0
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
  mesh = sharding.make_mesh(data=1, fsdp=-1, tensor=1)
  models = {"mesh": sharpened(sharding.create_sharded(make, mesh))}
  with jax.default_device(jax.local_devices()[0]):
    models["alone"] = sharpened(make())
  reqs = requests()
  seen = {"process": jax.process_index(), "devices": jax.device_count()}
  for name, model in models.items():
    eng = engine.ContinuousSampler(model, CFG, slots=4, max_prompt_len=12, prefill_rows=4)
    done = {c.id: c for c in eng.run(reqs)}
    seen[f"{name} engine"] = [
      [getattr(done[r.id], f).tolist() for r in reqs]
      for f in ("response_ids", "step_map", "logprobs")
    ]
    if name == "mesh":
      _, cache = eng._steps.init()
      seen["cache rows held"] = rows_held(cache.k)
      seen["cache bytes per device"] = [s.data.nbytes for s in cache.k.addressable_shards]
      seen["cache bytes"] = cache.k.nbytes
    out = sampler.generate(
      model, [r.prompt_ids for r in reqs[:4]], CFG, keys=jnp.stack([r.key for r in reqs[:4]])
    )
    if name == "mesh":
      seen["static rows held"] = rows_held(out.tokens)
    host = distributed.tree_to_host(out)
    seen[f"{name} static"] = [host.tokens.tolist(), host.step_map.tolist(), host.logprobs.tolist()]
  with open(os.path.join(args.out, f"process_{jax.process_index()}.json"), "w") as f:
    json.dump(seen, f)
  distributed.barrier("sampler_processes done")


if __name__ == "__main__":
  main()
