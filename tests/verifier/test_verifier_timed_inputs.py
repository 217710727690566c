"""Issue 37, item 9: timed calls' fresh inputs drawn straight into the exchange buffers
(``exchange.DrawInto``) must be the values and generator draws of today's private draw, bit for bit,
and the compare's fewer passes (``correctness._chunk_stats``) the full statistics' values. On the CPU:
the references of KernelBench level 1 (shrunk: only ``get_inputs`` runs) and fixtures of our own."""

import json
import math

import pytest

torch = pytest.importorskip("torch")

from verifier.api.contract import STRICT_TOLERANCE  # noqa: E402
from verifier.check import correctness  # noqa: E402
from verifier.check.reference import ReferenceTask, same_values, trial_seeds  # noqa: E402
from verifier.ipc import exchange, tensors  # noqa: E402

CPU = torch.device("cpu")


def _task(source: str, shrink: int = 0) -> ReferenceTask:
  namespace = {"__name__": "reference"}
  exec(compile(source, "reference", "exec"), namespace)
  if shrink:  # level-1 sizes reach gigabytes: every size constant at most ``shrink``
    for k, v in list(namespace.items()):
      if isinstance(v, int) and not isinstance(v, bool) and v > shrink:
        namespace[k] = shrink
      elif isinstance(v, tuple) and v and all(type(x) is int for x in v):
        namespace[k] = tuple(min(x, shrink) for x in v)
  return ReferenceTask("k", CPU, 0, namespace, [], [1], False)


def _both(task: ReferenceTask, seed: int):
  """(private draw, its RNG state after), (draw into buffers, state after, pairs, values sent)."""
  private = task.inputs_for(seed)
  state = torch.get_rng_state()
  buffers = exchange.BufferSet(CPU, False)
  drawn = exchange.DrawInto(buffers)
  inputs = task.inputs_for(seed, drawn)
  state_drawn = torch.get_rng_state()
  drawn.settle(inputs)
  used, pairs = [], []
  values = [exchange.send_value(v, buffers, used, pairs, drawn) for v in inputs]
  return (private, state), (inputs, state_drawn, pairs, values, buffers)


def _assert_same_draw(task: ReferenceTask, seed: int = 1234) -> tuple[int, int]:
  """Bitwise equal values, layouts and generator state; the pairs' buffer sides hold the private
  values. Returns (tensors drawn straight into a buffer, tensors)."""
  (private, state), (inputs, state_drawn, pairs, values, buffers) = _both(task, seed)
  assert torch.equal(state, state_drawn)
  assert same_values(private, inputs)
  leaves = [t for t in tensors.flatten(private) if isinstance(t, torch.Tensor)]
  assert len(pairs) == len(leaves)
  for p, (_, view) in zip(leaves, pairs):
    assert not correctness.mutated([p], [view])
  direct = sum(1 for a, v in pairs if a is v)
  for (a, v), leaf in zip(pairs, leaves):  # a direct one is a whole buffer, never shared
    if a is v:
      assert v.untyped_storage().data_ptr() in {
        b.raw.untyped_storage().data_ptr() for b in buffers.buffers.values()
      }
  buffers.close()
  return direct, len(leaves)


def test_level1_inputs_drawn_into_buffers_are_the_private_draws(shared_data):
  path = shared_data / "kernelbench" / "level1.jsonl"
  if not path.is_file():
    pytest.skip(f"KernelBench level 1 not found at {path}")
  rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  direct = total = 0
  for row in rows:
    d, n = _assert_same_draw(_task(row["code"], shrink=48))
    direct, total = direct + d, total + n
  # all but those computed after the draw (symmetrised, triangular, scaled, a cast mask)
  assert len(rows) == 100 and total == 127 and direct == 114


FIXTURES = {
  "abs": "return [torch.randn(6, 5).abs(), torch.randn(6, 5)]",
  "ints": "return [torch.randint(0, 7, (9,)), torch.randint(3, (4, 2), dtype=torch.int32)]",
  "lists": "x = torch.rand(3, 4)\n    return [[x, torch.ones(2)], (torch.zeros(3, dtype=torch.float64), 2.5)]",
  "scalars": "return [torch.rand(5), 3, 0.25, True, torch.float16, None, 'mean']",
  "like": (
    "x = torch.randn(4, 8)\n"
    "    return [torch.randn_like(x), torch.rand_like(x, dtype=torch.float64),\n"
    "            torch.randint_like(x, 2, 9), torch.full_like(x, 1.5), torch.zeros_like(x), x]"
  ),
  "like_transposed": "x = torch.randn(4, 8).t()\n    return [torch.randn_like(x), x]",
  "factories": (
    "return [torch.full((3, 2), 7), torch.randperm(11), torch.ones(2, 3, dtype=torch.bfloat16),\n"
    "            torch.rand(()), torch.randn(0, 4), torch.randn(2, 3, dtype=torch.float16)]"
  ),
  "views": "x = torch.randn(6, 4)\n    return [x.t(), x.view(24), x[:3], x, x]",
  "generator": (
    "g = torch.Generator().manual_seed(5)\n    return [torch.randn(8, generator=g), torch.randn(8)]"
  ),
  "in_place": "x = torch.rand(16)\n    x.mul_(2).sub_(1)\n    return [x]",
  "empty": "return [torch.empty(0), torch.randn(3)]",
}


