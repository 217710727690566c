"""Loaders: real files load with the expected counts; bad rows are reported with file and row."""

import json

import pytest

from dice_jax.data import tasks
from dice_jax.data.tasks import DataError

from ._helpers import shared_path


def _write(tmp_path, name, rows):
  p = tmp_path / name
  if name.endswith(".jsonl"):
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
  else:
    p.write_text(json.dumps(rows))
  return str(p)


def test_real_dice_and_kernelbench_files_load():
  e2e, rep = tasks.load_e2e_tasks(
    str(shared_path("dice_rl", "end_to_end_kernel_generation_4000.json"))
  )
  assert rep.accepted == 4000 and not rep.skipped
  levels = [t.level for t in e2e]
  # File order: 1 item of level 0, 590 of level 1, 3407 of level 2, 2 of level 3 (DICE's end_to_end_kernel_generation_4000.json).
  assert levels == [0] + [1] * 590 + [2] * 3407 + [3] * 2
  infill, _ = tasks.load_infilling_tasks(
    str(shared_path("dice_rl", "kernel_infilling_evaluation.json"))
  )
  assert len(infill) == 99 and all(t.prefix + t.middle + t.suffix == t.cuda_code for t in infill)
  kb1, _ = tasks.load_e2e_tasks(
    str(shared_path("dice_rl", "kernelbench_level1.json")), default_level=1
  )
  assert len(kb1) == 100 and {t.level for t in kb1} == {1}
  kb, reports = tasks.load_kernelbench(str(shared_path("kernelbench")))
  assert [sum(t.level == lv for t in kb) for lv in (1, 2, 3, 4)] == [100, 100, 50, 20]
  assert kb[18].name == "19_ReLU" and kb[18].task_id == "kernelbench/L1/19"
  assert len(tasks.load_kernelbench(str(shared_path("kernelbench")), levels=[3])[0]) == 50


def test_kernelbench_checkout_layout(tmp_path):
  for lv, files in {1: ["1_Matmul.py", "19_ReLU.py"], 2: ["3_Fused.py"]}.items():
    d = tmp_path / "KernelBench" / f"level{lv}"
    d.mkdir(parents=True)
    for f in files:
      (d / f).write_text(f"# {f}\nclass Model: pass\n")
  kb, reports = tasks.load_kernelbench(str(tmp_path))
  assert [t.task_id for t in kb] == ["kernelbench/L1/1", "kernelbench/L1/19", "kernelbench/L2/3"]
  assert kb[1].name == "19_ReLU" and kb[1].reference_code == "# 19_ReLU.py\nclass Model: pass\n"


def test_kernelbench_parquet(tmp_path):
  p = str(tmp_path / "kb.parquet")
  try:
    import pyarrow as pa
    import pyarrow.parquet as pq
  except ImportError:
    open(p, "wb").write(b"PAR1")
    with pytest.raises(DataError, match="kb.parquet: reading parquet needs pyarrow"):
      tasks.load_kernelbench(p)
    return
  pq.write_table(
    pa.Table.from_pylist([{"code": "x", "level": 2, "name": "5_a", "problem_id": 5}]), p
  )
  kb, _ = tasks.load_kernelbench(p)
  assert kb[0].task_id == "kernelbench/L2/5"


BAD_PAIRS = [
  {
    "pytorch_code": "class Model: pass",
    "cuda_code": "class ModelNew: pass",
    "speedup": 2.5,
  },  # ok, row 0
  {"pytorch_code": "class Model: pass"},  # row 1: missing cuda_code
  {"pytorch_code": "class Model: pass", "cuda_code": 42},  # row 2: non-string code
  {"pytorch_code": "   ", "cuda_code": "x"},  # row 3: empty
  {"pytorch_code": "a", "cuda_code": "b", "speedup": "fast"},  # row 4: bad speedup
  ["not", "an", "object"],  # row 5
  {"pytorch_code": "a", "cuda_code": "b", "level": "two"},  # row 6: bad level
  {
    "pytorch_code": "a",
    "cuda_code": "b",
    "reasoning": "why",
    "level": "2",
    "id": "p7",
  },  # ok, row 7
]


def test_bad_pairs_reported_with_file_and_row_when_skipping(tmp_path):
  p = _write(tmp_path, "pairs.json", BAD_PAIRS)
  pairs, rep = tasks.load_pairs(p, on_error="skip")
  assert [x.pair_id for x in pairs] == ["pairs/0", "pairs/p7"]
  assert pairs[1].level == 2 and pairs[1].reasoning == "why" and pairs[0].speedup == 2.5
  assert rep.accepted == 2 and rep.total == len(BAD_PAIRS)  # nothing silently dropped
  msgs = {i.row: str(i) for i in rep.skipped}
  assert sorted(msgs) == [1, 2, 3, 4, 5, 6]
  assert msgs[1] == f"{p}: record 2: missing field 'cuda_code'"
  assert msgs[2] == f"{p}: record 3: field 'cuda_code' must be a string, got int"
  assert msgs[3] == f"{p}: record 4: field 'pytorch_code' is empty"
  assert "speedup" in msgs[4] and "JSON object" in msgs[5] and "level" in msgs[6]


def test_bad_row_is_fatal_by_default(tmp_path):
  p = _write(tmp_path, "pairs.json", BAD_PAIRS)
  with pytest.raises(DataError, match=r"pairs\.json: record 2: missing field 'cuda_code'"):
    tasks.load_pairs(p)


def test_bad_jsonl_line_and_sft_rows(tmp_path):
  p = _write(
    tmp_path,
    "cuke.jsonl",
    [{"prompt": "p", "response": "r"}, "{broken", {"prompt": "p", "response": ""}],
  )
  rows, rep = tasks.load_sft_samples(p, on_error="skip")
  assert len(rows) == 1 and [i.row for i in rep.skipped] == [1, 2]
  assert (
    "invalid JSON" in rep.skipped[0].message
    and rep.skipped[1].message == "field 'response' is empty"
  )


def test_bad_infilling_and_e2e_rows(tmp_path):
  good = {
    "id": 1,
    "pytorch_code": "m",
    "prefix": "a",
    "middle": "b",
    "suffix": "c",
    "cuda_code": "abc",
  }
  bad = dict(good, id=2, cuda_code="abX")
  p = _write(tmp_path, "infill.json", [good, bad])
  with pytest.raises(
    DataError, match=r"infill\.json: record 2: prefix \+ middle \+ suffix != cuda_code"
  ):
    tasks.load_infilling_tasks(p)
  p = _write(
    tmp_path,
    "e2e.json",
    [{"idx": 0, "level": "1", "pytorch_code": "m"}, {"idx": 1, "pytorch_code": "m"}],
  )
  with pytest.raises(DataError, match=r"e2e\.json: record 2: missing field 'level'"):
    tasks.load_e2e_tasks(p)
  t, _ = tasks.load_e2e_tasks(p, default_level=1)
  assert [x.level for x in t] == [1, 1]
  with pytest.raises(DataError, match="file not found"):
    tasks.load_pairs(str(tmp_path / "missing.json"))


def test_curriculum_stage_mapping():
  assert [tasks.curriculum_stage(lv) for lv in (0, 1, 2, 3, 4)] == [0, 0, 1, 2, 2]
