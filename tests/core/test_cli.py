"""experiments/_cli.py: user errors are one line and exit 2; bugs keep their traceback."""

import errno

import pytest
from absl import app

from dice_jax.data.tasks import DataError
from dice_jax.errors import UserError
from experiments import _cli


def _exit(capsys, exc):
  def main(argv):
    raise exc

  with pytest.raises(SystemExit) as e:
    _cli.guarded(main)([])
  return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
  "exc, line",
  [
    (DataError("/d/x.jsonl: no SFT samples"), "/d/x.jsonl: no SFT samples"),
    (UserError("--verifier h:1: no verifier\nanswered"), "--verifier h:1: no verifier answered"),
    (app.UsageError("pass --hf_dir"), "pass --hf_dir"),
    (FileExistsError(errno.EEXIST, "output directory already exists", "/o"), "output directory"),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/p.json"), "directory: /p.json"),
  ],
)
def test_user_errors_are_one_line_and_exit_2(capsys, exc, line):
  code, err = _exit(capsys, exc)
  assert code == 2
  assert err.count("\n") == 1 and err.startswith(f"{_cli._prog()}: error: ") and line in err


def test_ctrl_c_is_one_line_and_exit_130(capsys):
  code, err = _exit(capsys, KeyboardInterrupt())
  assert code == 130 and err.endswith(": interrupted\n") and err.count("\n") == 1


def test_a_bug_keeps_its_exception():
  def main(argv):
    raise KeyError("not a user error")

  with pytest.raises(KeyError):
    _cli.guarded(main)([])


def test_user_errors_from_marks_a_block():
  with pytest.raises(UserError, match="override seq_len: expected int"):
    with _cli.user_errors_from(ValueError):
      raise ValueError("override seq_len: expected int, got '25x'")
  with pytest.raises(KeyError):
    with _cli.user_errors_from(ValueError):
      raise KeyError("x")


def _jax_backend_lines(monkeypatch, platforms):
  """What reaches a handler on JAX's backend logger after `quiet_missing_tpu` with JAX_PLATFORMS."""
  import logging

  logger = logging.getLogger(_cli.JAX_BACKEND_LOGGER)
  monkeypatch.setattr(logger, "filters", [])  # this test's filters only, dropped afterwards
  if platforms is None:
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  else:
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
  _cli.quiet_missing_tpu()
  seen = []
  handler = logging.Handler(logging.DEBUG)
  handler.emit = lambda record: seen.append(record.getMessage())
  logger.addHandler(handler)
  level = logger.level
  logger.setLevel(logging.DEBUG)
  try:
    logger.info("Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so")
    logger.info("Unable to initialize backend 'cuda': no CUDA")
    logger.warning("Unable to initialize backend 'tpu': asked for, and broken")
  finally:
    logger.removeHandler(handler)
    logger.setLevel(level)
  return seen


def test_the_missing_tpu_note_is_quiet_unless_a_tpu_was_asked_for(monkeypatch):
  assert _jax_backend_lines(monkeypatch, None) == [
    "Unable to initialize backend 'cuda': no CUDA",
    "Unable to initialize backend 'tpu': asked for, and broken",
  ]
  assert _jax_backend_lines(monkeypatch, "cpu") == _jax_backend_lines(monkeypatch, None)
  assert len(_jax_backend_lines(monkeypatch, "tpu,cpu")) == 3


def test_a_launcher_refuses_a_config_of_the_other_kind_naming_its_own():
  from experiments import configs

  with pytest.raises(UserError) as e:
    configs.load("rl_tiny", "sft")
  assert str(e.value) == (
    "--config rl_tiny is an RL config (for `python -m experiments.rl`); experiments.sft takes one "
    f"of {configs.known('sft')}"
  )
  assert "rl_tiny" not in configs.known("sft") and configs.known("rl") == [
    "rl_dice_e2e",
    "rl_dice_infill",
    "rl_tiny",
  ]
  with pytest.raises(UserError, match=r"unknown config 'nope'; known: \['sdar_1p7b', "):
    configs.load("nope", "sft")
  with pytest.raises(
    UserError, match=r"^--config tiny is an SFT config \(for `python -m experiments"
  ):
    configs.load("tiny", "rl")


def test_a_mesh_that_does_not_fit_the_devices_names_the_run_fields():
  import jax

  from dice_jax.train import run_setup
  from dice_jax.train.run_config import RunConfig

  n = len(jax.devices())
  with pytest.raises(UserError) as e:  # was a ValueError traceback from the launchers
    run_setup.make_mesh(RunConfig(mesh_data=1, mesh_fsdp=n + 1, mesh_tensor=1))
  assert str(e.value) == (
    f"run.mesh_data/mesh_fsdp/mesh_tensor/mesh_slices = 1/{n + 1}/1/1: mesh: data*fsdp*tensor = "
    f"{n + 1} != {n} devices"
  )


def test_verifier_addresses_are_read_once_for_every_launcher():
  assert _cli.verifier_endpoints("h:1, h:2") == ["h:1", "h:2"]
  with pytest.raises(UserError) as e:  # rl printed a ValueError traceback for this
    _cli.verifier_endpoints("bogus")
  assert str(e.value) == "--verifier: verifier endpoint 'bogus' is not HOST:PORT"


def test_a_host_without_accelerators_gives_jax_the_cpu_only():
  """libtpu (installed for TPU compiles) starts on every launch where JAX may look at every backend,
  and on a host with no TPU prints five lines of warnings: there, the launchers name the CPU."""
  assert _cli.default_platforms({}, []) == "cpu"
  assert _cli.default_platforms({}, ["/dev/accel0"]) is None
  assert _cli.default_platforms({}, ["/dev/nvidia0"]) is None
  assert _cli.default_platforms({"JAX_PLATFORMS": "tpu"}, []) is None  # the user's choice wins
  assert _cli.default_platforms({"JAX_PLATFORMS": ""}, []) is None
