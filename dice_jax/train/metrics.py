"""Metrics: a JSONL + TensorBoard writer, FLOP counting for MFU, and a progress line with ETA."""

from __future__ import annotations

import json
import os
import time

import jax
from absl import logging

from dice_jax import atomic
from dice_jax.model.config import ModelConfig

# Dense bf16 peak FLOP/s per device (vendor datasheets, no sparsity).
PEAK_BF16_FLOPS = {
  "h200": 989e12,
  "h100": 989e12,
  "a100": 312e12,
  "gh200": 989e12,
  "b200": 2250e12,
  "tpu v4": 275e12,
  "tpu v5 lite": 197e12,
  "tpu v5e": 197e12,
  "tpu v5p": 459e12,
  "tpu v5": 459e12,
  "tpu v6 lite": 918e12,
  "tpu v6e": 918e12,
}


def peak_flops(device=None) -> float | None:
  """bf16 peak of one device, or None when unknown (e.g. CPU: no MFU is reported)."""
  kind = (device or jax.devices()[0]).device_kind.lower()
  for name in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
    if name in kind:
      return PEAK_BF16_FLOPS[name]
  return None


def sft_flops_per_row(
  cfg: ModelConfig, seq_len: int, *, lm_head_tokens: int | None = None
) -> float:
  """Training FLOPs (forward + backward = 3x forward, matmuls only) of one SFT row of `seq_len`
  tokens, whose model input is the 2L `[x_t ; x_0]` sequence of 2*seq_len tokens.

  - Linear layers: 2 FLOPs per multiply-add, on all 2L input tokens.
  - LM head: on `lm_head_tokens` tokens (default seq_len: the objective projects only x_t).
  - Attention (QK^T and PV): counted on the query/key pairs the block-diffusion mask allows,
    about T^2 of the (2T)^2 (x_0 block-causal ~T^2/2, x_t -> earlier x_0 blocks ~T^2/2, x_t
    same-block ~0): what a mask-aware kernel must compute, not what a dense one does.
  """
  d, f, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
  n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  t2 = 2 * seq_len
  per_tok_layer = 2 * (d * n * h + 2 * d * k * h + n * h * d + 3 * d * f)
  head_tokens = seq_len if lm_head_tokens is None else lm_head_tokens
  fwd = L * per_tok_layer * t2 + 2 * d * cfg.vocab_size * head_tokens
  fwd += L * 4 * n * h * seq_len * seq_len  # 2 matmuls x 2 FLOPs x pairs x heads x head_dim
  return 3.0 * fwd


class MetricWriter:
  """Scalars to `metrics.jsonl` and TensorBoard event files (process 0 only)."""

  def __init__(self, workdir: str, *, tensorboard: bool = True):
    self.active = jax.process_index() == 0
    if not self.active:
      return
    os.makedirs(workdir, exist_ok=True)
    self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", buffering=1)
    self._tb = None
    if tensorboard:
      from tensorboard.summary.writer.event_file_writer import EventFileWriter

      self._tb = EventFileWriter(os.path.join(workdir, "tb"))

  def write(self, step: int, scalars: dict):
    if not self.active:
      return
    scalars = {k: float(v) for k, v in scalars.items()}
    self._jsonl.write(json.dumps({"step": int(step), **scalars}) + "\n")
    if self._tb is not None:
      from tensorboard.compat.proto import event_pb2, summary_pb2

      vals = [summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
      self._tb.add_event(
        event_pb2.Event(
          wall_time=time.time(), step=int(step), summary=summary_pb2.Summary(value=vals)
        )
      )

  def flush(self):
    if self.active:
      self._jsonl.flush()
      if self._tb is not None:
        self._tb.flush()

  def close(self):
    if self.active:
      self._jsonl.close()
      if self._tb is not None:
        self._tb.close()


class Throughput:
  """Step time, tokens/s, MFU and ETA over a sliding window of steps (first step = compile)."""

  def __init__(
    self,
    total_steps: int,
    flops_per_step: float,
    tokens_per_step: int,
    num_devices: int,
    peak: float | None,
  ):
    self.total, self.flops, self.tokens = total_steps, flops_per_step, tokens_per_step
    self.ndev, self.peak = num_devices, peak
    self._t = None
    self._steps = 0
    self._elapsed = 0.0

  def tick(self, step: int) -> dict:
    """Call after step `step` finished (its outputs fetched); returns rate metrics."""
    now = time.perf_counter()
    out = {}
    if self._t is not None:
      dt = now - self._t
      self._steps += 1
      self._elapsed += dt
      out = {"step_time_s": dt, "tokens_per_s": self.tokens / dt}
      if self.peak:
        out["mfu"] = self.flops / dt / (self.peak * self.ndev)
    self._t = now
    return out

  def eta_s(self, step: int) -> float | None:
    if not self._steps:
      return None
    return (self.total - step) * self._elapsed / self._steps


def progress_line(step: int, total: int, m: dict, eta: float | None) -> str:
  parts = [f"step {step}/{total}", f"loss {m.get('loss', float('nan')):.4f}"]
  if "tokens_per_s" in m:
    parts.append(f"{m['tokens_per_s']:.0f} tok/s")
  if "mfu" in m:
    parts.append(f"MFU {100 * m['mfu']:.1f}%")
  if eta is not None:
    parts.append(f"ETA {int(eta) // 3600:d}:{int(eta) % 3600 // 60:02d}:{int(eta) % 60:02d}")
  return " | ".join(parts)


def log_progress(step, total, m, eta):
  logging.info(progress_line(step, total, m, eta))


def read_metrics(path: str) -> dict[int, dict]:
  """{step: record} from a metrics.jsonl (the last record of a step wins: resumed runs re-log). A last
  line without its newline is a record still being written and is left out."""
  out = {}
  with open(path) as f:
    for line in f:
      if line.strip() and line.endswith("\n"):
        rec = json.loads(line)
        out[int(rec["step"])] = rec
  return dict(sorted(out.items()))


def plot_loss(metrics_path: str, png_path: str, title: str = "SFT loss") -> str:
  """Loss and masked-token CE per step (raw and a 10-step running mean) as a PNG."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  recs = read_metrics(metrics_path)
  steps = np.array(list(recs))
  fig, ax = plt.subplots(figsize=(7, 4))
  for key, label in (
    ("loss", "block-diffusion loss (1/p weighted)"),
    ("masked_ce", "CE on masked tokens"),
  ):
    y = np.array([recs[s].get(key, np.nan) for s in steps])
    (line,) = ax.plot(steps, y, alpha=0.3)
    k = min(10, len(y))
    ax.plot(
      steps[k - 1 :],
      np.convolve(y, np.ones(k) / k, "valid"),
      color=line.get_color(),
      label=f"{label}, {k}-step mean",
    )
  ax.set_xlabel("step")
  ax.set_ylabel("nats / token")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  try:
    return atomic.write_file(png_path, lambda tmp: fig.savefig(tmp, dpi=110))
  finally:
    plt.close(fig)
