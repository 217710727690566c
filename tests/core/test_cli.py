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
