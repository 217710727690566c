"""A task's reference as the checker holds it: the model, the trial inputs and the golden outputs.

Lock-step: golden output ``k`` is what a fresh reference instance (built under the task seed, like the
candidate's ``ModelNew``) returns on its ``k``-th forward, trial ``k``'s inputs, so a reference that
updates its own state on every forward (a recurrent hidden state kept on the module) is compared with a
candidate stepped the same number of times. Before any candidate code runs, two fresh instances must
agree on trial 0 within the request's tolerance (else the reference is not deterministic and cannot judge
anyone: REFERENCE_ERROR), a second forward of one of them on the same inputs tells whether the
reference is stateful, and a forward on perturbed inputs which of its outputs it determines (those the
norm rule judges: ``correctness.determined``). Trials are computed one at a time (level-1 tensors reach gigabytes); a task whose
trials fit the checker's budget keeps them (``TaskCache``), so an RL group of candidates for one task
pays for the reference once.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import hashlib
import hmac

import torch

from verifier.api.contract import FailureKind
from verifier.check import correctness
from verifier.ipc import tensors
from verifier.ipc.tensors import set_seed


class ReferenceFailure(Exception):
  """The reference itself failed or cannot judge (not the candidate's fault)."""

  def __init__(self, reason: str, out_of_memory: bool = False):
    super().__init__(reason)
    self.out_of_memory = out_of_memory


def is_out_of_memory(e: BaseException) -> bool:
  return type(e).__name__ == "OutOfMemoryError" or "out of memory" in str(e).lower()


def trial_seeds(seed: int, trials: int, key: bytes) -> list[int]:
  """Trial ``k``'s input seed: HMAC-SHA256(``key``, "seed/k") as 31 bits. ``key`` is the checker's secret
  (one per checker process, ``CheckerProcess``), so the request seed, which the candidate's constructor runs
  under (42 in every DICE request), does not tell it the trials' inputs: drawn from the seed alone, as
  KernelBench does, they let ``__init__`` (never judged) compute every trial's answer with torch and
  ``forward`` look it up (red team, session 42)."""
  if not key:
    raise ValueError("trial_seeds needs the checker's secret key")
  digest = lambda k: hmac.new(key, f"{seed}/{k}".encode(), hashlib.sha256).digest()
  return [int.from_bytes(digest(k)[:4], "little") & 0x7FFFFFFF for k in range(trials)]


def task_key(source: str, seed: int, trials: int, device: str, atol: float, rtol: float) -> str:
  h = hashlib.sha256()
  for part in (source, str(seed), str(trials), device, repr(atol), repr(rtol)):
    h.update(part.encode())
    h.update(b"\0")
  return h.hexdigest()


def _nbytes(values) -> int:
  return sum(
    t.numel() * t.element_size() for t in tensors.flatten(values) if isinstance(t, torch.Tensor)
  )


def same_values(a, b) -> bool:
  """Whether two draws of inputs are the same values, bit for bit (NaN included)."""
  xs, ys = tensors.flatten(a), tensors.flatten(b)
  if len(xs) != len(ys):
    return False
  for x, y in zip(xs, ys):
    if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
      return False
    if isinstance(x, torch.Tensor):
      if x.stride() != y.stride() or correctness.mutated([x], [y]):
        return False
    elif type(x) is not type(y) or not (x == y or x != x and y != y):
      return False
  return True


@dataclasses.dataclass
class ReferenceTask:
  """One task's reference: its code, init arguments, trial seeds and, once a job has computed them and
  they fit the checker's budget, every trial's inputs and golden outputs (``kept``)."""

  key: str
  device: torch.device
  seed: int
  namespace: dict
  init_args: list
  seeds: list[int]
  stateful: bool
  kept: list[tuple[list, object]] = dataclasses.field(default_factory=list)
  after_trials: torch.nn.Module | None = None  # the lock-step instance after all trials (stateful)
  # per output leaf: whether the norm rule judges it (correctness.determined, from trial 0)
  norm_rule: tuple[bool, ...] | None = None
  # trial 0 drawn again, into exchange buffers, is its private draw bit for bit (get_inputs() repeats
  # under a seed, and the buffers hold what a private draw gives): then a timed call's inputs can be
  # drawn straight into its buffers and re-drawn privately to judge it. None: not tried yet (the first
  # timed check of the task tries it, ``Check._decide_draw``)
  draws_into_buffers: bool | None = None

  @classmethod
  def load(
    cls,
    source: str,
    seed: int,
    trials: int,
    device: torch.device,
    atol: float,
    rtol: float,
    input_key: bytes,
  ) -> "ReferenceTask":
    """Run the reference's own checks before any candidate code: two fresh instances must agree on
    trial 0 (else it is not deterministic and cannot judge), and a second forward of one of them tells
    whether it is stateful. The trials' inputs are drawn under seeds only ``input_key`` gives
    (``trial_seeds``)."""
    key = task_key(source, seed, trials, device.type, atol, rtol)
    try:
      namespace = {"__name__": "reference", "__builtins__": __builtins__}
      exec(compile(source, "reference", "exec"), namespace)
      for name in ("Model", "get_inputs", "get_init_inputs"):
        if name not in namespace:
          raise ReferenceFailure(f"reference defines no {name}")
      set_seed(seed)
      init_args = tensors.to_device(list(namespace["get_init_inputs"]()), device)
      seeds = trial_seeds(seed, trials, input_key)
      task = cls(key, device, seed, namespace, init_args, seeds, False)
      inputs = task.make_inputs(0)
      first = task.forward(task.fresh_model(), inputs, 0)
      again = task.fresh_model()
      second = task.forward(again, inputs, 0)
      c = correctness.compare_outputs(first, second, atol, rtol, "a second fresh reference")
      if c.kind is not FailureKind.OK:
        raise ReferenceFailure(
          f"the reference is not deterministic: {c.reason} (its own two runs disagree, so it cannot "
          "judge a candidate)"
        )
      third = task.forward(again, inputs, 0)
      task.stateful = (
        correctness.compare_outputs(first, third, atol, rtol, "").kind is not FailureKind.OK
      )
      del second, third, again
      moved = task.forward(task.fresh_model(), correctness.perturbed(inputs, seed), 0)
      task.norm_rule = correctness.determined(first, moved)
      del inputs, first, moved
    except ReferenceFailure:
      raise
    except BaseException as e:  # noqa: BLE001 - reference code may raise anything
      raise ReferenceFailure(
        f"reference failed: {type(e).__name__}: {str(e)[:3000]}", is_out_of_memory(e)
      ) from None
    tensors.empty_caches(device)
    return task

  @property
  def trials(self) -> int:
    return len(self.seeds)

  def make_inputs(self, i: int) -> list:
    return self.inputs_for(self.seeds[i])

  def inputs_for(self, seed: int, draw_into=None) -> list:
    """``get_inputs()`` under ``seed``. Drawn on the device (torch.device as a context sets the default
    device of factories): level-1 inputs reach gigabytes, too slow to draw on one CPU thread. With
    ``draw_into`` (an ``exchange.DrawInto``), its factories draw straight into exchange buffers, the
    same values (the mode is entered first, so the device context has named the device when it sees a
    factory)."""
    with draw_into if draw_into is not None else contextlib.nullcontext():
      set_seed(seed)
      get_inputs = self.namespace["get_inputs"]
      if self.device.type == "cuda":
        with torch.device(self.device):
          return tensors.to_device(list(get_inputs()), self.device)
      return tensors.to_device(list(get_inputs()), self.device)

  def fresh_model(self) -> torch.nn.Module:
    with torch.no_grad():
      set_seed(self.seed)
      return self.namespace["Model"](*self.init_args).to(self.device)

  def forward(self, model, args: list, i: int):
    return self.forward_seeded(model, args, self.seeds[i])

  def forward_seeded(self, model, args: list, seed: int):
    set_seed(seed)
    with torch.no_grad():
      return model(*tensors.clone_args(args))


class TrialStream:
  """One job's walk through a task's trials, in lock-step with the candidate: trial ``k``'s golden output
  is the ``k``-th forward of one fresh reference instance. Kept trials are replayed; otherwise they are
  computed one at a time (only trial 0 stays, for the re-check after the timing), and kept for the next
  job when the whole set fits ``keep_bytes``."""

  def __init__(self, task: ReferenceTask, keep_bytes: int):
    self.task, self.keep_bytes = task, keep_bytes
    self.model = None if task.kept else task.fresh_model()
    self.done: list[tuple[list, object]] = []
    self.nbytes = 0

  def trial(self, k: int) -> tuple[list, object]:
    """Trial ``k``'s (inputs, golden output). Trials are asked for in order; trial 0 again at any time."""
    task = self.task
    if task.kept:
      return task.kept[k]
    if k == 0 and self.done:
      return self.done[0]
    if k != len(self.done):
      raise ValueError(f"trial {k} requested out of order (next is {len(self.done)})")
    inputs = task.make_inputs(k)
    golden = task.forward(self.model, inputs, k)
    self.nbytes += _nbytes(inputs) + _nbytes(golden)
    self.done.append((inputs, golden))
    if self.nbytes > self.keep_bytes:  # too big to keep them all: hold trial 0 and the newest only
      for j in range(1, len(self.done) - 1):
        self.done[j] = ([], None)
    elif len(self.done) == task.trials:
      task.kept = list(self.done)
      task.after_trials = self.model if task.stateful else None
    return inputs, golden

  def lockstep_model(self) -> torch.nn.Module:
    """A reference instance in the state the candidate's model should be in after the trials (a copy:
    the timing steps it on every timed call), or any instance when the reference keeps no state."""
    if not self.task.stateful:
      return self.model if self.model is not None else self.task.fresh_model()
    return copy.deepcopy(self.task.after_trials if self.task.kept else self.model)

  def kept_bytes(self) -> int:
    return sum(_nbytes(i) + _nbytes(g) for i, g in self.task.kept)


class TaskCache:
  """The last few tasks (their kept trials count against the byte budget)."""

  def __init__(self, max_tasks: int, max_bytes: int):
    self.max_tasks, self.max_bytes = max_tasks, max_bytes
    self.tasks: collections.OrderedDict[str, ReferenceTask] = collections.OrderedDict()

  def get(self, key: str) -> ReferenceTask | None:
    task = self.tasks.get(key)
    if task is not None:
      self.tasks.move_to_end(key)
    return task

  def put(self, task: ReferenceTask) -> None:
    if self.max_tasks <= 0:
      return
    self.tasks[task.key] = task
    self.tasks.move_to_end(task.key)
    while len(self.tasks) > self.max_tasks or self.nbytes() > self.max_bytes:
      self.tasks.popitem(last=False)

  def nbytes(self) -> int:
    return sum(_nbytes([x for i, g in t.kept for x in (i, g)]) for t in self.tasks.values())

  def clear(self) -> None:
    self.tasks.clear()
