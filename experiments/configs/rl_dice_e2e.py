"""DICE's BiC-RL end-to-end phase (reference §1.7 table, `rl_sdar_kernel_final-*.yaml`).

100 RL steps x 64 tasks x 16 rollouts of DICE's 4,000 end-to-end tasks in file order (sorted
level 0/1 -> 2 -> 3), KernelBench's one-shot prompt (DICE's raw string), prompts up to 1,500
tokens, 4,096 new tokens, binary reward, AdamW 1e-6 constant, 256 rows per optimizer step.
Initialise from the infilling phase: `--init_checkpoint=INFILL_RUN`. The model size comes from
the checkpoint (`--init_hf` / `--init_checkpoint`); DICE's sizes differ only in the rollout
engine's concurrency (`max_active` 20 / 20 / 48 for 1.7B / 4B / 8B), which `groups_per_batch`
replaces (8 groups = 128 rows per sampler call on one GPU).
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
    "e2e",
    "sdar_1p7b",
    e2e_tasks=data_path("dice_rl", "end_to_end_kernel_generation_4000.json"),
    model_overrides={"dtype": "bfloat16", "param_dtype": "float32", "attention_impl": "flash"},
    tokenizer=data_path("sdar_chat"),
  )
  # DICE's evaluation set of this phase, every 10 RL steps (eval_every of the dice recipe)
  cfg = apply_recipe(cfg, "dice")
  return dataclasses.replace(
    cfg, eval_tasks=data_path("dice_rl", "kernelbench_level1.json")
  )  # docs/dice_recipe.md: DICE's recipe, item by item
