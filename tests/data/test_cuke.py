"""CuKe builder against an in-process fake verifier (a test double), plus resume and atomic output."""

import json
import re
import stat

import pytest

from dice_jax.data.cuke import CukeConfig, build_cuke, pair_key, read_measurements
from dice_jax.data.code_extraction import first_block as extract_code
from dice_jax.data.prompts import e2e_user_message
from dice_jax.data.tasks import load_sft_samples
from verifier.api.contract import FailureKind, VerifyResult

REF = "class Model:\n    pass  # {i}\n"


class FakeVerifier:
  """TEST DOUBLE, not a verifier: reads the verdict from a marker in the candidate ('# fake: 2.5x' or
  '# fake: wrong') and counts the candidates it was asked about."""

  def __init__(self, fail_after=None):
    self.seen = []
    self.fail_after = fail_after

  def verify_batch(self, items):
    out = []
    for task_id, ref, cand in items:
      if self.fail_after is not None and len(self.seen) >= self.fail_after:
        raise ConnectionError("fake verifier went away")
      self.seen.append(task_id)
      m = re.search(r"# fake: ([\d.]+)x", cand)
      out.append(
        VerifyResult(
          task_id=task_id,
          compiled=True,
          correct=True,
          speedup=float(m.group(1)),
          failure_kind=FailureKind.OK,
        )
        if m
        else VerifyResult(
          task_id=task_id,
          compiled=True,
          failure_kind=FailureKind.WRONG_OUTPUT,
          reason="values differ",
        )
      )
    return out


def _pairs(tmp_path, rows):
  p = tmp_path / "pairs.jsonl"
  p.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(p)


ROWS = [
  {
    "id": "a",
    "pytorch_code": REF.format(i=0),
    "cuda_code": "class ModelNew: pass  # fake: 3.0x",
    "level": 1,
  },
  {
    "id": "b",
    "pytorch_code": REF.format(i=1),
    "cuda_code": "class ModelNew: pass  # fake: 1.5x",
    "level": 1,
  },
  {
    "id": "c",
    "pytorch_code": REF.format(i=2),
    "cuda_code": "class ModelNew: pass  # fake: wrong",
    "level": 2,
  },
  {
    "id": "d",
    "pytorch_code": REF.format(i=3),
    "cuda_code": "class ModelNew: pass  # fake: 2.0x",
    "level": 2,
    "reasoning": "Fuse the two ops.",
  },
  {
    "id": "a-dup",
    "pytorch_code": REF.format(i=0) + "\n\n",
    "cuda_code": "class ModelNew: pass  # fake: 3.0x  ",
  },
  {"id": "bad", "pytorch_code": REF.format(i=9)},  # missing cuda_code
  {
    "id": "e",
    "pytorch_code": REF.format(i=4),
    "cuda_code": "class ModelNew: pass  # fake: 8.0x",
    "level": 3,
  },
]


