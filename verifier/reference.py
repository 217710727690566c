"""A task's reference as the checker holds it: the model, the trial inputs and the golden outputs.

Lock-step: golden output ``k`` is what a fresh reference instance (built under the task seed, like the
candidate's ``ModelNew``) returns on its ``k``-th forward, trial ``k``'s inputs, so a reference that
updates its own state on every forward (a recurrent hidden state kept on the module) is compared with a
candidate stepped the same number of times. Before any candidate code runs, a second fresh instance must
reproduce golden output 0 within the request's tolerance (else the reference is not deterministic and
cannot judge anyone: REFERENCE_ERROR), and a second forward of it on the same inputs tells whether the
reference is stateful. The checker keeps a few tasks in memory (``TaskCache``) so an RL group of
candidates for one task pays for the reference once.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import hashlib

import torch

from verifier import correctness, timing
from verifier.contract import FailureKind


class ReferenceFailure(Exception):
  """The reference itself failed or cannot judge (not the candidate's fault)."""


def set_seed(seed: int) -> None:
  torch.manual_seed(seed)
  if torch.cuda.is_available():
    torch.cuda.manual_seed_all(seed)


def trial_seeds(seed: int, trials: int) -> list[int]:
  gen = torch.Generator().manual_seed(seed)
  return [int(s) for s in torch.randint(0, 2**31 - 1, (trials,), generator=gen)]


def task_key(source: str, seed: int, trials: int, device: str, atol: float, rtol: float) -> str:
  h = hashlib.sha256()
  for part in (source, str(seed), str(trials), device, repr(atol), repr(rtol)):
    h.update(part.encode())
    h.update(b"\0")
  return h.hexdigest()


def _nbytes(values) -> int:
  return sum(
    t.numel() * t.element_size() for t in correctness.flatten(values) if isinstance(t, torch.Tensor)
  )


@dataclasses.dataclass
class ReferenceTask:
  key: str
  device: torch.device
  seed: int
  namespace: dict
  init_args: list
  seeds: list[int]
  inputs: list[list]
  golden: list
  stateful: bool
  after_trials: (
    torch.nn.Module | None
  )  # the golden instance after its forwards (stateful tasks only)
  peak_bytes: int
  nbytes: int
  overhead_ms: float | None = None

  @classmethod
  def load(
    cls, source: str, seed: int, trials: int, device: torch.device, atol: float, rtol: float
  ) -> "ReferenceTask":
    key = task_key(source, seed, trials, device.type, atol, rtol)
    try:
      namespace = {"__name__": "reference", "__builtins__": __builtins__}
      exec(compile(source, "reference", "exec"), namespace)
      for name in ("Model", "get_inputs", "get_init_inputs"):
        if name not in namespace:
          raise ReferenceFailure(f"reference defines no {name}")
      set_seed(seed)
      init_args = correctness.to_device(list(namespace["get_init_inputs"]()), device)
      seeds = trial_seeds(seed, trials)
      if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
      task = cls(key, device, seed, namespace, init_args, seeds, [], [], False, None, 0, 0)
      inputs = [task.make_inputs(i) for i in range(trials)]
      model = task.fresh_model()
      golden = [task.forward(model, inputs[i], i) for i in range(trials)]
      again = task.fresh_model()
      first = task.forward(again, inputs[0], 0)
      c = correctness.compare_outputs(golden[0], first, atol, rtol, "a second fresh reference")
      if c.kind is not FailureKind.OK:
        raise ReferenceFailure(
          f"the reference is not deterministic: {c.reason} (its own two runs disagree, so it cannot "
          "judge a candidate)"
        )
      second = task.forward(again, inputs[0], 0)
      stateful = (
        correctness.compare_outputs(golden[0], second, atol, rtol, "").kind is not FailureKind.OK
      )
      del again, first, second
    except ReferenceFailure:
      raise
    except BaseException as e:  # noqa: BLE001 - reference code may raise anything
      raise ReferenceFailure(f"reference failed: {type(e).__name__}: {str(e)[:3000]}") from None
    correctness.empty_caches(device)
    task.inputs, task.golden, task.stateful = inputs, golden, stateful
    task.after_trials = model if stateful else None
    task.peak_bytes = int(torch.cuda.max_memory_allocated()) if device.type == "cuda" else 0
    task.nbytes = _nbytes(inputs) + _nbytes(golden)
    return task

  def make_inputs(self, i: int) -> list:
    # Drawn on the device (torch.device as a context sets the default device of factories): level-1
    # inputs reach gigabytes, too slow to draw on one CPU thread.
    set_seed(self.seeds[i])
    get_inputs = self.namespace["get_inputs"]
    if self.device.type == "cuda":
      with torch.device(self.device):
        return correctness.to_device(list(get_inputs()), self.device)
    return correctness.to_device(list(get_inputs()), self.device)

  def fresh_model(self) -> torch.nn.Module:
    with torch.no_grad():
      set_seed(self.seed)
      return self.namespace["Model"](*self.init_args).to(self.device)

  def forward(self, model, args: list, i: int):
    set_seed(self.seeds[i])
    with torch.no_grad():
      return model(*correctness.clone_args(args))

  def expected_after(self, extra_calls: int):
    """What the reference returns on trial 0's inputs after its golden forwards and ``extra_calls``
    more on trial 0's inputs (the candidate's timing calls): the re-check after timing, in lock-step."""
    if not self.stateful:
      return self.golden[0]
    model = copy.deepcopy(self.after_trials)
    with torch.no_grad():
      set_seed(self.seeds[0])
      for _ in range(extra_calls):
        model(*correctness.clone_args(self.inputs[0]))
    return self.forward(model, self.inputs[0], 0)

  def harness_overhead_ms(self) -> float:
    if self.overhead_ms is None:
      self.overhead_ms = timing.harness_overhead_ms(self.inputs[0], self.device)
    return self.overhead_ms


class TaskCache:
  """The last few tasks, within a byte budget (inputs + golden outputs)."""

  def __init__(self, max_tasks: int, max_bytes: int):
    self.max_tasks, self.max_bytes = max_tasks, max_bytes
    self.tasks: collections.OrderedDict[str, ReferenceTask] = collections.OrderedDict()

  def get(self, key: str) -> ReferenceTask | None:
    task = self.tasks.get(key)
    if task is not None:
      self.tasks.move_to_end(key)
    return task

  def put(self, task: ReferenceTask) -> None:
    if task.nbytes > self.max_bytes or self.max_tasks <= 0:
      return
    self.tasks[task.key] = task
    while (
      len(self.tasks) > self.max_tasks
      or sum(t.nbytes for t in self.tasks.values()) > self.max_bytes
    ):
      self.tasks.popitem(last=False)

  def clear(self) -> None:
    self.tasks.clear()
