"""bench_broken_build's inputs: DICE solutions read as `load_inline` arguments, one device-code error each."""

from experiments.bench_broken_build import _EMBEDDED, broken, dice_candidates
from verifier.build.build_cache import fast_variant
from verifier.build.split_build import split_variant


def test_the_error_lands_in_device_code_once():
  bad = broken(_EMBEDDED)
  assert bad["cuda_sources"].count("threadIdx.q") == 1
  assert bad["cuda_sources"].replace("threadIdx.q", "threadIdx.x") == _EMBEDDED["cuda_sources"]
  # every build the cache would try sees it: the split's torch-free kernels file, the fast and stock .cu
  assert "threadIdx.q" in split_variant(bad, lean=True)["cuda_sources"]
  assert "threadIdx.q" in fast_variant(bad)["cuda_sources"]


def test_dice_solutions_become_splittable_load_inline_arguments(shared_data):
  tasks = shared_data / "dice_rl" / "kernel_infilling_evaluation.json"
  candidates = dice_candidates(str(tasks), 3)
  assert [c["name"] for c in candidates] == ["dice_0", "dice_1", "dice_2"]
  assert candidates[1]["functions"] == ["mm_cuda", "ge_cuda"]
  for c in candidates:
    assert "__global__" in c["cuda_sources"] and "{" not in c["cpp_sources"]
    assert split_variant(c, lean=True) is not None
