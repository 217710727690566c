"""Red team 42, hole B1: relabelling torch's code as the candidate's own for the host sampler.

The sampler attributes a sample to the file of the last ``MMAP2`` record covering its address, and
``mremap`` makes no record. A candidate moved libtorch_cpu's and libc10's text away (``mremap`` with
MREMAP_FIXED), mapped its own build-cache ``.so`` over the hole (a record: "own") and moved torch's pages
back on top: ``at::cpu::clamp_min_out`` found by ``dlsym`` then got reward 1 under ``strict``, timed or
not. Now the candidate's seccomp filter refuses every ``mremap`` that may move a mapping
(``confine.evidence_filter_program``), and a mapping that reaches past what its file holds counts as a
forgery, foreign to the candidate (``host_sampler.ModuleTable.module_of``).
"""

import asyncio
import ctypes
import importlib.util
import os
import pathlib
import struct
import subprocess

import pytest

torch = pytest.importorskip("torch")

import verifier_compute_cases as compute  # noqa: E402
from verifier_loop import cpu_service  # noqa: E402
from verifier_sampled import run_sampled  # noqa: E402

from verifier.api.contract import FailureKind, VerifyOptions, VerifyRequest  # noqa: E402
from verifier.check import host_sampler  # noqa: E402
from verifier.sandbox import confine  # noqa: E402

MAP_PRIVATE, MAP_ANONYMOUS = 0x02, 0x20
MREMAP_MAYMOVE, MREMAP_FIXED, MREMAP_DONTUNMAP = 1, 2, 4

LIBC = """
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = libc.mremap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
libc.mremap.argtypes = [ctypes.c_void_p] + [ctypes.c_size_t] * 2 + [ctypes.c_int, ctypes.c_void_p]
"""


def _libc():
  scope = {"ctypes": ctypes}
  exec(LIBC, scope)
  return scope["libc"]


def _under_the_filter(body) -> str:
  """``repr([notes, *body()])`` from a forked child that installed the candidate's seccomp filter
  (``confine.protect_evidence``, ``notes``: how many of its layers failed) before running ``body``."""
  r, w = os.pipe()
  pid = os.fork()
  if pid == 0:
    try:
      os.close(r)
      notes = confine.protect_evidence()
      os.write(w, repr([len(notes), *body()]).encode())
    finally:
      os._exit(0)
  os.close(w)
  got = os.read(r, 200).decode()
  os.close(r)
  os.waitpid(pid, 0)
  return got


