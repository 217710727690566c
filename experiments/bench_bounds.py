r"""The wall-clock bounds the tests do not assert: run the tests that time themselves and hold each
recorded time to its bound.

  python -m experiments.bench_bounds [--groups=static,client,verifier,cluster] [--out=bounds.json]

A test asserts behaviour only (a loaded CI machine must not fail it on time); where it used to
assert `elapsed < N` it now records the time with pytest's `record_property` and keeps at most a
hang guard far above it. This runs those tests under pytest with `--junitxml`, reads the recorded
properties back and prints, for each, the measurement, its bound and their ratio; exit status 1 if
a bound is broken or a test did not pass. `BOUNDS` names every bound and why it is what it is.
Numbers: docs/performance.md ("Bounds the tests no longer assert").
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

from absl import flags

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The launcher's flags, defined when it runs (tests import BOUNDS beside other launchers)."""
  flags.DEFINE_list("groups", ["static", "client"], "groups of BOUNDS to run (see --helpfull)")
  flags.DEFINE_string("out", None, "also write the rows as JSON here")


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVICE_DEADLINE_S = 10.0  # verifier.static.static_worker.DEFAULT_TIMEOUT_S


STATIC = "tests/verifier/test_verifier_static_bounds.py"
CLIENT = "tests/test_verifier_client.py"
CLUSTER = "tests/train/test_multiprocess.py"
SERVER = "tests/verifier/test_verifier_server_cpu.py"
HOLES = "tests/verifier/test_verifier_holes.py"
LIMITS = "tests/verifier/test_verifier_limits.py"
LIVENESS = "tests/verifier/test_verifier_liveness.py"
PROTOCOL = "tests/verifier/test_verifier_protocol.py"
EVIDENCE = "tests/verifier/test_verifier_evidence.py"


@dataclasses.dataclass(frozen=True)
class Bound:
  """A recorded property of a test (each case of a parametrized one) and its bound.

  Groups: static (no builds, ~2 min on 2 cores), client (~1 min), verifier (C++ builds, ~10-30 min),
  cluster (a two-process SFT, ~3 min)."""

  group: str
  file: str
  name: str
  prop: str
  limit: float  # seconds, or a ratio
  why: str

  @property
  def test(self) -> str:
    return f"{self.file}::{self.name}"


BOUNDS = (
  Bound(
    "static",
    STATIC,
    "test_fuzz_generated_and_mutated_sources_each_get_a_verdict",
    "max_seconds",
    SERVICE_DEADLINE_S / 2,
    "any generated or mutated source: half the service's static-check deadline",
  ),
  Bound(
    "static",
    STATIC,
    "test_every_kernelbench_file_and_dice_task_gets_a_verdict",
    "max_seconds",
    SERVICE_DEADLINE_S / 2,
    "any KernelBench or DICE source: half the service's static-check deadline",
  ),
  Bound(
    "static",
    STATIC,
    "test_self_extending_or_cyclic_aliases_get_a_verdict_at_once",
    "seconds",
    20.0,
    "an alias stall (issue 24) in a fresh interpreter, start-up included",
  ),
  Bound(
    "client",
    CLIENT,
    "test_all_endpoints_down_gives_up_after_max_wait_naming_the_address",
    "seconds",
    10.0,
    "the client gives up soon after its max_wait_s (0.6 s)",
  ),
  Bound(
    "client",
    CLUSTER,
    "test_local_cluster_prefixes_output_and_stops_the_others_when_one_fails",
    "seconds",
    60.0,
    "local_cluster kills the others at once (--grace_s=1), not after their hour of sleep",
  ),
  Bound(
    "client",
    SERVER,
    "test_port_in_use_fails_at_once_with_one_line_and_leaves_nothing",
    "seconds",
    30.0,
    "serve on a port in use fails before starting any worker",
  ),
  Bound(
    "verifier",
    HOLES,
    "test_init_that_never_returns_times_out_under_the_request_limit_and_frees_the_compile_slot",
    "seconds_over_limit",
    2.0,
    "answered at the request's limit (6 s, or 3x a cached build), not at the build's 300 s",
  ),
  Bound(
    "verifier",
    LIMITS,
    "test_sleeping_static_initialiser_times_out_and_frees_the_compile_slot",
    "seconds",
    22.0,
    "the request's 10 s plus kill, clean-up and a loaded 2-core box (12 s)",
  ),
  Bound(
    "verifier",
    LIMITS,
    "test_sleeping_static_initialiser_times_out_and_frees_the_compile_slot",
    "good_seconds",
    34.0,
    "a correct candidate behind it gets the compile slot at that deadline (10 s + 2 x 12 s)",
  ),
  Bound(
    "verifier",
    LIMITS,
    "test_compile_bomb_is_bounded_by_the_request_timeout",
    "seconds",
    22.0,
    "the compile worker dies at the request's 10 s (g++ alone takes about a minute)",
  ),
  Bound(
    "verifier",
    LIVENESS,
    "test_the_alias_stall_gets_a_verdict_and_the_health_check_answers",
    "seconds",
    30.0,
    "four alias stalls get their verdicts through the service",
  ),
  Bound(
    "verifier",
    LIVENESS,
    "test_the_alias_stall_gets_a_verdict_and_the_health_check_answers",
    "health_max_seconds",
    1.0,
    "the health check answers within 1 s meanwhile",
  ),
  Bound(
    "verifier",
    LIVENESS,
    "test_health_answers_and_a_correct_candidate_passes_while_hostile_ones_run",
    "health_max_seconds",
    1.0,
    "the health check answers within 1 s while six hostile candidates run",
  ),
  Bound(
    "verifier",
    LIVENESS,
    "test_health_answers_and_a_correct_candidate_passes_while_hostile_ones_run",
    "good_seconds",
    20.0,
    "a correct candidate sent after them: its own 15 s timeout plus 5 s",
  ),
  Bound(
    "verifier",
    PROTOCOL,
    "test_candidate_maps_the_first_forwards_buffers_while_it_loads_and_runs_on_them",
    "map_seconds",
    1.0,
    "mapping a forward's (prefetched) buffers in the candidate process",
  ),
  Bound(
    "verifier",
    EVIDENCE,
    "test_helpers_spinning_from_init_do_not_slow_the_baseline",
    "baseline_ratio",
    3.0,
    "baseline with 8 spinning helpers / honest baseline (0063b19 measured 7.59x)",
  ),
  Bound(
    "cluster",
    CLUSTER,
    "test_two_processes_train_like_one_survive_a_kill_and_export_once",
    "seconds",
    60.0,
    "the survivor of a kill -9 exits after its 10 s heartbeat timeout",
  ),
)


