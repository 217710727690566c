"""Issue 37, items 3-8, with hostile candidates written for this project (each got reward 1, a leak or
an unfair wait on c10e1a8): tasks bounded by the kernel, a tolerance small outputs cannot game, nothing
of the host in a verdict, compared calls that look like the others, fair compile slots, CPU timing that
cannot floor into a reward.

One module-scoped CPU service (one compile slot, a short compile quantum) and one pybind11 extension
without torch headers (built once, through the build cache) whose functions do the hostile part in
native code: threads started through ``dlsym`` of a name built at run time, a burst of processes too
brief for any poll, a constant fill. No assertion here is a wall-clock bound: the fair-slot test compares
the order in which answers arrive, the timing test compares three runs with each other.
"""

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import verifier_hole_cases as holes  # noqa: E402
from verifier_loop import cpu_service  # noqa: E402

from verifier.api.contract import (  # noqa: E402
  CANDIDATE_TEXT_LABEL,
  CANDIDATE_TEXT_LIMIT,
  FailureKind,
  VerifyOptions,
  VerifyRequest,
)
from verifier.build.build_stage import BuildStage  # noqa: E402
from verifier.build.fair_slots import TICK_S, Budget, FairSlots, Turn  # noqa: E402
from verifier.check import correctness, timed_calls, timing  # noqa: E402
from verifier.sandbox import confine, task_limits  # noqa: E402

OPTS = VerifyOptions(device="cpu", timeout_s=60, num_correct_trials=2, strictness="off")
MAX_PROCESSES = 64
QUANTUM_S = 1.5

EXTENSION = r"""
#include <pybind11/pybind11.h>
#include <csignal>
#include <cstdint>
#include <string>
#include <vector>
#include <cstdlib>
#include <dirent.h>
#include <dlfcn.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
void scaled_add_raw(std::uintptr_t a, std::uintptr_t b, std::uintptr_t out, std::int64_t n, double s) {
    const float* pa = reinterpret_cast<const float*>(a);
    const float* pb = reinterpret_cast<const float*>(b);
    float* po = reinterpret_cast<float*>(out);
    for (std::int64_t i = 0; i < n; ++i) po[i] = (pa[i] + pb[i]) * (float)s;
}
void fill_raw(std::uintptr_t out, std::int64_t n, double value) {
    float* po = reinterpret_cast<float*>(out);
    for (std::int64_t i = 0; i < n; ++i) po[i] = (float)value;
}
static void* sleep_forever(void*) { for (;;) pause(); return nullptr; }
// Threads through a function found at run time: no thread symbol in the built library.
int start_threads(int n) {
    std::string name = std::string("pthread_") + "create";
    using create_t = int (*)(unsigned long*, const void*, void* (*)(void*), void*);
    auto create = reinterpret_cast<create_t>(dlsym(RTLD_DEFAULT, name.c_str()));
    int started = 0;
    for (int i = 0; i < n; ++i) {
        unsigned long t;
        if (create(&t, nullptr, sleep_forever, nullptr) != 0) break;
        ++started;
    }
    return started;
}
// n processes alive at once for a moment (spawned without copying this process: far less than a
// poll's period), then gone.
int fork_burst(int n) {
    std::vector<pid_t> kids;
    char arg0[] = "sleep", arg1[] = "30";
    char* argv[] = {arg0, arg1, nullptr};
    for (int i = 0; i < n; ++i) {
        pid_t p;
        if (posix_spawn(&p, "/bin/sleep", nullptr, nullptr, argv, environ) != 0) break;
        kids.push_back(p);
    }
    for (pid_t p : kids) kill(p, SIGKILL);
    for (pid_t p : kids) waitpid(p, nullptr, 0);
    return (int)kids.size();
}
static int highest_other_thread() {
    int self = (int)syscall(SYS_gettid), top = 0;
    DIR* d = opendir("/proc/self/task");
    if (!d) return 0;
    while (dirent* e = readdir(d)) {
        int t = atoi(e->d_name);
        if (t != self && t > top) top = t;
    }
    closedir(d);
    return top;
}
static void exit_this_thread(int) { syscall(SYS_exit, 0); }
// End the runtime's newest thread (the worker's idle buffer mapper): one task fewer alive, so a pids
// cgroup's peak has room for one of the candidate's own (red team 46, T1). Returns the tid ended.
int end_runtime_thread() {
    int victim = highest_other_thread();
    if (victim == 0) return 0;
    signal(SIGUSR2, exit_this_thread);
    syscall(SYS_tgkill, getpid(), victim, SIGUSR2);
    for (int i = 0; i < 2000 && highest_other_thread() == victim; ++i) usleep(1000);
    return highest_other_thread() == victim ? -1 : victim;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("scaled_add_raw", &scaled_add_raw);
    m.def("fill_raw", &fill_raw);
    m.def("start_threads", &start_threads);
    m.def("fork_burst", &fork_burst);
    m.def("end_runtime_thread", &end_runtime_thread);
}
"""