# ---- 1. the candidate's seccomp filter ----------------------------------------------------------------
def test_no_mapping_of_a_candidate_moves_but_realloc_and_in_place_mremap_still_work():
  # Round 42 left a plain MREMAP_MAYMOVE allowed (glibc's realloc passes it): the kernel puts the moved
  # pages in the highest hole that fits, and a munmap of an "own" range (no record) makes that hole, so
  # torch's text could still land under an "own" label. Now no flag that may move a mapping passes.
  def body():
    libc = _libc()
    libc.malloc.restype = libc.realloc.restype = ctypes.c_void_p
    libc.malloc.argtypes, libc.realloc.argtypes = (
      [ctypes.c_size_t],
      [ctypes.c_void_p, ctypes.c_size_t],
    )
    n = 1 << 20
    a = libc.mmap(None, 2 * n, 3, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    b = libc.mmap(None, n, 3, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    out = []
    for flags, to in ((0, None), (MREMAP_FIXED, b), (MREMAP_DONTUNMAP, None)):
      ctypes.set_errno(0)
      moved = libc.mremap(a, 2 * n, 16 * n, MREMAP_MAYMOVE | flags, to)
      out.append(moved == ctypes.c_void_p(-1).value and ctypes.get_errno() == 1)  # EPERM
    out.append(libc.mremap(a, 2 * n, n, 0, None) == a)  # shrinking in place
    big = libc.malloc(64 << 20)  # an mmapped chunk: realloc would mremap it
    ctypes.memset(big + (64 << 20) - 1, 7, 1)
    grown = libc.realloc(big, 256 << 20)  # refused MREMAP_MAYMOVE: malloc, copy, free
    out.append(grown is not None and ctypes.string_at(grown + (64 << 20) - 1, 1) == b"\x07")
    out.append(len(bytearray(64 << 20) + bytearray(64 << 20)))
    return out

  got = _under_the_filter(body)
  assert got == f"[0, True, True, True, True, True, {128 << 20}]", got


def test_no_process_shares_the_candidates_memory_but_threads_forks_and_spawns_still_work():
  # Red team 46: a clone(CLONE_VM) child kept the sampler's copy of its parent's address space while
  # the parent loaded OpenBLAS over its own code; the child's sgemm there counted as "own" (reward 1).
  import platform
  import threading

  nrs = {"x86_64": (56, 435), "aarch64": (220, 435)}.get(platform.machine())
  if nrs is None:
    pytest.skip(f"no clone syscall numbers for {platform.machine()}")
  clone, clone3 = nrs

  def body():
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    out = []
    for flags in (
      confine.CLONE_VM | 17,
      confine.CLONE_VM | 0x800 | 17,
    ):  # SIGCHLD; CLONE_SIGHAND too
      ctypes.set_errno(0)
      rc = libc.syscall(ctypes.c_long(clone), ctypes.c_ulong(flags), None, None, None, None)
      if rc == 0:  # the old filter let it through: a child on this stack, leave at once
        libc.syscall(ctypes.c_long(60 if platform.machine() == "x86_64" else 93), 0)
      out.append((rc, ctypes.get_errno()))
    ctypes.set_errno(0)
    out.append((libc.syscall(ctypes.c_long(clone3), None, ctypes.c_size_t(0)), ctypes.get_errno()))
    seen = []
    t = threading.Thread(target=lambda: seen.append(1))
    t.start()
    t.join()
    out.append(seen == [1])
    out.append(subprocess.run(["true"]).returncode)  # posix_spawn / vfork
    pid = os.fork()
    if pid == 0:
      os._exit(3)
    out.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    return out

  got = _under_the_filter(body)
  assert got == "[0, (-1, 1), (-1, 1), (-1, 38), True, 0, 3]", got


def test_a_candidate_cannot_reach_the_kernels_keyrings():
  # Red team 42, round 2: keys outlive the worker (one user keyring for every worker of a root service),
  # so a candidate stored each forward's trial seed with add_key and a later request of the task read
  # them back with keyctl. The filter refuses add_key, request_key and keyctl.
  import platform

  nrs = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}.get(platform.machine())
  if nrs is None:
    pytest.skip(f"no keyring syscall numbers for {platform.machine()}")
  add_key, request_key, keyctl = nrs

  def body():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    out = []
    for args in (
      (add_key, b"user", b"rt42-seed", b"x", 1, ctypes.c_long(-2)),
      (request_key, b"user", b"rt42-seed", None, ctypes.c_long(0)),
      (keyctl, 0, ctypes.c_long(-4), 0),  # KEYCTL_GET_KEYRING_ID of the user keyring
    ):
      ctypes.set_errno(0)
      out.append((libc.syscall(*args), ctypes.get_errno()))
    return out

  got = _under_the_filter(body)
  assert got == "[0, (-1, 1), (-1, 1), (-1, 1)]", got  # EPERM each


def test_a_candidate_cannot_set_up_io_uring():
  # Red team 43b: io_uring's requests run in kernel mode, out of the host sampler's sight.
  def body():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    params = ctypes.create_string_buffer(120)  # struct io_uring_params
    out = []
    for nr, args in ((425, (8, params)), (426, (0, 1, 0, 0, None, 0)), (427, (0, 0, None, 0))):
      ctypes.set_errno(0)
      out.append((libc.syscall(nr, *args), ctypes.get_errno()))
    return out

  got = _under_the_filter(body)
  assert got == "[0, (-1, 1), (-1, 1), (-1, 1)]", got  # EPERM each


def test_the_evidence_filters_jumps_land_inside_the_program_on_each_arch():
  for arch, (_, prctl) in confine._EVIDENCE_SYSCALLS.items():
    audit_arch = confine._SOCKET_SYSCALLS[arch][0]
    prog = confine.evidence_filter_program(audit_arch, *confine._EVIDENCE_SYSCALLS[arch])
    for i, (code, jt, jf, _) in enumerate(prog):
      if code in (0x15, 0x35, 0x45):
        assert i + 1 + jt < len(prog) and i + 1 + jf < len(prog), (arch, i)
    for nr, args_offset in (
      (confine._MREMAP_SYSCALL[audit_arch], 40),
      (confine._CLONE_SYSCALLS[audit_arch][0], 16),
    ):
      (i,) = [i for i, ins in enumerate(prog) if ins[0] == 0x15 and ins[3] == nr]
      assert prog[i + 1 + prog[i][1]][3] == args_offset, (arch, nr)  # its flags argument is loaded
    assert prog[-1][3] == 0x00050001  # EPERM


# ---- 2. a mapping past its file's end is a forgery ----------------------------------------------------
def _elf(path: pathlib.Path, loads: list[tuple[int, int, int, int]], size: int) -> None:
  """A 64-bit ELF file of ``size`` bytes whose program headers are ``loads`` (offset, vaddr, filesz,
  memsz), as a linker lays out a library whose first segment holds its code (``-z noseparate-code``)."""
  head = bytearray(64)
  head[:7] = b"\x7fELF\x02\x01\x01"
  struct.pack_into("<Q", head, 32, 64)
  struct.pack_into("<HH", head, 54, 56, len(loads))
  for off, vaddr, filesz, memsz in loads:
    head += struct.pack("<IIQQQQQQ", 1, 5, off, vaddr, vaddr, filesz, memsz, 0x200000)
  path.write_bytes(bytes(head) + b"\0" * (size - len(head)))


def test_a_mapping_past_what_its_file_holds_counts_as_a_forgery_not_as_the_file(tmp_path):
  page = host_sampler.PAGE
  own = tmp_path / "0123456789abcdef0123456789abcdef" / "rt_b1.so"
  own.parent.mkdir()
  _elf(own, [(0, 0, page + 100, page + 100)], page + 100)  # two pages
  lib = tmp_path / "libgomp.so.1"  # its code and the data 2 MiB above it: a 2 MiB + 3 page image
  _elf(lib, [(0, 0, page, page), (page, 0x200000 + page, 16, 2 * page)], page + 200)
  assert host_sampler.file_extent(str(own)) == 2 * page
  assert host_sampler.file_extent(str(lib)) == 0x200000 + 3 * page
  assert host_sampler.file_extent(str(tmp_path / "absent.so")) is None
  assert host_sampler.file_extent("/dev/null") is None

  table = host_sampler.ModuleTable()
  base = 1 << 32
  forged = host_sampler.FORGED.format("rt_b1.so")
  cases = [  # (slot, length, path, pgoff, the module its samples then count for)
    (0, 2 * page, own, 0, str(own)),
    (1, page, own, page, forged),  # within the file, but a second base (red team 43)
    (2, 0x200000 + 3 * page, lib, 0, str(lib)),  # the loader's first mapping of the whole image
    (3, 400 << 20, own, 0, forged),  # torch's text relabelled (hole B1)
    (4, 2 * page, own, page, forged),
    (5, 400 << 20, tmp_path / "absent.so", 0, str(tmp_path / "absent.so")),  # nothing to judge by
  ]
  for i, (k, length, path, pgoff, _) in enumerate(cases):
    start = base + k * (1 << 30)
    table.apply(host_sampler.Mapping(i, 7, start, start + length, str(path), pgoff))
    table.apply(host_sampler.Sample(100 + i, 7, start + length - 1))
  assert [table.names[m] for m in table.modules] == [c[-1] for c in cases]
  assert [(m.start - base) >> 30 for m in table.forged] == [1, 3, 4]


def _sampled_numpy_child(forgery: str):
  """Samples per module of a child process that, with the host sampler attached, runs ``forgery`` (Python,
  ``libc`` at hand) and then numpy's sqrt for 0.15 s of CPU; and the sampler."""
  setup = (
    "import ctypes, time, numpy as np\n" + LIBC + "a = np.random.rand(1 << 18).astype('float32')\n"
  )
  work = (
    forgery
    + "t = time.process_time()\nwhile time.process_time() - t < 0.15:\n    np.sqrt(a, out=a)\n"
  )
  return run_sampled(setup, work, env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))


