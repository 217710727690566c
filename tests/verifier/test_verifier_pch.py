"""The precompiled torch header for main.cpp (verifier/build/pch.py): built from a real build's flags, checked by
g++ itself, then used by later builds that still give a working extension."""

import asyncio
import os
import pathlib

import pytest

torch = pytest.importorskip("torch")

import verifier_cases as cases  # noqa: E402

from verifier.api.contract import FailureKind, VerifyOptions, VerifyRequest  # noqa: E402
from verifier.build import pch  # noqa: E402
from verifier.build.build_cache import CachedLoadInline, toolchain_signature  # noqa: E402
from verifier.serve.service import ServiceConfig, VerifierService  # noqa: E402

SOURCE = r"""
torch::Tensor twice_{tag}(torch::Tensor x) {{
  auto out = torch::empty_like(x);
  auto* po = out.data_ptr<float>();
  const auto* px = x.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) po[i] = 2.0f * px[i] + {offset}.0f;
  return out;
}}
"""


def test_pch_request_takes_the_builds_flags_without_the_extension_name_or_its_own_include(tmp_path):
  d = str(tmp_path / "pch" / "k")
  (tmp_path / "build.ninja").write_text(
    "ninja_required_version = 1.3\ncxx = c++\n\n"
    f"cflags = -DTORCH_EXTENSION_NAME=ext_1 -DTORCH_API_INCLUDE_EXTENSION_H -isystem '/opt/torch include' "
    f"-fPIC -std=c++20 -O0 -include {d}/dice_torch.h\npost_cflags = -D_GLIBCXX_USE_CXX11_ABI=1\n"
  )
  req = pch.request_from_build(str(tmp_path), d)
  assert req["command"] == [
    "c++",
    "-DTORCH_API_INCLUDE_EXTENSION_H",
    "-isystem",
    "/opt/torch include",
    "-fPIC",
    "-std=c++20",
    "-O0",
    "-D_GLIBCXX_USE_CXX11_ABI=1",
  ]
  assert req["header"] == os.path.join(d, "dice_torch.h") and req["dir"] == d
  assert pch.request_from_build(str(tmp_path / "missing"), d) is None


def test_pch_directory_depends_on_the_flags_that_change_main_cpp():
  tc = {"torch": "2.13"}
  a = pch.pch_dir("/c", ["-O0"], None, False, tc)
  assert a == pch.pch_dir("/c", ["-O0"], [], False, tc)
  assert (
    len(
      {
        a,
        pch.pch_dir("/c", ["-O2"], None, False, tc),
        pch.pch_dir("/c", ["-O0"], None, True, tc),
        pch.pch_dir("/c", ["-O0"], None, False, {"torch": "2.11"}),
      }
    )
    == 4
  )


def test_pch_build_refuses_flags_gcc_cannot_use(tmp_path):
  d = tmp_path / "p"
  flags = pch.include_flags(str(d))
  req = {
    "dir": str(d),
    "header": flags[1],
    "command": ["c++", "-std=c++20", "-DNOT_A_REAL_HEADER_FLAG", "-isystem", "/nonexistent"],
  }
  out = pch.build(req, timeout_s=120)
  assert not out["ok"] and "torch/extension.h" in out["error"]
  assert not pch.ready(str(d)) and not list(d.glob("*.tmp-*"))


