"""DICE's SFT recipe, exactly (docs/dice_recipe.md items 10-13), for SDAR-1.7B on CuKe.

`recipe="dice"`: SDAR's absolute block grid (the prompt's tail shares a block with the response's
start, each sample padded to a multiple of 4), SDAR's "at least one masked token" per packed row
(redraw the row up to 10 times, then force one), and the loss divided by each device
micro-batch's answer tokens then averaged over devices: DICE's 8 GPUs x 2 rows (1.7B) are 8 groups
of `device_rows=2` in a batch of 16. LLaMA-Factory's `sdar_1.7b_full.yaml`: lr 1e-5, constant after
3% warm-up, wd 0, clip 1.0, cutoff 6144 with over-long samples dropped, 3 epochs: set
`--set=num_steps=` to 3 epochs of packed rows / 16. `--set=recipe=ours` gives our defaults.
"""

from dice_jax.diffusion.objective import ObjectiveConfig
from dice_jax.recipe import apply_recipe
from experiments.configs import sdar_1p7b

DEVICE_ROWS = 2  # per_device_train_batch_size of DICE's 1.7B yaml (4B / 8B: 1)


def get_config(device_rows: int = DEVICE_ROWS, model: str = "sdar_1p7b", batch_size: int = 16):
  import dataclasses

  base = sdar_1p7b.get_config()
  cfg = dataclasses.replace(
    base,
    run=dataclasses.replace(base.run, model=model),
    batch_size=batch_size,
    objective=ObjectiveConfig(device_rows=device_rows),
    max_sample_len=6143,  # LLaMA-Factory packing: cutoff_len - 1; rows of 6144
  )
  return apply_recipe(cfg, "dice")