def test_the_sampler_names_relabelled_code_a_forgery_from_the_kernels_own_records(tmp_path):
  # Hole B1 on a live process, through the kernel's records: numpy's text moved away with mremap, a
  # small file mapped over the hole, numpy's pages moved back. Before this, every sample in numpy counted
  # for the small file. Also loads an honest library whose image is larger than its file, after the attach.
  pytest.importorskip("numpy")
  own = tmp_path / "rt_b1.so"
  own.write_bytes(b"\0" * 4096)
  spec = importlib.util.find_spec("torch")
  gomp = pathlib.Path(spec.origin).parent / "lib" / "libgomp.so.1"
  gomp = str(gomp) if gomp.exists() else ""
  counts, sampler = _sampled_numpy_child(
    f"if {gomp!r}:\n"
    f"    ctypes.CDLL({gomp!r})\n"
    "maps = [l.split() for l in open('/proc/self/maps')]\n"
    "(lo, hi), = [[int(v, 16) for v in m[0].split('-')] for m in maps\n"
    "             if len(m) > 5 and 'x' in m[1] and '_multiarray_umath' in m[5]]\n"
    "n = hi - lo\n"
    f"fd = os.open({str(own)!r}, os.O_RDONLY)\n"
    "away = libc.mremap(lo, n, n, 3, libc.mmap(None, n, 0, 0x22, -1, 0))\n"
    "libc.mmap(lo, n, 5, 0x12, fd, 0)\n"
    "assert libc.mremap(away, n, n, 3, lo) == lo\n"
  )
  total = sum(counts.values())
  assert total >= 750 and str(own) not in counts, counts
  assert counts.get(host_sampler.FORGED.format("rt_b1.so"), 0) > 0.5 * total, counts
  assert [m.path for m in sampler.table.forged] == [str(own)]
  if gomp:  # its loader mapping reached past the file, and was taken as it is
    assert gomp in sampler.table.extents
    assert host_sampler.file_extent(gomp) > os.path.getsize(gomp)


