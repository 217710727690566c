"""Test-wide setup: JAX on 8 fake CPU devices (set before JAX initialises), except for a GPU run
(`pytest -m gpu`), where JAX keeps its GPU; shared data location; the `gpu` fixture."""

import gc
import os
import pathlib
import re
import subprocess
import sys

import pytest

_XLA_FLAGS_GIVEN = os.environ.get("XLA_FLAGS")
_FORCED_CPU = "JAX_PLATFORMS" not in os.environ


def cpu_xla_flags(given: str | None) -> str:
  """XLA_FLAGS for the CPU suite: 8 fake devices and the CPU backend at optimisation level 0, each
  unless the caller's flags set it. The suite's programs are tiny, so compiling them costs more than
  running them: level 0 took `test_sampler.py` from 190 s to 129 s (docs/performance.md, CI)."""
  flags = (given or "").split()
  if not any("host_platform_device_count" in f for f in flags):
    flags.append("--xla_force_host_platform_device_count=8")
  if not any("xla_backend_optimization_level" in f for f in flags):
    flags.append("--xla_backend_optimization_level=0")
  return " ".join(flags)


os.environ["XLA_FLAGS"] = cpu_xla_flags(_XLA_FLAGS_GIVEN)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

REPO = pathlib.Path(__file__).resolve().parents[1]


def gpu_session(markexpr: str) -> bool:
  """Whether `-m markexpr` selects the GPU tests (`gpu`, `gpu and not slow`; not `not gpu`)."""
  return bool(re.search(r"\bgpu\b", markexpr)) and not re.search(r"\bnot\s+gpu\b", markexpr)


def pytest_configure(config):
  """A GPU run undoes the CPU default (the conftest runs before `-m` is known)."""
  if _FORCED_CPU and gpu_session(config.getoption("markexpr") or ""):
    del os.environ["JAX_PLATFORMS"]
    # the GPU's programs keep XLA's own optimisation level
    os.environ["XLA_FLAGS"] = _XLA_FLAGS_GIVEN or "--xla_force_host_platform_device_count=8"
    if "jax" in sys.modules:  # imported by a conftest already, not yet initialised
      sys.modules["jax"].config.update("jax_platforms", None)


# The files with the most test time (seconds on the 2-core CI VM with three workers, 2026-12-08: the TPU
# compiles 645 and 454, the sampler's 421 and 285, ...), run first so that the workers end together rather
# than one running a long file alone at the end. `make test` passes `--no-loadscope-reorder`, so
# pytest-xdist keeps this order (by default it sends the files with the most tests first).
SLOW_FIRST = (
  "tests/train/test_tpu_compile.py",
  "tests/train/test_tpu_compile_8b.py",
  "tests/diffusion/test_sampler.py",
  "tests/diffusion/test_flash_decode.py",
  "tests/train/test_launcher_resume.py",
  "tests/model/test_flash_tpu_real.py",
  "tests/verifier/test_verifier_cli.py",
  "tests/launchers/test_user_errors.py",
  "tests/model/test_transformer.py",
  "tests/verifier/test_verifier_server_cpu.py",
)


def pytest_collection_modifyitems(config, items):
  """`SLOW_FIRST`'s files first, in its order; within a file and among the others, the collection's."""
  rank = {path: i for i, path in enumerate(SLOW_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(scope="module", autouse=True)
def _compiled_programs_freed():
  """A module's compiled programs are freed when it ends: the suite runs in three processes (pytest-xdist)
  on a 2-core host, and JAX's caches kept every program of ~900 tests (a worker reached ~8 GB)."""
  yield
  jax = sys.modules.get("jax")
  if jax is not None:
    jax.clear_caches()
  gc.collect()


@pytest.fixture(scope="session")
def gpu():
  """Fails (does not skip) a GPU test that finds no GPU: a skipped GPU test is one never run."""
  import jax

  if jax.default_backend() != "gpu":
    pytest.fail(
      f"JAX found no GPU (backend {jax.default_backend()!r}, devices {jax.devices()}); run the "
      "GPU tests on a host with an NVIDIA GPU and CUDA jaxlib: python3 -m pytest -m gpu"
    )
  return jax.devices()[0]


@pytest.fixture(scope="session")
def shared_data():
  """The data root (`$DICE_DATA_ROOT`, else `../shared/data`: present in CI and dev checkouts,
  absent for users): skip when missing."""
  from experiments.data_root import ENV, data_root

  root = data_root()
  if not root.is_dir():
    pytest.skip(f"data root not found at {root} (set ${ENV}; only dev/CI checkouts have it)")
  return root


@pytest.fixture
def umask_022():
  """The usual umask (files 0644, directories 0755) for tests of output permissions."""
  old = os.umask(0o022)
  yield
  os.umask(old)


@pytest.fixture
def reaped():
  """A list to put started processes in: whatever still runs when the test ends (a failed assertion, a
  guard's TimeoutExpired) is killed, so a failure costs its own test and not the CPU of the rest of the
  suite (they run in their own sessions: pytest's exit does not reach them)."""
  procs: list[subprocess.Popen] = []
  yield procs
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.wait(timeout=30)
