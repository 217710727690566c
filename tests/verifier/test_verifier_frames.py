"""Red team 42, Hole E2: a CPU candidate's C++ found the worker's own frame (``PyEval_GetFrame``,
``PyFrame_GetLocals``: ``self.buffers``, ``targets``), wrote its output straight into the exchange buffer
the checker reads it from, returned that view (the publishing copy a no-op, so libtorch spent less than in
a null round trip, and the host rule let that saving pay for the ReLU libtorch computed) and set
``requires_grad`` on it so it was not poisoned: reward 1 under strict, untimed, with no kernel of its own.

Each defence on its own: the host rule nets no module's saving against another's excess; the built
extension is refused for the frame APIs it links; an output that requires grad is poisoned like any
other; an output in an exchange buffer other than the forward's inputs is refused by the worker. The
service-level candidates share one pybind11-only extension (no torch headers: it builds in seconds).
"""

import asyncio
import dataclasses
import shutil
import socket
import subprocess

import pytest

torch = pytest.importorskip("torch")

import verifier_hole_cases as holes  # noqa: E402
from verifier_loop import cpu_service  # noqa: E402

from verifier.api.contract import FailureKind, Strictness, VerifyOptions, VerifyRequest  # noqa: E402
from verifier.build import artefact_check  # noqa: E402
from verifier.candidate import candidate_main  # noqa: E402
from verifier.check import host_evidence  # noqa: E402
from verifier.ipc import exchange  # noqa: E402
from verifier.ipc.channel import Channel  # noqa: E402
from verifier.ipc.tensors import poison  # noqa: E402


# ---- the host rule: a module's saving pays for no other module's excess ----------------------------
def test_a_modules_saving_does_not_pay_for_another_modules_excess():
  torch_cpu, jit = "/venv/torch/lib/libtorch_cpu.so", "[anonymous JIT code]"
  nulls = [host_evidence.HostWindow({torch_cpu: 200}, 0, 1)] * 3  # the publishing copy
  # the copy saved (an output in the exchange's buffer), the same time spent elsewhere
  calls = [host_evidence.HostWindow({torch_cpu: 100, jit: 100}, 1, 1)] * 3
  v = host_evidence.judge_host(calls, nulls, 100_000, "/cache", "cpu")
  assert v.kind is FailureKind.HOST_COMPUTE, v  # OK while the saving was netted against it
  assert v.excess_ms == pytest.approx(3 * 100 * 0.1) and v.top == ((jit, pytest.approx(30.0)),)
  assert "[anonymous JIT code] 30.0 ms" in v.reason, v.reason
  # a saving alone is no verdict
  alone = [host_evidence.HostWindow({torch_cpu: 100}, 1, 1)] * 3
  v = host_evidence.judge_host(alone, nulls, 100_000, "/cache", "cpu")
  assert v.kind is FailureKind.OK and v.excess_ms == 0.0, v


# ---- the built extension: the interpreter's frames, locals and sys ---------------------------------
FRAME_SYMBOLS = [
  "PyEval_GetFrame",
  "PyEval_GetFrameLocals",
  "PyEval_GetFrameGlobals",
  "PyEval_GetFrameBuiltins",
  "PyFrame_GetLocals",
  "PyFrame_GetGlobals",
  "PyThreadState_GetFrame",
  "PyEval_GetLocals",
  "PyEval_GetGlobals",
  "_PyEval_GetBuiltin",
  "PySys_GetObject",
]
# what every pybind11 build links (error_already_set's traceback walk; a function record's pickling)
PYBIND11_LINKS = [
  "PyFrame_GetBack",
  "PyFrame_GetCode",
  "PyFrame_GetLineNumber",
  "PyEval_GetBuiltins",
]


def test_the_frame_apis_are_refused_in_a_built_extension_and_what_pybind11_links_is_not(tmp_path):
  for symbol in FRAME_SYMBOLS:
    found = artefact_check.judge_symbol(symbol)
    assert found is not None and found.kind is FailureKind.FRAME_INTROSPECTION, symbol
    assert symbol in found.reason and "frames" in found.reason
  for symbol in PYBIND11_LINKS + ["PyThreadState_Get", "_PyThreadState_UncheckedGet"]:
    assert artefact_check.judge_symbol(symbol) is None, symbol
  assert artefact_check.enforced(FailureKind.FRAME_INTROSPECTION, Strictness.preset("strict"))
  assert not artefact_check.enforced(FailureKind.FRAME_INTROSPECTION, Strictness.preset("off"))
  if shutil.which("g++") is None:
    pytest.skip("needs a C++ compiler")
  names = FRAME_SYMBOLS + PYBIND11_LINKS
  decls = "".join(f'extern "C" void* {n}(void*);\n' for n in names)
  calls = " ".join(f"(void*){n}," for n in names)
  (tmp_path / "m.cpp").write_text(f"{decls}void* const table[] = {{{calls}}};\n")
  so = tmp_path / "m.so"
  subprocess.run(["g++", "-shared", "-fPIC", "-o", str(so), str(tmp_path / "m.cpp")], check=True)
  found = {s: artefact_check.judge_symbol(s) for s in artefact_check.undefined_symbols(str(so))}
  assert {s for s, f in found.items() if f is not None} == set(FRAME_SYMBOLS), found
  assert artefact_check.judge_extension(str(so)).kind is FailureKind.FRAME_INTROSPECTION