# ---- 3. a mapping within the file that no loader makes (red team 43) -----------------------------------
def _elf_segments(path: pathlib.Path, loads: list[tuple[int, int, int, int]], size: int) -> None:
  """A 64-bit ELF file of ``size`` bytes with ``loads`` (offset, vaddr, filesz, p_flags) as its ``PT_LOAD``
  headers (p_flags 5: read and execute, 4: read only)."""
  head = bytearray(64)
  head[:7] = b"\x7fELF\x02\x01\x01"
  struct.pack_into("<Q", head, 32, 64)
  struct.pack_into("<HH", head, 54, 56, len(loads))
  for off, vaddr, filesz, flags in loads:
    head += struct.pack("<IIQQQQQQ", 1, flags, off, vaddr, vaddr, filesz, filesz, 0x1000)
  path.write_bytes(bytes(head) + b"\0" * (size - len(head)))


def test_a_mapping_within_the_file_that_no_loader_makes_is_a_forgery(tmp_path):
  # Red team 43: the candidate's build carried a byte copy of libtorch_cpu's text (``.incbin``, in a
  # read-only section) and mapped that part of itself over libtorch's text, within the file's extent: the
  # same bytes, so torch ran on, and reward 1 for at::cpu::clamp_min_out (speedup 0.67 timed).
  page = host_sampler.PAGE
  own = tmp_path / ("0123456789abcdef" * 2) / "rt_o1.so"
  own.parent.mkdir()
  # its code in pages 1-2, a read-only blob in pages 3-8
  _elf_segments(
    own, [(0, 0, page, 4), (page, page, 2 * page, 5), (3 * page, 3 * page, 6 * page, 4)], 9 * page
  )
  other = tmp_path / ("fedcba9876543210" * 2) / "rt_o2.so"
  other.parent.mkdir()
  _elf_segments(other, [(0, 0, 2 * page, 5)], 2 * page)
  torch_text = (1 << 40, (1 << 40) + 64 * page)
  table = host_sampler.ModuleTable()
  table.seed(
    7, f"{torch_text[0]:x}-{torch_text[1]:x} r-xp 00000000 08:01 1 /venv/libtorch_cpu.so\n"
  )
  base = 1 << 32
  forged = host_sampler.FORGED.format
  cases = [  # (start, length, path, pgoff, the module its samples then count for, why)
    (base + page, 2 * page, own, page, str(own), ""),  # its loader's mapping of its code
    (base + page, page, own, page, str(own), ""),  # the same again (mprotect makes such a record)
    (torch_text[0], 6 * page, own, 3 * page, forged("rt_o1.so"), "without execute permission"),
    (torch_text[0], 2 * page, own, page, forged("rt_o1.so"), "a second copy"),
    (
      torch_text[0] + 8 * page,
      2 * page,
      other,
      0,
      forged("rt_o2.so"),
      "lies over the code of libtorch_cpu.so",
    ),
    (base + (1 << 30), 2 * page, other, 0, forged("rt_o2.so"), "a second copy"),
  ]
  for i, (start, length, path, pgoff, _, _) in enumerate(cases):
    table.apply(host_sampler.Mapping(i, 7, start, start + length, str(path), pgoff))
    table.apply(host_sampler.Sample(100 + i, 7, start))
  assert [table.names[m] for m in table.modules] == [c[4] for c in cases]
  assert len(table.forgery) == 4
  for why, case in zip(table.forgery, cases[2:]):
    assert case[5] in why, (why, case)
  # anonymous memory mapped over torch's text first (no file there any more): the range still held its code
  third = tmp_path / ("0f" * 16) / "rt_o5.so"
  third.parent.mkdir()
  _elf_segments(third, [(0, 0, 2 * page, 5)], 2 * page)
  at = torch_text[0] + 16 * page
  table.apply(host_sampler.Mapping(150, 7, at, at + 2 * page, host_sampler.ANON, 0))
  table.apply(host_sampler.Mapping(151, 7, at, at + 2 * page, str(third), 0))
  assert table.forgery[-1] == "lies over the code of libtorch_cpu.so"
  # round 43b: one page of a never-loaded build mapped into a free gap first set its base, then its copy
  # of torch's text mapped over torch's at that same base
  fourth = tmp_path / ("1e" * 16) / "rt_q1.so"
  fourth.parent.mkdir()
  _elf_segments(fourth, [(0, 0, 80 * page, 5)], 80 * page)
  for start, pgoff in (
    (torch_text[0] + 70 * page, 70 * page),
    (torch_text[0] + 32 * page, 32 * page),
  ):
    table.apply(host_sampler.Mapping(160, 7, start, start + page, str(fourth), pgoff))
  assert table.forgery[-1] == "lies over the code of libtorch_cpu.so"
  assert str(fourth) in table.names  # the landing page itself: a mapping of its own
  # a file of a build entry that is no ELF file (its sources, build.ninja) mapped as code
  ninja = fourth.parent / "build.ninja"
  ninja.write_text("rule cxx\n")
  table.apply(host_sampler.Mapping(170, 7, 1 << 36, (1 << 36) + page, str(ninja), 0))
  assert table.forgery[-1] == "maps a file no loader loads (not a 64-bit ELF file) as code"
  del table.forgery[-3:]
  # a child inherits its parent's load bases; an exec starts afresh
  table.apply(host_sampler.Fork(200, 8, 7))
  table.apply(host_sampler.Mapping(201, 8, base + 5 * page, base + 7 * page, str(own), page))
  table.apply(host_sampler.Exec(202, 9))
  table.apply(host_sampler.Mapping(203, 9, base + 5 * page, base + 7 * page, str(own), page))
  assert table.forgery[4:] == ["a second copy of the file's code at another base"]


