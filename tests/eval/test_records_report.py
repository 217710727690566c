"""Run records (resume, settings check, reviews) and the report built from them."""

import json

import pytest

from dice_jax.eval import metrics, published, records, report
from dice_jax.eval.records import EvalRecord, Problem, RecordLog, Timing


def _rec(pid, sample=0, *, level=1, correct=True, speedup=1.5, kind=None, flagged=False, **kw):
  return EvalRecord(
    task_id=f"kernelbench/L{level}/{pid}",
    level=level,
    problem_id=pid,
    name=f"{pid}_P",
    sample=sample,
    compiled=kw.pop("compiled", correct),
    correct=correct,
    failure_kind=kind or ("OK" if correct else "WRONG_OUTPUT"),
    eager=Timing(speedup if correct else 0.0, 1.0, speedup, flagged),
    speedup_flagged=flagged,
    **kw,
  )


def test_record_log_appends_reloads_and_drops_a_line_cut_short(tmp_path):
  log = RecordLog(str(tmp_path))
  a, b = _rec(1), _rec(2, correct=False, deceptive=True, kind="TORCH_COMPUTE")
  log.append(a)
  log.append(b)
  with open(log.path, "a") as f:
    f.write('{"task_id": "kernelbench/L1/3", "lev')  # a crash in the middle of a line
  again = RecordLog(str(tmp_path))
  assert list(again.records) == [a.key, b.key] and again.records[b.key] == b
  assert open(log.path).read().count("\n") == 2 and open(log.path).read().endswith("\n")
  again.append(_rec(3))
  assert len(RecordLog(str(tmp_path))) == 3


def test_record_log_refuses_a_line_that_is_not_a_record(tmp_path):
  (tmp_path / records.RECORDS).write_text('{"task_id": 1}\n')
  with pytest.raises(records.RunError, match="line 1 is not a record"):
    RecordLog(str(tmp_path))


def test_manifest_refuses_other_settings_and_names_them(tmp_path):
  s = {"samples": 1, "verify": {"num_perf_trials": 100}}
  records.check_manifest(str(tmp_path), s)  # a new run: nothing to compare, nothing written
  assert not (tmp_path / records.MANIFEST).exists()
  records.write_manifest(str(tmp_path), s, environment={"jax": "0.10.2"})
  records.check_manifest(str(tmp_path), s)
  changed = {"samples": 1, "verify": {"num_perf_trials": 10}}
  with pytest.raises(records.RunError, match=r"verify: .*100.* -> .*10"):
    records.check_manifest(str(tmp_path), changed)
  records.check_manifest(str(tmp_path), changed, allow_change=True)
  records.write_manifest(str(tmp_path), changed, environment={"jax": "other"})
  m = records.read_manifest(str(tmp_path))
  assert m["verify"] == {"num_perf_trials": 10} and m["environment"] == {"jax": "0.10.2"}


def test_reviews_accept_or_reject_flagged_speedups(tmp_path):
  rec = _rec(1, speedup=50.0, flagged=True)
  assert rec.outcome().flagged and rec.outcome().correct
  assert not rec.outcome(review="accept").flagged
  rejected = rec.outcome(review="reject")
  assert not rejected.correct and rejected.deceptive
  assert rejected.failure_kind == records.REJECTED_IN_REVIEW
  (tmp_path / records.REVIEWS).write_text(json.dumps({rec.key: "maybe"}))
  with pytest.raises(records.RunError, match="'accept' or 'reject'"):
    records.read_reviews(str(tmp_path))


def test_level_outcomes_align_every_problem_and_sample():
  problems = [Problem(f"kernelbench/L{lv}/{i}", lv, "") for lv in (1, 2) for i in (1, 2)]
  recs = [_rec(1), _rec(1, 1, correct=False), _rec(2, level=2)]
  out = records.level_outcomes(problems, recs, samples=2)
  first1, every1 = out[1]
  assert first1[0].correct and first1[1] is None
  assert [len(s) for s in every1] == [2, 0]
  first2, _ = out[2]
  assert first2[0] is None and first2[1].correct


def test_published_row_follows_the_model_size():
  assert published.size_class(2_031_739_904) == "1.7B"  # sdar_1p7b
  assert published.size_class(4_411_424_256) == "4B"
  assert published.size_class(8_190_735_360) == "8B"
  assert published.size_class(106_880) is None  # tiny: no published row
  dice = [r for r in published.rows_for(2_031_739_904) if r.model == "DICE"]
  assert dice[0].levels[1] == (24.0, 12.0, 3.0)


def _run_dir(tmp_path, recs, num_params=2_031_739_904, baselines=("eager",), decoding=None):
  problems = [
    {"task_id": f"kernelbench/L{lv}/{i}", "level": lv, "name": f"{i}_P"}
    for lv in (1, 2)
    for i in (1, 2, 3, 4)
  ]
  settings = {
    "model": {"source": "/m", "num_params": num_params},
    "problems_source": "kb",
    "problems": problems,
    "samples": 1,
    "pass_at_k": [],
    "decoding": decoding or {"block_size": 4},
    "verify": {"num_perf_trials": 100},
    "baselines": list(baselines),
    "review_speedup": 10.0,
  }
  records.write_manifest(str(tmp_path), settings, environment={"jax": "0.10.2"})
  log = RecordLog(str(tmp_path))
  for r in recs:
    log.append(r)
  return report.write_report(str(tmp_path))


