"""DICE's SFT recipe for SDAR-4B (as `sft_dice_1p7b`, docs/dice_recipe.md): 8 GPUs x 1 row per
device (`device_rows=1`), a batch of 8. `--set=num_steps=` for 3 epochs; `--init_hf=` SDAR-4B-Chat.
"""

from experiments.configs import sft_dice_1p7b


def get_config():
  return sft_dice_1p7b.get_config(device_rows=1, model="sdar_4b", batch_size=8)
