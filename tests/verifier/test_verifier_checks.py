"""Fast unit tests: static anti-cheating rules, output comparison, options validation, wire round trip."""

import math
import dataclasses
import json

import pytest

torch = pytest.importorskip("torch")

import verifier_cases as cases  # noqa: E402
import verifier_gpu_cases as g  # noqa: E402

from verifier.api import wire  # noqa: E402
from verifier.api.contract import (
  FailureKind,
  Runtime,
  Strictness,
  VerifyOptions,
  VerifyRequest,
  VerifyResult,
)  # noqa: E402
from verifier.build.build_cache import build_key, fast_variant  # noqa: E402
from verifier.check.correctness import compare_outputs, mutated  # noqa: E402
from verifier.ipc.tensors import poison  # noqa: E402
from verifier.serve import reward  # noqa: E402
from verifier.static.static_check import check_candidate  # noqa: E402

STRICT = Strictness.preset("strict")
KB = Strictness.preset("kernelbench")


@pytest.mark.parametrize(
  "source,kind,needle",
  [
    (g.GOOD_MATMUL, FailureKind.OK, ""),
    (g.NON_DEFAULT_STREAM, FailureKind.THREAD_OR_STREAM, "cudaStreamCreate"),
    (g.DEFINED_NOT_LAUNCHED_STATIC, FailureKind.KERNEL_NOT_LAUNCHED, "tiled_matmul_kernel"),
    (g.TORCH_MATMUL_FORWARD, FailureKind.TORCH_COMPUTE, "torch.matmul"),
    (
      g.GOOD_MATMUL.replace(
        "return ext.run(A, B)",
        "try:\n            return ext.run(A, B)\n        except Exception:\n            return A @ B",
      ),
      FailureKind.FALLBACK,
      "try/except",
    ),
    (
      g.GOOD_MATMUL.replace("import torch.nn as nn", "import torch.nn as nn\nimport threading"),
      FailureKind.THREAD_OR_STREAM,
      "threading",
    ),
    (
      g.GOOD_MATMUL.replace("import torch.nn as nn", "import torch.nn as nn\nimport gc"),
      FailureKind.FORBIDDEN_IMPORT,
      "gc",
    ),
    (
      g.GOOD_MATMUL + "\ntorch.cuda.Event.elapsed_time = lambda self, other: 0.001\n",
      FailureKind.MONKEY_PATCH,
      "torch.cuda.Event.elapsed_time",
    ),
    (
      g.GOOD_MATMUL.replace("class ModelNew(nn.Module):", "class ModelNew(Model):"),
      FailureKind.FALLBACK,
      "Model",
    ),
    (g.GOOD_MATMUL + "\nclass Lazy(torch.Tensor):\n    pass\n", FailureKind.LAZY_OUTPUT, "Lazy"),
    (
      g.GOOD_MATMUL.replace(
        "tiled_matmul_kernel<<<grid, block>>>(A.data_ptr<float>(), B.data_ptr<float>(), C.data_ptr<float>(), n);",
        "at::matmul_out(C, A, B);",
      ),
      FailureKind.KERNEL_NOT_LAUNCHED,
      "",
    ),
    (
      g.GOOD_MATMUL.replace(
        "auto C = torch::empty({n, n}, A.options());", "auto C = at::matmul(A, B);"
      ),
      FailureKind.FOREIGN_KERNELS,
      "at::matmul",
    ),
    (
      "import torch\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return x.relu()\n",
      FailureKind.NO_KERNEL,
      "load_inline",
    ),
    ("def broken(:\n", FailureKind.SYNTAX_ERROR, "line 1"),
    ("import torch\n", FailureKind.MISSING_MODEL_NEW, "ModelNew"),
  ],
)
def test_static_check_strict(source, kind, needle):
  v = check_candidate(source, STRICT, "cuda")
  assert v.kind is kind, v.reason
  assert needle in v.reason


def test_static_check_kernelbench_preset_only_warns_on_torch_ops():
  v = check_candidate(g.TORCH_MATMUL_FORWARD, KB, "cuda")
  assert v.kind is FailureKind.OK and any("torch.matmul" in w for w in v.warnings)
  assert v.kernel_names == ("tiled_matmul_kernel",)