def candidate(forward: str, module: str = "", init: str = "") -> str:
  """``forward`` as the body of ``ModelNew.forward(self, a, b)`` (8-space indented), ``module`` as
  module-level code after the extension loads, ``init`` appended to ``__init__``."""
  return f'''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = r"""{EXTENSION}"""
ops = load_inline(name="vt_v2", cpp_sources=source, no_implicit_headers=True, extra_cflags=["-O2"])
{module}

def good(a, b, scale):
    out = torch.empty_like(a)
    ops.scaled_add_raw(a.data_ptr(), b.data_ptr(), out.data_ptr(), a.numel(), scale)
    return out


class ModelNew(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale
{init}
    def forward(self, a, b):
{forward}
'''


GOOD = candidate("        return good(a, b, self.scale)")


@pytest.fixture(scope="module")
def service(tmp_path_factory):
  root = tmp_path_factory.mktemp("evidence_v2")
  with cpu_service(root, max_processes=MAX_PROCESSES, compile_quantum_s=QUANTUM_S) as (loop, svc):
    yield loop, svc


def _req(rid, source, reference=holes.REFERENCE, **opts):
  return VerifyRequest(rid, "v2", reference, source, dataclasses.replace(OPTS, **opts))


def _verify(service, *reqs):
  loop, svc = service

  async def go():
    return await asyncio.gather(*(svc.verify(r) for r in reqs))

  return loop.run(go())


def _ok(r):
  assert r.failure_kind is FailureKind.OK and r.reward == 1.0, (r.reason, r.logs[-2000:])


# ---- 3. tasks bounded by the kernel, not by polling -------------------------------------------------
def test_a_brief_burst_of_processes_fails_at_the_limit(service):
  # c10e1a8: the poll every 0.25 s never saw the burst; reward 1.
  src = candidate(
    "        self.forked = max(self.forked, ops.fork_burst(4 * self.limit))\n"
    "        return good(a, b, self.scale)",
    init=f"        self.forked = 0\n        self.limit = {MAX_PROCESSES}",
  )
  (r,) = _verify(service, _req("fork-burst", src))
  assert r.failure_kind is FailureKind.RESOURCE_LIMIT and r.reward == 0.0, (r.reason, r.warnings)
  assert "refused" in r.reason
  assert any("pids cgroup" in w or "RLIMIT_NPROC" in w or "pid_max" in w for w in r.warnings)


def test_threads_started_through_dlsym_are_refused_under_strict(service):
  # c10e1a8: two threads through a dlsym'd pthread_create, strict preset: reward 1.
  beyond = service[1].metrics.tasks_beyond_baseline  # jobs by their tasks beyond the runtime's
  before = beyond.copy()
  good_strict = _verify(service, _req("strict-good", GOOD, strictness="strict"))[0]
  _ok(good_strict)
  src = candidate("        return good(a, b, self.scale)", init="        ops.start_threads(2)\n")
  (r,) = _verify(service, _req("dlsym-threads", src, strictness="strict"))
  assert r.failure_kind is FailureKind.THREAD_OR_STREAM and r.reward == 0.0, r.reason
  assert "kernel's count" in r.reason
  assert beyond - before == {0: 1, 2: 1}  # the honest job held none, the hostile one its two


def test_ending_a_runtime_thread_makes_no_room_for_the_candidates_own(service):
  # Red team 46 (T1): the pids cgroup counts tasks alive at once, so a candidate that ended the
  # worker's idle mapper thread (tgkill, a handler that exits the thread) started one of its own with
  # the peak still at the runtime's: reward 1 under strict. The checker now counts the tasks created
  # since it attached, from the kernel's fork and exit records; a runtime task ending frees nothing.
  src = candidate(
    "        return good(a, b, self.scale)",
    init="        assert ops.end_runtime_thread() > 0\n        ops.start_threads(1)\n",
  )
  (r,) = _verify(service, _req("end-runtime-thread", src, strictness="strict"))
  assert r.failure_kind is FailureKind.THREAD_OR_STREAM and r.reward == 0.0, (
    r.reason,
    r.logs[-800:],
  )
  assert "1 alive at once beyond its runtime's own" in r.reason, r.reason


def test_thousands_of_sleeping_threads_fail_at_the_limit(service):
  # c10e1a8: 3,000 sleeping threads, reward 1 (no preset counts threads from outside).
  src = candidate("        return good(a, b, self.scale)", init="        ops.start_threads(3000)\n")
  (r,) = _verify(service, _req("sleeping-threads", src))
  assert r.failure_kind is FailureKind.RESOURCE_LIMIT and r.reward == 0.0, r.reason


COMM = (
  "vt-outlive-5521"  # a task name (15 characters at most): /proc shows it until the task is gone
)


def _named() -> list[int]:
  found = []
  for d in os.listdir("/proc"):
    try:
      with open(f"/proc/{d}/comm") as f:
        if f.read().strip() == COMM:
          found.append(int(d))
    except (OSError, ValueError):
      pass
  return found


