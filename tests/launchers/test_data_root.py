"""One data-root setting: `$DICE_DATA_ROOT` (or `--data_root`) moves every config's data paths;
unset, they resolve to ../shared/data next to the repository, as before."""

import pathlib

from experiments import configs
from experiments.data_root import DEFAULT, ENV, data_path, data_root

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_default_is_the_repos_sibling_shared_data(monkeypatch):
  monkeypatch.delenv(ENV, raising=False)
  assert DEFAULT == REPO.parent / "shared" / "data"
  assert data_root() == DEFAULT
  assert configs.load("tiny").data_path == str(
    REPO.parent / "shared" / "data" / "dice_rl" / "kernel_infilling_evaluation.json"
  )


def test_the_environment_variable_moves_every_config(monkeypatch, tmp_path):
  monkeypatch.setenv(ENV, str(tmp_path))
  assert data_path("sdar_chat") == str(tmp_path / "sdar_chat")
  assert configs.load("tiny").data_path.startswith(str(tmp_path))
  assert configs.load("sdar_1p7b").run.tokenizer == str(tmp_path / "sdar_chat")
  infill = configs.load("rl_dice_infill")
  assert infill.infill_tasks == str(tmp_path / "dice_rl" / "kernel_infilling_992.json")
  assert infill.run.tokenizer == str(tmp_path / "sdar_chat")
  e2e = configs.load("rl_dice_e2e")
  assert e2e.e2e_tasks.startswith(str(tmp_path)) and e2e.eval_tasks.startswith(str(tmp_path))


def test_the_launchers_data_root_flag_wins_over_the_environment(tmp_path):
  import os
  import subprocess
  import sys

  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), **{ENV: str(tmp_path / "env")})
  proc = subprocess.run(
    [sys.executable, "-m", "experiments.sft", "--config=tiny", f"--workdir={tmp_path / 'w'}"]
    + [f"--data_root={tmp_path / 'flag'}"],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 2, proc.stderr[-2000:]
  want = tmp_path / "flag" / "dice_rl" / "kernel_infilling_evaluation.json"
  assert proc.stderr.strip().splitlines()[-1] == f"sft: error: {want}: file not found"
