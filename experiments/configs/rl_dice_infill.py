"""DICE's BiC-RL kernel-infilling phase (reference §1.7 table, `rl_sdar_kernel_infilling-*.yaml`).

20 RL steps x 64 tasks x 16 rollouts of DICE's infilling tasks in file order: the reference, the
kernel file's prefix and suffix in the prompt, the whole file emitted; prompts up to 2,000 tokens,
4,096 new tokens, binary reward, AdamW 1e-6 constant, 256 rows per optimizer step. Start from the
SFT model (`--init_hf=SFT_HF` or `--init_checkpoint=SFT_RUN`); the end-to-end phase then starts
from this run (`rl_dice_e2e`). DICE's sizes differ only in `max_active` (16 / 32 / 32 for
1.7B / 4B / 8B), which `groups_per_batch` replaces.

DICE trains on `kernel_infilling_992.json`, which the released snapshot lacks (only the 99-task
`kernel_infilling_evaluation.json` is there): pass `--set=infill_tasks=FILE`; with the
evaluation file the 99 tasks are no longer held out.
The update's micro-batches and remat policy are chosen at start-up from its memory estimate
(`dice_jax/rl/memory.py`, `accum_steps=0`, `update_remat='auto'`): a setting that does not fit is
refused before the rollout, naming it and its estimate.
"""

import dataclasses

from dice_jax.recipe import apply_recipe
from dice_jax.rl.config import dice_phase_config
from experiments.data_root import data_path


def get_config():
  cfg = dice_phase_config(
    "infill",
    "sdar_1p7b",
    infill_tasks=data_path("dice_rl", "kernel_infilling_992.json"),
    model_overrides={"dtype": "bfloat16", "param_dtype": "float32", "attention_impl": "flash"},
    tokenizer=data_path("sdar_chat"),
  )
  # DICE's evaluation set of this phase, every 10 RL steps (eval_every of the dice recipe)
  cfg = apply_recipe(cfg, "dice")
  return dataclasses.replace(
    cfg, eval_tasks=data_path("dice_rl", "kernel_infilling_evaluation.json")
  )  # docs/dice_recipe.md: DICE's recipe, item by item