# ---- poisoning: an output that requires grad is no exception ---------------------------------------
def test_an_output_that_requires_grad_is_poisoned_too():
  leaf = torch.ones(4).requires_grad_(True)  # spared before: an in-place fill of it raises
  made = torch.ones(3, requires_grad=True) * 2
  poison((leaf, [made]))
  assert torch.isnan(leaf).all() and torch.isnan(made).all()
  assert leaf.requires_grad and leaf.grad_fn is None  # poisoned, not otherwise changed
  weight = torch.nn.Parameter(torch.ones(2))
  poison(weight, {weight.untyped_storage().data_ptr()})  # the model's own state stays
  assert torch.equal(weight.detach(), torch.ones(2))


# ---- the worker: an output in an exchange buffer that is none of the forward's inputs -------------
def _runtime(tmp_path, x):
  """A worker's runtime over the checker's buffers (one process: the same mappings) for one forward of
  input ``x``: (runtime, its arguments, the expected outputs, the buffers)."""
  buffers = exchange.BufferSet(torch.device("cpu"), use_device_memory=False)
  used = []
  args = (exchange.send_value(x, buffers, used),)
  outs = (exchange.output_buffer(x, buffers, used),)
  rt = candidate_main.CandidateRuntime(Channel(socket.socketpair()[1]), "cpu", str(tmp_path))
  rt.buffers = {b.id: b for b in buffers.buffers.values()}
  return rt, rt._args(args)[1], outs, buffers


def test_an_output_in_the_checkers_output_buffer_is_refused_and_an_input_is_not(tmp_path):
  x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
  rt, args, outs, buffers = _runtime(tmp_path, x)
  target = rt.buffers[outs[0].buffer]
  view = target.view(outs[0])
  view.copy_(x * 2)
  with pytest.raises(candidate_main._Failed) as e:
    rt._publish(view.requires_grad_(True), outs, args)
  assert e.value.kind is FailureKind.RUNTIME_ERROR and "exchange buffer" in e.value.reason
  # the same memory under a storage of its own is the same buffer
  alias = torch.frombuffer(target.map, dtype=torch.float32, count=6).view(2, 3)
  with pytest.raises(candidate_main._Failed):
    rt._publish((torch.zeros(1), alias), (None, outs[0]), args)
  # an input returned as is, or a view of it: published and left alone (an input is the checker's)
  for out in (args[0], args[0][:], args[0].t()):
    (spec,) = rt._publish(out, outs, args)
    assert spec.copied == (out.shape == x.shape) and torch.equal(args[0], x)
  assert torch.equal(view, x)
  # the candidate's own tensor: published, then poisoned
  own = (x * 3).requires_grad_(True)
  (spec,) = rt._publish(own, outs, args)
  assert spec.copied and torch.equal(view, x * 3) and torch.isnan(own).all()
  buffers.close()


# ---- end to end: the attack, compact, through the CPU verifier -------------------------------------
FRAME_WALK = r"""
#include <pybind11/pybind11.h>
#include <Python.h>
#include <frameobject.h>
#include <cstdint>
namespace py = pybind11;
// The checker's buffer for output 0, found in the worker's own frame (``self.buffers``, ``targets``).
py::object exchange_output() {
    PyFrameObject* f = PyEval_GetFrame();
    Py_XINCREF(f);
    while (f) {
        PyObject* locals = PyFrame_GetLocals(f);
        PyObject* targets = locals ? PyDict_GetItemString(locals, "targets") : nullptr;
        PyObject* self = locals ? PyDict_GetItemString(locals, "self") : nullptr;
        if (targets && self && PyTuple_Check(targets) && PyTuple_Size(targets) > 0) {
            py::object t = py::reinterpret_borrow<py::object>(PyTuple_GetItem(targets, 0));
            py::object rt = py::reinterpret_borrow<py::object>(self);
            py::object view = rt.attr("buffers")[t.attr("buffer")].attr("view")(t);
            Py_DECREF(locals);
            Py_DECREF(f);
            return view;
        }
        Py_XDECREF(locals);
        PyFrameObject* back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    return py::none();
}
void scaled_add_raw(std::uintptr_t a, std::uintptr_t b, std::uintptr_t out, std::int64_t n, double s) {
    const float* pa = reinterpret_cast<const float*>(a);
    const float* pb = reinterpret_cast<const float*>(b);
    float* po = reinterpret_cast<float*>(out);
    for (std::int64_t i = 0; i < n; ++i) po[i] = (pa[i] + pb[i]) * (float)s;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("exchange_output", &exchange_output);
    m.def("scaled_add_raw", &scaled_add_raw);
}
"""

