"""Where a checker-clock round trip's time goes on a GPU host (issue 25), with no verifier code in the way.

A parent ("checker") times a child ("candidate") process's forward on the parent's ``perf_counter``
around a one-byte request and a 16-byte reply over a socketpair, inputs and outputs shared through CUDA
IPC, and compares it with the in-process CUDA-event method (``verifier.check.timing.time_calls``' rule:
256 MB L2 flush, fresh clones, events around the call with a device sync before the end event). Both
processes stamp ``perf_counter`` (CLOCK_MONOTONIC, one clock for the host), so a round trip splits into:
request wake-up (parent send -> child has it), the child's work, reply wake-up (child send -> parent has
it).

Variables: the child's work (``null``: sync only; ``fwd``: the forward and a sync; ``pub``: the forward,
the output copied into the shared buffer and poisoned, a sync), how both sides wait (``block``: a
blocking ``recv``; ``spin``: polling with MSG_DONTWAIT), whether the parent wrote fresh inputs and flushed
L2 in its own CUDA context before each call (``prep``), and CPU load on every core (busy processes at
nice 0 or nice 19, the way compile workers load the host).

  python3 -m experiments.gpu.exchange_floor --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import time

import torch
import torch.multiprocessing as mp

REPLY = struct.Struct("dd")
WORKLOADS = {"tiny": (1024,), "add": (4096, 4096), "mm": (4096, 4096)}


def _forward(kind, a, b):
  return a @ b if kind == "mm" else a + b


def _recv(sock, n, spin):
  if not spin:
    return sock.recv(n)
  while True:
    try:
      return sock.recv(n, socket.MSG_DONTWAIT)
    except BlockingIOError:
      pass


def child_main(sock, kind, a, b, out):
  torch.cuda.set_device(0)
  spin = False
  while True:
    msg = _recv(sock, 2, spin)
    t_in = time.perf_counter()
    op, mode = msg[:1], msg[1:2]
    spin = mode == b"s"
    if op == b"x":
      return
    if op == b"n":
      torch.cuda.synchronize()
    elif op == b"f":
      y = _forward(kind, a, b)
      torch.cuda.synchronize()
      del y
    elif op == b"p":
      y = _forward(kind, a, b)
      out.copy_(y)
      y.fill_(float("nan"))
      torch.cuda.synchronize()
      del y
    t_out = time.perf_counter()
    sock.sendall(REPLY.pack(t_in, t_out))


def _stats(xs):
  return {
    "mean": statistics.fmean(xs),
    "median": statistics.median(xs),
    "p10": sorted(xs)[len(xs) // 10],
    "p90": sorted(xs)[len(xs) * 9 // 10],
  }


def in_process(kind, a, b, flush, calls, warmup):
  ev, wall = [], []
  for i in range(warmup + calls):
    args = (a.clone(), b.clone())
    flush.fill_(i)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    s.record()
    _forward(kind, *args)
    torch.cuda.synchronize()
    e.record()
    e.synchronize()
    t1 = time.perf_counter()
    if i >= warmup:
      ev.append(s.elapsed_time(e))
      wall.append((t1 - t0) * 1e3)
  return {"events_ms": _stats(ev), "wall_ms": _stats(wall)}


def cross_process(sock, op, spin, prep, a, b, out, flush, calls, warmup):
  trips, wake_in, work, wake_out = [], [], [], []
  mode = b"s" if spin else b"b"
  for i in range(warmup + calls):
    if prep:
      a.normal_()
      b.normal_()
      out.fill_(float("nan"))
      flush.fill_(i)
      torch.cuda.synchronize()
    t0 = time.perf_counter()
    sock.sendall(op + mode)
    reply = b""
    while len(reply) < REPLY.size:
      reply += _recv(sock, REPLY.size - len(reply), spin)
    t1 = time.perf_counter()
    t_in, t_out = REPLY.unpack(reply)
    if i >= warmup:
      trips.append((t1 - t0) * 1e3)
      wake_in.append((t_in - t0) * 1e3)
      work.append((t_out - t_in) * 1e3)
      wake_out.append((t1 - t_out) * 1e3)
  return {
    "round_trip_ms": _stats(trips),
    "wake_in_ms": _stats(wake_in),
    "child_work_ms": _stats(work),
    "wake_out_ms": _stats(wake_out),
  }


def start_load(nice):
  n = os.cpu_count() or 1
  code = f"import os; os.nice({nice})\nwhile True: pass"
  return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def stop_load(procs):
  for p in procs:
    p.kill()
  for p in procs:
    p.wait()


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", required=True)
  ap.add_argument("--calls", type=int, default=40)
  ap.add_argument("--warmup", type=int, default=5)
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  torch.cuda.set_device(0)
  ctx = mp.get_context("spawn")
  flush = torch.empty(256 << 18, dtype=torch.int32, device="cuda")
  results = []
  path = os.path.join(args.out, "exchange_floor.json")
  for kind, shape in WORKLOADS.items():
    a = torch.randn(shape, device="cuda")
    b = torch.randn(shape, device="cuda")
    out = torch.empty_like(_forward(kind, a, b))
    ip = in_process(kind, a, b, flush, args.calls, args.warmup)
    results.append({"workload": kind, "variant": "in_process", **ip})
    print(kind, "in_process", json.dumps(ip), flush=True)
    parent, kid = socket.socketpair()
    proc = ctx.Process(target=child_main, args=(kid, kind, a, b, out))
    proc.start()
    kid.close()
    variants = []
    for load in ("none", "nice0", "nice19"):
      for spin in (False, True):
        for op in (b"n", b"f", b"p"):
          variants.append((load, spin, op, True))
    variants.append(("none", False, b"f", False))
    variants.append(("none", True, b"f", False))
    current, procs = "none", []
    for load, spin, op, prep in variants:
      if load != current:
        stop_load(procs)
        procs = [] if load == "none" else start_load(0 if load == "nice0" else 19)
        current = load
        time.sleep(0.5)
      r = cross_process(parent, op, spin, prep, a, b, out, flush, args.calls, args.warmup)
      name = f"{ {b'n': 'null', b'f': 'fwd', b'p': 'pub'}[op] }-{'spin' if spin else 'block'}-load_{load}{'' if prep else '-noprep'}"
      results.append({"workload": kind, "variant": name.strip(), **r})
      print(
        kind,
        name.strip(),
        "trip %.3f (med %.3f) wake_in %.3f work %.3f wake_out %.3f"
        % (
          r["round_trip_ms"]["mean"],
          r["round_trip_ms"]["median"],
          r["wake_in_ms"]["mean"],
          r["child_work_ms"]["mean"],
          r["wake_out_ms"]["mean"],
        ),
        flush=True,
      )
      with open(path, "w") as f:
        json.dump(results, f, indent=1)
    stop_load(procs)
    parent.sendall(b"xb")
    proc.join()
    parent.close()
  print("wrote", path)


if __name__ == "__main__":
  main()
