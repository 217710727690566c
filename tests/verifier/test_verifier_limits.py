"""Issue 24, items 2-4, one test per row of its table: the request's timeout bounds the compile and the
module import, resources are counted where they hide (memfds, processes, scratch), logs are read capped,
and nothing of the host leaves through a result.

One module-scoped CPU service with small limits. The C++ of the timeout and host-file rows is a plain
shared library (``is_python_module=False``: no pybind11, no torch headers), so only the hostile part
costs compiler time; the other rows reuse the holes' pybind11-only extension.
"""

import asyncio
import dataclasses
import os
import shutil
import subprocess
import sys
import time
import tracemalloc

import pytest

torch = pytest.importorskip("torch")

import verifier_hole_cases as holes  # noqa: E402
from verifier_loop import cpu_service  # noqa: E402

from verifier.api.contract import LOG_LIMIT, FailureKind, VerifyOptions, VerifyRequest  # noqa: E402
from verifier.sandbox import confine, sandbox  # noqa: E402

OPTS = VerifyOptions(device="cpu", timeout_s=60, num_correct_trials=2, strictness="off")
MEM_MB, SCRATCH_MB, MAX_PROCESSES = 2048, 64, 64
BUILD_TIMEOUT_S = 150  # the old cap on a build; the rows below name the request's limit instead
REPO_FILE = os.path.join(os.path.dirname(confine.__file__), "confine.py")
REPO_MARKER = "def toolchain_paths() -> list[str]:"


@pytest.fixture(scope="module")
def service(tmp_path_factory):
  root = tmp_path_factory.mktemp("limits")
  config = dict(mem_mb=MEM_MB, scratch_mb=SCRATCH_MB, max_processes=MAX_PROCESSES)
  with cpu_service(root, build_timeout_s=BUILD_TIMEOUT_S, **config) as (loop, svc):
    yield loop, svc


def _req(rid, source, **opts):
  return VerifyRequest(rid, "limits", holes.REFERENCE, source, dataclasses.replace(OPTS, **opts))


def _timed(service, *reqs, delay_s=0.0):
  """Results and seconds to each answer; the requests after the first are sent ``delay_s`` later."""
  loop, svc = service

  async def one(i, r):
    await asyncio.sleep(delay_s if i else 0.0)
    t0 = time.monotonic()
    res = await svc.verify(r)
    return res, time.monotonic() - t0

  async def go():
    return await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))

  return loop.run(go())


def _plain_library(cpp: str, module: str = "") -> str:
  """A candidate whose module first builds ``cpp`` as a plain shared library, then is GOOD."""
  return holes.GOOD.replace(
    "\ndef good(",
    f"lib = load_inline(name='vt_plain', cpp_sources={cpp!r}, is_python_module=False,\n"
    f"                  no_implicit_headers=True)\n{module}\n\ndef good(",
    1,
  )