def test_static_check_cpu_candidate_and_exported_function_named_like_a_torch_op():
  assert check_candidate(cases.GOOD, STRICT, "cpu").kind is FailureKind.OK
  src = cases.GOOD.replace("functions=", "functions=['add'] + ").replace(
    "ops.scaled_add(", "ops.add("
  )
  assert (
    check_candidate(src, STRICT, "cpu").kind is FailureKind.OK
  )  # ext.add is the candidate's own


def test_static_check_on_dice_known_good_solutions(shared_data):
  tasks = json.loads((shared_data / "dice_rl" / "kernel_infilling_evaluation.json").read_text())
  kinds = [check_candidate(t["cuda_code"], STRICT, "cuda").kind for t in tasks]
  assert len(kinds) == 99
  # 84 use only their own kernels; 13 call cuBLAS/cuDNN from C++; 2 define no __global__ kernel at all.
  assert kinds.count(FailureKind.OK) == 84
  assert kinds.count(FailureKind.FOREIGN_KERNELS) == 13 and kinds.count(FailureKind.NO_KERNEL) == 2


def test_compare_outputs_rules():
  ref = torch.linspace(-1, 1, 100)
  assert compare_outputs(ref, ref + 5e-3, 1e-2, 1e-2, "t").kind is FailureKind.OK
  c = compare_outputs(ref, ref + 5e-3, 1e-2, 1e-2, "t")
  assert (
    not c.strict_ok and abs(c.max_abs_diff - 5e-3) < 1e-6
  )  # passes DICE's 1e-2, fails fp32 1e-4
  assert compare_outputs(ref, ref + 1e-5, 1e-2, 1e-2, "t").strict_ok
  assert compare_outputs(ref, ref + 0.5, 1e-2, 1e-2, "t").kind is FailureKind.WRONG_OUTPUT
  nan = ref.clone()
  nan[3] = float("nan")
  assert (
    compare_outputs(ref, nan, 1.0, 1.0, "t").kind is FailureKind.NONFINITE_OUTPUT
  )  # NaN never passes
  assert (
    compare_outputs(nan, nan.clone(), 1e-2, 1e-2, "t").kind is FailureKind.OK
  )  # NaN where the reference has NaN
  assert compare_outputs(ref, ref[:50], 1e-2, 1e-2, "t").kind is FailureKind.SHAPE_MISMATCH
  assert compare_outputs(ref, ref.double(), 1e-2, 1e-2, "t").kind is FailureKind.DTYPE_MISMATCH
  assert compare_outputs((ref, ref), (ref,), 1e-2, 1e-2, "t").kind is FailureKind.SHAPE_MISMATCH
  ints = torch.arange(10)
  assert compare_outputs(ints, ints + 0, 0, 0, "t").kind is FailureKind.OK
  assert (
    compare_outputs(ints, ints + 1, 1.0, 1.0, "t").kind is FailureKind.WRONG_OUTPUT
  )  # integers match exactly

  class Sub(torch.Tensor):
    pass

  assert compare_outputs(ref, ref.as_subclass(Sub), 1e-2, 1e-2, "t").kind is FailureKind.LAZY_OUTPUT


def test_mutation_and_poison():
  a, b = torch.randn(8), torch.randn(8)
  assert mutated([a, b, 3], [a.clone(), b.clone(), 3]) == ""
  changed = b.clone()
  changed[0] += 1
  assert mutated([a, b], [a.clone(), changed]) == "input 1"
  out = torch.ones(4)
  poison(out)
  assert torch.isnan(out).all()


def test_options_validation_names_the_field():
  with pytest.raises(ValueError, match="num_correct_trials"):
    VerifyOptions(num_correct_trials=0)
  with pytest.raises(ValueError, match="strictness"):
    VerifyOptions(strictness="lenient")
  with pytest.raises(ValueError, match="device"):
    VerifyOptions(device="tpu")
  with pytest.raises(ValueError, match="atol"):
    VerifyOptions(atol=float("nan"))
  with pytest.raises(ValueError, match="candidate_source"):
    VerifyRequest("id", "t", "ref", "  ").validate()
  d = VerifyOptions()
  assert (d.num_correct_trials, d.atol, d.rtol, d.num_perf_trials) == (5, 1e-2, 1e-2, 100)