def test_nothing_the_candidate_started_outlives_its_verdict(service):
  # c10e1a8 answered once the worker's waiter was gone, while the kernel was still tearing its
  # namespace down: a process of the candidate's holding 1 GB was still exiting after the verdict.
  src = candidate(
    "        import os\n"
    "        if not self.started:\n"
    "            self.started = True\n"
    "            if os.fork() == 0:\n"
    "                os.setsid()\n"
    "                with open('/proc/self/comm', 'w') as f:\n"
    f"                    f.write({COMM!r})\n"
    "                held = b'x' * (1 << 30)\n"
    "                time.sleep(600)\n"
    "            time.sleep(2)\n"
    "        return good(a, b, self.scale)",
    module="import time",
    init="        self.started = False",
  )
  (r,) = _verify(service, _req("outlive", src))
  left = _named()
  for pid in left:  # never leave it on a shared box, whatever the verdict
    os.kill(pid, signal.SIGKILL)
  assert not left, (
    f"{len(left)} of the candidate's processes outlived its verdict ({r.failure_kind})"
  )


# The confined side of the two task-limit tests, run in a fresh interpreter: a fork of this process
# (gRPC's threads running from earlier tests) could come out multithreaded, where unshare(CLONE_NEWUSER)
# fails with EINVAL (it did once in a run of tests/verifier). Prints "<processes spawned> <notes>".
SPAWN_SLEEPERS = r"""
import os, signal, sys
from verifier.sandbox import confine


def spawn_sleepers(n):
  # up to n sleeping processes, until the kernel refuses one (spawned, not forked: cheap)
  kids = []
  try:
    for _ in range(n):
      kids.append(os.posix_spawn("/bin/sleep", ["sleep", "30"], {}))
  except OSError:
    pass
  return kids
"""

NPROC_CHILD = (
  SPAWN_SLEEPERS
  + r"""
if os.geteuid() == 0:  # the kernel exempts uid 0: run as nobody
  os.setgroups([])
  os.setresgid(65534, 65534, 65534)
  os.setresuid(65534, 65534, 65534)
  confine._libc.prctl(confine.PR_SET_DUMPABLE, 1, 0, 0, 0)  # a uid change cleared it
notes = confine.own_user_namespace(16)
kids = spawn_sleepers(500)
for k in kids:
  os.kill(k, signal.SIGKILL)
print(len(kids), "; ".join(notes))
"""
)

PID_NAMESPACE_CHILD = (
  SPAWN_SLEEPERS
  + r"""
assert confine.isolate_network() == []
confine.enter_pid_namespace()
notes = confine.read_only_filesystem((), max_tasks=40)
kids = spawn_sleepers(1000)  # killed with the namespace's init, this process, when it exits
print(len(kids), "; ".join(n for n in notes if "pid_max" in n))
"""
)


def _confined_child(code: str) -> tuple[int, str]:
  """Runs ``code`` in a fresh interpreter: (processes it spawned, its notes)."""
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=repo)
  run = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
  )
  assert run.returncode == 0, run.stderr[-2000:]
  forked, _, notes = run.stdout.strip().partition(" ")
  return int(forked), notes


def test_rlimit_nproc_in_the_workers_own_user_namespace_stops_a_fork_bomb():
  # The mechanism for a service not running as root (the kernel exempts uid 0): run as nobody here.
  forked, notes = _confined_child(NPROC_CHILD)
  assert notes == "" and forked < 16 + confine.RUNTIME_TASKS, (forked, notes)


def test_cgroups_of_services_that_died_are_swept(tmp_path):
  gone = subprocess.Popen(["true"])
  gone.wait()  # a pid no process has now
  dead = tmp_path / task_limits.service_name(gone.pid, "a1")
  (dead / "job-3").mkdir(parents=True)
  alive = tmp_path / task_limits.service_name(os.getpid(), "b2")
  (alive / "job-1").mkdir(parents=True)
  (tmp_path / "dice-verifier-probe-1").mkdir()  # not a service's name: left alone
  assert task_limits.sweep_dead(str(tmp_path)) == [str(dead)]
  assert (
    not dead.exists()
    and (alive / "job-1").is_dir()
    and (tmp_path / "dice-verifier-probe-1").is_dir()
  )


def test_a_workers_pid_namespace_holds_a_bounded_number_of_tasks():
  # Whoever runs the service (root included), on kernels with a pid_max per PID namespace.
  forked, notes = _confined_child(PID_NAMESPACE_CHILD)
  assert notes == "" and forked < 40 + confine.PID_NAMESPACE_RESERVED, (forked, notes)


def test_strict_thread_rule_counts_from_outside():
  verdict = task_limits.tasks_verdict
  assert verdict({"baseline": 3, "end": 3, "peak": 3, "refused": 0}, True, "cpu") is None
  assert verdict({"baseline": 3, "end": 3, "peak": 5}, True, "cpu")[0] == "THREAD_OR_STREAM"
  assert verdict({"baseline": 3, "end": 4, "peak": 5}, True, "cuda") is None  # CUPTI's, maybe
  assert verdict({"baseline": 3, "end": 5}, True, "cpu")[0] == "THREAD_OR_STREAM"  # no cgroup
  assert verdict({"baseline": 3, "end": 3, "peak": 5}, False, "cpu") is None  # threads allowed
  assert verdict({"baseline": 3, "refused": 1}, False, "cpu")[0] == "RESOURCE_LIMIT"


