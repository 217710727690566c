"""What an RL run reports per step: rollout and update metrics, the progress line, the sample
file and the plot (process 0 writes; the loop only calls these)."""

from __future__ import annotations

import collections
import json
import os
import zlib

import numpy as np

from dice_jax import distributed
from dice_jax.rl import rewards as rewards_lib
from dice_jax.train import metrics as metrics_lib


def rollout_metrics(ro) -> dict:
  """Outcome rates, lengths, sampler counters and speedup percentiles of one `Rollout`."""
  n = max(len(ro.outcomes), 1)
  passed = [rewards_lib.passed(o) for o in ro.outcomes]
  kinds = collections.Counter(o.failure_kind.label for o in ro.outcomes)
  m = {
    "samples": float(len(ro.outcomes)),
    "reward_mean": float(ro.rewards.mean()) if ro.rewards.size else 0.0,
    "correct_rate": sum(passed) / n,
    "compiled_rate": sum(o.compiled for o in ro.outcomes) / n,
    "deceptive_rate": sum(o.deceptive for o in ro.outcomes) / n,
    "response_tokens_mean": float(np.mean([t.trained_tokens for t in ro.trajectories]))
    if ro.trajectories
    else 0.0,
    "tokens_per_forward": ro.generated_tokens / max(ro.steps_used, 1),
    "sampler_forwards": float(ro.forwards),
    "judge_requests": float(ro.judge_requests),
    "groups_skipped": float(ro.groups_skipped),
    "time/sample_s": ro.sample_s,
    "time/verify_wait_s": ro.verify_wait_s,
  }
  for kind, c in kinds.items():
    if kind != "ok":
      m[f"failure/{kind}"] = c / n
  speedups = np.asarray([o.speedup for o, p in zip(ro.outcomes, passed) if p and o.speedup > 0])
  if speedups.size:
    m.update(
      speedup_p10=float(np.percentile(speedups, 10)),
      speedup_p50=float(np.median(speedups)),
      speedup_p90=float(np.percentile(speedups, 90)),
      speedup_geomean=float(np.exp(np.log(speedups).mean())),
      speedup_timed=float(speedups.size),
    )
  return m


def fingerprint(parts) -> float:
  """CRC32 over byte strings and arrays (exact in float64): identifies data or samples in metrics."""
  crc = 0
  for p in parts:
    crc = zlib.crc32(np.ascontiguousarray(p).tobytes() if isinstance(p, np.ndarray) else p, crc)
  return float(crc)


class UpdateStats:
  """Sums of the train step's metric sums over one RL step's optimizer steps."""

  def __init__(self):
    self.sums = collections.Counter()
    self.losses: list[float] = []
    self.grad_norms: list[float] = []
    self.ratio_max = 0.0

  def add(self, m: dict) -> None:
    self.losses.append(m["loss"])
    self.grad_norms.append(m["grad_norm"])
    self.ratio_max = max(self.ratio_max, m.get("ratio_max", 0.0))
    for k in ("pg_sum", "kl_sum", "clipped_tokens", "entropy_sum", "ratio_sum", "trained_tokens"):
      self.sums[k] += m.get(k, 0.0)
    self.sums["rounds"] += m.get("rounds", 0.0)

  def metrics(self) -> dict:
    tok = max(self.sums["trained_tokens"], 1.0)
    out = {"updates": float(len(self.losses)), "trained_tokens": self.sums["trained_tokens"]}
    if self.losses:
      out.update(
        loss=float(np.mean(self.losses)),
        loss_first=self.losses[0],
        loss_last=self.losses[-1],
        grad_norm=float(np.mean(self.grad_norms)),
        kl=self.sums["kl_sum"] / tok,
        clip_fraction=self.sums["clipped_tokens"] / tok,
        entropy=self.sums["entropy_sum"] / tok,
        ratio_mean=self.sums["ratio_sum"] / tok,
        ratio_max=self.ratio_max,
        trace_rounds=self.sums["rounds"],
      )
    return out


def progress_line(step: int, total: int, m: dict) -> str:
  parts = [
    f"rl step {step}/{total}",
    f"reward {m['reward_mean']:.3f}",
    f"correct {m['correct_rate']:.3f} compiled {m['compiled_rate']:.3f}",
    f"groups kept {int(m['groups'] - m['groups_dropped'])}/{int(m['groups'])}",
    f"updates {int(m['updates'])}",
  ]
  if m.get("updates"):
    parts.append(f"loss {m['loss']:.4g} kl {m['kl']:.2e} clip {m['clip_fraction']:.3f}")
  parts.append(
    f"time sample {m['time/sample_s']:.1f}s verify-wait {m['time/verify_wait_s']:.1f}s "
    f"update {m['time/update_s']:.1f}s"
    + (f" (compiling {m['time/compile_s']:.1f}s)" if m.get("time/compile_s", 0) >= 0.1 else "")
  )
  if "memory/peak_gib" in m:
    parts.append(f"peak memory {m['memory/peak_gib']:.1f} GiB")
  return " | ".join(parts)


def write_samples(path: str, step: int, ro, n: int) -> None:
  """Appends the first `n` responses of the step with their verdicts (process 0 only)."""
  if not n or not distributed.is_primary():
    return
  with open(path, "a") as f:
    for i in range(min(n, len(ro.trajectories))):
      t, o = ro.trajectories[i], ro.outcomes[i]
      rec = {
        "step": step,
        "task_id": t.task_id,
        "group": t.group,
        "member": t.member,
        "reward": float(ro.rewards[i]),
        "failure_kind": o.failure_kind.label,
        "reason": o.reason[:300],
        "response": ro.responses[i],
      }
      f.write(json.dumps(rec) + "\n")


def plot_rl(metrics_path: str, png_path: str, phase: str) -> str:
  """Reward/correctness, KL and clip fraction, and the time split per RL step, as one PNG."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  recs = metrics_lib.read_metrics(metrics_path)
  steps = np.array(list(recs))
  get = lambda k: np.array([recs[s].get(k, np.nan) for s in steps], float)  # noqa: E731
  fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
  for k in ("reward_mean", "correct_rate", "compiled_rate", "deceptive_rate"):
    axes[0].plot(steps, get(k), marker=".", label=k)
  axes[0].set_title(f"BiC-RL {phase}: rollout outcomes")
  axes[0].set_ylim(-0.02, max(1.02, np.nanmax(get("reward_mean")) + 0.05))
  axes[1].plot(steps, get("kl"), marker=".", label="kl (k3, vs rollout policy)")
  axes[1].plot(steps, get("clip_fraction"), marker=".", label="clip fraction")
  axes[1].set_yscale("symlog", linthresh=1e-4)
  axes[1].set_title("policy update")
  bottom = np.zeros(len(steps))
  for k, label in (
    ("time/sample_s", "sampling"),
    ("time/verify_wait_s", "waiting for the verifier"),
    ("time/update_s", "update"),
  ):
    v = np.nan_to_num(get(k))
    axes[2].bar(steps, v, bottom=bottom, label=label)
    bottom += v
  axes[2].set_title("time per RL step (s)")
  for ax in axes:
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  tmp = png_path + ".tmp.png"
  fig.savefig(tmp, dpi=100)
  plt.close(fig)
  os.replace(tmp, png_path)
  return png_path
