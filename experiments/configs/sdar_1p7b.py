"""DICE's SFT recipe for SDAR-1.7B on CuKe (reference §1.6): AdamW lr 1e-5, constant with 3%
warm-up, bf16 compute with fp32 master weights, cutoff 6144, block 4, 2 rows per device.

Attention is the mask-aware `flash` kernel (docs/learner-spec.md, "Training"; docs/performance.md, "Training (SFT)"); with rows of 4096 tokens
`--set=run.model_overrides.remat=False` is faster on an H200.
`num_steps` must be set for the dataset (3 epochs of packed rows / batch_size), e.g.
`--set=num_steps=...`; `--init_hf=` the SDAR-1.7B-Chat checkpoint.
"""

from dice_jax.train.config import SFTConfig
from dice_jax.train.optimizer import OptimizerConfig
from dice_jax.train.run_config import RunConfig
from experiments.data_root import data_path


def get_config() -> SFTConfig:
  return SFTConfig(
    run=RunConfig(
      model="sdar_1p7b",
      # H200: 2 rows of 4096 (8192 input) fit without remat (98 GiB); rows of 6144 need remat
      model_overrides={"attention_impl": "flash", "remat": True},
      tokenizer=data_path("sdar_chat"),
      checkpoint_every=200,
    ),
    data_source="cuke",
    data_path="",
    seq_len=6144,
    batch_size=16,
    num_steps=1000,
    optim=OptimizerConfig(learning_rate=1e-5, schedule="constant_with_warmup", warmup_ratio=0.03),
    log_every=10,
  )
