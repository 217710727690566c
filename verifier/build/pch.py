"""Precompiled torch headers for the g++ half (``main.cpp``) of candidate builds.

Every ``load_inline`` build compiles a ``main.cpp`` that starts with ``#include <torch/extension.h>``; on the
H200 host that parse is most of its 16-19 s (issue 4: 15.6 s at -O0, 6.7 s with a g++ precompiled header and
-O0). torch's own ``load_inline(use_pch=True)`` keeps one ``extension.h.gch`` inside the torch install and any
build without ``use_pch`` deletes it, so it cannot serve concurrent builds. Here a PCH lives in the build cache,
one per flag set and set of torch headers (:func:`pch_dir`; the split build's main.cpp may start with the
lean set, ``split_build.LEAN_TORCH_INCLUDES``):

    <build_root>/pch/<key>/dice_torch.h       #include <torch/extension.h>  (or the lean set)
    <build_root>/pch/<key>/dice_torch.h.gch   built with the exact cflags ninja used for such a main.cpp

Every main.cpp of that flag set is compiled with ``-include <dir>/dice_torch.h``. g++ loads the ``.gch``
when it exists and matches the command line, and otherwise parses the header as usual: the result is the
same program either way (the header is guarded and main.cpp includes it first anyway), only the time
differs. After a build that found no ``.gch``, :func:`request_from_build` reads the flags from its
``build.ninja``; the service then runs :func:`build` once in a build worker, which publishes the ``.gch`` by an
atomic rename, so a build never sees a half-written one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import time
import uuid

HEADER = "dice_torch.h"
PCH_VERSION = 1
FULL_INCLUDES = "#include <torch/extension.h>"  # what a stock load_inline main.cpp starts with
EXTENSION_INCLUDE = re.compile(
  r"#\s*include\s*[<\"]torch/extension\.h[>\"]"
)  # that include, however spaced

# A tiny extension with no extra flags: building it reports the PCH request of flag-less builds, the flag set
# of DICE's solutions and of KernelBench's one-shot example (its ``extra_cflags=[""]`` adds nothing), so the
# service can build that PCH before the first burst of candidates (``VerifierService.warm_pch``).
_SEED_CUDA = r"""
#include <torch/extension.h>
__global__ void dj_pch_seed_kernel(float* x, int64_t n) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) x[i] += 1.0f;
}
torch::Tensor dj_pch_seed(torch::Tensor x) {
  auto y = x.clone();
  dj_pch_seed_kernel<<<(y.numel() + 255) / 256, 256>>>(y.data_ptr<float>(), y.numel());
  return y;
}
"""


def seed_params(with_cuda: bool) -> dict:
  """``load_inline`` arguments of the seed extension (a CUDA kernel when ``with_cuda``)."""
  if with_cuda:
    return {
      "name": "dj_pch_seed_cuda",
      "cpp_sources": "torch::Tensor dj_pch_seed(torch::Tensor x);",
      "cuda_sources": _SEED_CUDA,
      "functions": ["dj_pch_seed"],
    }
  return {
    "name": "dj_pch_seed_cpu",
    "cpp_sources": "torch::Tensor dj_pch_seed(torch::Tensor x) { return x + 1; }",
    "functions": ["dj_pch_seed"],
  }


def pch_dir(
  build_root: str,
  extra_cflags: list[str],
  extra_include_paths,
  with_cuda: bool,
  toolchain: dict,
  includes: str = FULL_INCLUDES,
) -> str:
  """Directory of the PCH of ``includes`` for main.cpp files compiled with these flags (the ninja cflags
  depend only on them, the toolchain and the extension name, which the PCH does not use)."""
  payload = json.dumps(
    {
      "v": PCH_VERSION,
      "includes": includes,
      "cflags": [str(f) for f in extra_cflags if str(f).strip()],  # "" adds nothing to the command
      "inc": list(extra_include_paths or []),
      "cuda": bool(with_cuda),
      "toolchain": toolchain,
    },
    sort_keys=True,
    default=str,
  )
  return os.path.join(build_root, "pch", hashlib.sha256(payload.encode()).hexdigest()[:24])


def include_flags(directory: str, includes: str = FULL_INCLUDES) -> list[str]:
  """``extra_cflags`` that make g++ use the PCH of ``includes`` (or the plain headers while there is none
  yet); ``directory`` comes from :func:`pch_dir` with the same ``includes``."""
  os.makedirs(directory, exist_ok=True)
  header = os.path.join(directory, HEADER)
  if not os.path.exists(header):
    tmp = f"{header}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
      f.write(f"#pragma once\n{includes}\n")
    os.replace(tmp, header)
  return ["-include", header]


_KEY = re.compile(r"^[0-9a-f]{24}$")  # pch_dir's names


def stored(build_root: str) -> set[str]:
  """The PCH directories kept under ``build_root`` (built, or being built), by path."""
  root = os.path.join(build_root, "pch")
  try:
    names = os.listdir(root)
  except FileNotFoundError:
    return set()
  return {os.path.join(root, n) for n in names if _KEY.match(n)}


def ready(directory: str) -> bool:
  return os.path.exists(os.path.join(directory, HEADER + ".gch"))


def _ninja_vars(build_dir: str) -> dict[str, str]:
  out = {}
  with open(os.path.join(build_dir, "build.ninja")) as f:
    for line in f:
      m = re.match(r"^(\w+)\s*=\s*(.*)$", line.rstrip("\n"))
      if m:
        out[m.group(1)] = m.group(2)
  return out


def request_from_build(build_dir: str, directory: str) -> dict | None:
  """The PCH build command for ``directory``, from the cflags ninja used in ``build_dir``; None if the build
  has no main.cpp compile rule we understand."""
  try:
    v = _ninja_vars(build_dir)
  except OSError:
    return None
  if "cflags" not in v or "cxx" not in v:
    return None
  header = os.path.join(directory, HEADER)
  flags, skip = [], False
  for tok in shlex.split(v["cflags"]) + shlex.split(v.get("post_cflags", "")):
    if skip:
      skip = False
      continue
    if tok == "-include":
      skip = True  # our own -include of the header being precompiled
      continue
    if tok.startswith("-DTORCH_EXTENSION_NAME="):
      continue  # differs per extension; the torch headers never read it
    flags.append(tok)
  return {"dir": directory, "header": header, "command": shlex.split(v["cxx"]) + flags}


def accepted(command: list[str], header: str, gch: str) -> bool:
  """Whether g++ loads ``gch`` for ``-include header`` under ``command``'s flags (``-H`` marks a used PCH
  with '!'); an unusable PCH is silently ignored by g++, so this is checked before publishing one."""
  probe_dir = os.path.dirname(gch)
  probe = os.path.join(probe_dir, f"probe-{uuid.uuid4().hex[:8]}")
  os.makedirs(probe, exist_ok=True)
  try:
    os.symlink(gch, os.path.join(probe, HEADER + ".gch"))
    with open(os.path.join(probe, HEADER), "w") as f:
      f.write(open(header).read())
    p = subprocess.run(
      list(command)
      + ["-H", "-fsyntax-only", "-include", os.path.join(probe, HEADER), "-x", "c++", "-"],
      input="int dice_probe;\n",
      capture_output=True,
      text=True,
      timeout=120,
    )
    return p.returncode == 0 and any(
      line.startswith("! ") and line.endswith(HEADER + ".gch") for line in p.stderr.splitlines()
    )
  except (OSError, subprocess.TimeoutExpired):
    return False
  finally:
    shutil.rmtree(probe, ignore_errors=True)


def build(request: dict, timeout_s: float = 600.0) -> dict:
  """Compile the PCH and publish it atomically. Returns {"ok", "seconds", "error"}."""
  header = request["header"]
  final = header + ".gch"
  if os.path.exists(final):
    return {"ok": True, "seconds": 0.0, "error": "", "existed": True}
  tmp = f"{final}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
  cmd = list(request["command"]) + ["-x", "c++-header", header, "-o", tmp]
  t0 = time.monotonic()
  try:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if p.returncode != 0:
      return {
        "ok": False,
        "seconds": time.monotonic() - t0,
        "error": (p.stderr or p.stdout)[-2000:],
      }
    if not accepted(request["command"], header, tmp):
      return {
        "ok": False,
        "seconds": time.monotonic() - t0,
        "error": "g++ does not accept the precompiled header under the build's own flags",
      }
    os.replace(tmp, final)
    return {"ok": True, "seconds": time.monotonic() - t0, "error": ""}
  except (OSError, subprocess.TimeoutExpired) as e:
    return {"ok": False, "seconds": time.monotonic() - t0, "error": f"{type(e).__name__}: {e}"}
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
