r"""Where a compiled call's device time goes: a table of kernels from a `jax.profiler` trace.

  with jax.profiler.trace(DIR, create_perfetto_trace=True): ...   # N calls of the function
  python -m experiments.trace_summary DIR --calls=N

Reads the newest `perfetto_trace.json.gz` under DIR, keeps the device's kernel events (processes
named `/device:GPU...`; on a CPU host, XLA's own threads), and sums their durations by kernel name
and by a coarse kind (matmul, attention kernel, dynamic-slice / copy, fusion, other), per call.
Plain JSON; no TensorBoard needed.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import sys

_KINDS = (  # first match wins; on the kernel name and its HLO op (XLA puts it in args)
  ("matmul", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|\bdot\b|matmul", re.I)),
  ("attention", re.compile(r"cache_part|flash|attention|_kernel$|pallas|triton", re.I)),
  ("slice/copy", re.compile(r"dynamic[-_]slice|dynamic[-_]update|copy|memcpy|memset", re.I)),
  ("fusion", re.compile(r"fusion", re.I)),
)


def kind_of(name: str, hlo_op: str = "") -> str:
  for kind, rx in _KINDS:
    if rx.search(name) or rx.search(hlo_op):
      return kind
  return "other"


def newest_trace(trace_dir: str) -> str:
  found = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
  if not found:
    raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir} (profiler trace failed?)")
  return max(found, key=os.path.getmtime)


def device_events(events: list) -> list:
  """Complete events on the device: GPU processes, or XLA's threads on a CPU-only host."""
  procs = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
  threads = {
    (e["pid"], e.get("tid")): e["args"]["name"] for e in events if e.get("name") == "thread_name"
  }
  gpu = {pid for pid, name in procs.items() if "/device:GPU" in name}
  if gpu:
    keep = lambda e: e["pid"] in gpu
  else:
    keep = lambda e: threads.get((e["pid"], e.get("tid")), "").startswith("tf_XLA")
  return [e for e in events if e.get("ph") == "X" and keep(e)]


def summarize(trace_dir: str, calls: int = 1, top: int = 25) -> dict:
  """{'device_ms_per_call', 'by_kind': {kind: ms per call}, 'top': [[name, kind, ms per call,
  launches per call]], 'trace': path}."""
  path = newest_trace(trace_dir)
  with gzip.open(path) as f:
    data = json.load(f)
  events = device_events(data["traceEvents"] if isinstance(data, dict) else data)
  by_name = collections.defaultdict(lambda: [0.0, 0, ""])
  for e in events:
    args = e.get("args") or {}
    row = by_name[e["name"]]
    row[0] += e.get("dur", 0.0) / 1e3  # us -> ms
    row[1] += 1
    row[2] = row[2] or str(args.get("hlo_op", "") or args.get("long_name", ""))
  by_kind = collections.Counter()
  table = []
  for name, (ms, n, op) in by_name.items():
    kind = kind_of(name, op)
    by_kind[kind] += ms / calls
    table.append([name[:120], kind, round(ms / calls, 3), round(n / calls, 1)])
  table.sort(key=lambda r: -r[2])
  return dict(
    device_ms_per_call=round(sum(by_kind.values()), 3),
    by_kind={k: round(v, 3) for k, v in by_kind.most_common()},
    top=table[:top],
    trace=path,
  )


def markdown(summary: dict) -> str:
  lines = [f"device time per call: {summary['device_ms_per_call']} ms", ""]
  lines += ["| kind | ms per call |", "| --- | --- |"]
  lines += [f"| {k} | {v} |" for k, v in summary["by_kind"].items()]
  lines += ["", "| kernel | kind | ms per call | launches per call |", "| --- | --- | --- | --- |"]
  lines += [f"| `{n}` | {k} | {ms} | {c} |" for n, k, ms, c in summary["top"]]
  return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
  """Bad arguments or a directory without a trace: one line on stderr, exit status 2."""
  from experiments import _cli

  calls = 1
  dirs = []
  for a in argv:
    if a.startswith("--calls="):
      calls = a.split("=", 1)[1]
      if not calls.isdigit() or int(calls) < 1:
        _cli.fail(f"--calls must be a number >= 1, got {calls!r}")
      calls = int(calls)
    else:
      dirs.append(a)
  if len(dirs) != 1:
    _cli.fail("usage: python -m experiments.trace_summary TRACE_DIR [--calls=N]")
  try:
    print(markdown(summarize(dirs[0], calls)))
  except FileNotFoundError as e:
    _cli.fail(_cli.message(e))


if __name__ == "__main__":
  main(sys.argv[1:])
