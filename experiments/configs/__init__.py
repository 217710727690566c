"""SFT run configs: each module defines `get_config() -> dice_jax.train.config.SFTConfig`."""
