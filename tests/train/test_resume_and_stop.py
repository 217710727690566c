"""Resume refuses a changed config (field by field); SIGTERM/SIGINT become a stop request."""

import os
import signal

import pytest

from dice_jax.train.config import SFTConfig, apply_overrides
from dice_jax.train.resume import ConfigChangedError, check_resume, config_changes
from dice_jax.train.stop import Interrupted, StopSignals


def _json(*overrides):
  return apply_overrides(SFTConfig(data_path="d.jsonl"), list(overrides)).to_json()


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
