"""Why a Landlock-confined candidate worker fails to start CUDA on the H200 host (cudaGetDeviceCount error
304 since session 11; the pool then drops Landlock for every candidate worker).

Each probe is a fresh process that applies only the worker's Landlock ruleset (``confine.landlock``, the
same rules a worker gets) and then calls ``cuInit`` through the driver API; on failure it tries to open
every device node and driver file CUDA uses and prints each denial. ``--writable PATH`` runs one more
probe with PATH writable in the same ruleset (one ruleset: a second one could only restrict further), to
test a fix.

  python3 -m experiments.gpu.landlock_cuda_probe [--writable /dev/shm ...]
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

PATHS = (
  ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset"]
  + sorted(glob.glob("/dev/nvidia[0-9]*"))
  + sorted(glob.glob("/dev/nvidia-caps/*"))
  + ["/proc/driver/nvidia/params", "/proc/driver/nvidia/capabilities/mig/config"]
  + sorted(glob.glob("/proc/driver/nvidia/gpus/*/information"))
)


def probe(extra: list[str]) -> dict:
  from verifier.sandbox import confine

  scratch = tempfile.mkdtemp(prefix="landlock-probe-")
  os.environ.update(HOME=scratch, TMPDIR=scratch)  # as a worker's scrubbed environment has them
  spec = confine.SandboxSpec(writable=(scratch, *extra), mount_namespace=False, scratch=scratch)
  notes = confine.landlock(spec)
  out = {"notes": notes}
  cuda = ctypes.CDLL("libcuda.so.1")
  out["cuInit"] = int(cuda.cuInit(0))
  count = ctypes.c_int(0)
  out["cuDeviceGetCount"] = int(cuda.cuDeviceGetCount(ctypes.byref(count)))
  out["devices"] = count.value
  denied = {}
  for p in PATHS:
    for flags, name in ((os.O_RDONLY, "read"), (os.O_RDWR, "readwrite")):
      try:
        os.close(os.open(p, flags))
      except OSError as e:
        denied[f"{p} ({name})"] = e.strerror
  for d in ("/dev/shm", "/tmp", scratch):
    try:
      fd, path = tempfile.mkstemp(dir=d)
      os.close(fd)
      os.unlink(path)
    except OSError as e:
      denied[f"{d} (create a file)"] = e.strerror
  out["denied"] = denied
  return out


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--child", action="store_true")
  ap.add_argument("--writable", action="append", default=[])
  a = ap.parse_args()
  if a.child:
    print(json.dumps(probe(a.writable)))
    return
  # also inside a user and network namespace, as the fork server puts every worker
  prefixes = [("", [])]
  if shutil.which("unshare"):
    prefixes.append(("userns ", ["unshare", "--user", "--map-root-user", "--net"]))
  for where, prefix in prefixes:
    for label, paths in (("worker rules", []), *[(f"+ {w} writable", [w]) for w in a.writable]):
      args = prefix + [sys.executable, "-m", "experiments.gpu.landlock_cuda_probe", "--child"]
      for w in paths:
        args += ["--writable", w]
      p = subprocess.run(args, capture_output=True, text=True, timeout=120)
      print(where + label, "->", p.stdout.strip() or p.stderr[-1500:], flush=True)


if __name__ == "__main__":
  main()
