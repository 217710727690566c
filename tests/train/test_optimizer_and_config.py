import numpy as np
import pytest

from dice_jax.train.config import SFTConfig, apply_overrides
from dice_jax.train.optimizer import OptimizerConfig, make_schedule, warmup_steps


def test_dice_schedule_is_constant_after_three_percent_warmup():
  cfg = OptimizerConfig()  # DICE: lr 1e-5, constant_with_warmup, warmup_ratio 0.03
  sched = make_schedule(cfg, total_steps=200)
  assert warmup_steps(cfg, 200) == 6  # ceil(0.03 * 200), as HF computes it
  lrs = np.array([float(sched(s)) for s in range(200)])
  np.testing.assert_allclose(
    lrs[:7], [0, 1e-5 / 6, 2e-5 / 6, 3e-5 / 6, 4e-5 / 6, 5e-5 / 6, 1e-5], rtol=1e-6
  )
  np.testing.assert_allclose(lrs[6:], 1e-5, rtol=1e-6)


def test_cosine_schedule_reaches_the_end_ratio():
  sched = make_schedule(
    OptimizerConfig(learning_rate=1.0, schedule="cosine", warmup_steps=10, end_lr_ratio=0.1),
    total_steps=110,
  )
  assert float(sched(10)) == pytest.approx(1.0)
  assert float(sched(60)) == pytest.approx(0.55, abs=1e-6)
  assert float(sched(110)) == pytest.approx(0.1, abs=1e-6)


def test_bad_optimizer_values_are_named():
  with pytest.raises(ValueError, match="schedule"):
    OptimizerConfig(schedule="triangle")
  with pytest.raises(ValueError, match="warmup_ratio"):
    OptimizerConfig(warmup_ratio=1.5)


def test_overrides_set_nested_fields_with_types():
  cfg = apply_overrides(
    SFTConfig(),
    [
      "optim.learning_rate=3e-4",
      "seq_len=512",
      "run.model_overrides.remat=True",
      "run.async_checkpoint=False",
    ],
  )
  assert cfg.optim.learning_rate == 3e-4 and cfg.seq_len == 512
  assert cfg.run.model_overrides == {"remat": True} and cfg.run.async_checkpoint is False
  assert SFTConfig.from_json(cfg.to_json()) == cfg


def test_a_field_of_the_run_section_named_at_the_top_says_where_it_moved():
  from dice_jax.rl.config import RLConfig

  for cfg in (SFTConfig(), RLConfig()):
    with pytest.raises(
      ValueError, match=r"'seed' moved into the run section: use --set=run\.seed="
    ):
      apply_overrides(cfg, ["seed=3"])
    with pytest.raises(ValueError, match=r"use --set=run\.model_overrides\.remat="):
      apply_overrides(cfg, ["model_overrides.remat=True"])
    assert apply_overrides(cfg, ["run.seed=3"]).run.seed == 3


def test_a_config_saved_before_the_run_section_loads_into_it():
  from dice_jax.rl.config import RLConfig

  for cls, cfg in ((SFTConfig, SFTConfig()), (RLConfig, RLConfig())):
    flat = cfg.to_json()
    run = flat.pop("run")
    flat.update(run, seed=7, model="small", checkpoint_every=5)
    old = cls.from_json(flat)
    assert (old.run.seed, old.run.model, old.run.checkpoint_every) == (7, "small", 5)
    assert old.run.mesh_fsdp == cfg.run.mesh_fsdp and old.to_json().keys() == cfg.to_json().keys()


@pytest.mark.parametrize(
  "override,message",
  [
    ("optim.lr=1", "unknown field 'lr'"),
    ("seq_len=long", "expected int"),
    ("run.async_checkpoint=1", "True/False"),
    ("optim=3", "section"),
    ("seq_len", "key=value"),
  ],
)
def test_malformed_overrides_fail_clearly(override, message):
  with pytest.raises(ValueError, match=message):
    apply_overrides(SFTConfig(), [override])


def test_invalid_config_is_rejected():
  with pytest.raises(ValueError, match="multiple of accum_steps"):
    SFTConfig(batch_size=6, accum_steps=4)
  with pytest.raises(ValueError, match="data_source"):
    SFTConfig(data_source="web")


def test_the_run_section_holds_where_the_weights_start():
  from dice_jax.rl.config import RLConfig

  rl = apply_overrides(RLConfig(), ["run.init_checkpoint=/runs/sft"])
  assert rl.run.init_checkpoint == "/runs/sft" and rl.run.init_hf == ""
  with pytest.raises(ValueError, match="at most one of run.init_hf and run.init_checkpoint"):
    apply_overrides(rl, ["run.init_hf=/hf"])
  with pytest.raises(ValueError, match="run.init_checkpoint is RL's"):
    apply_overrides(SFTConfig(), ["run.init_checkpoint=/runs/sft"])
  assert apply_overrides(SFTConfig(), ["run.init_hf=/hf"]).run.init_hf == "/hf"