def test_a_process_past_the_mapping_cap_has_every_later_sample_count_as_foreign(monkeypatch):
  # red team 45: 2.4M short-lived executable mappings kept the checker busy for minutes (each one a
  # record the table kept). Past the cap a process's mappings are no longer recorded, and nothing it
  # runs afterwards can count as its own code.
  monkeypatch.setattr(host_sampler, "MAX_MAPPINGS", 50)
  table, page = host_sampler.ModuleTable(), 4096
  own = "/cache/" + "ab" * 16 + "/own.so"
  table.apply(host_sampler.Mapping(0, 7, 1 << 30, (1 << 30) + page, own, 0))
  for i in range(1, 60):
    table.apply(
      host_sampler.Mapping(
        i, 7, (2 << 30) + 2 * i * page, (2 << 30) + (2 * i + 1) * page, host_sampler.ANON, 0
      )
    )
  assert table.forgery == ["more than 50 executable mappings in one process"]
  assert len(table.procs[7].space.ranges) == 50  # the own file and 49 anonymous ranges
  table.apply(host_sampler.Sample(100, 7, (1 << 30) + 8))  # in the own file's range
  table.apply(host_sampler.Fork(101, 8, 7))
  table.apply(host_sampler.Sample(102, 8, (1 << 30) + 8))  # its child too
  table.apply(host_sampler.Sample(103, 9, 5))  # another process: as before
  assert table.count(100, 103) == {host_sampler.OVERFLOW: 2, host_sampler.UNKNOWN: 1}


