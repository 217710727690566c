"""experiments/bench_bounds.py: the times tests record reach the bench, which holds them to bounds."""

import pytest

from experiments import bench_bounds

TIMED = """
import pytest

@pytest.mark.parametrize("s", [0.5, 3.0])
def test_timed(record_property, s):
  record_property("seconds", s)

def test_failing(record_property):
  record_property("seconds", 0.1)
  assert False
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  d = tmp_path_factory.mktemp("bounds")
  (d / "test_timed.py").write_text(TIMED)
  xml = str(d / "report.xml")
  assert bench_bounds.run_tests([str(d / "test_timed.py")], xml) == 1  # one test fails
  got = bench_bounds.recorded(xml)
  (path,) = {k.split("::")[0] for k in got}  # the file as pytest names it
  return {k.split("::")[1]: v for k, v in got.items()}, path


def test_recorded_properties_are_read_back_per_case(results):
  got, path = results
  assert path.endswith("test_timed.py")
  assert got["test_timed[0.5]"] == {"passed": True, "seconds": "0.5"}
  assert got["test_timed[3.0]"]["seconds"] == "3.0"
  assert got["test_failing"]["passed"] is False


def test_a_bound_holds_only_for_a_passing_test_within_it(results):
  got, path = results
  full = {f"{path}::{k}": v for k, v in got.items()}
  bounds = [
    bench_bounds.Bound("g", path, name, "seconds", 2.0, "why")
    for name in ("test_timed", "test_failing", "test_absent")
  ]
  rows = bench_bounds.rows(bounds, full)
  assert [(r["value"], r["ok"]) for r in rows] == [
    (0.5, True),
    (3.0, False),
    (0.1, False),
    (None, False),
  ]
  assert rows[1]["ratio"] == 1.5 and "| 3 | 2 | 1.50 | NO |" in bench_bounds.table(rows)


def test_every_bound_names_a_test_that_records_its_property():
  import pathlib

  for b in bench_bounds.BOUNDS:
    text = (pathlib.Path(bench_bounds.REPO) / b.file).read_text()
    assert f"def {b.name}(" in text and f'record_property("{b.prop}"' in text, b
