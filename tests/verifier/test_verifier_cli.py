"""`python -m verifier check`: inputs, one-line errors, flag files, progress, and a batch through the
real service (CPU backend)."""

import argparse
import io
import json
import os
import subprocess
import sys

import pytest

from verifier import batch, cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(REPO, "experiments", "demo_data")
PROBLEMS = os.path.join(DEMO, "cpu_problems.jsonl")
REF = "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x\n"


def _check(*args, timeout=600):
  cmd = [sys.executable, "-m", "verifier", "check", *args]
  env = {**os.environ, "PYTHONPATH": REPO, "VERIFIER_TOKEN": ""}
  return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


def _help(sub):
  with pytest.raises(SystemExit):
    cli.main([sub, "--help"])


def test_every_check_flag_has_help_and_units(capsys):
  _help("check")
  text = " ".join(capsys.readouterr().out.split())
  assert "--trials TRIALS correctness trials, each with new random inputs" in text
  assert "--timeout SECONDS wall-clock limit of the run stage per candidate, in seconds" in text
  assert "--atol ATOL absolute tolerance of the output comparison" in text
  assert "--flagfile PATH read more flags from PATH" in text
  for sub in ("serve", "bench"):
    _help(sub)
    assert "--flagfile PATH" in capsys.readouterr().out


@pytest.mark.parametrize(
  "args, message",
  [
    (
      ["--reference", "missing_ref.py", "--candidate", "c.py"],
      "reference missing_ref.py: no such file",
    ),
    (["--reference", "DIR", "--candidate", "c.py"], "is a directory, expected a Python file"),
    (["--reference", "r.py", "--candidate", "DIR"], "candidate DIR: is a directory"),
    (["missing_dir"], "missing_dir: no such file or directory"),
    (["--flagfile=missing.flags"], "--flagfile missing.flags: no such file"),
    (["r.py"], "r.py: expected a directory or a .jsonl file of candidates"),
  ],
)
def test_bad_inputs_give_one_line_and_exit_2(tmp_path, args, message):
  (tmp_path / "r.py").write_text(REF)
  (tmp_path / "c.py").write_text(REF.replace("Model", "ModelNew"))
  (tmp_path / "DIR").mkdir()
  old = os.getcwd()
  os.chdir(tmp_path)
  try:
    r = subprocess.run(
      [sys.executable, "-m", "verifier", "check", *args, "--device", "cpu"],
      capture_output=True,
      text=True,
      timeout=120,
      env={**os.environ, "PYTHONPATH": REPO},
    )
  finally:
    os.chdir(old)
  assert r.returncode == 2
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and message in lines[0] and "Traceback" not in r.stderr
  assert not [p for p in tmp_path.iterdir() if p.name not in ("r.py", "c.py", "DIR")]


def test_flagfiles_expand_in_place_with_comments_and_nesting(tmp_path):
  inner = tmp_path / "inner.flags"
  inner.write_text("--trials=3\n")
  outer = tmp_path / "outer.flags"
  outer.write_text(f"# settings\n--device=cpu\n\n--flagfile={inner}\n--timeout=30\n")
  argv = ["check", "--flagfile", str(outer), "--json"]
  assert cli.expand_flagfiles(argv) == [
    "check",
    "--device=cpu",
    "--trials=3",
    "--timeout=30",
    "--json",
  ]


def test_candidates_from_jsonl_rows(tmp_path):
  (tmp_path / "ref.py").write_text(REF)
  (tmp_path / "cand.py").write_text("class ModelNew: pass\n")
  rows = [
    {"id": "inline", "reference": REF, "candidate": "A"},
    {"id": "paths", "reference_path": "ref.py", "candidate_path": "cand.py"},
    {"task_id": "kernelbench/L1/2", "sample": 1, "candidate": "B"},
    {"level": 1, "problem_id": 3, "candidate": "C"},
    {"task_id": "kernelbench/L1/6", "candidate": None},  # an eval record without a code block
  ]
  path = tmp_path / "c.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  cands, skipped = batch.load_candidates(str(path), kernelbench=PROBLEMS)
  kb = {json.loads(x)["problem_id"]: json.loads(x)["code"] for x in open(PROBLEMS)}
  assert skipped == 1
  assert [(c.name, c.task_id, c.candidate) for c in cands] == [
    ("inline", "inline", "A"),
    ("paths", "paths", "class ModelNew: pass\n"),
    ("kernelbench/L1/2#1", "kernelbench/L1/2", "B"),
    ("kernelbench/L1/3", "kernelbench/L1/3", "C"),
  ]
  assert cands[1].reference == REF and cands[2].reference == kb[2] and cands[3].reference == kb[3]
  with pytest.raises(batch.InputError, match="pass --kernelbench"):
    batch.load_candidates(str(path))
  path.write_text('{"candidate": "A"}\n')
  with pytest.raises(batch.InputError, match=r"c.jsonl:1: needs 'reference'"):
    batch.load_candidates(str(path))


