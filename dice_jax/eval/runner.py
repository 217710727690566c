"""The evaluation loop: (problem, sample) pairs -> candidates -> verifier -> one record each.

Batches of work go to the candidate source (a model or a file); each candidate is then verified in a
worker thread, so the next batch is generated while the last one is verified (at most one batch
waits). Records are appended in the calling thread as each verdict arrives; pairs already in the log
are not redone. A progress bar shows the running compile rate, exec accuracy and fast_1 over the
samples done so far.
"""

from __future__ import annotations

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
  done_now: int  # records written by this run: verified, or failures without a code block
  resumed: int
  missing: int  # pairs the source had no candidate for (no record)
  no_code_block: int = 0  # of `done_now`: responses without a code block (failures, not verified)

  @property
  def verified(self) -> int:
    return self.done_now - self.no_code_block

  def line(self) -> str:
    """What the run did, each pair counted once."""
    return (
      f"{self.verified} verified now, {self.no_code_block} without a code block (failures, not "
      f"sent), {self.resumed} resumed, {self.missing} skipped (no candidate given)"
    )


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
    prompt_cut=gen.prompt_cut,
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

  def _verify(self, task: KernelTask, sample: int, gen: Generation) -> EvalRecord:
    """Runs in a worker thread: the verdicts on one candidate, as its record."""
    item = (task.task_id, task.reference_code, gen.candidate)
    eager = self.verifier.verify(item)
    comp = (
      self.verifier.verify(item, compile_baseline=True)
      if (self.compile_baseline and eager.correct)
      else None
    )
    return make_record(task, sample, gen, eager, comp, self.review_speedup)

  def run(self, tasks: Sequence[KernelTask], samples: int = 1) -> RunSummary:
    todo = [
      (t, s) for t in tasks for s in range(samples) if record_key(t.task_id, s) not in self.log
    ]
    resumed = len(tasks) * samples - len(todo)
    bs = max(1, self.source.batch_size)
    bar = _Progress(len(todo), self.log, self.progress)
    pool = concurrent.futures.ThreadPoolExecutor(2 * bs, thread_name_prefix="verify")
    pending: set[concurrent.futures.Future] = set()
    done = missing = no_code = 0

    def add(rec: EvalRecord) -> None:
      nonlocal done
      self.log.append(rec)
      done += 1
      bar.update([rec])

    def drain(block: bool) -> None:
      nonlocal pending
      finished, pending = concurrent.futures.wait(
        pending, timeout=None if block else 0, return_when=concurrent.futures.FIRST_COMPLETED
      )
      for f in finished:
        add(f.result())

    try:
      for start in range(0, len(todo), bs):
        work = todo[start : start + bs]
        for (t, s), g in zip(work, self.source.generate(work)):
          if g is None:  # the source has no candidate: the problem stays without a result
            missing += 1
            bar.update([], skipped=1)
          elif not g.candidate:  # no code block: nothing to verify
            no_code += 1
            add(make_record(t, s, g, None, None, self.review_speedup))
          else:
            pending.add(pool.submit(self._verify, t, s, g))
        drain(block=False)
        while len(pending) > bs:  # generate the next batch while at most one batch verifies
          drain(block=True)
      while pending:
        drain(block=True)
    finally:
      pool.shutdown(wait=False, cancel_futures=True)
      bar.close()
    return RunSummary(done_now=done, resumed=resumed, missing=missing, no_code_block=no_code)