def test_report_tables_metrics_and_plots(tmp_path):
  recs = [
    _rec(1, speedup=2.5, device_name="NVIDIA H200", compile_s=7.0, run_s=1.0, generation_s=3.0),
    _rec(2, speedup=0.5),
    _rec(3, speedup=40.0, flagged=True),
    _rec(4, correct=False, compiled=False, kind="COMPILE_ERROR"),
    _rec(1, level=2, correct=False, kind="WRONG_OUTPUT"),
  ]
  path = _run_dir(tmp_path, recs)
  md = open(path).read()
  m = json.load(open(tmp_path / report.METRICS))["eager"]
  # level 1: 4 problems, 3 correct (one flagged), fast_1 counts only the 2.5x kernel
  assert m["1"]["exec_accuracy"] == 0.75 and m["1"]["compile_rate"] == 0.75
  assert m["1"]["fast_p"]["1"] == 0.25 and m["1"]["fast_p_counting_flagged"]["1"] == 0.5
  assert m["1"]["geomean_speedup"] == pytest.approx((2.5 * 0.5) ** 0.5)
  assert m["2"]["problems"] == 4 and m["2"]["with_results"] == 1
  assert m["2"]["failure_kinds"] == {"MISSING": 3, "WRONG_OUTPUT": 1}
  # fast_0.5 leaves out the 0.5x kernel (strict '>') and the flagged one; beside it DICE's 1.7B row
  row = "| L1 | 4 | 4 | 75.0 | 75.0 | 75.0 | 25.0 | 25.0 | 25.0 | 25.0 | 25.0 | 1.118 | 0.0 | 1 |"
  assert row + " 24.0 / 12.0 / 3.0 | 0.0 / 0.0 / 0.0 |" in md and "DICE 1.7B" in md
  assert "| kernelbench/L1/3 | 0 | 40.00 | - | pending |" in md
  assert "NVIDIA H200" in md and "| 3.0 | 7.0 | 7.0 | 1.0 |" in md
  for png in (report.SPEEDUP_PNG, report.FAILURES_PNG):
    assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  # a review accepting the flagged kernel moves it into fast_p
  (tmp_path / records.REVIEWS).write_text(json.dumps({"kernelbench/L1/3#0": "accept"}))
  report.write_report(str(tmp_path))
  m = json.load(open(tmp_path / report.METRICS))["eager"]
  assert m["1"]["fast_p"]["2"] == 0.5 and m["1"]["flagged"] == 0
  assert "| kernelbench/L1/3 | 0 | 40.00 | - | accept |" in open(path).read()


def test_report_without_a_published_row_and_with_a_compile_baseline(tmp_path):
  r = _rec(1, speedup=1.2)
  r = EvalRecord(**{**r.to_json(), "eager": r.eager, "compiled_baseline": Timing(0.8, 1.0, 0.8)})
  # flags are per baseline: 40x over eager is flagged, 1.5x over torch.compile is not
  f = _rec(2, speedup=40.0, flagged=True)
  f = EvalRecord(**{**f.to_json(), "eager": f.eager, "compiled_baseline": Timing(1.5, 1.0, 1.5)})
  assert f.outcome("eager").flagged and not f.outcome("compile").flagged
  path = _run_dir(tmp_path, [r, f], num_params=106_880, baselines=("eager", "compile"))
  md = open(path).read()
  assert "no published row of this size" in md and "torch.compile" in md
  m = json.load(open(tmp_path / report.METRICS))
  assert m["eager"]["1"]["fast_p"]["1"] == 0.25 and m["compile"]["1"]["fast_p"]["1"] == 0.25
  assert m["compile"]["1"]["fast_p"]["0.5"] == 0.5 and m["compile"]["1"]["flagged"] == 0


def test_report_names_the_prompts_cut_to_dices_limit(tmp_path):
  recs = [_rec(1, level=2, prompt_tokens=4096, prompt_cut=2_612), _rec(2, prompt_tokens=900)]
  md = open(_run_dir(tmp_path, recs, decoding={"max_prompt_tokens": 4096})).read()
  assert "Prompts cut to their first 4096 tokens" in md
  assert "1 sample(s) (L2 1), up to 2,612 tokens lost from the end" in md
  (tmp_path / "x").mkdir()
  assert "Prompts cut" not in open(_run_dir(tmp_path / "x", [_rec(1)])).read()


def test_metrics_of_an_empty_run_report_zero_rates(tmp_path):
  _run_dir(tmp_path, [])
  m = json.load(open(tmp_path / report.METRICS))["eager"]
  assert m["1"]["exec_accuracy"] == 0.0 and m["1"]["failure_kinds"] == {metrics.MISSING: 4}
