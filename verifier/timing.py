"""Timing of a model's forward (runs inside a worker).

GPU: CUDA events around each call, with ``torch.cuda.synchronize()`` (all streams of the device) before
the end event is recorded, so work hidden on other streams is counted; a 256 MB write flushes L2 before
every trial (KernelBench main's ``clear_l2_cache``); warm-up calls first; fresh input clones each trial
(defeats caches keyed on ``data_ptr``; reference doc section 2.6). CPU: ``perf_counter`` with a 64 MB
write to flush caches. Reports median and mean in milliseconds.
"""

from __future__ import annotations

import statistics
import time

import torch

from verifier.contract import Runtime
from verifier.correctness import clone_args

L2_FLUSH_BYTES = {"cuda": 256 << 20, "cpu": 64 << 20}


def time_forward(model, inputs: list, device: torch.device, trials: int, warmup: int) -> Runtime:
  flush = torch.empty(L2_FLUSH_BYTES[device.type] // 4, dtype=torch.int32, device=device)
  with torch.no_grad():
    for _ in range(warmup):
      model(*clone_args(inputs))
    if device.type == "cuda":
      torch.cuda.synchronize()
    times = []
    for i in range(trials):
      args = clone_args(inputs)
      flush.fill_(i)
      if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        model(*args)
        torch.cuda.synchronize()  # every stream of the device
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
      else:
        t0 = time.perf_counter()
        model(*args)
        times.append((time.perf_counter() - t0) * 1e3)
      del args
  return Runtime(
    median_ms=float(statistics.median(times)),
    mean_ms=float(statistics.fmean(times)),
    num_trials=len(times),
  )