# ---- 4. a tolerance small outputs cannot game ---------------------------------------------------------
SOFTMAX_REFERENCE = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, a, b):
        return torch.softmax(a.reshape(4, -1) * self.scale, dim=1).reshape(a.shape)


def get_inputs():
    return [torch.randn(64, 1024), torch.randn(64, 1024)]


def get_init_inputs():
    return [1.0]
"""


def test_a_constant_softmax_over_16384_logits_is_wrong(service):
  # c10e1a8: every true value is under atol = 0.01, so 1/16384 everywhere passed; reward 1.
  src = candidate(
    "        out = torch.empty_like(a)\n"
    "        ops.fill_raw(out.data_ptr(), out.numel(), 1.0 / 16384)\n"
    "        return out"
  )
  (r,) = _verify(service, _req("constant-softmax", src, reference=SOFTMAX_REFERENCE))
  assert r.failure_kind is FailureKind.WRONG_OUTPUT and r.reward == 0.0, r.reason
  assert "norm" in r.reason


def test_the_norm_rule_passes_rounding_and_noise_outputs():
  x = torch.randn(16, 16384)
  ref = torch.softmax(x, dim=1)
  assert correctness.compare_outputs(
    ref, torch.full_like(ref, 1 / 16384), 1e-2, 1e-2, "t"
  ).kind is (FailureKind.WRONG_OUTPUT)
  assert correctness.compare_outputs(ref, torch.zeros_like(ref), 1e-2, 1e-2, "t").kind is (
    FailureKind.WRONG_OUTPUT
  )
  honest = ref * (1 + 1e-3 * torch.randn_like(ref))  # a half-precision-like kernel
  assert correctness.compare_outputs(ref, honest, 1e-2, 1e-2, "t").kind is FailureKind.OK
  # An output that is rounding noise itself (KernelBench L2-23: mean ~ 0 after a GroupNorm): perturbed
  # inputs move it by ~100 %, so the reference does not determine it and atol/rtol alone judge it
  # (zeros as right as the reference, as before).
  x = torch.randn(128, 64)
  noise = lambda v: (v - v.mean(dim=1, keepdim=True)).sum(dim=1)  # noqa: E731
  ref_noise = noise(x)
  rule = correctness.determined(ref_noise, noise(correctness.perturbed([x], 0)[0]))
  assert rule == (False,)
  zeros = torch.zeros_like(ref_noise)
  assert correctness.compare_outputs(ref_noise, zeros, 1e-2, 1e-2, "t", rule).kind is FailureKind.OK
  x16 = torch.randn(16, 16384)
  rule = correctness.determined(
    torch.softmax(x16, 1), torch.softmax(correctness.perturbed([x16], 0)[0], 1)
  )
  assert rule == (True,)  # a softmax is determined: the norm rule judges it


def test_the_norm_rule_keeps_the_verdicts_of_honest_rounding_on_dice_references(shared_data):
  # The DICE references with the largest float32 rounding (experiments/tolerance_survey.py over all 99,
  # docs/verifier-security.md): their own rounding error, and ten times it, still pass.
  from experiments import tolerance_survey

  ids = {"74", "7278", "5756"}
  judged = 0
  for _, name, src in tolerance_survey.references(["dice"], 64, 2):
    if name in ids:
      v = tolerance_survey.survey_one(src, 1e-2, 1e-2)["verdicts"]
      assert v["identity"][0] == v["honest"][0] == v["honest x10"][0] == "OK", (name, v)
      judged += 1
  assert judged == len(ids)


def test_dice_7278s_pooling_bins_are_wrong_though_every_value_is_within_atol():
  # DICE's infilling "known-good" 7278 (AdaptiveAvgPool2d((3, 3)) + ReLU over 16x3x256x256) cuts a
  # 256-wide axis at 85 and 170 (`(H / KH) * oh`); PyTorch's adaptive pooling takes [0, 86),
  # [85, 171), [170, 256) (floor(i*H/KH) to ceil((i+1)*H/KH)). Its outputs are means of ~7,000
  # normals (~0.01), so every error is under atol = 0.01; the H200 verdict (2026-12-03) was the norm
  # rule's: the error's norm 0.118 of the reference's. Here the kernel's arithmetic in torch.
  x = torch.randn(16, 3, 256, 256, generator=torch.Generator().manual_seed(0))
  ref = torch.relu(torch.nn.functional.adaptive_avg_pool2d(x, (3, 3)))
  cut = lambda i: (85 * i, 256 if i == 2 else 85 * (i + 1))  # noqa: E731
  out = torch.stack(
    [
      torch.stack([x[:, :, slice(*cut(i)), slice(*cut(j))].mean((2, 3)) for j in range(3)], -1)
      for i in range(3)
    ],
    -2,
  ).clamp_min(0)
  assert torch.allclose(ref, out, atol=1e-2, rtol=1e-2)  # KernelBench's check passes it
  c = correctness.compare_outputs(ref, out, 1e-2, 1e-2, "t")
  assert c.kind is FailureKind.WRONG_OUTPUT and "norm" in c.reason, c
  assert 0.08 < float((out - ref).norm() / ref.norm()) < 0.2  # ~12 % off, not rounding


EMBEDDING_REFERENCE = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(1000, 16)

    def forward(self, indices):
        return self.embedding(torch.floor(indices).long())


def get_inputs():
    return [torch.rand(128, 32) * 1000]


def get_init_inputs():
    return []
"""


