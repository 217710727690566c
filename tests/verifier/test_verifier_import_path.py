"""The local verifier started from a relative `PYTHONPATH` where the project is not pip-installed
(issue 36, item 4): its checkers, fork servers and static-check processes start in scratch
directories of their own, so they need the caller's import path as absolute paths.

The dev and CI environments have the project installed editable, which would find `verifier` from
any directory and hide the bug; the service here runs under a bare virtual environment whose only
packages are this interpreter's site-packages, added by a `.pth` line (so the editable install's own
`.pth` hook is never run there).
"""

import json
import os
import pathlib
import site
import subprocess
import sys
import venv

import pytest

pytest.importorskip("torch", reason="the verifier service needs torch")
pytest.importorskip("grpc", reason="the verifier service needs grpcio")

from verifier.sandbox.import_path import IMPORT_ROOT, child_pythonpath  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
REFERENCE = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn(8, 8)]


def get_init_inputs():
    return []
"""
# Starts the service, sends one candidate that the static check refuses (a syntax error: answered
# by a static-check process, no compiler), prints the failure kind.
CLIENT = """
import asyncio, sys
from verifier.api.client import VerifierClient
from verifier.serve.local import LocalVerifier

async def ask(address):
  return await VerifierClient(address, token="").submit("t", sys.argv[2], "class ModelNew(:\\n")

with LocalVerifier(sys.argv[1], device="cpu", extra_args=("--no-pch",)) as v:
  print("kind", asyncio.run(ask(v.address)).failure_kind.value)
"""


def bare_venv(path: pathlib.Path) -> pathlib.Path:
  """A venv whose site-packages holds one `.pth` line per site-packages of this interpreter."""
  venv.EnvBuilder(with_pip=False, symlinks=True).create(path)
  (purelib,) = path.glob("lib/python*/site-packages")
  (purelib / "base.pth").write_text("".join(p + "\n" for p in site.getsitepackages()))
  return path / "bin" / "python"


def test_child_pythonpath_is_absolute_and_starts_at_the_import_root(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  got = child_pythonpath(os.pathsep.join([".", "", "deps", str(tmp_path)])).split(os.pathsep)
  assert got == [IMPORT_ROOT, str(tmp_path), str(tmp_path / "deps")]
  assert (pathlib.Path(IMPORT_ROOT) / "verifier" / "__init__.py").is_file()


def test_local_verifier_starts_from_a_relative_pythonpath_without_the_project_installed(tmp_path):
  python = bare_venv(tmp_path / "venv")
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
  absent = subprocess.run(
    [python, "-c", "import verifier"], cwd=tmp_path, env=env, capture_output=True, text=True
  )
  assert "No module named 'verifier'" in absent.stderr  # not installed there: the test means it
  out = subprocess.run(
    [python, "-c", CLIENT, str(tmp_path / "service"), REFERENCE],
    cwd=REPO,
    env={**env, "PYTHONPATH": "."},
    capture_output=True,
    text=True,
    timeout=240,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split() == ["kind", "SYNTAX_ERROR"], out.stdout


def test_bench_rl_reports_why_the_local_verifier_did_not_start(tmp_path):
  """Was `KeyError: 'server'`: the start-up error is now raised and written to bench_rl.json."""
  code = (
    "import os, sys\nfrom absl import flags\nfrom experiments import bench_common, bench_rl\n"
    "flags.FLAGS(['bench_rl', '--out=' + sys.argv[1], '--verifier_args=--no-such-option'])\n"
    "report = bench_common.Report(os.path.join(sys.argv[1], 'bench_rl.json'), 'bench_rl')\n"
    "thread, holder = bench_rl.start_verifier()\n"
    "bench_rl.local_verifier(thread, holder, report)\n"
  )
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  out = subprocess.run(
    [sys.executable, "-c", code, str(tmp_path)],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=240,
  )
  assert out.returncode == 1 and "KeyError" not in out.stderr, out.stderr[-3000:]
  assert "VerifierStartError: local verifier did not start" in out.stderr, out.stderr[-3000:]
  error = json.loads((tmp_path / "bench_rl.json").read_text())["verifier_error"]
  assert error.startswith("VerifierStartError") and "--no-such-option" in error, error