def test_an_elf_header_with_an_impossible_table_offset_is_no_loaders_file(tmp_path):
  import struct

  head = bytearray(b"\x7fELF\x02\x01" + bytes(58))
  struct.pack_into("<Q", head, 32, 1 << 63)  # e_phoff past what pread takes
  struct.pack_into("<HH", head, 54, 56, 1)
  (tmp_path / "x.so").write_bytes(bytes(head) + bytes(4096))
  assert host_sampler.file_layout(str(tmp_path / "x.so")) == (2 * 4096, None)


def test_the_code_history_answers_as_the_list_of_every_mapping_would_and_stays_small():
  import random

  rng = random.Random(43)
  history, every = host_sampler.CodeHistory(), []
  for _ in range(3000):
    start = rng.randrange(0, 1 << 16) & ~0xFF
    end, module = start + rng.randrange(1, 8) * 0x100, rng.randrange(5)
    if rng.random() < 0.5:
      history.add(start, end, module)
      every.append((start, end, module))
    else:
      want = {m for s, e, m in every if s < end and start < e and m != module}
      got = history.others(start, end, module)
      assert (got is None) == (not want) and (got is None or got in want), (start, end, module)
  assert all(a[1] <= b[0] for a, b in zip(history.segs, history.segs[1:]))  # disjoint, sorted
  # a candidate that maps one page over and over adds nothing after the first
  loop = host_sampler.CodeHistory()
  for _ in range(10_000):
    loop.add(1 << 20, (1 << 20) + 4096, 3)
  assert loop.segs == [(1 << 20, (1 << 20) + 4096, frozenset({3}))]


def test_the_sampler_names_a_copy_mapped_over_a_library_a_forgery_from_the_kernels_records(
  tmp_path,
):
  # Red team 43 on a live process, through the kernel's records: a byte copy of numpy's extension (another
  # file) mapped over numpy's text from the offset numpy's own mapping has. The same bytes, so numpy runs
  # on; before this, every sample in numpy counted for the copy.
  np = pytest.importorskip("numpy")
  umath = importlib.util.find_spec("numpy._core._multiarray_umath") or importlib.util.find_spec(
    "numpy.core._multiarray_umath"
  )
  copy = tmp_path / "rt_o3.so"
  copy.write_bytes(pathlib.Path(umath.origin).read_bytes())
  del np
  counts, sampler = _sampled_numpy_child(
    "maps = [l.split() for l in open('/proc/self/maps')]\n"
    "text = [m for m in maps if len(m) > 5 and 'x' in m[1] and '_multiarray_umath' in m[5]]\n"
    f"fd = os.open({str(copy)!r}, os.O_RDONLY)\n"
    "for m in text:\n"
    "    lo, hi = [int(v, 16) for v in m[0].split('-')]\n"
    "    assert libc.mmap(lo, hi - lo, 5, 0x12, fd, int(m[2], 16)) == lo\n"
  )
  total = sum(counts.values())
  assert total >= 750 and str(copy) not in counts, counts
  assert counts.get(host_sampler.FORGED.format("rt_o3.so"), 0) > 0.5 * total, counts
  assert {m.path for m in sampler.table.forged} == {str(copy)}
  assert all("lies over the code of _multiarray_umath" in w for w in sampler.table.forgery)


