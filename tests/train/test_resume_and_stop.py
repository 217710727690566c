"""One resume rule for SFT and RL: safe changes pass, others are refused field by field unless
allowed, fixed ones are refused with their reason always; SIGTERM/SIGINT become a stop request."""

import os
import signal

import pytest

from dice_jax.train.config import SFTConfig, apply_overrides
from dice_jax.train.resume import ConfigChangedError, check_resume, config_changes
from dice_jax.train.stop import Interrupted, StopSignals


def _json(*overrides):
  return apply_overrides(SFTConfig(data_path="d.jsonl"), list(overrides)).to_json()


def _rl(*overrides):
  from dice_jax.rl.config import RLConfig

  return apply_overrides(RLConfig(e2e_tasks="t.jsonl"), list(overrides)).to_json()


def test_changed_fields_are_listed_old_to_new_with_dotted_names():
  saved = _json("seq_len=512", "batch_size=4")
  now = _json("seq_len=256", "batch_size=2", "optim.learning_rate=1e-4", "log_every=5")
  assert config_changes(saved, now) == [
    ("batch_size", 4, 2),
    ("log_every", 1, 5),
    ("optim.learning_rate", 1e-5, 1e-4),
    ("seq_len", 512, 256),
  ]
  with pytest.raises(ConfigChangedError) as e:
    check_resume(saved, now, workdir="/runs/a", step=7)
  assert str(e.value) == (
    "/runs/a holds a run (step 7) started with another config: batch_size 4 -> 2, "
    "optim.learning_rate 1e-05 -> 0.0001, seq_len 512 -> 256; pass --allow_config_change to "
    "continue it with the new values, or use a new --workdir"
  )


def test_bookkeeping_changes_pass_and_allow_change_returns_every_change():
  saved = _json()
  assert check_resume(saved, _json("log_every=10", "run.mesh_fsdp=2"), workdir="w", step=1) == [
    ("log_every", 1, 10),
    ("run.mesh_fsdp", -1, 2),
  ]
  changes = check_resume(saved, _json("num_steps=200"), workdir="w", step=1, allow_change=True)
  assert changes == [("num_steps", 100, 200)]
  assert check_resume(saved, _json(), workdir="w", step=1) == []


def test_training_longer_or_shorter_and_cadence_changes_pass_for_sft_and_rl():
  assert check_resume(_json("num_steps=6"), _json("num_steps=8"), workdir="w", step=6) == [
    ("num_steps", 6, 8)
  ]
  saved = _rl("stream.num_steps=12")
  now = _rl(
    "stream.num_steps=20",
    "eval_every=2",
    "eval_tasks=e.jsonl",
    "samples_per_step=8",
    "prompt_width_multiple=256",
  )
  changes = check_resume(saved, now, workdir="w", step=4)
  assert [c[0] for c in changes] == [
    "eval_every",
    "eval_tasks",
    "prompt_width_multiple",
    "samples_per_step",
    "stream.num_steps",
  ]
  assert check_resume(saved, _rl("stream.num_steps=4"), workdir="w", step=4)  # not below 4 done


def test_rl_changes_that_train_differently_are_refused_naming_each_field_unless_allowed():
  saved = _rl("optim.learning_rate=1e-4")
  now = _rl("optim.learning_rate=0.5", "sampler.temperature=0.7", "run.checkpoint_every=5")
  with pytest.raises(ConfigChangedError) as e:
    check_resume(saved, now, workdir="/runs/rl", step=3)
  assert str(e.value) == (
    "/runs/rl holds a run (step 3) started with another config: optim.learning_rate 0.0001 -> "
    "0.5, sampler.temperature 1.0 -> 0.7; pass --allow_config_change to continue it with the new "
    "values, or use a new --workdir"
  )
  assert len(check_resume(saved, now, workdir="w", step=3, allow_change=True)) == 3


@pytest.mark.parametrize("allow", [False, True])
def test_fields_the_saved_state_depends_on_are_refused_with_the_reason_even_when_allowed(allow):
  saved, now = _rl("stream.group_size=16"), _rl("stream.group_size=8", "optim.learning_rate=0.5")
  with pytest.raises(ConfigChangedError) as e:
    check_resume(saved, now, workdir="/runs/rl", step=3, allow_change=allow)
  assert str(e.value) == (
    "/runs/rl holds a run (step 3) whose config cannot change in these fields, even with "
    "--allow_config_change: stream.group_size 16 -> 8 (the saved RL-stream position counts "
    "samples of this layout); also changed: optim.learning_rate 1e-06 -> 0.5; use a new --workdir"
  )
  cases = [
    (_rl("stream.num_steps=12"), _rl("stream.num_steps=2"), "the run has done 3 steps already"),
    (_rl(), _rl("stream.seed=7"), "it fixes the order of the tasks"),
    (_json(), _json("run.seed=1"), "the seed fixes the data order"),
    (_json(), _json("data_shards=2", "batch_size=8"), "one state per data shard"),
    (_json(), _json("run.model_overrides.hidden_size=128"), "parameters of the saved shapes"),
  ]
  for saved, now, why in cases:
    with pytest.raises(ConfigChangedError, match=why):
      check_resume(saved, now, workdir="w", step=3, allow_change=allow)


def test_a_field_the_saved_config_lacks_shows_as_absent():
  saved = _json()
  saved["objective"].pop("per_block_t")
  with pytest.raises(ConfigChangedError, match=r"objective\.per_block_t \(absent\) -> False"):
    check_resume(saved, _json(), workdir="w", step=3)


def test_stop_signals_interrupt_start_up_and_request_a_save_while_training():
  previous = signal.getsignal(signal.SIGINT)
  with StopSignals() as stop:
    with pytest.raises(Interrupted, match="SIGTERM during start-up"):
      os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next bytecode
    stop.training = True
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: the same as SIGTERM
    assert stop.requested == "SIGINT"
    with pytest.raises(Interrupted, match=r"second stop signal \(SIGTERM\)"):
      os.kill(os.getpid(), signal.SIGTERM)
  assert signal.getsignal(signal.SIGINT) is previous
