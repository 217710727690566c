"""BiC-RL rollout: G samples per task with the block sampler, judged while the next groups sample.

DICE `training/RL/rl.py` (github.com/deadlykitten4/DICE), steps 1-3 of an RL step: every scheduled task is sampled G times (one group) with
DICE's decoding (temperature 1.0, block 4, 4 steps, `low_confidence_dynamic` 0.9, up to 4,096 new
tokens; `RLConfig.sampler`), the first fenced code block of each response is the candidate
(`data/code_extraction.py`, DICE's `extract_first_code`), and each group goes to the judge (the verifier
service, or a local function for tests) as soon as it is sampled, so verification overlaps the
sampling of the next groups. Outcomes are joined back to responses by request id (a content hash:
equal candidates of a task are judged once).

The data stack (`dice_jax.data`: tokenizers, grain) is imported only by the functions that need
it (`data/code_extraction.py` is plain Python), so a GPU host can sample and judge without it (`experiments/bench_rl.py`).

Two seams:
* `SamplerBackend` -- how groups are sampled. Every sample has its own key, derived from
  (seed, RL step, group, member) (`sample_key`), so a sample's tokens depend neither on how
  samples are batched nor on restarts. `StaticBatches` runs `groups_per_batch` groups per
  `sampler.generate` call; `ContinuousBatches` keeps `slots` rows decoding in the
  continuous-batching engine (`diffusion.engine`) and hands a group on when its last member
  stops. Both give the same tokens for the same keys.
* `Judge` -- `submit(task_id, reference, candidate) -> Future[VerifyResult]`:
  `dice_jax.verifier_client.ThreadedVerifier` or `FunctionJudge`.

Several JAX processes make the same sampler calls (one computation over the global mesh) on the
same groups and keys; the rows and their KV cache are split over the mesh's data axes
(`diffusion/placement.py`), so each process's devices decode their share of the rows, and the
finished rows are gathered to every process: each ends with every group's trajectories (the
group-normalised advantages and the update's batches need them all). Verification is split: the
i-th distinct request of the step goes to the judge of process i mod n, and the verdicts are
merged across processes (`exchange_verdicts`), so every process ends with the same outcomes and
rewards.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from dice_jax import distributed
from dice_jax.data import code_extraction
from dice_jax.diffusion import sampler as sampler_lib
from dice_jax.rl.trajectory import Trajectory, from_sample_output
from verifier.api.client import request_id
from verifier.api.contract import FailureKind, VerifyResult

NO_CODE = FailureKind.NO_CODE  # a response without a fenced code block (never sent)


# ------------------------------------------------------------------ groups
@dataclasses.dataclass(frozen=True)
class GroupTask:
  """One task to sample `size` times: the unit of sampling, judging and advantages."""

  group: int  # global group number (RL stream's group_index)
  task_id: str
  prompt_ids: np.ndarray
  reference: str  # the PyTorch reference the candidates are judged against
  size: int


def user_message(element: dict) -> str:
  """The un-templated user message of an RL stream element (end-to-end or infilling)."""
  from dice_jax.data import prompts as prompts_lib

  if element["kind"] == "infill":
    return prompts_lib.infilling_user_message(
      element["reference_code"], element["prefix"], element["suffix"]
    )
  return prompts_lib.e2e_user_message(element["reference_code"])


def groups_from_stream(
  elements: Sequence[dict], *, tokenizer=None, prompt_tail_chars: int = 0
) -> list[GroupTask]:
  """Groups of consecutive stream elements (`data.rl_stream`: G members share a group_index).

  `prompt_tail_chars > 0` (tiny CPU runs only) keeps the last N characters of the user message
  and renders it with the tokenizer's chat template, as SFT rows built the same way were."""
  by_group: dict[int, list[dict]] = {}
  for e in elements:
    by_group.setdefault(int(e["group_index"]), []).append(e)
  out = []
  for g, members in by_group.items():
    first = members[0]
    if any(m["task_id"] != first["task_id"] for m in members):
      raise ValueError(f"group {g} mixes tasks: {sorted({m['task_id'] for m in members})}")
    if sorted(m["member_index"] for m in members) != list(range(len(members))):
      raise ValueError(f"group {g} ({first['task_id']}) is missing members")
    ids = np.asarray(first["prompt_ids"], np.int32)
    if prompt_tail_chars:
      from dice_jax.data import prompts as prompts_lib

      text = prompts_lib.render_user_turn(user_message(first)[-prompt_tail_chars:], tokenizer)
      ids = np.asarray(tokenizer.encode(text), np.int32)
    out.append(GroupTask(g, first["task_id"], ids, first["reference_code"], len(members)))
  return out