SLEEPING_INITIALISER = _plain_library(
  "#include <chrono>\n#include <thread>\n"
  "static int slept = [] { std::this_thread::sleep_for(std::chrono::hours(1)); return 1; }();\n"
)
# 100 constexpr loops just under g++'s iteration limit: about a minute of compiler time on this box.
CONSTEXPR_BOMB = _plain_library(
  "".join(
    f"constexpr long f{i}() {{ long s = 0; for (long j = 0; j < 262000; ++j) s += j % {i + 3}; "
    f"return s; }}\nstatic_assert(f{i}() > 0);\n"
    for i in range(100)
  )
)
# The assembler reads a file of the repository into the library; the module prints it.
INCBIN = _plain_library(
  'asm(".section .rodata\\n.global vt_leaked\\nvt_leaked:\\n.incbin \\"'
  + REPO_FILE
  + '\\"\\n.byte 0\\n.previous");\n',
  module="import ctypes\nprint(ctypes.string_at(ctypes.addressof(ctypes.c_char.in_dll("
  "ctypes.CDLL(lib), 'vt_leaked'))).decode())",
)
# The environment's configuration, which the compiler read wherever a candidate's source named it (red
# team 43d: ``#include`` quoted it line by line in the COMPILE_ERROR; ``.incbin`` in a pybind11 module put
# it in the library, /work/redteam43d/cands/e3_incbin_leak.py, now "file not found" as well).
VENV_CFG = os.path.join(sys.prefix, "pyvenv.cfg")
VENV_CFG_INCLUDE = _plain_library(f'#include "{VENV_CFG}"\n')
MEMFD_HOG = holes.candidate(
  f"""        import os
        chunk = b"x" * (64 << 20)
        for name in ("a", "b"):  # two: each stays below the 4 GiB file-size limit
            fd = os.memfd_create(name)
            for _ in range({MEM_MB} // 64):
                os.write(fd, chunk)
        return good(a, b, self.scale)"""
)
FORK_SLEEPERS = holes.candidate(
  """        import os
        for _ in range(200):
            if os.fork() == 0:
                os.execv("/bin/sleep", ["sleep", "120"])
        return good(a, b, self.scale)"""
)
SCRATCH_FLOOD = holes.candidate(
  f"""        with open("flood.bin", "wb") as f:
            for _ in range({2 * SCRATCH_MB}):
                f.write(b"x" * (1 << 20))
        return good(a, b, self.scale)"""
)
SLEEPS_IN_FORWARD = holes.candidate(
  """        import time
        time.sleep(120)
        return good(a, b, self.scale)"""
)
STDOUT_FLOOD = holes.candidate(
  """        import sys
        for _ in range(256):
            sys.stdout.write("y" * (1 << 20))
        return zeros(a)"""
)
READS_THE_REPOSITORY = holes.candidate(
  f"""        print(open({REPO_FILE!r}).read())
        return zeros(a)"""
)


def test_good_candidate_passes_under_the_limits(service):
  ((res, _),) = _timed(service, _req("good", holes.GOOD))
  assert res.failure_kind is FailureKind.OK and res.reward == 1.0, res.reason + res.logs
  degraded = ("unavailable", "refused", "not size-limited", "not disabled", "can read it")
  assert not [w for w in res.warnings if any(d in w for d in degraded)], res.warnings
  assert sandbox.ACCOUNTING_NOTE in res.warnings


def test_sleeping_static_initialiser_times_out_and_frees_the_compile_slot(service, record_property):
  """Row 1: the extension's initialiser sleeps for an hour; the request's 10 s bound it (was the build
  limit, 900 s by default), and a correct candidate sent 1 s later, a build of its own behind it on the one
  compile slot, is answered once the slot is freed at that deadline (how soon: experiments/bench_bounds.py)."""
  (bad, bad_s), (good, good_s) = _timed(
    service,
    _req("static-init", SLEEPING_INITIALISER, timeout_s=10),
    _req("good-2", holes.GOOD + "\n# another build: it needs the compile slot\n"),
    delay_s=1.0,
  )
  record_property("seconds", bad_s)  # experiments/bench_bounds.py reads them
  record_property("good_seconds", good_s)
  assert bad.failure_kind is FailureKind.TIMEOUT and bad.reward == 0.0, bad.reason
  assert "10 s" in bad.reason, bad.reason
  assert good.failure_kind is FailureKind.OK, good.reason + good.logs
  stage = service[1].build_stage
  assert stage.slots.free == stage.slots.total


def test_compile_bomb_is_bounded_by_the_request_timeout(service, record_property):
  """Row 2: constexpr loops keep g++ busy for about a minute; the compile worker dies at 10 s."""
  ((res, seconds),) = _timed(service, _req("constexpr-bomb", CONSTEXPR_BOMB, timeout_s=10))
  record_property("seconds", seconds)  # experiments/bench_bounds.py reads it
  assert res.failure_kind is FailureKind.TIMEOUT and res.reward == 0.0, res.reason
  assert "10 s" in res.reason, res.reason  # the request's limit, not the build's 150 s
  # red team 44: a compile killed at the deadline left its build directory in the cache for good (1.9 GB
  # of compiler dumps there); the service removes it
  cache = service[1].cfg.cache_dir
  deadline = time.monotonic() + 30
  while (left := [n for n in os.listdir(cache) if ".tmp-" in n]) and time.monotonic() < deadline:
    time.sleep(0.2)
  assert not left, left


