"""The evaluation loop: (problem, sample) pairs -> candidates -> verifier -> one record each.

Batches of work go to the candidate source (a model or a file) and then to the verifier in a
background thread, so the next batch is generated while the last one is verified (at most two
batches in flight). Records are appended in the calling thread as verdicts arrive; pairs already in the
log are not redone. A progress bar shows the running compile rate, exec accuracy and fast_1 over the
samples done so far.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import sys
from collections.abc import Sequence

from dice_jax.data.tasks import KernelTask
from dice_jax.eval import metrics
from dice_jax.eval.candidates import CandidateSource, Generation
from dice_jax.eval.records import NO_CODE_BLOCK, EvalRecord, RecordLog, Timing, record_key
from dice_jax.eval.verifying import CandidateVerifier, Verdict


@dataclasses.dataclass(frozen=True)
class RunSummary:
  done_now: int
  resumed: int
  missing: int  # pairs the source had no candidate for


def _problem_id(task: KernelTask) -> int:
  return int(task.task_id.rsplit("/", 1)[1])


def make_record(
  task: KernelTask,
  sample: int,
  gen: Generation,
  eager: Verdict | None,
  compiled: Verdict | None,
  review_speedup: float,
) -> EvalRecord:
  """The record of one sample from its generation and verdicts (``eager`` None: no code block)."""
  base = dict(
    task_id=task.task_id,
    level=task.level,
    problem_id=_problem_id(task),
    name=task.name,
    sample=sample,
    prompt_tokens=gen.prompt_tokens,
    response_tokens=gen.response_tokens,
    generation_s=gen.seconds,
    candidate=gen.candidate,
    response=gen.response,
  )
  if eager is None:
    return EvalRecord(**base, failure_kind=NO_CODE_BLOCK, reason="no fenced code block")

  def timing(v: Verdict) -> Timing:
    flagged = v.correct and metrics.is_excessive(v.speedup, review_speedup)
    return Timing(v.speedup, v.candidate_ms, v.baseline_ms, flagged)

  comp = timing(compiled) if compiled is not None and compiled.correct else None
  flagged = timing(eager).flagged or (comp is not None and comp.flagged)
  return EvalRecord(
    **base,
    compiled=eager.compiled,
    correct=eager.correct,
    deceptive=eager.deceptive,
    failure_kind=eager.failure_kind,
    reason=eager.reason[:2000],
    eager=timing(eager),
    compiled_baseline=comp,
    speedup_flagged=bool(flagged),
    strict_correct=eager.strict_correct,
    device_name=eager.device_name,
    compile_s=eager.compile_s + (compiled.compile_s if compiled else 0.0),
    run_s=eager.run_s + (compiled.run_s if compiled else 0.0),
  )


class _Progress:
  """tqdm bar with running metrics over the records done so far (quiet when not a terminal)."""

  def __init__(self, total: int, log: RecordLog, enabled: bool):
    from tqdm import tqdm

    self.log = log
    self.bar = tqdm(
      total=total, desc="eval", unit="sample", disable=not enabled, file=sys.stderr, smoothing=0
    )

  def update(self, recs: Sequence[EvalRecord], skipped: int = 0) -> None:
    done = [r.outcome() for r in self.log.records.values()]
    if done:
      self.bar.set_postfix_str(
        f"compiled {100 * metrics.compile_rate(done):.0f}% exec "
        f"{100 * metrics.exec_accuracy(done):.0f}% fast_1 {100 * metrics.fast_p(done, 1.0):.0f}%"
        f" (of {len(done)} done)",
        refresh=False,
      )
    self.bar.update(len(recs) + skipped)

  def close(self) -> None:
    self.bar.close()


class Evaluator:
  """Runs the (task, sample) pairs of ``tasks`` x ``samples`` not yet in the run's record log."""

  def __init__(
    self,
    log: RecordLog,
    source: CandidateSource,
    verifier: CandidateVerifier,
    *,
    compile_baseline: bool = False,
    review_speedup: float = metrics.REVIEW_SPEEDUP,
    progress: bool = True,
  ):
    self.log, self.source, self.verifier = log, source, verifier
    self.compile_baseline = compile_baseline
    self.review_speedup = review_speedup
    self.progress = progress

  def _verify(self, work, gens):
    """(work item, generation, eager verdict, compile verdict) for every generated item."""
    items = [
      (i, (t.task_id, t.reference_code, g.candidate))
      for i, ((t, _), g) in enumerate(zip(work, gens))
      if g is not None and g.candidate
    ]
    eager = dict(zip([i for i, _ in items], self.verifier.verify_batch([x for _, x in items])))
    comp = {}
    if self.compile_baseline:
      again = [(i, x) for i, x in items if eager[i].correct]
      verdicts = self.verifier.verify_batch([x for _, x in again], compile_baseline=True)
      comp = dict(zip([i for i, _ in again], verdicts))
    return [
      make_record(t, s, g, eager.get(i), comp.get(i), self.review_speedup)
      for i, ((t, s), g) in enumerate(zip(work, gens))
      if g is not None
    ]

  def run(self, tasks: Sequence[KernelTask], samples: int = 1) -> RunSummary:
    todo = [
      (t, s) for t in tasks for s in range(samples) if record_key(t.task_id, s) not in self.log
    ]
    resumed = len(tasks) * samples - len(todo)
    bs = max(1, self.source.batch_size)
    bar = _Progress(len(todo), self.log, self.progress)
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="verify")
    inflight: collections.deque = collections.deque()
    done = missing = 0

    def collect(future, n_work):
      nonlocal done, missing
      recs = future.result()
      for r in recs:
        self.log.append(r)
      done += len(recs)
      missing += n_work - len(recs)
      bar.update(recs, skipped=n_work - len(recs))

    try:
      for start in range(0, len(todo), bs):
        work = todo[start : start + bs]
        gens = self.source.generate(work)
        inflight.append((pool.submit(self._verify, work, gens), len(work)))
        while inflight and (len(inflight) > 1 or inflight[0][0].done()):
          collect(*inflight.popleft())
      while inflight:
        collect(*inflight.popleft())
    finally:
      pool.shutdown(wait=False, cancel_futures=True)
      bar.close()
    return RunSummary(done_now=done, resumed=resumed, missing=missing)