def test_the_norm_rules_perturbation_keeps_inputs_in_their_draws_range_whatever_the_trial_key():
  # Like DICE's 7798: float indices drawn in [0, 1000) and floored. Scaled by 1 + 1e-3 N(0, 1), a value
  # near 1,000 became index 1,000; on a GPU the device-side assert killed the checker (REFERENCE_ERROR "did
  # not finish", session 42), for 15 of 20 trial keys on CPU. Scaled toward zero, every key loads.
  from verifier.check.reference import ReferenceTask

  x = torch.rand(1 << 16, generator=torch.Generator().manual_seed(1)) * 1000
  moved = correctness.perturbed([x], 7)[0]
  assert bool((moved >= 0).all()) and bool((moved < 1000).all())
  assert bool((moved.abs() <= x.abs()).all()) and bool((moved != x).any())
  for k in range(16):
    task = ReferenceTask.load(
      EMBEDDING_REFERENCE, 42, 3, torch.device("cpu"), 1e-2, 1e-2, bytes([k + 1]) * 32
    )
    # floored indices move with any perturbation: the norm rule does not judge this output
    assert task.trials == 3 and task.norm_rule == (False,)


# ---- 5. nothing but the candidate's own output comes back ---------------------------------------------
REPO_SOURCE_MARK = "def toolchain_paths() -> list[str]:"


def test_a_verdict_carries_nothing_of_the_host(service):
  with open(confine.__file__) as f:
    assert REPO_SOURCE_MARK in f.read()  # the marker is the file's own text (it went stale once)
  # c10e1a8: the exception's text carried the venv's configuration, the worker's command line and
  # environment as the kernel shows them (/proc/self/cmdline, /proc/self/environ).
  src = candidate(
    "        import os, sys\n"
    "        found = []\n"
    "        paths = [sys.prefix + '/pyvenv.cfg', '/proc/self/environ', '/proc/self/cmdline',\n"
    "                 '/proc/1/cmdline', '/proc/1/environ']\n"
    "        paths += [p + '/verifier/sandbox/confine.py' for p in sys.path]\n"
    "        paths += [os.path.dirname(p) + '/verifier/sandbox/confine.py' for p in sys.path]\n"
    "        for p in paths:\n"
    "            try:\n"
    "                found.append(open(p, 'rb').read().decode(errors='replace'))\n"
    "            except OSError:\n"
    "                pass\n"
    "        print('\\n'.join(found))\n"
    "        raise RuntimeError(repr(sys.argv) + repr(sys.path) + repr(dict(os.environ))\n"
    "                           + '\\n'.join(found) + 'x' * 100000)"
  )
  (r,) = _verify(service, _req("host-leak", src))
  assert r.failure_kind is FailureKind.RUNTIME_ERROR and r.reward == 0.0, r.reason
  text = r.reason + r.logs
  for leak in (
    "include-system-site-packages",
    "verifier.candidate.zygote",
    "--isolate-network",
    "TORCH_EXTENSIONS_DIR=",
    "PYTHONPATH",
    REPO_SOURCE_MARK,
    os.path.join(confine.IMPORT_ROOT, "verifier"),
  ):
    assert leak not in text, leak
  assert r.reason.startswith(CANDIDATE_TEXT_LABEL), r.reason[:200]
  assert len(r.reason) < CANDIDATE_TEXT_LIMIT + 200


def test_landlock_rules_leave_out_an_installed_verifier_and_the_venv_configuration(tmp_path):
  prefix = tmp_path / "venv"
  site = prefix / "lib" / "python3" / "site-packages"
  for d in ("torch", "verifier/sandbox", "numpy"):
    (site / d).mkdir(parents=True)
  (prefix / "pyvenv.cfg").write_text("home = /secret\n")
  (prefix / "bin").mkdir()
  hidden = [str(site / "verifier"), str(prefix / "pyvenv.cfg")]
  rules = confine.without(str(prefix), hidden)
  covered = lambda p: any(confine.beneath(p, q) for q in rules)  # noqa: E731
  assert covered(str(site / "torch")) and covered(str(prefix / "bin"))
  assert not covered(str(site / "verifier" / "sandbox")) and not covered(str(prefix / "pyvenv.cfg"))
  assert confine.without(str(site / "torch"), hidden) == [str(site / "torch")]