def test_wire_round_trip_and_defaults():
  req = VerifyRequest(
    "r1", "t1", "ref", "cand", VerifyOptions(device="cpu", atol=0.0, min_speedup=1.2)
  )
  back = wire.request_from_proto(wire.request_to_proto(req), "cuda")
  assert back == req  # atol=0.0 survives: options are proto3 optional
  from verifier.api.proto import verifier_pb2 as pb

  defaulted = wire.request_from_proto(
    pb.VerifyRequest(request_id="x", reference_source="a", candidate_source="b"), "cpu"
  )
  assert defaulted.options == VerifyOptions(device="cpu")
  res = VerifyResult(
    "r1",
    "t1",
    True,
    True,
    False,
    1.0,
    1.5,
    1.41,
    Runtime(1, 2, 3),
    Runtime(4, 5, 6),
    FailureKind.OK,
    "",
    "",
    True,
    1e-6,
    ("w",),
    1.0,
    2.0,
    True,
    "H200",
  )
  assert wire.result_from_proto(wire.result_to_proto(res)) == res
  for kind in FailureKind:  # every kind has a proto enum value
    assert (
      wire.result_from_proto(
        wire.result_to_proto(dataclasses.replace(res, failure_kind=kind))
      ).failure_kind
      is kind
    )


def test_rewards():
  assert (
    reward.binary_reward(FailureKind.OK) == 1.0
    and reward.binary_reward(FailureKind.WRONG_OUTPUT) == 0.0
  )
  assert reward.shaped_reward(FailureKind.OK, 0.0) == 1.0
  assert reward.shaped_reward(FailureKind.OK, 2.0) == 2.0
  assert reward.shaped_reward(FailureKind.OK, 1000.0) == 4.0  # clipped at log2 = 3
  assert reward.shaped_reward(FailureKind.OK, 0.01) == 0.0  # clipped at log2 = -1
  # timed but not resolved: what its mean time gives, capped at 1 (red team 43c: a slow candidate that
  # jittered its timed calls past the resolution got 1.0)
  assert reward.shaped_reward(FailureKind.OK, 0.0, unmeasured=0.78) == 1.0 + math.log2(0.78)
  assert reward.shaped_reward(FailureKind.OK, 0.0, unmeasured=0.05) == 0.0
  assert reward.shaped_reward(FailureKind.OK, 0.0, unmeasured=1e9) == 1.0
  assert reward.shaped_reward(FailureKind.WRONG_OUTPUT, 0.0, unmeasured=1e9) == 0.0
  assert (
    reward.apply_min_speedup(FailureKind.OK, 0.9, 1.0, True)[0] is FailureKind.BELOW_MIN_SPEEDUP
  )
  assert reward.apply_min_speedup(FailureKind.OK, 0.9, 1.0, False)[0] is FailureKind.OK


def test_build_key_and_fast_variant():
  base = {
    "name": "x",
    "cpp_sources": "torch::Tensor f(torch::Tensor a);",
    "cuda_sources": "#include <torch/extension.h>\n__global__ void k() {}",
    "functions": ["f"],
  }
  assert build_key(base) == build_key(dict(base, verbose=True, build_directory="/elsewhere"))
  assert build_key(base) != build_key(dict(base, extra_cuda_cflags=["-O3"]))
  fast = fast_variant(base)
  assert (
    "#include <torch/types.h>" in fast["cuda_sources"]
    and "torch/extension.h" not in fast["cuda_sources"]
  )
  assert fast["extra_cflags"] == ["-O0"]
  assert (
    fast_variant({"name": "x", "cpp_sources": "int f() { return 1; }"}) is None
  )  # C++-only: untouched
  py = fast_variant(
    dict(
      base,
      cuda_sources=base["cuda_sources"] + "\npy::object o;",
      cpp_sources="int f() { return 1; }",
    )
  )
  assert py is None  # uses pybind11 in the .cu and has bodies in main.cpp: nothing to shorten


