"""Pieces the RL benchmarks share (`bench_rl`, `rl_step`): a JSON record written as it grows, the
persistent compilation cache, compile seconds from JAX's own events, a local verifier started in
a thread, and a profiled optimizer step. No flags here (each benchmark has its own)."""

from __future__ import annotations

import json
import os
import threading
import time

import jax
import numpy as np

from dice_jax.compile_clock import COMPILE_EVENTS, CompileClock  # noqa: F401 - the benchmarks' clock

# The reference every synthetic rollout's responses are judged against (a ReLU).
RELU_REFERENCE = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn(4096, 1024)]


def get_init_inputs():
    return []
"""


class Report:
  """A JSON record at `path`, rewritten (atomically) at every `update`; each update is also
  printed as one line with `prefix`."""

  def __init__(self, path: str, prefix: str):
    self.path, self.prefix = path, prefix
    self.data = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "jax": jax.__version__}

  def update(self, **kw):
    self.data.update(kw)
    print(f"{self.prefix}: " + json.dumps(kw), flush=True)
    if self.path:
      os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
      with open(self.path + ".tmp", "w") as f:
        json.dump(self.data, f, indent=2)
      os.replace(self.path + ".tmp", self.path)


def decode_tiles(spec: str, flag: str = "--decode_tiles", default=None):
  """A `DecodeTiles` from a flag's value: JSON, a JSON file's path, or empty (`default`, else the
  default tiles); an absl UsageError naming the flag otherwise."""
  from absl import app

  from dice_jax.model import flash_decode

  if not spec:
    return default or flash_decode.DecodeTiles()
  text = open(spec).read() if os.path.exists(spec) else spec
  try:
    return flash_decode.DecodeTiles(**json.loads(text))
  except (ValueError, TypeError) as e:
    raise app.UsageError(f"{flag}: {e}") from e


def use_compilation_cache(path: str) -> dict:
  """A persistent JAX compilation cache in `path` (every compile cached); whether it was warm."""
  os.makedirs(path, exist_ok=True)
  entries = len(os.listdir(path))
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return dict(dir=path, entries_at_start=entries, warm=entries > 0)


def start_local_verifier(workdir: str, device: str, extra_args=()):
  """A local verifier service started in a thread (it overlaps model set-up): (thread, holder);
  after `thread.join()`, `holder['server']` is the entered `LocalVerifier` (or `holder['error']`
  the exception that stopped it), `holder['start_s']` its start-up time."""
  holder: dict = {}

  def run():
    from verifier.serve.local import LocalVerifier

    t0 = time.perf_counter()
    try:
      v = LocalVerifier(workdir, device=device, extra_args=tuple(extra_args))
      holder["server"] = v.__enter__()
    except Exception as e:  # noqa: BLE001 - reported and re-raised by the caller's thread
      holder["error"] = e
    holder["start_s"] = time.perf_counter() - t0

  t = threading.Thread(target=run, daemon=True)
  t.start()
  return t, holder


def keep_micro_batches(batch: dict, micro_rows: int, keep: int) -> dict:
  """Host `batch` with every row after the first `keep` micro-batches emptied (segment 0, nothing
  trained): the train step skips those micro-batches (`tracerl.is_empty`)."""
  out = {k: np.array(v) for k, v in batch.items()}
  cut = keep * micro_rows
  for k in ("segment_ids", "p_mask", "norm_rounds"):
    out[k][cut:] = 0
  out["traj_index"][cut:] = -1
  if "trained_index" in out:
    out["trained_index"][cut:] = -1
  return out


def profile_step(step_fn, state, batch, mesh, accum: int, key, trace_dir: str, keep: int):
  """(state, summary): one optimizer step on host `batch` cut to `keep` micro-batches, run once
  untraced (compiles happen there) and once under `jax.profiler`; the trace summarised per
  micro-step (`experiments/trace_summary.py`, also written to trace_dir/summary.md)."""
  from dice_jax.train import train_step as ts
  from experiments import trace_summary

  keep = min(keep, accum)
  sb = ts.shard_batch(
    keep_micro_batches(batch, batch["tokens"].shape[0] // accum, keep), mesh, accum
  )
  state, m = step_fn(state, sb, key)
  jax.block_until_ready(m)
  t0 = time.perf_counter()
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    state, m = step_fn(state, sb, key)
    jax.block_until_ready(m)
  wall = time.perf_counter() - t0
  summary = trace_summary.summarize(trace_dir, calls=keep)
  with open(os.path.join(trace_dir, "summary.md"), "w") as f:
    f.write(trace_summary.markdown(summary))
  return state, dict(
    micro_steps=keep,
    traced_step_s=round(wall, 2),
    device_ms_per_micro_step=summary["device_ms_per_call"],
    by_kind_ms_per_micro_step=summary["by_kind"],
    top=summary["top"][:12],
  )


def peak_gib() -> float | None:
  """Peak device memory in use so far, GiB (None where the backend does not say)."""
  stats = jax.local_devices()[0].memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  return None if peak is None else round(peak / 2**30, 1)


class StackSampler:
  """Where the main thread is, every `every_s` seconds, written to `path` as it goes: names a stall
  that no clock names (a host-side wait shows as the Python line that waits). Consecutive identical
  stacks are written once with their count. A context manager; a daemon thread."""

  def __init__(self, path: str, every_s: float, depth: int = 12):
    self.path, self.every_s, self.depth = path, every_s, depth
    self._stop = threading.Event()
    self._main = threading.main_thread().ident
    self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

  def _stack(self) -> str:
    import sys
    import traceback

    frame = sys._current_frames().get(self._main)
    if frame is None:
      return "(main thread gone)"
    frames = traceback.extract_stack(frame)[-self.depth :]
    return " < ".join(
      f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames)
    )

  def _run(self):
    t0, last, count, since = time.perf_counter(), None, 0, 0.0
    with open(self.path, "w") as f:
      while not self._stop.wait(self.every_s):
        now, stack = time.perf_counter() - t0, self._stack()
        if stack == last:
          count += 1
          continue
        if last is not None:
          f.write(f"{since:8.1f} s  x{count}  {last}\n")
          f.flush()
        last, count, since = stack, 1, now
      if last is not None:
        f.write(f"{since:8.1f} s  x{count}  {last}\n")

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
