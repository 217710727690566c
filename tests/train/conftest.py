"""Fixtures for the training tests."""

import pytest

from dice_jax.model.config import get_config


@pytest.fixture
def tiny_cfg():
  """The tiny preset computing in float32 (so sharded and unsharded runs agree to fp32 rounding)."""
  return get_config("tiny", dtype="float32")