def test_chunked_comparison_matches_whole_tensor_rules(monkeypatch):
  from verifier.check import correctness

  monkeypatch.setattr(correctness, "CHUNK", 7)
  ref = torch.linspace(-3, 3, 100)
  out = ref.clone()
  out[97] += 1.0
  c = compare_outputs(ref, out, 1e-2, 1e-2, "t")
  assert (
    c.kind is FailureKind.WRONG_OUTPUT
    and "1 of 100" in c.reason
    and abs(c.max_abs_diff - 1.0) < 1e-5
  )
  ref[50], ref[51] = float("nan"), float("-inf")
  out = ref.clone()
  assert compare_outputs(ref, out, 1e-2, 1e-2, "t").kind is FailureKind.OK
  out[51] = float("inf")
  assert compare_outputs(ref, out, 1e-2, 1e-2, "t").kind is FailureKind.NONFINITE_OUTPUT
  half = torch.randn(50).half()
  assert compare_outputs(half, half.clone(), 1e-2, 1e-2, "t").kind is FailureKind.OK


def test_mutation_check_is_nan_safe():
  x = torch.tensor([1.0, float("nan"), 3.0])
  assert mutated([x], [x.clone()]) == ""
  y = x.clone()
  y[0] = 2.0
  assert mutated([x], [y]) == "input 0"
  assert mutated([x.t()], [x.clone()]) == ""  # non-contiguous path


def test_poison_spares_outputs_that_alias_model_state():
  from verifier.ipc.tensors import storages_of

  lin = torch.nn.Linear(3, 3)
  keep = storages_of(lin)
  poison([lin.weight.detach(), lin.bias.detach()[:2]], keep)
  assert torch.isfinite(lin.weight).all() and torch.isfinite(lin.bias).all()


def test_slots_let_a_waiting_exclusive_run_go_first():
  import asyncio

  from verifier.sandbox.pool import Slots

  async def go():
    slots, order = Slots(2), []
    await slots.acquire(1)

    async def take(tag, k):
      await slots.acquire(k)
      order.append(tag)
      await slots.release(k)

    big = asyncio.ensure_future(take("exclusive", 2))
    await asyncio.sleep(0)
    small = asyncio.ensure_future(take("single", 1))
    await asyncio.sleep(0.01)
    assert order == []  # the single run queues behind the waiting exclusive one
    await slots.release(1)
    await asyncio.gather(big, small)
    return order

  assert asyncio.run(go()) == ["exclusive", "single"]


def _line_of(source: str, needle: str) -> int:
  return source[: source.index(needle)].count("\n") + 1


