"""Tiny model, byte tokenizer, DICE infilling-eval tasks paired with their known solutions.

A CPU-sized run whose loss visibly falls: texts truncated to fit 1024-token rows, a higher
learning rate than DICE's 1e-5 (a fresh 0.1M-parameter model, not a fine-tune).
"""

from dice_jax.train.config import SFTConfig
from dice_jax.train.optimizer import OptimizerConfig
from dice_jax.train.run_config import RunConfig
from experiments.data_root import data_path


def get_config() -> SFTConfig:
  return SFTConfig(
    run=RunConfig(model="tiny", model_overrides={"dtype": "float32"}, checkpoint_every=50),
    data_source="infill_pairs",
    data_path=data_path("dice_rl", "kernel_infilling_evaluation.json"),
    max_prompt_chars=384,
    max_response_chars=512,
    seq_len=1024,
    batch_size=8,
    num_steps=150,
    optim=OptimizerConfig(
      learning_rate=3e-3, schedule="cosine", warmup_ratio=0.05, end_lr_ratio=0.1, weight_decay=0.01
    ),
    log_every=10,
  )
