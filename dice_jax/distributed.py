"""Multi-process JAX: join the processes, agree across them, write from one of them.

A multi-host run starts the same program once per host (or per GPU); `initialize` joins the
processes into one set of global devices (`jax.devices()`), over which one mesh is built. Every
process then runs the same jitted steps on its own devices and feeds them its own rows.
Files that exist once (metrics, exports, plots) are written by the primary process (index 0);
orbax checkpoints are written by all processes together.

Everything here works unchanged in a single-process run, where the gathers are plain copies and
no collective runs.

Failure: each process sends heartbeats to the coordinator (process 0). When one process dies
(kill -9, a lost host), the others terminate once `heartbeat_timeout_s` has passed without its
heartbeats (or at once, when the coordinator itself is gone) instead of waiting forever in a
collective; rerun every process to resume from the last checkpoint.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
from absl import logging

from dice_jax.errors import UserError

HEARTBEAT_TIMEOUT_S = 100  # jax's default


def initialize(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  *,
  heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S,
) -> None:
  """`jax.distributed.initialize`; must run before any other JAX call.

  Arguments left None are read from the cluster environment (SLURM, Open MPI, Cloud TPU,
  Kubernetes with `JAX_COORDINATOR_ADDRESS`...). A missing or inconsistent setting is a
  UserError naming it.
  """
  if heartbeat_timeout_s < 1:
    raise UserError(f"heartbeat timeout must be >= 1 s, got {heartbeat_timeout_s}")
  try:
    jax.distributed.initialize(
      coordinator_address=coordinator_address,
      num_processes=num_processes,
      process_id=process_id,
      heartbeat_timeout_seconds=heartbeat_timeout_s,
    )
  except (ValueError, TypeError) as e:
    raise UserError(
      f"jax.distributed.initialize (coordinator_address={coordinator_address}, "
      f"num_processes={num_processes}, process_id={process_id}): {e}"
    ) from e
  logging.info(
    "process %d of %d: %d local devices of %d (coordinator %s)",
    jax.process_index(),
    jax.process_count(),
    jax.local_device_count(),
    jax.device_count(),
    coordinator_address or "from the environment",
  )


def is_primary() -> bool:
  """Whether this process writes the files that exist once (process 0)."""
  return jax.process_index() == 0


def primary_logs_only() -> None:
  """Other processes than the primary log warnings and errors only (one copy of each line)."""
  if not is_primary():
    logging.set_verbosity(logging.WARNING)


def gather(x: np.ndarray) -> np.ndarray:
  """`[process_count, *x.shape]`: every process's `x` (same shape and dtype on all), on every
  process. A collective: every process must call it, in the same order."""
  x = np.asarray(x)
  if jax.process_count() == 1:
    return x[None]
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def any_process(flag: bool) -> bool:
  """True on every process when `flag` is True on any (e.g. a stop signal that reached one)."""
  return bool(gather(np.asarray(flag, np.int32)).any())


def gather_json(obj: Any) -> list:
  """Every process's JSON-serialisable `obj`, in process order, on every process."""
  if jax.process_count() == 1:
    return [obj]
  raw = np.frombuffer(json.dumps(obj, sort_keys=True).encode(), np.uint8)
  sizes = gather(np.asarray(raw.size, np.int64))
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[: raw.size] = raw
  rows = gather(padded)
  return [json.loads(rows[i, : sizes[i]].tobytes()) for i in range(len(rows))]


def _on_this_host(x) -> bool:
  return getattr(x, "is_fully_addressable", True) or x.is_fully_replicated


def to_host(x: jax.Array) -> np.ndarray:
  """The whole value of a global array as numpy on this host. When other processes hold parts
  of it, this is an all-gather (a collective: every process must call it)."""
  if _on_this_host(x):
    return np.asarray(jax.device_get(x))
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def tree_to_host(tree):
  """`to_host` of every leaf of a pytree (one batched transfer when no leaf needs a gather)."""
  if all(_on_this_host(x) for x in jax.tree.leaves(tree)):
    return jax.tree.map(np.asarray, jax.device_get(tree))
  return jax.tree.map(to_host, tree)


def barrier(name: str) -> None:
  """Waits until every process has reached the barrier called `name`."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)