def test_the_projects_installation_record_is_hidden_and_other_packages_are_not(tmp_path):
  # red team 44: .incbin of the dist-info's METADATA (the README), the editable install's finder and .pth
  # (the checkout's path and layout) came back in a reason
  site = tmp_path / "site-packages"
  (site / "__pycache__").mkdir(parents=True)
  record = [
    "dice_jax-0.1.0.dist-info",
    "__editable__.dice_jax-0.1.0.pth",
    "__editable___dice_jax_0_1_0_finder.py",
    "__pycache__/__editable___dice_jax_0_1_0_finder.cpython-311.pyc",
  ]
  others = ["torch", "numpy-2.0.0.dist-info", "__editable__.other-1.0.pth", "__pycache__/six.pyc"]
  for name in record + others:
    (site / name).mkdir() if "." not in name.rsplit("/", 1)[-1] else (site / name).write_text("x")
  hidden = confine.hidden_paths([str(site)])
  assert sorted(h for h in hidden if h.startswith(str(site))) == sorted(
    str(site / n) for n in record
  )
  rules = confine.without(str(site), hidden)
  assert all(any(confine.beneath(str(site / n), q) for q in rules) for n in others)


def test_a_link_to_a_directory_with_hidden_entries_is_expanded_like_its_target(tmp_path):
  # red team 44: the venv's lib64 -> lib link became one rule, and a rule holds its target: all of lib,
  # the hidden entries of site-packages too
  prefix = tmp_path / "venv"
  site = prefix / "lib" / "python3.11" / "site-packages"
  (site / "torch").mkdir(parents=True)
  (site / "dice_jax-0.1.0.dist-info").mkdir()
  (prefix / "lib64").symlink_to("lib")
  (site / "up").symlink_to(prefix)  # a link above itself: left out, no endless expansion
  hidden = [str(site / "dice_jax-0.1.0.dist-info")]
  rules = confine.without(str(prefix), hidden)
  targets = [os.path.realpath(q) for q in rules]
  assert str(site / "torch") in targets
  assert not [t for t in targets if confine.beneath(hidden[0], t)], rules


# ---- 6. compared calls indistinguishable ----------------------------------------------------------------
SLOW_REFERENCE = holes.REFERENCE.replace(
  "    def forward(self, a, b):\n", "    def forward(self, a, b):\n        time.sleep(0.25)\n"
).replace("import torch\n", "import time\nimport torch\n", 1)


def test_a_candidate_cannot_tell_compared_bursts_by_the_gap_before_them(service):
  # c10e1a8 computed a compared call's golden output before its burst: a long host gap announced it,
  # and a candidate that worked only after long gaps skipped the uncompared bursts (reward 1).
  # The first forward of a round trip works on the same buffer every time (the checker's buffers are
  # reused in order); the host's gap before it decides the whole round trip.
  src = candidate(
    "        key = a.flatten()[:8].tolist()\n"
    "        if self.first is None:\n"
    "            self.first, self.p0 = key, a.data_ptr()\n"
    "        if a.data_ptr() == self.p0:\n"
    "            self.honest = time.perf_counter() - self.last > 0.15\n"
    "        out = good(a, b, self.scale) if self.honest or key == self.first else torch.zeros_like(a)\n"
    "        self.last = time.perf_counter()\n"
    "        return out",
    module="import time",
    init="        self.last, self.first, self.p0, self.honest = 0.0, None, 0, True",
  )
  timed = dict(measure_performance=True, num_warmup=1, num_perf_trials=16)
  (r,) = _verify(service, _req("gap-watcher", src, reference=SLOW_REFERENCE, **timed))
  assert r.failure_kind is FailureKind.WRONG_OUTPUT and r.reward == 0.0, r.reason
  assert "timed call" in r.reason


def test_a_timed_call_returning_an_earlier_output_again_is_wrong_without_the_poison(service):
  # Timed calls no longer NaN their outputs after publishing (ForwardRequest.poison: a 4 GB fill a
  # call on level-1's largest tasks). A candidate honest in the trials and its first timed call,
  # then returning that output object again, unpoisoned now: every later input is fresh, so the
  # compared calls and trial 0's re-check see a wrong (finite) answer.
  src = candidate(
    "        self.calls += 1\n"
    "        if self.calls <= 3:  # the 2 trials and the first timed call\n"
    "            self.last = good(a, b, self.scale)\n"
    "        return self.last",
    init="        self.calls, self.last = 0, None",
  )
  timed = dict(measure_performance=True, num_warmup=1, num_perf_trials=16)
  (r,) = _verify(service, _req("stale-output", src, **timed))
  assert r.failure_kind is FailureKind.WRONG_OUTPUT and r.reward == 0.0, r.reason
  assert "timed call" in r.reason or "re-checked" in r.reason, r.reason