def sampling_params(params, dtype):
  """Parameters for the sampler: matrices cast to the compute dtype (decoding is bound by weight
  reads, and the fp32 masters would double them); vectors (norm scales) stay as they are."""

  def cast(x):
    return x.astype(dtype) if x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating) else x

  return jax.tree.map(cast, params)


def rollout_key(seed: int, rl_step: int, group: int) -> jax.Array:
  """The sampling key of (seed, RL step, group): independent of batching and of restarts."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), rl_step), group)


def sample_key(seed: int, rl_step: int, group: int, member: int) -> jax.Array:
  """The key of one sample: member `member` of group `group` at RL step `rl_step`."""
  return jax.random.fold_in(rollout_key(seed, rl_step, group), member)


def group_keys(seed: int, rl_step: int, groups: Sequence["GroupTask"]) -> jax.Array:
  """`[sum of sizes]` typed keys, members of each group in order."""
  return jnp.stack([sample_key(seed, rl_step, g.group, m) for g in groups for m in range(g.size)])


# ------------------------------------------------------------------ sampler backends
@dataclasses.dataclass
class SampledGroup:
  task: GroupTask
  trajectories: list[Trajectory]  # in member order
  steps_used: int  # this group's rows' denoising forwards, summed


class SamplerBackend(Protocol):
  forwards: int  # decode forwards of the last `sample` call (set when it is exhausted)

  def sample(self, model, groups: Sequence[GroupTask], rl_step: int) -> Iterator[SampledGroup]:
    """Yields each group as soon as all its members are sampled."""
    ...


def _check_sampler(cfg: sampler_lib.SamplerConfig, grids=("response", "absolute")) -> None:
  if not cfg.return_logprobs:
    raise ValueError("the rollout needs SamplerConfig.return_logprobs=True")
  if cfg.block_alignment not in grids:
    raise ValueError(
      f"this rollout backend decodes on the {' or '.join(grids)} block grid, not "
      f"{cfg.block_alignment!r}"
    )


def prompt_width(lengths: Sequence[int], multiple: int) -> int:
  """The prompt width of one step's sampler calls: its longest prompt, rounded up to `multiple`
  tokens (0: none here; the sampler rounds to its block). Each width is one compiled program
  (a few seconds on CPU, ~30 s for sdar_1p7b at 896 + 4,096 on an H200), so a width rounded to 128
  is compiled again only when a step's longest prompt crosses into a new multiple; the cost is up
  to `multiple - 1` more cache slots a row, never more prefill tiles (the flash prefill tiles by
  128)."""
  width = max(lengths)
  return -(-width // multiple) * multiple if multiple else width


class StaticBatches:
  """`groups_per_batch` groups per `sampler.generate` call, all calls of a step at one prompt width
  (`prompt_width`: one compile per width). The last call is padded with copies of its last group
  (discarded)."""

  def __init__(
    self,
    cfg: sampler_lib.SamplerConfig,
    groups_per_batch: int,
    seed: int,
    width_multiple: int = 0,
  ):
    if groups_per_batch < 1:
      raise ValueError(f"groups_per_batch must be >= 1, got {groups_per_batch}")
    if width_multiple < 0:
      raise ValueError(f"width_multiple must be >= 0, got {width_multiple}")
    _check_sampler(cfg)
    self.cfg, self.k, self.seed = cfg, groups_per_batch, seed
    self.width_multiple = width_multiple
    self.forwards = 0
    self.call_s: list[float] = []  # wall seconds of each sampler call of the last `sample`

  def sample(self, model, groups: Sequence[GroupTask], rl_step: int) -> Iterator[SampledGroup]:
    self.forwards, self.call_s = 0, []
    if not groups:
      return
    cfg = self.cfg.for_model(model.cfg)  # the model's block size unless the config sets one
    width = prompt_width([len(g.prompt_ids) for g in groups], self.width_multiple)
    for start in range(0, len(groups), self.k):
      chunk = list(groups[start : start + self.k])
      padded = chunk + [chunk[-1]] * (self.k - len(chunk))
      prompts = [g.prompt_ids.tolist() for g in padded for _ in range(g.size)]
      keys = group_keys(self.seed, rl_step, padded)
      t0 = time.perf_counter()
      out = distributed.tree_to_host(
        sampler_lib.generate(model, prompts, cfg, keys=keys, prompt_width=width)
      )
      self.call_s.append(time.perf_counter() - t0)
      self.forwards += int(out.forwards)
      n_real = sum(g.size for g in chunk)
      trajs = from_sample_output(
        out,
        prompts[:n_real],
        block_size=cfg.block_size,
        block_alignment=cfg.block_alignment,
      )
      steps = np.asarray(out.steps_used)
      row = 0
      for g in chunk:
        yield SampledGroup(g, trajs[row : row + g.size], int(steps[row : row + g.size].sum()))
        row += g.size


class ContinuousBatches:
  """`slots` rows decoding at once in `diffusion.engine.ContinuousSampler`; a row that stops is
  refilled from the queue of samples at once, and a group is handed on as soon as its last member
  has stopped. Prompts up to `max_prompt_len` tokens (0: the longest prompt of each call).

  One engine is built per `sample` call (per RL step: the parameters change). Its programs are
  shaped by `slots` and `max_prompt_len` only, so JAX compiles them on the first step and reuses
  them on later ones."""

  def __init__(
    self,
    cfg: sampler_lib.SamplerConfig,
    slots: int,
    max_prompt_len: int,
    seed: int,
    prefill_rows: int = 16,
  ):
    _check_sampler(cfg, grids=("response",))
    self.cfg, self.slots, self.max_prompt_len, self.seed = cfg, slots, max_prompt_len, seed
    self.prefill_rows = prefill_rows
    self.forwards = 0

  def sample(self, model, groups: Sequence[GroupTask], rl_step: int) -> Iterator[SampledGroup]:
    from dice_jax.diffusion import engine as engine_lib

    self.forwards = 0
    if not groups:
      return
    cfg = self.cfg.for_model(model.cfg)
    engine = engine_lib.ContinuousSampler(
      model,
      cfg,
      slots=self.slots,
      max_prompt_len=self.max_prompt_len or max(len(g.prompt_ids) for g in groups),
      prefill_rows=self.prefill_rows,
    )
    by_group = {g.group: g for g in groups}
    requests = [
      engine_lib.Request((g.group, m), g.prompt_ids, sample_key(self.seed, rl_step, g.group, m))
      for g in groups
      for m in range(g.size)
    ]
    done: dict[int, dict[int, Trajectory]] = {}
    steps: dict[int, int] = {}
    for c in engine.run(requests):
      group, member = c.id
      n = c.response_ids.size
      logp = np.zeros(n, np.float32) if c.logprobs is None else c.logprobs
      traj = Trajectory(
        prompt_ids=c.prompt_ids,
        response_ids=c.response_ids,
        step_map=c.step_map,
        loss_mask=np.arange(n) < c.response_length,
        sampler_logp=logp,
      )
      traj.check_grid(cfg.block_size)
      done.setdefault(group, {})[member] = traj
      steps[group] = steps.get(group, 0) + c.steps_used
      task = by_group[group]
      if len(done[group]) == task.size:
        members = done.pop(group)
        yield SampledGroup(task, [members[m] for m in range(task.size)], steps.pop(group))
    self.forwards = int(engine.stats.get("forwards", 0))


# ------------------------------------------------------------------ judges
class Judge(Protocol):
  def submit(self, task_id: str, reference: str, candidate: str) -> concurrent.futures.Future:
    """The future `VerifyResult` of one candidate."""
    ...


class FunctionJudge:
  """Judges with a Python function `fn(task_id, reference, candidate) -> VerifyResult | bool`
  (True: compiled and correct), on one worker thread: for tests and toy rewards."""

  def __init__(self, fn: Callable[[str, str, str], VerifyResult | bool]):
    self.fn = fn
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="judge")

  def _judge(self, task_id: str, reference: str, candidate: str) -> VerifyResult:
    got = self.fn(task_id, reference, candidate)
    if isinstance(got, VerifyResult):
      return got
    ok = bool(got)
    return VerifyResult(
      request_id=request_id(task_id, reference, candidate),
      task_id=task_id,
      compiled=ok,
      correct=ok,
      deceptive=False,
      reward=float(ok),
      failure_kind=FailureKind.OK if ok else FailureKind.WRONG_OUTPUT,
    )

  def submit(self, task_id: str, reference: str, candidate: str) -> concurrent.futures.Future:
    return self._pool.submit(self._judge, task_id, reference, candidate)

  def close(self) -> None:
    self._pool.shutdown(wait=True)


def load_function_judge(spec: str) -> FunctionJudge:
  """'python:package.module:function' -> a `FunctionJudge` of that function."""
  _, _, target = spec.partition("python:")
  module, _, attr = target.partition(":")
  if not spec.startswith("python:") or not module or not attr:
    raise ValueError(f"judge {spec!r}: expected 'verifier' or 'python:package.module:function'")
  try:
    fn = getattr(importlib.import_module(module), attr)
  except (ImportError, AttributeError) as e:
    raise ValueError(f"judge {spec!r}: cannot load {module}.{attr}: {e}") from None
  return FunctionJudge(fn)


# ------------------------------------------------------------------ one step's rollout
@dataclasses.dataclass
class Rollout:
  """What one RL step sampled and how it was judged; lists are aligned, in group order."""

  trajectories: list[Trajectory]
  responses: list[str]  # decoded response text (up to the stop id)
  candidates: list[str | None]  # extracted candidate source (None: no code block)
  outcomes: list[VerifyResult]
  rewards: np.ndarray  # [N] float32
  sample_s: float  # wall time of the sampling loop (sampler calls and host-side decoding)
  verify_wait_s: float  # waiting for verdicts after the last group was sampled
  judge_requests: int  # unique requests sent to the judge
  forwards: int  # decode forwards, summed over sampler calls
  steps_used: int  # per-row denoising forwards, summed over rows
  generated_tokens: int  # decoded response tokens (whole blocks), summed over rows
  groups_skipped: int  # groups whose prompt exceeded max_prompt_len


def exchange_verdicts(mine: dict[str, VerifyResult]) -> dict[str, VerifyResult]:
  """Every process's verdicts (request id -> outcome), merged, on every process; a collective.
  Each request must have been judged by exactly one process."""
  if jax.process_count() == 1:
    return dict(mine)
  merged: dict[str, VerifyResult] = {}
  parts = distributed.gather_json({rid: o.to_dict() for rid, o in mine.items()})
  for part in parts:
    for rid, fields in part.items():
      if rid in merged:
        raise RuntimeError(f"request {rid} ({fields['task_id']}) was judged by two processes")
      merged[rid] = VerifyResult.from_dict(fields)
  return merged


def response_text(traj: Trajectory, tokenizer) -> str:
  """The decoded response up to (without) its first stop id, special tokens dropped."""
  ids = traj.response_ids[traj.loss_mask]
  return tokenizer.decode(ids.tolist(), skip_special_tokens=True)


def collect(
  model,
  groups: Sequence[GroupTask],
  *,
  backend: SamplerBackend,
  judge: Judge,
  tokenizer,
  reward_fn: Callable[[VerifyResult], float],
  rl_step: int,
  extraction: str = "dice",
  max_prompt_len: int = 0,
  progress_every_s: float = 30.0,
) -> Rollout:
  """Samples every group, judges each group as soon as it is sampled, joins verdicts by request id.

  With several JAX processes every process calls this with the same groups; each judges its
  share of the distinct requests and all get every verdict (see the module docstring)."""
  process, processes = jax.process_index(), jax.process_count()
  code_extraction.check_rule(extraction)
  keep = [g for g in groups if not max_prompt_len or len(g.prompt_ids) <= max_prompt_len]
  if len(keep) < len(groups):
    logging.warning(
      "rollout step %d: %d of %d groups skipped: prompt longer than %d tokens",
      rl_step,
      len(groups) - len(keep),
      len(groups),
      max_prompt_len,
    )
  trajs: list[Trajectory] = []
  texts: list[str] = []
  cands: list[str | None] = []
  rids: list[str] = []
  first_seen: dict[str, int] = {}  # distinct request -> its rank in this step
  pending: dict[str, concurrent.futures.Future] = {}  # the requests this process judges
  local: dict[str, VerifyResult] = {}
  steps_used = 0
  t_start = last_log = time.perf_counter()
  for n_done, sg in enumerate(backend.sample(model, keep, rl_step), 1):
    task = sg.task
    for member, traj in enumerate(sg.trajectories):
      traj.task_id, traj.group, traj.member = task.task_id, task.group, member
      text = response_text(traj, tokenizer)
      cand = code_extraction.extract(text, extraction)
      if cand is None or not cand.strip():  # nothing to judge (the service refuses empty code)
        rid = request_id(task.task_id, task.reference, "", {"no_code": True})
        local[rid] = VerifyResult(
          rid, task.task_id, failure_kind=NO_CODE, reason="no code in the response"
        )
        cand = None
      else:
        rid = request_id(task.task_id, task.reference, cand)
        if rid not in first_seen:
          first_seen[rid] = len(first_seen)
          if first_seen[rid] % processes == process:
            pending[rid] = judge.submit(task.task_id, task.reference, cand)
      trajs.append(traj)
      texts.append(text)
      cands.append(cand)
      rids.append(rid)
    steps_used += sg.steps_used
    now = time.perf_counter()
    if now - last_log > progress_every_s or n_done == len(keep):
      ready = sum(f.done() for f in pending.values())
      logging.info(
        "rollout step %d: %d/%d groups sampled (%.0f s), verdicts %d/%d",
        rl_step,
        n_done,
        len(keep),
        now - t_start,
        ready,
        len(pending),
      )
      last_log = now
  sample_s = time.perf_counter() - t_start
  t_wait = time.perf_counter()
  verdicts = exchange_verdicts({rid: fut.result() for rid, fut in pending.items()})
  verify_wait_s = time.perf_counter() - t_wait
  verdicts.update(local)
  outcomes = [verdicts[r] for r in rids]
  for o, t in zip(outcomes, trajs):
    if o.task_id != t.task_id:
      raise RuntimeError(f"verdict for task {o.task_id!r} joined to a response of {t.task_id!r}")
  return Rollout(
    trajectories=trajs,
    responses=texts,
    candidates=cands,
    outcomes=outcomes,
    rewards=np.asarray([reward_fn(o) for o in outcomes], np.float32),
    sample_s=sample_s,
    verify_wait_s=verify_wait_s,
    judge_requests=len(first_seen),
    forwards=backend.forwards,
    steps_used=steps_used,
    generated_tokens=int(sum(t.response_ids.size for t in trajs)),
    groups_skipped=len(groups) - len(keep),
  )
