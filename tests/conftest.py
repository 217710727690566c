"""Test-wide setup: 8 fake CPU devices (set before JAX initialises), shared data location."""

import os
import pathlib

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data():
  """`../shared/data` (present in CI and dev checkouts, absent for users): skip when missing."""
  if not SHARED_DATA.is_dir():
    pytest.skip(f"shared data not found at {SHARED_DATA} (only dev/CI checkouts have it)")
  return SHARED_DATA


@pytest.fixture
def umask_022():
  """The usual umask (files 0644, directories 0755) for tests of output permissions."""
  old = os.umask(0o022)
  yield
  os.umask(old)