def test_a_huge_log_is_read_head_and_tail_only(tmp_path):
  """Row 3: a 256 MiB log (sparse: the candidate wrote 2 GiB in the issue) is not read whole."""
  path = tmp_path / sandbox.LOG_FILE
  with open(path, "wb") as f:
    f.write(b"HEAD-OF-LOG\n")
    f.truncate(256 << 20)
    f.seek(0, os.SEEK_END)
    f.write(b"\nTAIL-OF-LOG")
  worker = sandbox.Worker.__new__(sandbox.Worker)
  worker.scratch = str(tmp_path)
  tracemalloc.start()
  try:
    text = worker.read_log()
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert peak < 2 << 20, peak
  assert text.startswith("HEAD-OF-LOG") and text.endswith("TAIL-OF-LOG")
  assert len(text) <= LOG_LIMIT + 100


def test_a_candidate_flooding_its_log_does_not_grow_the_service(service):
  """Row 3 through the service: 256 MiB printed per forward, wrong output; the service (this process)
  allocates a few MiB for the result (was: the whole log, 4 GiB in the issue)."""
  tracemalloc.start()
  try:
    ((res, _),) = _timed(service, _req("stdout-flood", STDOUT_FLOOD))
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert res.failure_kind is FailureKind.WRONG_OUTPUT and res.reward == 0.0, res.reason
  assert res.logs.endswith("y" * 1000) and len(res.logs) <= LOG_LIMIT + 100
  assert peak < 32 << 20, peak


def test_a_log_replaced_by_a_link_to_a_host_file_is_not_read(tmp_path):
  os.symlink(REPO_FILE, tmp_path / sandbox.LOG_FILE)
  worker = sandbox.Worker.__new__(sandbox.Worker)
  worker.scratch = str(tmp_path)
  assert worker.read_log() == ""


def test_memory_of_a_tree_counts_unmapped_memfds():
  """Row 4 (accounting): 96 MiB in a memfd that is not mapped is not resident memory, but it is held."""
  child = subprocess.Popen(
    [
      sys.executable,
      "-c",
      "import os, sys, time\nfd = os.memfd_create('hog')\n"
      "for _ in range(96): os.write(fd, b'x' * (1 << 20))\n"
      "print('ready', flush=True)\ntime.sleep(60)",
    ],
    stdout=subprocess.PIPE,
  )
  try:
    assert child.stdout.readline().strip() == b"ready"
    usage = sandbox.process_tree_usage(child.pid)
  finally:
    child.kill()
    child.wait()
  assert usage.memory_mb > 96, usage
  assert usage.processes == 1


def test_memfd_hog_is_killed_as_out_of_memory(service):
  """Row 4: two memfds of the memory limit each, never mapped (was reward 1 with 2x the limit held)."""
  ((res, _),) = _timed(service, _req("memfd-hog", MEMFD_HOG))
  assert res.failure_kind is FailureKind.OUT_OF_MEMORY and res.reward == 0.0, res.reason
  assert f"(resident and shared memory) exceeded the limit of {MEM_MB} MiB" in res.reason, (
    res.reason
  )


def test_fork_sleepers_hit_the_process_limit(service):
  """Row 5: 200 forked sleepers against a limit of 64 processes (was reward 1, 589 host processes)."""
  ((res, _),) = _timed(service, _req("fork-sleepers", FORK_SLEEPERS))
  assert res.failure_kind is FailureKind.RESOURCE_LIMIT and res.reward == 0.0, res.reason
  # the kernel refuses the fork past the limit (issue 37: a cgroup per job, RLIMIT_NPROC or pid_max);
  # the poll kills the worker where none of those caps it exactly
  assert (
    "the kernel refused" in res.reason
    or f"processes exceeded the limit of {MAX_PROCESSES}" in res.reason
  ), res.reason


def test_scratch_flood_stops_at_the_quota(service):
  """Row 5: twice the scratch quota written into the working directory: the write fails (ENOSPC)."""
  ((res, _),) = _timed(service, _req("scratch-flood", SCRATCH_FLOOD))
  assert res.failure_kind is FailureKind.RUNTIME_ERROR and res.reward == 0.0, res.reason
  assert "No space left on device" in res.reason + res.logs, res.reason


