"""The evaluation loop's summary counts each (problem, sample) once: verified, failed without a code
block (never sent to the verifier), resumed, or skipped for want of a candidate."""

from dice_jax.data.tasks import KernelTask
from dice_jax.eval.candidates import Generation
from dice_jax.eval.records import NO_CODE_BLOCK, RecordLog
from dice_jax.eval.runner import Evaluator
from dice_jax.eval.verifying import Verdict

TASKS = [KernelTask(f"kernelbench/L1/{i}", 1, "class Model: pass", name=f"p{i}") for i in (1, 2, 3)]


class _Source:
  """A TEST DOUBLE of a candidate source: `plan[problem id]` is the response (None: no candidate)."""

  batch_size = 2

  def __init__(self, plan):
    self.plan = plan

  def generate(self, work):
    out = []
    for task, _ in work:
      response = self.plan[int(task.task_id.rsplit("/", 1)[1])]
      code = response.split("```")[1] if response and "```" in response else None
      out.append(None if response is None else Generation(response, code))
    return out


class _Verifier:
  """A TEST DOUBLE of a verifier: every candidate it is sent is correct; it records what it saw."""

  def __init__(self):
    self.seen = []

  def verify(self, item, compile_baseline=False):
    self.seen.append(item[0])
    return Verdict(compiled=True, correct=True, deceptive=False, failure_kind="OK", speedup=1.0)


def test_responses_without_a_code_block_are_not_counted_as_verified(tmp_path):
  verifier = _Verifier()
  log = RecordLog(str(tmp_path))
  plan = {1: "no code here", 2: "nor here", 3: "nothing"}
  s = Evaluator(log, _Source(plan), verifier, progress=False).run(TASKS)
  assert (s.verified, s.no_code_block, s.resumed, s.missing) == (0, 3, 0, 0) and not verifier.seen
  assert {r.failure_kind for r in log.records.values()} == {NO_CODE_BLOCK}
  assert s.line() == (  # was "verified 3 now, 0 resumed, 0 without a candidate"
    "0 verified now, 3 without a code block (failures, not sent), 0 resumed, 0 skipped (no "
    "candidate given)"
  )


def test_each_pair_is_counted_once_across_kinds_and_a_rerun(tmp_path):
  plan = {1: "```kernel```", 2: "no code", 3: None}
  s = Evaluator(RecordLog(str(tmp_path)), _Source(plan), _Verifier(), progress=False).run(TASKS)
  assert (s.verified, s.no_code_block, s.resumed, s.missing) == (1, 1, 0, 1)
  again = _Verifier()
  s = Evaluator(RecordLog(str(tmp_path)), _Source(plan), again, progress=False).run(TASKS)
  assert (s.verified, s.no_code_block, s.resumed, s.missing) == (0, 0, 2, 1) and not again.seen
