"""sdar_8b's programs compiled ahead of time for real TPU slices from this CPU host, at the recipe's
settings and full size (the module docstring of `test_tpu_compile.py` says what is checked and
why): the SFT step and the RL update on a v5p-8, the sampler's decode step on a v5p-16. In a file of
their own so that `make test`'s two workers share the minutes these compiles take (pytest's
`--dist loadfile` gives a file to one worker).
"""

import pytest

from dice_jax import tpu_topology

_MISSING = tpu_topology.libtpu_missing()
if _MISSING:
  pytest.skip(_MISSING, allow_module_level=True)

from dice_jax import tpu_memory  # noqa: E402

from ._tpu_compile import (  # noqa: E402
  assert_compiled_within_hbm,
  assert_rl_row,
  assert_sft_row,
  compiled_row,
)


def test_sft_step_of_sdar_8b_fits_a_v5p_8_with_the_mosaic_kernels():
  row = compiled_row("sdar_8b", "v5p-8", "sft")
  assert_sft_row(row, chips=4)


def test_rl_update_of_sdar_8b_fits_a_v5p_8_and_the_planner_is_above_it_by_under_15_percent():
  row = compiled_row("sdar_8b", "v5p-8", "rl")
  # jax 0.10.2 / libtpu 0.0.42.1: planner 46.06 GiB, compiler 45.53 GiB (x1.01; its TPU model)
  assert_rl_row(row)


def test_sampler_decode_of_sdar_8b_fits_a_v5p_16_with_the_cache_kernel():
  """64 slots over the 8 chips of a `v5p:2x2x2` (the only 3-D topology here), all 36 layers (the
  decode step unrolls them: two kernel calls each)."""
  row = compiled_row("sdar_8b", "v5p-16", "decode")
  assert_compiled_within_hbm(row)
  assert row.kernels == {"bd_flash_tpu_fwd": 2 * tpu_memory.model_config("sdar_8b").num_layers}
  # 9.46 GiB against the compiler's 9.67 (jax 0.10.2 / libtpu 0.0.42.1; 18.92 / 19.20 on a v5p-8)
  assert abs(row.estimate / row.memory.peak - 1) < 0.15, (row.estimate, row.memory)
  # no copy of the cache among the temporaries (0.36 GiB; 14.73 with the `[L, B, S, K, H]` cache)
  assert row.memory.temps < 0.25 * row.memory.arguments, row.memory