def _source(body: str) -> str:
  return f"import torch\n\ndef get_inputs():\n    {body}\n"


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_fixture_inputs_drawn_into_buffers_are_the_private_draws(name):
  direct, total = _assert_same_draw(_task(_source(FIXTURES[name])))
  expected = {
    "abs": (1, 2),  # .abs() is computed after the draw: copied
    "ints": (2, 2),
    "lists": (3, 3),
    "scalars": (1, 1),
    "like": (6, 6),
    "like_transposed": (1, 2),  # randn_like of a transposed x: drawn privately; x.t() is dense
    "factories": (5, 6),  # the empty tensor has no buffer
    "views": (1, 5),  # x.t() is dense over the whole buffer: it takes it; each buffer goes once
    "generator": (2, 2),
    "in_place": (1, 1),
    "empty": (1, 2),
  }[name]
  assert (direct, total) == expected


def test_a_tensor_returned_twice_gets_two_buffers():
  task = _task(_source("x = torch.randn(5)\n    return [x, x]"))
  _, (inputs, _, pairs, values, buffers) = _both(task, 3)
  assert values[0].tensor.buffer != values[1].tensor.buffer
  assert [a is v for a, v in pairs] == [True, False]
  buffers.close()


def test_unreturned_draws_give_their_buffers_back():
  task = _task(_source("a = torch.rand(8, 8)\n    return [(a + a.T) / 2]"))
  _, (inputs, _, pairs, values, buffers) = _both(task, 3)
  # the intermediate's buffer went back and the copy took it: one buffer in all
  assert len(buffers.buffers) == 1 and values[0].tensor.buffer in buffers.buffers
  buffers.close()


def test_torch_empty_and_unknown_keywords_are_not_drawn_into_buffers():
  buffers = exchange.BufferSet(CPU, False)
  with exchange.DrawInto(buffers) as drawn:
    torch.empty(4)
    torch.randn(4, requires_grad=True)
    torch.zeros(4, device="meta")
  assert not drawn.drawn and not buffers.buffers
  buffers.close()


def test_a_reference_drawing_outside_torchs_generator_is_not_repeatable():
  assert same_values(*(_task(_source("return [torch.rand(3), 2]")).inputs_for(9) for _ in "ab"))
  task = _task(
    "import torch, random\n\ndef get_inputs():\n    return [torch.rand(3) + random.random()]\n"
  )
  assert not same_values(task.inputs_for(9), task.inputs_for(9))


# ---- the compare's passes --------------------------------------------------------------------------
def _same_stats(r, o, atol=1e-2, rtol=1e-2):
  new = correctness._chunk_stats(r, o, atol, rtol, STRICT_TOLERANCE)
  old = correctness._chunk_stats_full(r, o, atol, rtol, STRICT_TOLERANCE)
  assert len(new) == len(old)
  for a, b in zip(new, old):
    assert a == b or (math.isnan(a) and math.isnan(b)), (new, old)


