"""DICE's published KernelBench numbers (project-page tables v1, 29 Jan 2026; DICE, arXiv 2602.11715).

Percentages of the problems of a level (L1 = 100, L2 = 100, L3 = 50 problems): Exec, fast_1, fast_2
against PyTorch eager, one greedy sample per problem. SDAR-Chat of the same size is the untrained base.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PublishedRow:
  model: str
  size: str
  levels: dict[int, tuple[float, float, float]]  # level -> (exec, fast_1, fast_2), in percent


PUBLISHED = (
  PublishedRow("DICE", "8B", {1: (40.0, 9.0, 5.0), 2: (39.0, 14.0, 0.0), 3: (16.0, 8.0, 4.0)}),
  PublishedRow("DICE", "4B", {1: (27.0, 13.0, 4.0), 2: (24.0, 15.0, 9.0), 3: (12.0, 6.0, 4.0)}),
  PublishedRow("DICE", "1.7B", {1: (24.0, 12.0, 3.0), 2: (6.0, 3.0, 2.0), 3: (10.0, 6.0, 4.0)}),
  PublishedRow("SDAR-Chat", "8B", {1: (6.0, 2.0, 1.0), 2: (2.0, 0.0, 0.0), 3: (0.0, 0.0, 0.0)}),
  PublishedRow("SDAR-Chat", "4B", {1: (5.0, 0.0, 0.0), 2: (1.0, 0.0, 0.0), 3: (4.0, 0.0, 0.0)}),
  PublishedRow("SDAR-Chat", "1.7B", {1: (0.0, 0.0, 0.0), 2: (0.0, 0.0, 0.0), 3: (0.0, 0.0, 0.0)}),
)

# Parameter counts (embeddings included) of the SDAR/Qwen3 sizes: 1.7B has 2.03e9, 4B 4.41e9, 8B 8.19e9.
_SIZE_RANGES = (("1.7B", 1.0e9, 3.0e9), ("4B", 3.0e9, 6.0e9), ("8B", 6.0e9, 11.0e9))


def size_class(num_params: int) -> str | None:
  """The published size a model of ``num_params`` parameters is compared with, or None."""
  for name, lo, hi in _SIZE_RANGES:
    if lo <= num_params < hi:
      return name
  return None


def rows_for(num_params: int) -> list[PublishedRow]:
  """DICE's and SDAR-Chat's rows of the model's size (empty: no published row)."""
  size = size_class(num_params)
  return [r for r in PUBLISHED if r.size == size]