def test_repository_is_not_readable_from_a_toolchain_path():
  paths = confine.toolchain_paths()
  repo = os.path.realpath(confine.IMPORT_ROOT)
  prefix = os.path.realpath(
    sys.prefix
  )  # the interpreter's installation may be the checkout's .venv
  inside = lambda p, d: p == d or p.startswith(d + os.sep)
  assert not [p for p in paths if inside(p, repo) and not inside(os.path.realpath(p), prefix)], (
    paths
  )
  assert not [p for p in paths if inside(repo, os.path.realpath(p))], paths  # nor a folder above it
  # the interpreter's installation is readable, all of it but a virtual environment's pyvenv.cfg and this
  # project's installation record (a directory holding one is allowed entry by entry)
  real = [os.path.realpath(p) for p in paths]
  for n in [n for n in os.listdir(prefix) if n != "pyvenv.cfg"]:
    q = os.path.realpath(os.path.join(prefix, n))
    assert any(inside(q, p) or inside(p, q) for p in real), (n, paths)
  assert any(inside(os.path.realpath(torch.__file__), p) for p in real), paths
  record = [
    n for n in os.listdir(os.path.dirname(os.path.dirname(torch.__file__))) if "dice_jax" in n
  ]
  for n in record:  # e.g. dice_jax-0.1.0.dist-info, __editable___dice_jax_0_1_0_finder.py
    q = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(torch.__file__))), n)
    assert not any(inside(q, p) for p in real), (n, paths)


def test_candidate_cannot_print_a_repository_file(service):
  """Row 6, in the candidate process: reading a file of the repository fails."""
  ((res, _),) = _timed(service, _req("reads-repo", READS_THE_REPOSITORY))
  assert res.reward == 0.0
  assert res.failure_kind is FailureKind.RUNTIME_ERROR, res.reason
  assert "Permission denied" in res.reason + res.logs, res.reason
  assert REPO_MARKER not in res.logs + res.reason


def test_assembler_cannot_include_a_repository_file(service):
  """Row 6, in the compiler: ``.incbin`` of a repository file fails to assemble, and nothing of the file
  comes back (was WRONG_OUTPUT with the file in ``result.logs``)."""
  with open(REPO_FILE) as f:
    assert REPO_MARKER in f.read()  # the marker is the file's own text (it went stale once)
  ((res, _),) = _timed(service, _req("incbin", INCBIN))
  assert res.failure_kind is FailureKind.COMPILE_ERROR and res.reward == 0.0, res.reason
  assert f"Error: file not found: {REPO_FILE}" in res.reason, res.reason  # Landlock: EACCES
  assert REPO_MARKER not in res.logs + res.reason


@pytest.mark.skipif(not os.path.isfile(VENV_CFG), reason="Python here is not a virtual environment")
def test_the_compiler_cannot_read_the_environments_configuration(service):
  """Red team 43d: compile workers kept ``pyvenv.cfg`` readable (for the environment's Python and a
  script ninja), and the compiler quoted it. Now no worker reads it."""
  ((res, _),) = _timed(service, _req("venv-cfg", VENV_CFG_INCLUDE))
  assert res.failure_kind is FailureKind.COMPILE_ERROR and res.reward == 0.0, res.reason
  assert f"{VENV_CFG}: Permission denied" in res.reason, res.reason
  with open(VENV_CFG) as f:
    lines = [line.strip() for line in f if line.strip()]  # "home = /...", "version = 3.11.7"
  assert lines and not [line for line in lines if line in res.reason + res.logs], lines


def test_a_script_ninja_gives_way_to_the_wheels_binary(tmp_path, monkeypatch):
  """Older ninja wheels install a Python entry point, which cannot start without ``pyvenv.cfg``: workers
  find the wheel's own binary first."""
  scripts, package = tmp_path / "bin", tmp_path / "site" / "ninja"
  scripts.mkdir()
  (scripts / "ninja").write_text("#!/venv/bin/python\nfrom ninja import ninja\n")
  (scripts / "ninja").chmod(0o755)
  (package / "data" / "bin").mkdir(parents=True)
  (package / "__init__.py").write_text("")
  shutil.copy("/bin/true", package / "data" / "bin" / "ninja")
  monkeypatch.syspath_prepend(str(tmp_path / "site"))
  monkeypatch.delitem(sys.modules, "ninja", raising=False)
  path = os.pathsep.join([str(scripts), "/usr/bin"])
  first = sandbox.native_ninja_first.__wrapped__(path)
  assert first == os.pathsep.join([str(package / "data" / "bin"), str(scripts), "/usr/bin"])
  assert sandbox.native_ninja_first.__wrapped__(first) == first  # a binary first: as it is
  assert sandbox.native_ninja_first.__wrapped__(str(tmp_path)) == str(tmp_path)  # no ninja at all


