"""Issue 37: why the zero-copy host candidate (its own kernel copies the input to pinned host memory,
numpy computes the ReLU there, its kernel copies it back) got reward 1 on the H200 (2026-12-03): verifies
it and the numpy-host and honest ReLU candidates one at a time, printing each verdict and the service's
host-evidence phases (own, foreign, excess, allowed, drift ms). Run on a GPU host from the repository
root: PYTHONPATH=$PWD:$PWD/tests/verifier python3 experiments/gpu/zero_copy_probe.py"""

import asyncio
import json
import sys
import tempfile

import torch
import verifier_gpu_evidence_cases as ev

from verifier.api.contract import VerifyOptions, VerifyRequest
from verifier.serve.service import ServiceConfig, VerifierService, default_compile_workers


async def main() -> None:
  root = tempfile.mkdtemp()
  major, minor = torch.cuda.get_device_capability(0)
  cfg = ServiceConfig(
    device="cuda",
    gpus=("0",),
    slots_per_gpu=1,
    compile_workers=default_compile_workers(),
    cache_dir=f"{root}/builds",
    scratch_root=f"{root}/scratch",
    arch_list=f"{major}.{minor}",
  )
  svc = VerifierService(cfg)
  await svc.start()
  opts = VerifyOptions(device="cuda", timeout_s=120, num_correct_trials=ev.TRIALS)
  try:
    for name in ("ZERO_COPY_HOST", "NUMPY_HOST", "GOOD_RELU"):
      before = dict(svc.metrics.run_phase_s), dict(svc.metrics.run_phase_n)
      r = await svc.verify(VerifyRequest(name, name, ev.RELU_REFERENCE, getattr(ev, name), opts))
      phases = {
        k: round(svc.metrics.run_phase_s[k] - before[0].get(k, 0.0), 3)
        for k in svc.metrics.run_phase_s
        if k.startswith("host_") and svc.metrics.run_phase_n[k] > before[1].get(k, 0)
      }
      print(
        json.dumps(
          dict(
            name=name,
            kind=r.failure_kind.value,
            reward=r.reward,
            reason=r.reason[:600],
            warnings=r.warnings,
            phases=phases,
          )
        ),
        flush=True,
      )
  finally:
    await svc.close()


if __name__ == "__main__":
  sys.exit(asyncio.run(main()))