def run_tests(tests: list[str], xml_path: str) -> int:
  """pytest on `tests` (slow ones included) with a JUnit report at `xml_path`; its exit status."""
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu"]
  cmd += ["-o", "junit_family=xunit1", f"--junitxml={xml_path}", *tests]
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  return subprocess.run(cmd, cwd=REPO, env=env).returncode


def recorded(xml_path: str) -> dict[str, dict]:
  """{test node id (file::name[param]): {"passed": bool, property: value}} from a JUnit report."""
  out = {}
  for case in ET.parse(xml_path).iter("testcase"):
    path = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    failed = any(case.find(k) is not None for k in ("failure", "error", "skipped"))
    out[f"{path}::{case.get('name')}"] = {"passed": not failed, **props}
  return out


def rows(bounds, results: dict[str, dict]) -> list[dict]:
  """One row per bound and test case: the measurement, the bound, their ratio, whether it holds."""
  out = []
  for b in bounds:
    cases = {k: v for k, v in results.items() if k == b.test or k.startswith(b.test + "[")}
    if not cases:
      out.append(dict(test=b.test, prop=b.prop, limit=b.limit, value=None, ok=False, why=b.why))
    for test, props in sorted(cases.items()):
      value = float(props[b.prop]) if b.prop in props else None
      ok = props["passed"] and value is not None and value <= b.limit
      ratio = None if value is None else value / b.limit
      row = dict(test=test, prop=b.prop, value=value, limit=b.limit, ratio=ratio, ok=ok, why=b.why)
      others = {k: v for k, v in props.items() if k not in ("passed", b.prop)}
      out.append(row | ({"recorded": others} if others else {}))
  return out


def table(rs: list[dict]) -> str:
  lines = [
    "| test | measured | bound | ratio | holds | why |",
    "| --- | ---: | ---: | ---: | --- | --- |",
  ]
  for r in rs:
    name = r["test"].split("::", 1)[1]
    value = "-" if r["value"] is None else f"{r['value']:.3g}"
    ratio = "-" if r.get("ratio") is None else f"{r['ratio']:.2f}"
    lines.append(
      f"| `{name}` {r['prop']} | {value} | {r['limit']:g} | {ratio} | {'yes' if r['ok'] else 'NO'} "
      f"| {r['why']} |"
    )
  return "\n".join(lines)


def main(argv):
  del argv
  unknown = set(FLAGS.groups) - {b.group for b in BOUNDS}
  if unknown:
    from dice_jax.errors import UserError

    raise UserError(
      f"--groups: unknown {sorted(unknown)}; known: {sorted({b.group for b in BOUNDS})}"
    )
  bounds = [b for b in BOUNDS if b.group in FLAGS.groups]
  with tempfile.TemporaryDirectory() as tmp:
    xml_path = os.path.join(tmp, "report.xml")
    run_tests(sorted({b.test for b in bounds}), xml_path)
    rs = rows(bounds, recorded(xml_path))
  print(table(rs))
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(rs, f, indent=1)
  if not all(r["ok"] for r in rs):
    sys.exit(1)


if __name__ == "__main__":
  from experiments import _cli

  define_flags()
  _cli.run(main)
