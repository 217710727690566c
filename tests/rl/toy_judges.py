"""Judges for launcher tests (`judge="python:tests.rl.toy_judges:NAME"`): cheap, deterministic
verdicts with variance across samples, so groups are kept and updates happen on CPU."""


def byte_parity(task_id: str, reference: str, candidate: str) -> bool:
  """Correct iff the candidate's UTF-8 bytes sum to an even number (about half of the samples)."""
  return sum(candidate.encode()) % 2 == 0


def first_byte_low(task_id: str, reference: str, candidate: str) -> bool:
  """Correct iff the response starts with a byte below 128 (about half, for a random byte model)."""
  data = candidate.encode()
  return bool(data) and data[0] < 128