_FWD = "return ops.scaled_add(a, b, self.scale)"
STATIC_HOLES = [
  # Attribute assignment on anything imported from torch, whatever its alias.
  (
    cases.GOOD.replace("import torch\n", "import torch\nfrom torch import Tensor\n", 1)
    + "\nTensor.sum = lambda self, *a, **k: 0\n",
    FailureKind.MONKEY_PATCH,
    "Tensor.sum = ",
  ),
  (
    cases.GOOD.replace("import torch\n", "import torch as T\n", 1).replace("torch.", "T.")
    + "\nT.Tensor.sum = None\n",
    FailureKind.MONKEY_PATCH,
    "T.Tensor.sum",
  ),
  (cases.GOOD + "\nX = torch.Tensor\nX.sum = None\n", FailureKind.MONKEY_PATCH, "X.sum"),
  (cases.GOOD + "\ntype(torch.ones(1)).sum = None\n", FailureKind.MONKEY_PATCH, "type(torch"),
  (cases.GOOD + "\ndel torch.Tensor.sum\n", FailureKind.MONKEY_PATCH, "del torch"),
  # Walking frames to reach the caller (the reference used to live there).
  (
    cases.GOOD.replace(_FWD, "import traceback\n        " + _FWD),
    FailureKind.FRAME_INTROSPECTION,
    "import traceback",
  ),
  (
    cases.GOOD.replace(
      _FWD, "g = (x for x in [a])\n        f = g.gi_frame.f_back\n        " + _FWD
    ),
    FailureKind.FRAME_INTROSPECTION,
    "g.gi_frame",
  ),
  (
    cases.GOOD.replace(_FWD, "c = self.forward.__code__\n        " + _FWD),
    FailureKind.FRAME_INTROSPECTION,
    "__code__",
  ),
  # Direct ATen entry points from C++ (no dispatcher event for the runtime check).
  (
    cases.GOOD.replace(
      "auto out = torch::empty_like(a);", "auto out = at::cpu::clamp_min(a, 0);", 1
    ),
    FailureKind.DIRECT_ATEN_CALL,
    "at::cpu::clamp_min",
  ),
  (
    cases.GOOD.replace("auto out = torch::empty_like(a);", "auto out = at::native::add(a, b);", 1),
    FailureKind.DIRECT_ATEN_CALL,
    "at::native::add",
  ),
  (
    cases.GOOD.replace(
      "auto out = torch::empty_like(a);", "auto out = at::_ops::sum::call(a, {});", 1
    ),
    FailureKind.DIRECT_ATEN_CALL,
    "at::_ops::sum",
  ),
  (
    cases.GOOD.replace("#include <vector>", "#include <vector>\nusing namespace at::native;", 1),
    FailureKind.DIRECT_ATEN_CALL,
    "using namespace at::native",
  ),
  # File writing and process control, however they are reached.
  (
    cases.GOOD.replace(_FWD, "os.abort()\n        " + _FWD).replace(
      "import torch\n", "import os\nimport torch\n", 1
    ),
    FailureKind.FORBIDDEN_IMPORT,
    "os.abort()",
  ),
  (
    cases.GOOD.replace("import torch\n", "from os import write as w\nimport torch\n", 1),
    FailureKind.FORBIDDEN_IMPORT,
    "from os import write",
  ),
  (
    cases.GOOD.replace("import torch\n", "import pathlib\nimport torch\n", 1),
    FailureKind.FORBIDDEN_IMPORT,
    "import pathlib",
  ),
  (
    cases.GOOD.replace("import torch\n", "import tempfile\nimport torch\n", 1),
    FailureKind.FORBIDDEN_IMPORT,
    "import tempfile",
  ),
  (
    cases.GOOD.replace(_FWD, "torch.utils.cpp_extension.os.abort()\n        " + _FWD),
    FailureKind.FORBIDDEN_IMPORT,
    "torch.utils.cpp_extension.os",
  ),
  (
    cases.GOOD.replace(_FWD, "torch.save(a, 'result.json')\n        " + _FWD),
    FailureKind.FORBIDDEN_IMPORT,
    "torch.save(",
  ),
  (
    cases.GOOD.replace(
      _FWD, "torch.utils.cpp_extension.load('x', ['/cache/k/cuda.cu'])\n        " + _FWD
    ),
    FailureKind.FORBIDDEN_IMPORT,
    "torch.utils.cpp_extension.load(",
  ),
  (
    cases.GOOD.replace(
      "import torch\n", "import verifier.candidate.candidate_main\nimport torch\n", 1
    ),
    FailureKind.FORBIDDEN_IMPORT,
    "import verifier",
  ),
]


@pytest.mark.parametrize(
  "source,kind,needle",
  STATIC_HOLES,
  ids=[f"{k.value}-{i}" for i, (_, k, _) in enumerate(STATIC_HOLES)],
)
def test_static_holes_get_their_own_kind_and_the_line(source, kind, needle):
  v = check_candidate(source, STRICT, "cpu")
  assert v.kind is kind, v.reason
  assert f"line {_line_of(source, needle)}" in v.reason, (v.reason, _line_of(source, needle))


def test_static_check_allows_stream_getters_and_aliases_of_torch_functions():
  # at::cuda utilities are not ATen kernels; keeping torch.sigmoid on self is not patching torch.
  src = g.GOOD_MATMUL.replace(
    "tiled_matmul_kernel<<<grid, block>>>(",
    "auto stream = at::cuda::getCurrentCUDAStream();\n    tiled_matmul_kernel<<<grid, block, 0, stream>>>(",
  ).replace("super().__init__()", "super().__init__()\n        self.act = torch.sigmoid")
  v = check_candidate(src, STRICT, "cuda")
  assert v.kind is FailureKind.OK, v.reason
  kb = check_candidate(
    STATIC_HOLES[8][0], KB, "cpu"
  )  # direct ATen: only a warning under kernelbench
  assert kb.kind is FailureKind.OK and any("at::cpu::clamp_min" in w for w in kb.warnings)