@pytest.mark.parametrize("n", [1, 7, 1000, 100_003])
def test_fewer_compare_passes_give_the_full_statistics(n):
  gen = torch.Generator().manual_seed(n)
  r = torch.randn(n, generator=gen) * 10
  noise = torch.randn(n, generator=gen)
  for o in (r.clone(), r + 1e-5 * noise, r + 5e-3 * noise, r + noise, r * 1.5, -r):
    for atol, rtol in ((1e-2, 1e-2), (0.0, 0.0), (1e-4, 0.0), (1.0, 1e-3)):
      _same_stats(r, o, atol, rtol)
      _same_stats(r.double(), o.double(), atol, rtol)
    nan_out = o.clone()
    nan_out[n // 2] = float("nan")
    _same_stats(r, nan_out)
    inf_ref = r.clone()
    inf_ref[0] = float("inf")
    _same_stats(inf_ref, o)
    _same_stats(inf_ref, inf_ref.clone())
  big = torch.full((n,), 3e38)
  _same_stats(big, -big)  # |o - r| overflows: the full statistics' scaled norms
  _same_stats(big, big * 0.99)


def test_fewer_compare_passes_keep_verdicts_and_reasons():
  gen = torch.Generator().manual_seed(0)
  r = torch.randn(4096, generator=gen)
  cases = [r + 1e-3, r + 0.5, r * 1.2, torch.full_like(r, float("nan")), r.half().float()]
  for o in cases:
    c = correctness.compare_outputs(r, o, 1e-2, 1e-2, "t")
    # the same verdict from the full statistics, chunk by chunk
    full = correctness._chunk_stats
    try:
      correctness._chunk_stats = correctness._chunk_stats_full
      d = correctness.compare_outputs(r, o, 1e-2, 1e-2, "t")
    finally:
      correctness._chunk_stats = full
    assert (c.kind, c.reason, c.max_abs_diff, c.strict_ok) == (
      d.kind,
      d.reason,
      d.max_abs_diff,
      d.strict_ok,
    )


def test_set_seed_draws_what_torch_manual_seed_draws():
  """Both processes seed the CPU (and CUDA) generators alone, not every backend ``torch.manual_seed``
  walks: a level-1 reference's inputs under it are ``torch.manual_seed``'s, bit for bit."""
  from verifier.ipc.tensors import set_seed

  for seed in (0, 7, 2**31 - 2):
    torch.manual_seed(seed)
    want = (torch.rand(3, 5), torch.randn(4), torch.randint(0, 9, (6,)))
    set_seed(seed)
    got = (torch.rand(3, 5), torch.randn(4), torch.randint(0, 9, (6,)))
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_mutation_check_reads_buffers_on_the_device_in_place():
  """The mutation check (``Check._readable``) reads an input buffer where it lives on the checker's
  device, not a copy of it (level-1's 8 GB inputs were copied on every judged call); a buffer elsewhere
  (host staging on a GPU) is copied to the device first."""
  import types

  from verifier.check.checker import Check

  here = types.SimpleNamespace(device=CPU)
  here._local = lambda v: Check._local(here, v)
  view = torch.arange(6.0)
  assert Check._readable(here, view) is view
  there = types.SimpleNamespace(device=torch.device("meta"))
  there._local = lambda v: Check._local(there, v)
  moved = Check._readable(there, view)
  assert moved.device.type == "meta" and moved.shape == view.shape
  assert correctness.mutated([view.clone()], [Check._readable(here, view)]) == ""
  view[3] = float("nan")
  assert correctness.mutated([torch.arange(6.0)], [Check._readable(here, view)]) == "input 0"


def test_only_compared_calls_outputs_are_copied_out():
  """``Check._copy_outputs``: a compared call's outputs are copied out (a copy the candidate cannot
  write afterwards); an uncompared call's are read sparsely (``_touch``) and give no copy, so no verdict
  can be drawn from them. With no ``compared`` set (trials, the re-check) every call is copied."""
  import types

  from verifier.check import checker
  from verifier.check.checker import Check

  buffers = exchange.BufferSet(CPU, False)
  golden = torch.arange(4096.0).reshape(64, 64)
  used: list[int] = []
  refs = [exchange.output_buffer(golden, buffers, used) for _ in range(3)]
  for r in refs:
    buffers.buffers[r.buffer].view(r).copy_(golden)
  here = types.SimpleNamespace(device=CPU, buffers=buffers)
  here._local = lambda v: Check._local(here, v)
  calls = [(r,) for r in refs]
  some = Check._copy_outputs(here, calls, frozenset({1}))
  assert some[0] is None and some[2] is None
  assert torch.equal(some[1][0], golden)
  view = buffers.buffers[refs[1].buffer].view(refs[1])
  # the candidate writing after the round trip: the copy keeps what was read
  view.fill_(float("nan"))
  assert torch.equal(some[1][0], golden)
  every = Check._copy_outputs(here, calls)
  assert all(c is not None for c in every) and every[1][0].isnan().all()
  assert torch.equal(every[0][0], golden)
  checker._touch(view)  # any layout: contiguous, empty, strided
  checker._touch(torch.empty(0))
  checker._touch(golden.t())
  buffers.close()


def test_trial_seeds_come_from_the_checkers_key_not_from_the_request_seed_alone():
  """A candidate's constructor runs under the request seed; the trials' inputs must not follow from it
  (KernelBench's rule, a generator seeded with it, let ``__init__`` draw them and store the answers)."""
  key = bytes(range(32))
  seeds = trial_seeds(42, 5, key)
  assert seeds == trial_seeds(42, 5, key)  # one checker: an RL group shares its reference's trials
  assert seeds[:3] == trial_seeds(42, 3, key)
  assert seeds != trial_seeds(42, 5, bytes(32)) and seeds != trial_seeds(43, 5, key)
  assert len(set(seeds)) == 5 and all(0 <= s < 2**31 for s in seeds)
  gen = torch.Generator().manual_seed(42)
  assert not set(seeds) & set(torch.randint(0, 2**31 - 1, (64,), generator=gen).tolist())
  with pytest.raises(ValueError, match="secret key"):
    trial_seeds(42, 3, b"")
