"""Fixtures for the data tests."""

import pytest

from ._helpers import shared_path, write_tiny_tokenizer_dir


@pytest.fixture(scope="session")
def sdar_dir():
  return shared_path("sdar_chat")


@pytest.fixture(scope="session")
def sdar_tokenizer(sdar_dir):
  from dice_jax.data.tokenizer import Tokenizer

  return Tokenizer.from_dir(sdar_dir)


@pytest.fixture()
def tiny_tokenizer_dir(tmp_path):
  return write_tiny_tokenizer_dir(tmp_path / "tiny_tok")


@pytest.fixture()
def tiny_tokenizer(tiny_tokenizer_dir):
  from dice_jax.data.tokenizer import Tokenizer

  return Tokenizer.from_dir(tiny_tokenizer_dir)