def test_build_keeps_correct_fast_pairs_and_writes_summary(tmp_path, umask_022):
  out = tmp_path / "cuke"
  fake = FakeVerifier()
  s = build_cuke(_pairs(tmp_path, ROWS), fake, str(out), CukeConfig(min_speedup=2.0, batch_size=2))
  assert sorted(fake.seen) == [
    "pairs/a",
    "pairs/b",
    "pairs/c",
    "pairs/d",
    "pairs/e",
  ]  # dup not re-measured
  assert (s.pairs_in, s.duplicates, s.unique, s.correct, s.kept) == (7, 1, 5, 4, 3)
  assert len(s.invalid_rows) == 1 and s.invalid_rows[0].endswith(
    "pairs.jsonl:6: missing field 'cuda_code'"  # line 6: lines count from 1
  )
  assert s.kept_by_level == {"1": 1, "2": 1, "3": 1}
  assert s.failure_kinds == {"below_min_speedup": 1, "wrong_output": 1}
  rows = [json.loads(line) for line in (out / "cuke.jsonl").read_text().splitlines()]
  assert [r["id"] for r in rows] == ["pairs/a", "pairs/d", "pairs/e"]
  assert [r["speedup"] for r in rows] == [3.0, 2.0, 8.0]  # 2.0x is kept (>= threshold)
  d = rows[1]
  assert d["prompt"] == e2e_user_message(REF.format(i=3)) and d["level"] == 2
  assert (
    d["response"].startswith("Fuse the two ops.")
    and extract_code(d["response"]) == ROWS[3]["cuda_code"]
  )
  samples, rep = load_sft_samples(str(out / "cuke.jsonl"))
  assert len(samples) == 3 and not rep.skipped
  summary = json.loads((out / "summary.json").read_text())
  assert summary["kept"] == 3 and summary["speedups_correct"] == [1.5, 2.0, 3.0, 8.0]
  assert (out / "speedup_hist.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert not [p.name for p in out.iterdir() if p.name.startswith(".tmp")]
  assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {
    "cuke.jsonl": 0o644,  # was 0600 (tempfile.mkstemp)
    "summary.json": 0o644,
    "speedup_hist.png": 0o644,
    "measurements.jsonl": 0o644,
  }


def test_rerun_after_crash_skips_measured_pairs(tmp_path):
  out = tmp_path / "cuke"
  pairs = _pairs(tmp_path, ROWS)
  with pytest.raises(ConnectionError):
    build_cuke(pairs, FakeVerifier(fail_after=2), str(out), CukeConfig(batch_size=2))
  assert len(read_measurements(str(out / "measurements.jsonl"))) == 2  # first batch journaled
  assert not (out / "cuke.jsonl").exists()  # no half-written dataset
  fake = FakeVerifier()
  s = build_cuke(pairs, fake, str(out), CukeConfig(batch_size=2))
  assert len(fake.seen) == 3 and (s.resumed, s.measured_now, s.kept) == (2, 3, 3)
  fake2 = FakeVerifier()
  s2 = build_cuke(
    pairs, fake2, str(out), CukeConfig(min_speedup=4.0)
  )  # re-threshold without re-measuring
  assert fake2.seen == [] and s2.kept == 1


def test_torn_journal_line_is_remeasured(tmp_path):
  out = tmp_path / "cuke"
  pairs = _pairs(tmp_path, ROWS[:2])
  build_cuke(pairs, FakeVerifier(), str(out))
  j = out / "measurements.jsonl"
  lines = j.read_text().splitlines()
  j.write_text(lines[0] + "\n" + lines[1][:10])
  fake = FakeVerifier()
  build_cuke(pairs, fake, str(out))
  assert fake.seen == ["pairs/b"]


def test_bad_rows_fatal_when_asked(tmp_path):
  from dice_jax.data.tasks import DataError

  with pytest.raises(DataError, match=r"pairs\.jsonl:6: missing field 'cuda_code'"):
    build_cuke(
      _pairs(tmp_path, ROWS), FakeVerifier(), str(tmp_path / "o"), CukeConfig(on_error="raise")
    )
  assert not (tmp_path / "o").exists()  # the output directory is made only for valid input


def test_pair_key_ignores_trailing_whitespace_only():
  from dice_jax.data.tasks import KernelPair

  a = KernelPair("x", "import torch\n", "k = 1\n")
  assert pair_key(a) == pair_key(KernelPair("y", "import torch   \n\n", "k = 1"))
  assert pair_key(a) != pair_key(KernelPair("z", "import torch\n", "k = 2\n"))


def test_show_data_cli_prints_examples_and_lengths():
  import subprocess
  import sys

  from ._helpers import REPO_ROOT, shared_path

  shared_path("dice_rl", "kernel_infilling_evaluation.json")
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.show_data",
      "--pipeline=infill",
      "--n=1",
      "--max_chars=200",
    ],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert "<|im_start|>user\nYou write custom CUDA kernels" in out.stdout
  assert "prompt tokens over all 99 tasks (dice style): p50=" in out.stdout
