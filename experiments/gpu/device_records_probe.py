"""Issue 37 probe on a GPU host, before any service: can this process record its device work with the
verifier's CUPTI collector, may a process sample another one's CPU time (perf_event_open), and which
kernel limit caps a worker's tasks here? Prints one JSON object: the CUPTI version, the collector's
self-test, what one ReLU, one matmul (cuBLAS), one marker copy and one device-to-host copy were recorded
as, the host sampler's view of a child computing in numpy, and the task cap (``task_limits``: a cgroup
per job, else ``RLIMIT_NPROC`` in a user namespace, else ``pid_max`` of the PID namespace).

  PYTHONPATH=$PWD python3 -m experiments.gpu.device_records_probe
"""

import json
import os
import subprocess
import sys
import tempfile
import time


def _device() -> dict:
  import torch

  from verifier.candidate import device_records

  out = {"torch": torch.__version__, "cupti_paths": device_records.cupti_paths()}
  with tempfile.TemporaryDirectory() as d:
    out["build"] = device_records.prepare(d) or "ok"
    torch.cuda.init()
    (torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")).sum().item()
    out["self_test"] = device_records.start_collector() or "ok"
    c = device_records.COLLECTOR
    if not c.active:
      return out
    out["cupti_version"] = int(c.lib.vc_version())
    x = torch.randn(1 << 20, device="cuda")
    buf = torch.zeros(64, dtype=torch.uint8, device="cuda")
    t0 = time.perf_counter()
    y = torch.relu(x)
    z = x.view(1024, 1024) @ x.view(1024, 1024)
    buf[32:45].copy_(buf[:13])
    host = y[:4096].cpu()
    torch.cuda.synchronize()
    rec = c.take(1)
    out["take_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
    out["kernels"] = [
      (k.name[:120], k.context, k.stream, k.graph, k.count, k.ns) for k in rec.kernels
    ]
    out["copies"] = [(k.kind, k.bytes, k.context, k.stream, k.count) for k in rec.copies]
    out["other"] = dict(
      contexts=rec.contexts_created,
      streams=rec.streams_created,
      graphs=rec.graph_launches,
      modules=rec.modules_loaded,
      lost=rec.lost,
    )
    del y, z, host
  return out


def _host() -> dict:
  from verifier.check import host_sampler

  with open("/proc/sys/kernel/perf_event_paranoid") as f:
    out = {"perf_event_paranoid": f.read().strip(), "uid": os.getuid()}
  r, w = os.pipe()
  code = f"import os, numpy as np\nos.read({r}, 1)\na = np.random.rand(1 << 20)\nfor _ in range(200): np.sqrt(a, out=a)\n"
  child = subprocess.Popen([sys.executable, "-c", code], pass_fds=(r,))
  try:
    time.sleep(1.0)
    s = host_sampler.HostSampler.attach(child.pid)
    t0 = time.monotonic_ns()
    os.write(w, b"x")
    child.wait(60)
    counts = s.count(t0, time.monotonic_ns())
    s.close()
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:4]
    out["samples"] = sum(counts.values())
    out["top"] = [(os.path.basename(p), n) for p, n in top]
  except Exception as e:  # noqa: BLE001 - reported
    out["error"] = f"{type(e).__name__}: {e}"
  finally:
    child.kill()
  return out


def _tasks() -> dict:
  from verifier.sandbox import confine
  from verifier.sandbox.task_limits import CgroupTree

  tree = CgroupTree.create(f"dice-verifier-probe-{os.getpid()}")
  out = {
    "uid": os.geteuid(),
    "kernel": os.uname().release,
    "cgroup": f"v{tree.version} at {tree.pids}" if tree else f"none ({CgroupTree.why})",
    "pid_max_per_namespace": confine._kernel_at_least(6, 14),
  }
  if tree is not None:
    tree.close()
  return out


if __name__ == "__main__":
  report = {}
  for name, fn in (("tasks", _tasks), ("host", _host), ("device", _device)):
    try:
      report[name] = fn()
    except Exception as e:  # noqa: BLE001 - reported
      report[name] = {"error": f"{type(e).__name__}: {e}"}
  print(json.dumps(report, indent=1))