def _module_file(name: str) -> str | None:
  """The source file of verifier module or package ``name``, or None."""
  base = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(confine.__file__))), *name.split(".")
  )
  for path in (base + ".py", os.path.join(base, "__init__.py")):
    if os.path.exists(path):
      return path
  return None


def _verifier_imports(path: str) -> set[str]:
  """The ``verifier`` modules a source file imports, at module level or inside functions."""
  import ast

  out = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names if a.name.startswith("verifier.")}
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("verifier"):
      out.add(node.module)
      out |= {f"{node.module}.{a.name}" for a in node.names}  # `from verifier.ipc import exchange`
  return {m for m in out if _module_file(m)}


def test_worker_code_is_imported_before_workers_lose_the_repository():
  """Confined workers cannot read the repository, so every verifier module the worker code imports,
  even lazily inside a function (exchange -> cuda_driver on a GPU), is imported by the fork server."""
  code = (
    "import importlib, sys\nfrom verifier.candidate import zygote\n"
    "for m in zygote.WORKER_MODULES: importlib.import_module(m)\n"
    "print(' '.join(k for k in sys.modules if k.startswith('verifier.')))"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  loaded = set(out.stdout.split())
  assert {
    "verifier.candidate.candidate_main",
    "verifier.build.build_main",
    "verifier.ipc.cuda_driver",
  } <= loaded
  missing = set()
  for name in loaded:
    path = _module_file(name)
    missing |= (
      {(name, dep) for dep in _verifier_imports(path) if dep not in loaded} if path else set()
    )
  assert not missing, missing


def _gone(pid: int) -> bool:
  """No such process, or a zombie (killed, not yet reaped)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rpartition(")")[2].split()[0] == "Z"
  except OSError:
    return True


@pytest.mark.parametrize("end", ["cancelled", "closed"])
def test_a_job_ended_mid_check_leaves_no_process_and_the_service_goes_on(service, end):
  """A request cancelled while its candidate runs (its client went away), or its coroutine closed (what
  a task destroyed pending with a stopped loop gets: GeneratorExit, where nothing may be awaited; the
  H200 run of 2026-12-03 logged "no running event loop" there): its worker and checker are killed at
  once, the slot and a fresh checker come back, and the next candidate passes."""
  loop, svc = service
  pool = svc.run_pools["cpu"][0]

  async def end_it():
    task = asyncio.ensure_future(svc.verify(_req(f"sleeps-{end}", SLEEPS_IN_FORWARD)))
    for _ in range(1200):
      if pool.running or task.done():
        break
      await asyncio.sleep(0.05)
    assert pool.running, task.result() if task.done() else "no check began in 60 s"
    await asyncio.sleep(0.5)  # into its check
    worker, checker = next(iter(pool.running.values()))
    pids = [*worker.tree_pids(), checker.proc.pid]
    ended = asyncio.CancelledError
    if end == "closed":
      task.get_coro().close()  # raises if anything was awaited on the way out
      ended = RuntimeError  # the task's own end: its closed coroutine cannot be resumed
    task.cancel()
    with pytest.raises(ended):
      await task
    for _ in range(200):
      if all(_gone(p) for p in pids) and pool.slots.free == pool.slots.total:
        break
      await asyncio.sleep(0.05)
    return pids

  pids = loop.run(end_it())
  assert [p for p in pids if not _gone(p)] == [] and not pool.running
  assert pool.slots.free == pool.slots.total
  ((res, _),) = _timed(service, _req(f"good-after-{end}", holes.GOOD))
  assert res.failure_kind is FailureKind.OK, res.reason + res.logs