def test_a_timed_call_that_changes_its_inputs_is_caught_with_inputs_drawn_into_buffers(service):
  # Item 9: timed calls' inputs are drawn straight into the exchange buffers and nothing private is
  # kept before the round trip; a compared call's private inputs are re-drawn from its seed after it.
  # A candidate honest in the trials that zeroes its second input in every timed call.
  src = candidate(
    "        self.calls += 1\n"
    "        out = good(a, b, self.scale)\n"
    "        if self.calls > 2:\n"
    "            b.zero_()\n"
    "        return out",
    init="        self.calls = 0",
  )
  timed = dict(measure_performance=True, num_warmup=1, num_perf_trials=16)
  phases = service[1].metrics.run_phase_s
  drawn = phases["timing_drawn_into_buffers"]
  (r,) = _verify(service, _req("timed-mutation", src, **timed))
  assert phases["timing_drawn_into_buffers"] == drawn + 1  # this check drew into the buffers
  assert r.failure_kind is FailureKind.INPUT_MUTATION and r.reward == 0.0, r.reason
  assert "timed call" in r.reason and "input 1" in r.reason, r.reason


def test_a_reference_drawing_outside_torch_keeps_its_timed_inputs_private(service):
  # get_inputs() that does not repeat under a seed (Python's random): a re-draw after the round trip
  # would not be the staged inputs, so an honest candidate would fail its compared calls. The check
  # finds it before any candidate code (trial 0 drawn again differs) and draws privately, as before.
  reference = holes.REFERENCE.replace("import torch\n", "import random\nimport torch\n", 1).replace(
    "return [torch.randn(64, 256), torch.randn(64, 256)]",
    "return [torch.randn(64, 256) + random.random(), torch.randn(64, 256)]",
  )
  assert reference != holes.REFERENCE
  timed = dict(measure_performance=True, num_warmup=1, num_perf_trials=16)
  (r,) = _verify(service, _req("unrepeatable-inputs", GOOD, reference=reference, **timed))
  _ok(r)
  assert any("drawn privately and copied" in w for w in r.warnings), r.warnings


def test_compared_calls_are_independent_draws():
  import random

  rng = random.Random(7)
  counts = [len(timed_calls.checked_calls(104, rng)) for _ in range(400)]
  assert min(counts) >= 1 and len(set(counts)) > 5  # the count itself tells the candidate nothing
  assert abs(sum(counts) / len(counts) - 104 * timed_calls.CHECKED_TIMED_FRACTION) < 1.0


# ---- 7. fair compile slots ------------------------------------------------------------------------------
def _sleeping_initialiser(tag: str) -> str:
  lib = (
    "#include <chrono>\n#include <thread>\n"
    "static int slept = [] { std::this_thread::sleep_for(std::chrono::hours(1)); return 1; }();\n"
  )
  return GOOD.replace(
    "\ndef good(",
    f"lib = load_inline(name='vt_v2_sleep', cpp_sources={lib!r}, is_python_module=False,\n"
    f"                  no_implicit_headers=True)\n# {tag}\n\ndef good(",
    1,
  )


def test_an_honest_build_is_answered_before_two_hostile_builds_ahead_of_it(service):
  # c10e1a8, one compile slot: two builds whose static initialisers sleep held it to their deadlines
  # one after the other; an honest request behind them was answered after both (185 s at timeout 60).
  loop, svc = service
  order = []

  async def one(delay, req):
    await asyncio.sleep(delay)
    res = await svc.verify(req)
    order.append(req.request_id)
    return res

  async def go():
    return await asyncio.gather(
      one(0.0, _req("sleeper-1", _sleeping_initialiser("1"), timeout_s=6)),
      one(0.2, _req("sleeper-2", _sleeping_initialiser("2"), timeout_s=6)),
      one(1.0, _req("honest", GOOD + "\n# a build of its own\n", timeout_s=60)),
    )

  _ok(
    _verify(service, _req("warm", GOOD))[0]
  )  # the extension in the cache: the honest build imports
  s1, s2, honest = loop.run(go())
  _ok(honest)
  assert s1.failure_kind is s2.failure_kind is FailureKind.TIMEOUT, (s1.reason, s2.reason)
  assert order[0] == "honest", order
  assert svc.build_stage.slots.preemptions >= 2
  assert svc.build_stage.slots.free == svc.build_stage.slots.total


def test_fair_slots_serve_the_least_served_build_first():
  async def go():
    slots = FairSlots(1, quantum_s=0.3)
    log = []
    long_a = Turn(lambda: log.append("stop a"), lambda: log.append("go a"))
    long_b = Turn(lambda: log.append("stop b"), lambda: log.append("go b"))
    short = Turn(lambda: log.append("stop short"), lambda: log.append("go short"))
    await slots.acquire(long_a)
    waiting_b = asyncio.ensure_future(slots.acquire(long_b))
    await asyncio.sleep(0.05)
    waiting_s = asyncio.ensure_future(slots.acquire(short))
    await asyncio.wait_for(waiting_b, 5)  # a is suspended after its quantum; b (first come) runs
    await asyncio.wait_for(waiting_s, 5)  # then b is, and the short one runs
    budget = Budget(10.0, long_a)
    before = budget.left()
    await asyncio.sleep(0.3)
    assert budget.left() == before  # a suspended build's budget stands still
    slots.finish(short)
    await asyncio.sleep(0.05)
    # the one of a and b that ran less goes on
    resumed = min((long_a, long_b), key=lambda t: (t.attained, t.seq))
    assert resumed.state == "running" and log[:2] == ["stop a", "stop b"], log
    assert log[2] == ("go a" if resumed is long_a else "go b"), log
    slots.finish(long_a)
    slots.finish(long_b)
    assert slots.free == 1 and not slots.waiting

  asyncio.run(go())