def test_candidates_from_directory_layouts(tmp_path):
  kb_run = tmp_path / "kb_run"  # KernelBench's generate_samples.py file names
  kb_run.mkdir()
  (kb_run / "level_1_problem_3_sample_0_kernel.py").write_text("X")
  (kb_run / "level_1_problem_1_sample_2_kernel.py").write_text("Y")
  cands, _ = batch.load_candidates(str(kb_run), kernelbench=PROBLEMS)
  assert [c.name for c in cands] == ["kernelbench/L1/1#2", "kernelbench/L1/3#0"]
  pairs = tmp_path / "pairs"
  for name in ("a", "b"):
    (pairs / name).mkdir(parents=True)
    (pairs / name / "reference.py").write_text(REF)
    (pairs / name / "candidate.py").write_text(name)
  cands, _ = batch.load_candidates(str(pairs))
  assert [(c.name, c.candidate) for c in cands] == [("a", "a"), ("b", "b")]
  flat = tmp_path / "flat"
  flat.mkdir()
  (flat / "one.py").write_text("1")
  (flat / "ref.py").write_text(REF)
  cands, _ = batch.load_candidates(str(flat), reference=str(flat / "ref.py"))
  assert {c.name for c in cands} == {"one.py", "ref.py"}
  (tmp_path / "empty").mkdir()
  with pytest.raises(batch.InputError, match="no candidates found"):
    batch.load_candidates(str(tmp_path / "empty"))


def test_progress_heartbeat_while_nothing_finishes():
  stream = io.StringIO()
  p = batch.Progress(3, stream=stream, every_s=0.0)
  p.status = "1 building, 0 running, 2 waiting"
  p.show()
  assert (
    stream.getvalue() == "check: 0/3 verified, 0 passed, 0 s (1 building, 0 running, 2 waiting)\n"
  )


@pytest.mark.slow
def test_batch_through_the_service_prints_progress_and_a_summary(tmp_path):
  rows = [json.loads(x) for x in open(os.path.join(DEMO, "cpu_candidates.jsonl"))]
  path = tmp_path / "batch.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows if "candidate" in r))
  common = [f"--kernelbench={PROBLEMS}", "--device=cpu", "--timing-trials=5"]
  common += [f"--cache-dir={tmp_path / 'cache'}", f"--scratch-root={tmp_path / 'scratch'}"]
  r = _check(str(path), *common)
  assert r.returncode == 1, r.stderr[-2000:]  # not every candidate passed
  assert "check: 5 candidate(s) on a cpu verifier started here" in r.stderr
  assert "check: [5/5] " in r.stderr and "(starting the verifier)" in r.stderr
  table = r.stdout.strip().splitlines()
  assert table[0].split()[:3] == ["candidate", "verdict", "speedup"]
  kinds = {line.split()[0]: line.split()[1] for line in table[1:-1]}
  assert kinds == {
    "kernelbench/L1/1": "OK",
    "kernelbench/L1/2": "OK",
    "kernelbench/L1/3": "WRONG_OUTPUT",
    "kernelbench/L1/4": "TORCH_COMPUTE",
    "kernelbench/L1/5": "SYNTAX_ERROR",
  }
  assert table[-1].startswith("2 of 5 passed; OK 2,") and table[-1].endswith("device cpu")
  # one passing pair: exit 0 (the build is cached now)
  ref, cand = tmp_path / "ref.py", tmp_path / "cand.py"
  ref.write_text(json.loads(open(PROBLEMS).readline())["code"])
  cand.write_text(rows[0]["candidate"])
  one = _check("--reference", str(ref), "--candidate", str(cand), *common)
  assert one.returncode == 0 and "kind=OK reward=1" in one.stdout


@pytest.mark.parametrize("flag,blocked", [((), True), (("--no-block-sockets-cuda",), False)])
def test_cuda_candidates_get_the_socket_filter_unless_lifted(flag, blocked):
  p = argparse.ArgumentParser()
  cli._service_args(p)
  cfg = cli._config(p.parse_args(["--device", "cpu", *flag]))
  assert cfg.block_sockets_cuda is blocked