# ---- 4. the attack, end to end through the CPU service -------------------------------------------------
RELABEL_EXTENSION = r"""
#include <pybind11/pybind11.h>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>
#include <dlfcn.h>
#include <fcntl.h>
#include <unistd.h>
#include <sys/mman.h>
static void marker() {}
int relabel() {  // torch's text under a record of our own build, torch's pages back on top
    Dl_info info; dladdr((void*)&marker, &info);
    FILE* f = fopen("/proc/self/maps", "r");
    char line[4096];
    std::vector<std::pair<uintptr_t, uintptr_t>> todo;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi; char perm[8]; char path[3000] = "";
        if (sscanf(line, "%lx-%lx %7s %*s %*s %*s %2999s", &lo, &hi, perm, path) < 3) continue;
        std::string p = path;
        if (perm[2] == 'x' && (p.find("libtorch_cpu.so") != std::string::npos
                               || p.find("libc10.so") != std::string::npos))
            todo.push_back({lo, hi});
    }
    fclose(f);
    int fd = open(info.dli_fname, O_RDONLY), done = 0;
    for (auto& r : todo) {
        size_t len = r.second - r.first;
        void* X = (void*)r.first;
        void* hole = mmap(nullptr, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        void* Y = mremap(X, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, hole);
        if (Y == MAP_FAILED) continue;
        mmap(X, len, PROT_READ | PROT_EXEC, MAP_PRIVATE | MAP_FIXED, fd, 0);
        done += mremap(Y, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, X) == X;
    }
    close(fd);
    return done;
}
struct TensorRef { void* impl; };
void lib_relu(std::uintptr_t out, std::uintptr_t x, std::uintptr_t zero) {
    static void* fn = nullptr;
    if (!fn) {
        std::string name = std::string("_ZN2at3cpu13") + "clamp_min" + "_outERNS_6TensorERKS1_S4_";
        void* lib = dlopen("libtorch_cpu.so", RTLD_NOW | RTLD_NOLOAD);
        fn = dlsym(lib ? lib : RTLD_DEFAULT, name.c_str());
    }
    TensorRef o{reinterpret_cast<void*>(out)}, s{reinterpret_cast<void*>(x)};
    TensorRef z{reinterpret_cast<void*>(zero)};
    reinterpret_cast<void* (*)(TensorRef&, const TensorRef&, const TensorRef&)>(fn)(o, s, z);
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("relabel", &relabel);
    m.def("lib_relu", &lib_relu);
}
"""
RELABEL = f'''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = r"""{RELABEL_EXTENSION}"""
ops = load_inline(name="vt_relabel", cpp_sources=source, no_implicit_headers=True, extra_cflags=["-O2"])


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.zero = torch.zeros(())
        self.moved = ops.relabel()

    def forward(self, x):
        out = torch.empty_like(x)
        ops.lib_relu(out._cdata, x._cdata, self.zero._cdata)
        return out
'''


@pytest.fixture(scope="module")
def service(tmp_path_factory):
  with cpu_service(tmp_path_factory.mktemp("relabel")) as (loop, svc):
    yield loop, svc


def test_torch_relabelled_as_the_candidates_own_code_gets_no_reward(service):
  # On 72ffdda: reward 1, OK (the red team's run.sh: timed, speedup 0.60, and untimed).
  loop, svc = service
  opts = VerifyOptions(
    device="cpu",
    timeout_s=120,
    strictness="strict",
    num_correct_trials=compute.TRIALS,
    measure_performance=False,
  )
  req = VerifyRequest("relabel", "relabel", compute.LIBRARY_REFERENCE, RELABEL, opts)
  r = loop.run(asyncio.wait_for(svc.verify(req), 300))
  if [w for w in r.warnings if "host evidence unavailable" in w]:
    pytest.skip("this host refuses perf_event_open")
  assert r.failure_kind is FailureKind.HOST_COMPUTE and r.reward == 0.0, (r.failure_kind, r.reason)
  top = r.reason.split("most in:")[1].split(",")[0]
  # torch under its own name (the relabel refused), or the forged mapping's (had it been made)
  assert "libtorch_cpu" in top or "[forged mapping of" in top, r.reason
