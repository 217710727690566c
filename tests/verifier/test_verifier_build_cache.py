"""The build cache's housekeeping: finished builds keep no object files, and least-recently-used entries are
evicted above a size cap (or under a free-disk floor) without touching recent entries, temporary builds or
precompiled headers; one build's output is capped."""

import os
import pathlib
import shutil
import time

import pytest

from verifier.build import build_cache

KB = 1024


def _entry(root, key: str, size: int, age_s: float):
  d = root / key
  d.mkdir()
  (d / "ext.so").write_bytes(b"\0" * size)
  t = time.time() - age_s
  os.utime(d, (t, t))
  return d


def test_finished_build_keeps_the_library_and_sources_but_not_objects(tmp_path):
  for f in (
    "ext.so",
    "main.cpp",
    "cuda.cu",
    "build.ninja",
    "main.o",
    "cuda.cuda.o",
    ".ninja_deps",
    ".ninja_log",
  ):
    (tmp_path / f).write_text("x")
  build_cache.strip_intermediates(str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == ["build.ninja", "cuda.cu", "ext.so", "main.cpp"]


def test_eviction_removes_least_recently_used_entries_down_to_the_cap(tmp_path):
  old = [
    _entry(tmp_path, f"{i:032x}", 100 * KB, age_s=7200 + 100 * i) for i in range(4)
  ]  # old[3] is oldest
  recent = _entry(tmp_path, "f" * 32, 100 * KB, age_s=10)
  tmp_build = tmp_path / (f"{1:032x}" + ".tmp-123-abcd")
  tmp_build.mkdir()
  (tmp_path / "pch" / "k").mkdir(parents=True)
  (tmp_path / "pch" / "k" / "dice_torch.h.gch").write_bytes(b"\0" * 500 * KB)

  out = build_cache.evict(str(tmp_path), max_bytes=250 * KB, min_age_s=3600)
  assert out == {
    "removed": 3,
    "freed_bytes": 300 * KB,
    "kept_bytes": 200 * KB,
    "entries": 2,
    "stale_removed": 0,  # the temporary build is fresh: a build may be running there
  }
  assert [d.exists() for d in old] == [True, False, False, False] and recent.exists()
  assert tmp_build.exists() and (tmp_path / "pch" / "k" / "dice_torch.h.gch").exists()
  assert not [p for p in os.listdir(tmp_path) if ".evict-" in p]


def _aged(path: pathlib.Path, age_s: float) -> pathlib.Path:
  t = time.time() - age_s
  os.utime(path, (t, t))
  return path


def test_leftovers_of_killed_builds_are_removed_by_tag_at_once_and_by_age_at_eviction(tmp_path):
  """Red team 44: a compile killed at its deadline left its build directory (1.9 GB of compiler dumps)
  where nothing removed it. The service removes its worker's directories by their tag when it kills the
  worker, and eviction removes any temporary untouched for an hour."""
  key = "a" * 32
  mine = [tmp_path / f"{key}.tmp-t0ag-{i}" for i in range(2)]
  other = tmp_path / f"{key}.tmp-other-1"
  for d in (*mine, other):
    d.mkdir()
    (d / "main.cpp.253r.expand").write_bytes(b"\0" * KB)
  entry = _entry(tmp_path, key, KB, age_s=10)
  assert build_cache.remove_tmp(str(tmp_path), "t0ag") == 2
  assert not any(d.exists() for d in mine) and other.exists() and entry.exists()

  pch = tmp_path / "pch" / "k"
  pch.mkdir(parents=True)
  evicting = tmp_path / f"{'b' * 32}.evict-1234"
  evicting.mkdir()
  for f in ("dice_torch.h.gch", "dice_torch.h.gch.tmp-2-abcd", "dice_torch.h.gch.tmp-3-ef01"):
    (pch / f).write_bytes(b"\0")
  stale = [_aged(p, 7200) for p in (other, evicting, pch / "dice_torch.h.gch.tmp-2-abcd")]
  fresh = [tmp_path / f"{'c' * 32}.tmp-2-ef01", pch / "dice_torch.h.gch.tmp-3-ef01"]
  fresh[0].mkdir()
  kept = [_entry(tmp_path, "d" * 32, KB, age_s=9000), _aged(pch / "dice_torch.h.gch", 9000), entry]
  out = build_cache.evict(str(tmp_path), max_bytes=1 << 30, min_age_s=3600)
  assert out["stale_removed"] == 3 and out["removed"] == 0
  assert not any(os.path.lexists(p) for p in stale)
  assert all(p.exists() for p in fresh + kept)


def test_recent_entries_are_kept_even_above_the_cap(tmp_path):
  a = _entry(tmp_path, "a" * 32, 100 * KB, age_s=60)
  b = _entry(tmp_path, "b" * 32, 100 * KB, age_s=30)
  out = build_cache.evict(str(tmp_path), max_bytes=0, min_age_s=3600)
  assert out["removed"] == 0 and a.exists() and b.exists() and out["kept_bytes"] == 200 * KB


def test_a_cache_hit_makes_an_entry_recently_used(tmp_path):
  d = _entry(tmp_path, "c" * 32, KB, age_s=9000)
  before = d.stat().st_mtime
  build_cache.touch(str(d))
  assert d.stat().st_mtime - before > 8000  # its 9000 s of age are gone
  assert build_cache.evict(str(tmp_path), max_bytes=0, min_age_s=3600)["removed"] == 0


def test_service_trims_the_cache_every_32_new_builds(tmp_path):
  import asyncio

  from verifier.api.contract import FailureKind
  from verifier.build.build_stage import BuildOutcome
  from verifier.serve.service import ServiceConfig, VerifierService

  old = _entry(tmp_path, "d" * 32, 100 * KB, age_s=7200)
  svc = VerifierService(
    ServiceConfig(
      device="cpu", cache_dir=str(tmp_path), cache_max_gb=50 * KB / 2**30, cache_min_free_gb=0
    )
  )

  async def go():
    svc._maybe_evict(
      BuildOutcome(FailureKind.OK, events=({"cached": False},) * 31 + ({"cached": True},))
    )
    assert svc.evicting is None and old.exists()  # 31 new builds: not yet
    svc._maybe_evict(BuildOutcome(FailureKind.OK, events=({"cached": False, "error": ""},)))
    await svc.evicting

  asyncio.run(go())
  assert (
    not old.exists()
    and svc.metrics.cache_evicted == 1
    and svc.metrics.snapshot()["cache_evicted"] == 1
  )


# ---- the cache's disk (red team 42, round 2: a 900 MB artefact built, passed and stayed) ---------------
def _fake_load_inline(size: int):
  """A ``load_inline`` stand-in that writes a sparse ``<name>.so`` of ``size`` bytes (no disk used)."""

  def load_inline(
    name,
    cpp_sources,
    cuda_sources=None,
    functions=None,
    extra_cflags=None,
    extra_cuda_cflags=None,
    extra_ldflags=None,
    extra_include_paths=None,
    build_directory=None,
    verbose=False,
    with_cuda=None,
    is_python_module=True,
    with_pytorch_error_handling=True,
    keep_intermediates=True,
    use_pch=False,
    no_implicit_headers=False,
  ):
    with open(os.path.join(build_directory, f"{name}.so"), "wb") as f:
      f.truncate(size)
    (pathlib.Path(build_directory) / "main.o").write_bytes(b"\0" * KB)  # stripped before the cap
    return object()

  return load_inline


def test_a_build_over_the_entry_cap_fails_and_leaves_nothing_in_the_cache(tmp_path):
  pytest.importorskip("torch")
  cap = build_cache.MAX_ENTRY_BYTES
  small = build_cache.CachedLoadInline(
    _fake_load_inline(cap - KB), str(tmp_path), fast=False, use_pch=False
  )
  small(name="fits", cpp_sources="")
  (event,) = small.events
  assert event["bytes"] == cap - KB and not event["error"]
  assert os.listdir(tmp_path / event["key"]) == ["fits.so"]

  big = build_cache.CachedLoadInline(
    _fake_load_inline(cap + 1), str(tmp_path), fast=False, use_pch=False
  )
  with pytest.raises(RuntimeError, match=r"over the build cache's cap of 256 MiB"):
    big(name="ballast", cpp_sources="")
  (event,) = big.events
  assert event["bytes"] == cap + 1 and "ballast" not in str(os.listdir(tmp_path))
  assert sorted(os.listdir(tmp_path)) == [small.events[0]["key"]]  # no entry, no temporary left


def test_under_the_free_disk_floor_even_recent_entries_go_oldest_first(tmp_path, monkeypatch):
  a = _entry(tmp_path, "a" * 32, 100 * KB, age_s=60)
  b = _entry(tmp_path, "b" * 32, 100 * KB, age_s=30)
  free = {"bytes": 10 * KB}
  monkeypatch.setattr(
    build_cache.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(0, 0, free["bytes"])
  )
  out = build_cache.evict(str(tmp_path), max_bytes=10**9, min_age_s=600, min_free_bytes=5 * KB)
  assert out["removed"] == 0 and a.exists() and b.exists()  # above the floor: the cap alone decides
  out = build_cache.evict(str(tmp_path), max_bytes=10**9, min_age_s=600, min_free_bytes=100 * KB)
  assert out == {
    "removed": 1,
    "freed_bytes": 100 * KB,
    "kept_bytes": 100 * KB,
    "entries": 1,
    "stale_removed": 0,
  }
  assert not a.exists() and b.exists()  # 10 + 100 KB free after the oldest went


def test_service_trims_the_cache_after_a_gib_of_new_builds(tmp_path):
  import asyncio

  from verifier.api.contract import FailureKind
  from verifier.build.build_stage import BuildOutcome
  from verifier.serve.service import ServiceConfig, VerifierService

  old = _entry(tmp_path, "e" * 32, 100 * KB, age_s=7200)
  svc = VerifierService(
    ServiceConfig(
      device="cpu", cache_dir=str(tmp_path), cache_max_gb=50 * KB / 2**30, cache_min_free_gb=0
    )
  )

  async def go():
    svc._maybe_evict(BuildOutcome(FailureKind.OK, events=({"cached": False, "bytes": 2**29},)))
    assert svc.evicting is None and old.exists()  # half a GiB in one build: not yet
    svc._maybe_evict(BuildOutcome(FailureKind.OK, events=({"cached": False, "bytes": 2**29},)))
    await svc.evicting

  asyncio.run(go())
  assert not old.exists() and svc.metrics.cache_evicted == 1