def test_pch_builds_for_new_flag_sets_run_one_at_a_time_and_stop_at_the_cap(tmp_path):
  """A stream of candidates each with flags of its own asked for a PCH each, all built at once (a
  compile worker and 0.1-1 GB of g++ apiece, every one kept on disk): now one at a time, for at most
  `pch_max_flag_sets` flag sets counting those already in the cache; the warm-up's is never refused.
  The build stage here only records what the service asks of it (a real PCH build takes ~35 s)."""
  cache = tmp_path / "builds"
  (cache / "pch" / ("a" * 24)).mkdir(parents=True)  # one kept from an earlier run
  svc = VerifierService(ServiceConfig(device="cpu", cache_dir=str(cache), pch_max_flag_sets=3))

  class Stage:
    running, most, built = 0, 0, []

    async def run_pch(self, request):
      Stage.running += 1
      Stage.most = max(Stage.most, Stage.running)
      await asyncio.sleep(0.02)
      os.makedirs(request["dir"])
      Stage.built.append(os.path.basename(request["dir"]))
      Stage.running -= 1

  svc.build_stage = Stage()
  asks = [str(cache / "pch" / (f"{i:x}" * 24)) for i in range(1, 6)]

  async def go():
    for d in asks:
      svc._schedule_pch({"dir": d})
    svc._schedule_pch({"dir": asks[0]})  # asked again while building: nothing new
    await asyncio.gather(*svc.pch_builds.values())
    svc._schedule_pch({"dir": str(cache / "pch" / ("f" * 24))}, background_only=False)
    await asyncio.gather(*svc.pch_builds.values())

  asyncio.run(go())
  assert Stage.most == 1
  assert Stage.built == ["1" * 24, "2" * 24, "f" * 24]
  assert svc.metrics.pch_refused == 3
  with pytest.raises(ValueError, match="pch_max_flag_sets"):
    VerifierService(ServiceConfig(device="cpu", cache_dir=str(cache), pch_max_flag_sets=-1))


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
  """A CPU service's build cache after `VerifierService.warm_pch` (the seed extension, then the flag-less
  PCH its build asked for) and one request built on it: the cache the two tests below share (a torch PCH
  and an extension built without one take ~30-40 s each on 2 cores)."""
  tmp_path = tmp_path_factory.mktemp("pch")
  cfg = ServiceConfig(
    device="cpu",
    cpu_slots=1,
    compile_workers=1,
    cache_dir=str(tmp_path / "builds"),
    scratch_root=str(tmp_path / "scratch"),
    mem_mb=3072,
    build_timeout_s=300,
    pch_background=False,  # only the warm-up builds a PCH here
  )
  flagless = pch.pch_dir(cfg.cache_dir, [], None, False, toolchain_signature())
  candidate = cases.candidate("scaled_add", name="vt_warm_pch", cflags='[""]')
  opts = VerifyOptions(device="cpu", timeout_s=300, num_correct_trials=1, strictness="off")

  async def run():
    svc = VerifierService(cfg)
    await svc.start()
    try:
      before = pch.ready(flagless)
      warmed = await svc.warm_pch()
      ready = pch.ready(flagless)
      again = await svc.warm_pch()  # the seed is cached now: nothing to build
      r = await svc.verify(VerifyRequest("warm-pch", "t", cases.REFERENCE, candidate, opts))
      steps = (before, warmed, ready, again)
      return steps, r, svc.metrics.build_s[-1], [b["dir"] for b in svc.metrics.pch_builds]
    finally:
      await svc.close()

  return (cfg.cache_dir, flagless, *asyncio.run(run()))


def test_the_service_warms_the_pch_of_flagless_builds_before_any_request(warmed):
  """`VerifierService.warm_pch` builds the seed extension and its PCH; a candidate copying KernelBench's
  one-shot flags (`extra_cflags=[""]`, the flag-less PCH) then builds on it at once."""
  _, flagless, steps, r, build, pch_builds = warmed
  assert steps == (False, True, True, True)  # not ready, warmed, ready, nothing left to build
  assert r.failure_kind is FailureKind.OK, r.reason
  assert build["pch"] is True, build
  assert pch_builds == [flagless]


def test_a_build_after_the_pch_is_published_uses_it_and_still_works(warmed):
  from torch.utils.cpp_extension import load_inline

  cache_dir, flagless, *_ = warmed
  cache = CachedLoadInline(load_inline, cache_dir, use_pch=True)
  second = cache(name="pch_b", cpp_sources=SOURCE.format(tag="b", offset=1), functions=["twice_b"])
  ev = cache.events[-1]
  assert ev["pch"] is True and "pch_request" not in ev and not ev["cached"], ev
  x = torch.arange(4, dtype=torch.float32)
  assert torch.equal(second.twice_b(x), 2 * x + 1)
  header = pathlib.Path(pch.include_flags(flagless)[1])
  assert (
    pathlib.Path(str(header) + ".gch").stat().st_size > 1_000_000
  )  # the torch headers, precompiled
  ninja = (pathlib.Path(cache_dir) / ev["key"] / "build.ninja").read_text()
  assert f"-include {header}" in ninja


def test_the_lean_and_the_full_torch_headers_get_their_own_pch(tmp_path):
  from verifier.build.build_cache import _leading_torch_includes
  from verifier.build.split_build import LEAN_TORCH_INCLUDES, split_variant

  cuda = "#include <torch/extension.h>\n__global__ void k(float* p) { p[0] = 1; }\n" + (
    "torch::Tensor f(torch::Tensor x) { k<<<1, 1>>>(x.data_ptr<float>()); return x; }\n"
  )
  params = {"name": "e", "cpp_sources": "torch::Tensor f(torch::Tensor x);", "cuda_sources": cuda}
  assert _leading_torch_includes(params) == pch.FULL_INCLUDES  # stock: load_inline adds extension.h
  assert _leading_torch_includes(split_variant(params)) == pch.FULL_INCLUDES
  assert _leading_torch_includes(split_variant(params, lean=True)) == LEAN_TORCH_INCLUDES
  assert _leading_torch_includes(dict(params, no_implicit_headers=True)) is None
  dirs = {
    inc: pch.pch_dir(str(tmp_path), [], None, True, {"t": 1}, inc)
    for inc in (pch.FULL_INCLUDES, LEAN_TORCH_INCLUDES)
  }
  assert len(set(dirs.values())) == 2
  for inc, d in dirs.items():
    (flag, header) = pch.include_flags(d, inc)
    assert flag == "-include" and open(header).read() == f"#pragma once\n{inc}\n"
