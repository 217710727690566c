r"""Where one iteration of a decode loop spends its device time: bench_sampler's `profile_loop` run.

A forward measured alone (`options_forward`, 15.1 ms for sdar_4b at 128 rows, fill 1,536) is not
the loop's step: the capped dynamic loop takes ~23 ms a batch forward and static ~20 ms (H200,
issue 39), and a float8 cache that makes the forward 1.4 ms faster made the loop slower. This run
accounts for the loop itself. One compiled sampler program (`max_new_tokens = L`) runs twice on
the same prompts, every row's budget first `2b` tokens (short), then `L` (long), each under the
profiler and once more untimed by it. Prefill and everything else a call does once cancel in the
difference; what is left, over the difference of batch forwards, is one loop iteration at fills
from prompt + 2b to prompt + L: device ms by kind and by kernel, launches, and wall ms.

The prompts are `prompt_len + new_tokens / 2 - L / 2` tokens long, so the iterations measured sit
around the fill of the forward account (prompt + new / 2).
"""

from __future__ import annotations

import collections

# the RL rollout's own loop (bench_rl, rollout.py): capped dynamic, sampling at temperature 1 with each
# token's log-prob, on the unsharpened model
_ROLLOUT = dict(
  strategy="low_confidence_dynamic", commit_rows=-1, temperature=1.0, return_logprobs=True
)

# name -> (sampler keywords, sharpened LM head): the loops bench_sampler's rate runs decode.
LOOPS = {
  "static": (dict(strategy="low_confidence_static"), False),
  "static_fp8": (dict(strategy="low_confidence_static", kv_cache_dtype="float8_e4m3fn"), False),
  "dynamic": (dict(strategy="low_confidence_dynamic"), True),
  "dynamic_capped": (dict(strategy="low_confidence_dynamic", commit_rows=-1), True),
  "dynamic_capped_fp8": (
    dict(strategy="low_confidence_dynamic", commit_rows=-1, kv_cache_dtype="float8_e4m3fn"),
    True,
  ),
  "dynamic_capped_fp8w": (
    dict(strategy="low_confidence_dynamic", commit_rows=-1, weights_dtype="float8_e4m3fn"),
    True,
  ),
  "rollout": (_ROLLOUT, False),
  "rollout_fp8": (dict(_ROLLOUT, kv_cache_dtype="float8_e4m3fn"), False),
}


def loop_settings(name: str, commit_rows: int) -> tuple[dict, bool]:
  """The sampler keywords of loop `name` (a cap of -1 becomes `commit_rows`) and whether its LM
  head is sharpened (the dynamic runs'); a ValueError naming the known loops otherwise."""
  if name not in LOOPS:
    raise ValueError(f"unknown loop {name!r}; known: {', '.join(LOOPS)}")
  kw, sharp = LOOPS[name]
  kw = dict(kw)
  if kw.get("commit_rows") == -1:
    if commit_rows < 1:
      raise ValueError(f"loop {name!r} needs commit_rows >= 1, got {commit_rows}")
    kw["commit_rows"] = commit_rows
  return kw, sharp


def loop_prompt_len(prompt_len: int, new_tokens: int, loop_tokens: int, block: int) -> int:
  """Prompt tokens of the profiled calls: the measured iterations centred on prompt + new / 2,
  a whole number of blocks, at least `prompt_len`."""
  p = prompt_len + new_tokens // 2 - loop_tokens // 2
  return max(prompt_len, -(-p // block) * block)


def per_forward(long: dict, short: dict, forwards: int, calls: int = 1) -> dict:
  """One loop iteration from two `trace_summary.summarize` results (their `top` holding every
  kernel) of `calls` calls each, whose batch forwards differ by `forwards`: {'device_ms',
  'by_kind': {kind: ms}, 'kernels': [[name, kind, ms, launches]]} per forward, largest first.
  A kernel only in the short call counts negative (it ran once per call, not per forward)."""
  if forwards < 1:
    raise ValueError(
      f"the long call must run more batch forwards than the short one, got {forwards}"
    )
  table = collections.defaultdict(lambda: [None, 0.0, 0.0])
  for sign, summary in ((1.0, long), (-1.0, short)):
    for name, kind, ms, launches in summary["top"]:
      row = table[name]
      row[0] = row[0] or kind
      row[1] += sign * ms * calls
      row[2] += sign * launches * calls
  kernels = [
    [name, kind, round(ms / forwards, 4), round(n / forwards, 2)]
    for name, (kind, ms, n) in table.items()
  ]
  kernels.sort(key=lambda r: -r[2])
  by_kind = collections.Counter()
  for _, kind, ms, _ in kernels:
    by_kind[kind] += ms
  return dict(
    device_ms=round(sum(by_kind.values()), 3),
    by_kind={k: round(v, 3) for k, v in by_kind.most_common()},
    kernels=kernels,
  )


def markdown(rows: list[dict], top: int = 15) -> str:
  """The loops side by side by kind, then each loop's largest kernels per forward."""
  kinds = []
  for r in rows:
    kinds += [k for k in r["by_kind"] if k not in kinds]
  lines = ["| loop | forwards | wall ms | device ms | " + " | ".join(kinds) + " |"]
  lines.append("| --- " * (4 + len(kinds)) + "|")
  for r in rows:
    cells = [str(r["by_kind"].get(k, 0.0)) for k in kinds]
    lines.append(
      f"| {r['loop']} | {r['forwards']} | {r['wall_ms']} | {r['device_ms']} | "
      + " | ".join(cells)
      + " |"
    )
  for r in rows:
    lines += ["", f"### {r['loop']}: largest kernels per batch forward", ""]
    lines += ["| kernel | kind | ms | launches |", "| --- | --- | --- | --- |"]
    lines += [f"| `{n}` | {k} | {ms} | {c} |" for n, k, ms, c in r["kernels"][:top]]
  return "\n".join(lines) + "\n"
