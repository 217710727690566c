"""`python -m experiments.eval` through the real verifier service (CPU backend, C++ candidates).

The seven CPU problems of experiments/demo_data have known candidates whose verdicts are fixed by
construction (make_cpu_problems.py), so the metrics are known exactly. All candidates share one C++
extension: the module costs one C++ build.
"""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(REPO, "experiments", "demo_data")
PROBLEMS = os.path.join(DEMO, "cpu_problems.jsonl")
CANDIDATES = os.path.join(DEMO, "cpu_candidates.jsonl")


@pytest.fixture(scope="module")
def cpu_verifier(tmp_path_factory):
  pytest.importorskip("torch", reason="the verifier service needs torch")
  from verifier.serve.local import LocalVerifier

  with LocalVerifier(str(tmp_path_factory.mktemp("verifier")), device="cpu") as v:
    yield v.address


def _eval(out, address, *extra):
  cmd = [
    sys.executable,
    "-m",
    "experiments.eval",
    f"--candidates={CANDIDATES}",
    f"--kernelbench={PROBLEMS}",
    "--levels=1",
    f"--verifier={address}",
    f"--out={out}",
    "--num_perf_trials=10",
    "--noprogress",
    *extra,
  ]
  env = {**os.environ, "VERIFIER_TOKEN": "", "PYTHONPATH": REPO}
  return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)


@pytest.mark.slow
def test_known_candidates_give_exactly_the_expected_metrics(cpu_verifier, tmp_path):
  out = tmp_path / "run"
  r = _eval(out, cpu_verifier)
  assert r.returncode == 0, r.stderr[-3000:]
  assert (
    "5 verified now, 1 without a code block (failures, not sent), 0 resumed, 1 skipped (no "
    "candidate given)" in r.stdout  # the no-code-block candidate is a failure, not sent
  )
  m = json.loads((out / "metrics.json").read_text())["eager"]["1"]
  n = 7
  assert (m["problems"], m["with_results"]) == (7, 6)
  assert m["compile_rate"] == 3 / n  # slow, flagged and wrong candidates built
  assert m["exec_accuracy"] == 2 / n and m["deceptive_rate"] == 1 / n
  # the slow kernel is < 0.5x; the > 10x kernel is flagged, so only fast_0 counts it
  assert m["fast_p"] == {"0": 2 / n, "0.5": 0.0, "0.8": 0.0, "1": 0.0, "1.5": 0.0, "2": 0.0}
  assert m["fast_p_counting_flagged"] == {
    "0": 2 / n,
    "0.5": 1 / n,
    "0.8": 1 / n,
    "1": 1 / n,
    "1.5": 1 / n,
    "2": 1 / n,
  }
  assert m["flagged"] == 1 and 0 < m["geomean_speedup"] < 0.5
  assert m["failure_kinds"] == {
    "MISSING": 1,
    "NO_CODE_BLOCK": 1,
    "OK": 2,
    "SYNTAX_ERROR": 1,
    "TORCH_COMPUTE": 1,
    "WRONG_OUTPUT": 1,
  }
  recs = {
    r["problem_id"]: r for r in map(json.loads, (out / "records.jsonl").read_text().splitlines())
  }
  assert recs[2]["speedup_flagged"] and recs[2]["eager"]["speedup"] > 10
  assert recs[1]["eager"]["speedup"] < 0.5 and recs[1]["device_name"] == "cpu"
  report = (out / "report.md").read_text()
  assert "| kernelbench/L1/2 | 0 |" in report and "pending |" in report

  # a rerun resumes: nothing is verified again
  again = _eval(out, cpu_verifier)
  assert (
    again.returncode == 0
    and "0 verified now, 0 without a code block (failures, not sent), 6 resumed" in again.stdout
  )
  # other settings are refused in one line, and nothing is written
  before = (out / "records.jsonl").read_text()
  changed = _eval(out, cpu_verifier, "--num_perf_trials=20")
  assert changed.returncode == 2 and "Traceback" not in changed.stderr
  assert changed.stderr.strip().splitlines()[-1].startswith("eval: error: ")
  assert "num_perf_trials" in changed.stderr and "--allow_config_change" in changed.stderr
  assert (out / "records.jsonl").read_text() == before


@pytest.mark.slow
def test_model_generations_reach_the_service(cpu_verifier, tmp_path):
  """The model path: a tiny byte-level model decodes two prompts; its raw responses (no code block)
  are verified by the service (``--extract=first_block_or_raw``)."""
  from flax import nnx

  from dice_jax.data.byte_tokenizer import byte_model_overrides, write_byte_tokenizer
  from dice_jax.data.tasks import load_kernelbench
  from dice_jax.data.tokenizer import Tokenizer
  from dice_jax.eval.candidates import EvalDecoding, ModelCandidates
  from dice_jax.eval.records import NO_CODE_BLOCK, RecordLog
  from dice_jax.eval.runner import Evaluator
  from dice_jax.eval.verifying import EVAL_OPTIONS, GrpcCandidateVerifier
  from dice_jax.model import Transformer, get_config

  tasks = load_kernelbench(PROBLEMS)[0][:2]
  tok = Tokenizer.from_dir(write_byte_tokenizer(str(tmp_path / "tok")))
  model = Transformer(get_config("tiny", **byte_model_overrides()), rngs=nnx.Rngs(0))
  dec = EvalDecoding(max_new_tokens=16, extract="first_block_or_raw")
  source = ModelCandidates(model, tok, dec, batch_size=2)
  verifier = GrpcCandidateVerifier([cpu_verifier], dict(EVAL_OPTIONS, num_perf_trials=5), token="")
  try:
    log = RecordLog(str(tmp_path))
    summary = Evaluator(log, source, verifier, progress=False).run(tasks)
  finally:
    verifier.close()
  assert summary.done_now == 2 and len(log) == 2
  for r in log.records.values():
    assert 1 <= r.response_tokens <= 16 and r.generation_s > 0 and not r.correct
    # a non-empty response went to the service, which answered with one of its kinds
    assert (r.candidate is None) == (r.failure_kind == NO_CODE_BLOCK)
    if r.candidate is not None:
      assert r.failure_kind in {"SYNTAX_ERROR", "MISSING_MODEL_NEW", "NO_KERNEL", "IMPORT_ERROR"}
