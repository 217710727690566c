"""Red team 46: the host sampler's records (strict, CPU; /work/redteam46/REPORT.md).

- A1: a ``clone(CLONE_VM)`` child kept the table's copy of its parent's address space, so OpenBLAS
  loaded by the parent over its own build's text counted as own code in the child (reward 1). Now a
  child shares its parent's tables until it execs (and the seccomp filter refuses such a clone:
  test_verifier_relabel.py).
- L1: a flood of name records (``prctl(PR_SET_NAME)``) filled the one ring, the kernel dropped the
  library's mapping record, and the table went on trusting its map (reward 1). Now the side-band records
  have a ring of their own, and one seen near full blinds the table.
- T1: ending one of the runtime's threads made room under the pids cgroup's peak for one of the
  candidate's own. Now tasks created since the attach are counted from fork and exit records
  (test_verifier_evidence_v2.py has the candidate).
- D1, D2, D3: lost records kept one entry each; every fork copied (and scanned) tables that nothing freed.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from verifier.api.contract import FailureKind
from verifier.check import host_sampler
from verifier.check.host_sampler import Exec, Exit, Fork, Lost, Mapping, ModuleTable, Sample

from verifier_sampled import run_sampled

OWN = "/cache/" + "ab" * 16 + "/own.so"
PAGE = 4096
PAD = 1 << 30


def test_a_clone_vm_child_sees_what_its_parent_maps_over_its_own_code():
  # A1's order of events: the own build's pad mapped, a child made, the parent maps a library over
  # the pad (a forgery: it lies over own code), the child computes there.
  table = ModuleTable()
  table.apply(Mapping(1, 7, PAD, PAD + 32 * PAGE, OWN))
  table.apply(Fork(2, 8, 7, 8))
  table.apply(Mapping(3, 7, PAD, PAD + 32 * PAGE, "/memfd:blas"))
  table.apply(Sample(4, 8, PAD + 8))  # before: the child's stale copy said "own"
  forged = host_sampler.FORGED.format("memfd:blas")
  assert table.count(4, 4) == {forged: 1}
  assert table.forgery == ["lies over the code of own.so"]
  # the other way round: what the child maps, the parent runs
  table.apply(Mapping(5, 8, 3 * PAD, 3 * PAD + PAGE, host_sampler.ANON))
  table.apply(Sample(6, 7, 3 * PAD + 8))
  assert table.count(6, 6) == {host_sampler.ANON: 1}
  # an exec starts a space of its own; the parent's stays
  table.apply(Exec(7, 8))
  table.apply(Sample(8, 8, PAD + 8))
  table.apply(Sample(9, 7, PAD + 8))
  assert table.count(8, 9) == {host_sampler.UNKNOWN: 1, forged: 1}


def test_forks_share_tables_and_exits_free_them():
  # D3: 800 loader-like mappings, then thousands of children: each fork copied the parent's tables and
  # scanned every process's load bases, and nothing was freed at exit (minutes of checker CPU).
  table = ModuleTable()
  for i in range(50):
    table.apply(Mapping(i, 7, PAD + 2 * i * PAGE, PAD + (2 * i + 1) * PAGE, f"/none/lib{i}.so"))
  for k in range(3000):
    child = 100 + k
    table.apply(Fork(1000 + 2 * k, child, 7, child))
    assert table.procs[child] is table.procs[7]  # nothing copied
    table.apply(Exit(1001 + 2 * k, child, child))
  assert sorted(table.procs) == [7]
  assert table.tasks_created == 3000 and table.tasks_peak == 1


def test_lost_records_cost_one_entry_per_record_not_per_sample():
  # D1: a Lost record of n samples became n entries (7 MB/s of checker memory under a name flood).
  table = ModuleTable()
  table.apply(Sample(5, 7, 1))
  table.apply(Lost(10, 1 << 20))
  table.apply(Lost(20, 3))
  table.apply(Lost(15, 0))  # a throttle mark: nothing lost
  assert len(table.lost_times) == 2 and len(table.times) == 1
  assert table.count(0, 30) == {host_sampler.UNKNOWN: 1, host_sampler.LOST: (1 << 20) + 3}
  assert table.count(11, 30) == {host_sampler.LOST: 3}
  assert table.lost == (1 << 20) + 3


def test_a_blind_table_counts_every_sample_since_for_no_ones_code():
  table = ModuleTable()
  table.apply(Mapping(1, 7, PAD, PAD + PAGE, OWN))
  for t in (10, 20, 30):
    table.apply(Sample(t, 7, PAD + 8))
  table.blind(15)  # the samples already attributed since then too
  table.apply(Sample(40, 7, PAD + 8))
  table.blind(35)  # a later loss does not shorten it
  assert table.count(0, 50) == {OWN: 1, host_sampler.BLIND: 3}


def test_tasks_alive_at_once_count_only_those_created_since_the_attach():
  # T1: the runtime's thread 11 (seeded, not created) ends; the candidate's 12 and 13 are created.
  table = ModuleTable()
  table.apply(Exit(1, 7, 11))
  table.apply(Fork(2, 7, 7, 12))
  assert table.tasks_peak == 1
  table.apply(Exit(3, 7, 12))
  table.apply(Fork(4, 7, 7, 13))
  table.apply(Fork(5, 20, 7, 20))  # a process
  assert (table.tasks_peak, table.tasks_created) == (2, 3)


# ---- on a live process --------------------------------------------------------------------------------
def _sampled_child(flood: int) -> host_sampler.HostSampler:
  """The sampler of a child that, once attached, renames its thread ``flood`` times
  (``prctl(PR_SET_NAME)``: one side-band record each) and then spins for 0.15 s of CPU."""
  work = (
    "import ctypes, time\n"
    "libc = ctypes.CDLL(None)\n"
    f"for i in range({flood}):\n"
    "    libc.prctl(15, b'n%d' % (i & 7), 0, 0, 0)\n"
    "t = time.process_time()\n"
    "while time.process_time() - t < 0.15:\n"
    "    pass\n"
  )
  return run_sampled("", work)[1]


def test_a_flood_of_name_records_blinds_the_table_and_a_quiet_process_does_not():
  # L1: 400,000 renames before the library was loaded; its mapping record was dropped.
  quiet = _sampled_child(0)
  assert quiet.table.blind_from is None
  assert sum(quiet.table.count(0, time.monotonic_ns()).values()) >= 200
  assert host_sampler.BLIND not in quiet.table.names
  flooded = _sampled_child(400_000)
  assert flooded.table.blind_from is not None
  counts = flooded.table.count(flooded.table.blind_from, time.monotonic_ns())
  assert counts.get(host_sampler.BLIND, 0) >= 200, counts  # the spin after the flood
  assert sum(counts.values()) == counts[host_sampler.BLIND], counts


def _exec_sampled(mode: int) -> tuple:
  """A child that, once sampled, runs a copy of ``sh`` of file mode ``mode`` busy for ~0.3 s of CPU (as
  an unprivileged user where the test runs as root, as the candidate's worker does): its samples and a
  strict CallEvidence over it."""
  from verifier.api.contract import Strictness
  from verifier.check.call_evidence import CallEvidence

  where = tempfile.mkdtemp()
  try:
    os.chmod(where, 0o755)
    exe = os.path.join(where, "sh")
    shutil.copy(shutil.which("sh"), exe)
    os.chmod(exe, mode)
    work = (
      "if os.getuid() == 0:\n"
      "    os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
      f"os.execv({exe!r}, ['sh', '-c', 'i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done'])\n"
    )
    counts, sampler = run_sampled("", work)
  finally:
    shutil.rmtree(where)
  evidence = CallEvidence("cpu", where, Strictness.preset("strict"))
  evidence.sampler = sampler
  return counts, evidence


def test_a_process_that_runs_another_program_fails_even_where_that_ends_its_sampling():
  # Red team 47 (E1): the worker exec'd an execute-only copy of the interpreter; the kernel made it
  # non-dumpable and ended every perf event attached to it, so no judged window held a sample and
  # torch.matmul in the new image got reward 1 (timed: speedup 1.09). The exec record comes first.
  readable, evidence = _exec_sampled(0o755)
  assert sum(readable.values()) >= 300, readable  # sampled through the exec: the loop in sh
  unreadable, evidence = _exec_sampled(0o111)
  assert sum(unreadable.values()) < 50, unreadable  # the events ended at the exec
  assert evidence.sampler.table.execs == 1
  v = evidence.verdict()
  evidence.close()
  assert v.kind is FailureKind.EVIDENCE_MISSING and "ran another program" in v.reason, v


def test_judged_round_trips_far_quieter_than_the_exchange_alone_are_no_evidence():
  # Red team 47's E1 by its effect: whatever ends the sampling of the candidate's process leaves the
  # judged round trips empty where the verifier's own exchange work alone leaves samples.
  from verifier.check import host_evidence
  from verifier.check.host_evidence import HostWindow

  nulls = [HostWindow({"/usr/lib/libpython3.11.so": 6}, 0, 8) for _ in range(4)]
  silent = [HostWindow({}, 8, 8) for _ in range(10)]
  v = host_evidence.judge_host(silent, nulls, 100_000, "/cache", "cpu")
  assert (
    v.kind is FailureKind.EVIDENCE_MISSING and "held 0 samples" in v.reason and "~60" in v.reason
  )
  honest = [HostWindow({"/usr/lib/libpython3.11.so": 6, OWN: 9}, 8, 8) for _ in range(10)]
  assert host_evidence.judge_host(honest, nulls, 100_000, "/cache", "cpu").kind is FailureKind.OK
  few = silent[:3]  # ~18 expected: too few to tell a quiet host from a silenced one
  assert host_evidence.judge_host(few, nulls, 100_000, "/cache", "cpu").kind is FailureKind.OK


def test_the_sampler_makes_room_for_its_descriptors_under_a_low_open_file_limit():
  # Two events per (thread, CPU): a 128-CPU host's worker of ten threads needs 2,560 descriptors, over
  # the usual soft limit of 1,024; an EMFILE had left the request without host evidence (a warning).
  code = (
    "import os, resource\n"
    "from verifier.check import host_sampler\n"
    "_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
    "resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir('/proc/self/fd')) + 1, hard))\n"
    "try:\n"
    "    s = host_sampler.HostSampler.attach(os.getpid())\n"
    "except host_sampler.SamplerUnavailable as e:\n"
    "    print('unavailable', e); raise SystemExit(0)\n"
    "print(len(s.fds), resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= len(os.listdir('/proc/self/fd')))\n"
    "s.close()\n"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert "errno 24" not in out.stdout, out.stdout  # EMFILE: before, the limit was left as it was
  if out.stdout.startswith("unavailable"):
    pytest.skip(f"this host refuses perf_event_open: {out.stdout}")
  fds, room = out.stdout.split()
  assert int(fds) >= 2 * len(host_sampler.online_cpus()) and room == "True", out.stdout


def test_code_of_no_loaded_file_gets_no_allowance_from_the_candidates_own_time():
  # Red team 48 (G): OpenBLAS copied into a memfd and run in slices between the sampler's ticks left a
  # few of its samples, which the general rule let the candidate's own (waiting) time pay for.
  from verifier.check import host_evidence
  from verifier.check.host_evidence import HostWindow

  nulls = [HostWindow({"/usr/lib/libpython3.11.so": 2, "[vdso]": 1}, 0, 1) for _ in range(4)]
  for module in ("/memfd:blas (deleted)", "/tmp/x.so (deleted)", host_sampler.ANON):
    calls = [HostWindow({OWN: 400, module: 20, "/usr/lib/libpython3.11.so": 2}, 1, 1)]
    v = host_evidence.judge_host(calls, nulls, 100_000, "/cache", "cpu")
    assert v.kind is FailureKind.HOST_COMPUTE and "no loaded file" in v.reason, (module, v)
  ticks = [HostWindow({OWN: 400, "[vdso]": 20, "/usr/lib/libpython3.11.so": 2}, 1, 1)]
  assert host_evidence.judge_host(ticks, nulls, 100_000, "/cache", "cpu").kind is FailureKind.OK
  assert not host_evidence.no_loaded_file("/usr/lib/libtorch_cpu.so")
