"""`python -m experiments.eval`: bad flags and inputs are one line on stderr, exit 2, nothing written."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(REPO, "experiments", "demo_data")
PROBLEMS = os.path.join(DEMO, "cpu_problems.jsonl")
CANDIDATES = os.path.join(DEMO, "cpu_candidates.jsonl")


def _eval(*args):
  env = {**os.environ, "PYTHONPATH": REPO, "VERIFIER_TOKEN": "", "JAX_PLATFORMS": "cpu"}
  return subprocess.run(
    [sys.executable, "-m", "experiments.eval", *args],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
  )


@pytest.mark.parametrize(
  "args, message",
  [
    ([f"--candidates={CANDIDATES}", "--verifier=local"], "--out is required"),
    (
      [f"--candidates={CANDIDATES}", "--hf_dir=/x", "--verifier=local", "--out=OUT"],
      "pass exactly one of --hf_dir, --checkpoint and --candidates",
    ),
    ([f"--candidates={CANDIDATES}", "--verifier=nohost", "--out=OUT"], "'nohost' is not HOST:PORT"),
    (
      [f"--candidates={CANDIDATES}", "--verifier=local", "--out=OUT", "--samples=0"],
      "--samples must be >= 1, got 0",
    ),
    (
      ["--candidates=missing.jsonl", "--verifier=local", "--out=OUT"],
      "missing.jsonl: no such file",
    ),
    (
      [f"--candidates={CANDIDATES}", "--verifier=local", "--out=OUT", "--problems=a-b"],
      "--problems: 'a-b' is not an id or a range",
    ),
    (
      [f"--candidates={CANDIDATES}", "--verifier=local", "--out=OUT", "--levels=7"],
      "no problems of levels [7]",
    ),
    (
      ["--hf_dir=/no/such/model", "--verifier=local", "--out=OUT"],
      "--hf_dir /no/such/model: no such directory",
    ),
    (
      ["--hf_dir=/tmp", "--verifier=local", "--out=OUT", "--samples=4"],
      "--samples > 1 needs --temperature > 0",
    ),
    (
      [f"--candidates={CANDIDATES}", "--verifier=127.0.0.1:9", "--out=OUT", "--verifier_wait_s=1"],
      "not ready after 1 s: 127.0.0.1:9",
    ),
    (["--report_only", "--out=OUT"], "is not an evaluation run directory"),
  ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, args, message):
  args = [a.replace("OUT", str(tmp_path / "run")) for a in args]
  r = _eval(f"--kernelbench={PROBLEMS}", *args)
  assert r.returncode == 2, r.stderr[-2000:]
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("eval: error: ") and message in lines[0], lines
  assert not (tmp_path / "run").exists()