ATTACK = f'''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = r"""{FRAME_WALK}"""
ops = load_inline(name="vt_frames", cpp_sources=source, no_implicit_headers=True, extra_cflags=["-O2"])


class ModelNew(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, a, b):
        out = ops.exchange_output()
        if out is None:
            out = torch.empty_like(a)
        ops.scaled_add_raw(a.data_ptr(), b.data_ptr(), out.data_ptr(), a.numel(), self.scale)
        out.requires_grad_(True)  # was never poisoned
        return out
'''

# how RL requests run: untimed, one trial asked for
RL = VerifyOptions(device="cpu", timeout_s=60, num_correct_trials=1, measure_performance=False)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
  with cpu_service(tmp_path_factory.mktemp("frames")) as (loop, svc):
    yield loop, svc


def _verify(service, rid, source, strictness):
  loop, svc = service
  opts = dataclasses.replace(RL, strictness=strictness)
  req = VerifyRequest(rid, "frames", holes.REFERENCE, source, opts)
  return loop.run(asyncio.wait_for(svc.verify(req), 300))


def test_the_frame_walk_is_refused_from_the_built_extension_under_strict(service):
  # red team 42: reward 1 (its forward wrote the output into the checker's buffer through the frames)
  r = _verify(service, "frame-walk", ATTACK, "strict")
  assert r.failure_kind is FailureKind.FRAME_INTROSPECTION and r.reward == 0.0, (r.reason, r.logs)
  assert "vt_frames" in r.reason and (
    "PyEval_GetFrame" in r.reason or "PyFrame_GetLocals" in r.reason
  )
  # a pybind11 build without them (it links PyFrame_GetBack and PyEval_GetBuiltins) still passes
  good = _verify(service, "pybind11-good", holes.GOOD, "strict")
  assert good.failure_kind is FailureKind.OK and good.reward == 1.0, (good.reason, good.logs)


def test_an_output_in_the_checkers_buffer_is_refused_where_the_frame_apis_are_allowed(service):
  # under off the extension's imports are not judged: the worker refuses the output it was handed
  r = _verify(service, "frame-walk-off", ATTACK, "off")
  assert r.failure_kind is FailureKind.RUNTIME_ERROR and r.reward == 0.0, (r.reason, r.logs)
  assert "exchange buffer" in r.reason and "output 0" in r.reason, r.reason


# ---- red team 43d: the worker's checks no-opped by Python run through the builtins' exec ----------------
HIDDEN = """
import sys, torch
import verifier.candidate.candidate_main as cm
cm.CandidateRuntime._in_exchange = lambda self, leaf, spans: None
cm.tensors.poison = lambda *a, **k: None
f = sys._getframe()
while f is not None and not (f.f_code.co_name == "forward" and "calls" in f.f_locals):
    f = f.f_back
rt, calls, k = f.f_locals["self"], f.f_locals["calls"], f.f_locals.get("k", 0)
view = rt.buffers[calls[k][2][0].buffer].view(calls[k][2][0])
torch._C._autograd._enable_record_function(False)
torch.clamp_min(x, 0, out=view)
torch._C._autograd._enable_record_function(True)
result = view
"""
BUILTINS_EXEC = r"""
#include <pybind11/pybind11.h>
#include <string>
namespace py = pybind11;
static const char* HIDDEN = "@HEX@";
py::object relu(py::object x) {
    std::string code;
    for (const char* p = HIDDEN; p[0] && p[1]; p += 2) code += char(std::stoi(std::string(p, 2), nullptr, 16));
    py::dict builtins = py::reinterpret_borrow<py::dict>(PyEval_GetBuiltins());
    py::dict scope;
    scope["__builtins__"] = builtins;
    scope["x"] = x;
    builtins["ex" "ec"](py::str(code), scope);
    return scope["result"];
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("relu", &relu); }
""".replace("@HEX@", HIDDEN.encode().hex())
EXEC_ATTACK = f'''
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = r"""{BUILTINS_EXEC}"""
ops = load_inline(name="vt_exec", cpp_sources=source, no_implicit_headers=True, extra_cflags=["-O1"])


class ModelNew(nn.Module):
    def forward(self, x):
        return ops.relu(x)
'''


def test_a_library_computing_into_the_output_buffer_is_host_compute_whatever_the_worker_checks(
  service,
):
  # Red team 43d: reward 1 untimed (RL's setting). The publish copy it skipped was libtorch_cpu's, as the
  # ReLU it ran, so the host rule netted one against the other; the verifier's copy is libc's now.
  import verifier_compute_cases as compute

  loop, svc = service
  opts = dataclasses.replace(RL, strictness="strict", timeout_s=120)
  req = VerifyRequest("builtins-exec", "relu", compute.LIBRARY_REFERENCE, EXEC_ATTACK, opts)
  r = loop.run(asyncio.wait_for(svc.verify(req), 300))
  if [w for w in r.warnings if "host evidence unavailable" in w]:
    pytest.skip("this host refuses perf_event_open")
  assert r.failure_kind is FailureKind.HOST_COMPUTE and r.reward == 0.0, (r.failure_kind, r.reason)
  assert "libtorch_cpu" in r.reason.split("most in:")[1].split(",")[0], r.reason
