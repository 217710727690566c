"""CuKe builder against the real verifier service (CPU device, C++ extension), via dice_jax.verifier_client.ThreadedVerifier."""

import json
import os
import subprocess
import sys

import pytest

from ._helpers import REPO_ROOT

REFERENCE = """import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        return torch.relu(a - b)


def get_inputs():
    return [torch.randn(32, 128), torch.randn(32, 128)]


def get_init_inputs():
    return []
"""

CANDIDATE = '''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = r"""
#include <torch/extension.h>
torch::Tensor relu_sub(torch::Tensor a, torch::Tensor b) {
    auto out = torch::empty_like(a);
    const float* pa = a.data_ptr<float>(); const float* pb = b.data_ptr<float>(); float* po = out.data_ptr<float>();
    // repeated: a call well above what the CPU clock resolves through the exchange (~1 ms, more
    // under load: at 400 repeats it was reported unmeasurable once in a loaded CI), so it has a speedup
    for (int r = 0; r < 4000; ++r) {
        for (int64_t i = 0; i < a.numel(); ++i) { float d = pa[i] - pb[i]; po[i] = d > 0.f ? d : 0.f; }
        asm volatile("" ::: "memory");
    }
    return out;
}
torch::Tensor relu_add(torch::Tensor a, torch::Tensor b) {
    auto out = torch::empty_like(a);
    const float* pa = a.data_ptr<float>(); const float* pb = b.data_ptr<float>(); float* po = out.data_ptr<float>();
    for (int64_t i = 0; i < a.numel(); ++i) { float d = pa[i] + pb[i]; po[i] = d > 0.f ? d : 0.f; }
    return out;
}
"""
ops = load_inline(name="dj_cuke_ops", cpp_sources=source, functions=["relu_sub", "relu_add"], extra_cflags=["-O2"])


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        return ops.FUNC(a, b)
'''


@pytest.fixture(scope="module")
def cpu_verifier(tmp_path_factory):
  pytest.importorskip("torch", reason="the verifier service needs torch")
  from verifier.serve.local import LocalVerifier

  with LocalVerifier(
    str(tmp_path_factory.mktemp("verifier")), device="cpu", start_timeout_s=90
  ) as v:
    yield v.address


@pytest.mark.slow
def test_build_cuke_with_cpu_verifier(cpu_verifier, tmp_path):
  from dice_jax.data.cuke import CukeConfig, build_cuke
  from dice_jax.verifier_client import ThreadedVerifier

  rows = [
    {
      "id": "right",
      "pytorch_code": REFERENCE,
      "cuda_code": CANDIDATE.replace("FUNC", "relu_sub"),
      "level": 1,
    },
    {
      "id": "wrong",
      "pytorch_code": REFERENCE,
      "cuda_code": CANDIDATE.replace("FUNC", "relu_add"),
      "level": 1,
    },
  ]
  pairs = tmp_path / "pairs.jsonl"
  pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
  with ThreadedVerifier(
    cpu_verifier, options={"measure_performance": True, "num_perf_trials": 10}, token=""
  ) as client:
    client.wait_ready(30)
    s = build_cuke(str(pairs), client, str(tmp_path / "out"), CukeConfig(min_speedup=1e-6))
  m = {
    r["pair_id"]: r
    for r in map(json.loads, (tmp_path / "out" / "measurements.jsonl").read_text().splitlines())
  }
  assert m["pairs/right"]["correct"] and m["pairs/right"]["speedup"] > 0
  assert not m["pairs/wrong"]["correct"] and m["pairs/wrong"]["failure_kind"] == "wrong_output"
  assert (s.correct, s.kept) == (1, 1)
  kept = [json.loads(line) for line in (tmp_path / "out" / "cuke.jsonl").read_text().splitlines()]
  assert [r["id"] for r in kept] == ["pairs/right"] and kept[0]["speedup"] == m["pairs/right"][
    "speedup"
  ]


@pytest.mark.slow
def test_build_cuke_cli_resumes(cpu_verifier, tmp_path):
  rows = [
    {
      "id": "right",
      "pytorch_code": REFERENCE,
      "cuda_code": CANDIDATE.replace("FUNC", "relu_sub"),
      "level": 2,
    }
  ]
  pairs = tmp_path / "pairs.jsonl"
  pairs.write_text(
    "".join(json.dumps(r) + "\n" for r in rows) + '{"id": "bad", "pytorch_code": 3}\n'
  )
  cmd = [
    sys.executable,
    "-m",
    "experiments.build_cuke",
    f"--pairs={pairs}",
    f"--verifier={cpu_verifier}",
    "--min_speedup=0.00001",
    f"--out={tmp_path / 'out'}",
    "--num_perf_trials=5",
  ]
  env = {**os.environ, "VERIFIER_TOKEN": ""}
  first = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env)
  assert first.returncode == 0, first.stderr[-3000:]
  assert "invalid rows: 1" in first.stdout and "measured now: 1" in first.stdout
  assert "kept (>= 1e-05x): 1  by level: {'2': 1}" in first.stdout
  again = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env)
  assert again.returncode == 0 and "measured now: 0  resumed: 1" in again.stdout