def test_builds_of_one_extension_compile_it_once_and_wait_for_it_without_a_slot():
  """Three builds of one extension, one slot: the first compiles it; the others wait for that compile
  suspended, their slot given up and their budget standing still, then find it built (round-robin
  slots had them compile it three times over, 150 s where one build at a time took 54 s)."""

  async def go():
    stage = BuildStage.__new__(BuildStage)  # only its slots and the compiles in flight
    stage.slots, stage.compiling, stage.split_build = FairSlots(1, quantum_s=0.05), {}, True
    busy, calls = [], []

    async def compile(params, budget, procs=None):
      calls.append(len(busy))  # compiles running beside this one
      busy.append(1)
      await asyncio.sleep(2.0 if len(calls) == 1 else 0.0)  # later ones find it in the cache
      busy.pop()
      return {"cached": len(calls) > 1}

    stage.compile = compile
    log = []
    turns = [
      Turn(lambda i=i: log.append(f"stop {i}"), lambda i=i: log.append(f"go {i}")) for i in range(3)
    ]
    budgets = [Budget(10.0, t) for t in turns]
    params = {"name": "ext", "cpp_sources": "int f();", "functions": ["f"]}

    async def build(i):
      await stage.slots.acquire(turns[i])
      event = await stage._compile_once(params, budgets[i], [], turns[i])
      stage.slots.finish(turns[i])
      return event

    first = asyncio.ensure_future(build(0))
    await asyncio.sleep(0.01)
    rest = [asyncio.ensure_future(build(i)) for i in (1, 2)]
    # the slots' first look (TICK_S) preempts the first; the others find its compile running
    await asyncio.sleep(TICK_S + 0.25)
    assert turns[0].state == "running" and {t.state for t in turns[1:]} == {"suspended"}, log
    left = [b.left() for b in budgets[1:]]
    await asyncio.sleep(0.2)
    assert [b.left() for b in budgets[1:]] == left  # waiting for another's compile costs nothing
    events = await asyncio.wait_for(asyncio.gather(first, *rest), 5)
    assert calls == [0, 0, 0] and [e["cached"] for e in events] == [False, True, True]
    assert stage.slots.free == 1 and not stage.compiling

  asyncio.run(go())


# ---- 8. CPU timing that cannot floor into a reward --------------------------------------------------------
def test_a_time_within_the_clocks_resolution_gives_no_speedup():
  trips = [0.0100, 0.0102, 0.0098, 0.0101, 0.0099, 0.0100]
  res = timing.resolution_ms(trips, 8, [0.0099, 0.0101], 0.02)
  assert timing.CLOCK_TICK_MS <= res < 0.1
  cost = 0.0100 / 8  # the exchange alone: the candidate's share is noise
  r = timing.candidate_runtime(trips, cost, 8)
  assert timing.measured(r, res) is None
  r = timing.candidate_runtime(trips, cost - 0.5e-3, 8)  # half a millisecond a call: a time
  assert timing.measured(r, res) is r
  noisy = timing.resolution_ms([0.01, 0.03, 0.02, 0.05, 0.01, 0.04], 8, [0.01, 0.04], 10.0)
  assert noisy > res  # a jittery exchange resolves less


def test_an_honest_cpu_candidate_is_timed_consistently(service):
  # c10e1a8: the same axpy candidate was timed at 129,690x, 124,769x, 56x and 70.7x (its time floored
  # at 1 us, shaped reward 4.0). On its CPU clock, the speedups three runs report agree within 2x (a run
  # may report none: it cannot resolve the time).
  timed = dict(measure_performance=True, num_warmup=8, num_perf_trials=40)
  runs = [_verify(service, _req(f"axpy-{i}", GOOD, **timed))[0] for i in range(3)]
  for r in runs:
    _ok(r)
    unmeasurable = any("no speedup reported" in w for w in r.warnings)
    assert (r.speedup == 0.0) == unmeasurable and r.shaped_reward <= 1.0 + 3.0
    if unmeasurable:  # no bonus; capped by what its mean time gives
      assert r.shaped_reward <= 1.0
  # A time at the edge of the resolution may be reported by one run and not by another (seen: 0.73x,
  # then twice "no speedup"): what is reported agrees within 2x.
  speedups = [r.speedup for r in runs if r.speedup]
  if speedups:
    assert max(speedups) / min(speedups) <= 2.0, [r.speedup for r in runs]
