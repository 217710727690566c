"""Rollout: DICE's candidate extraction, groups from the RL stream, sampling with judging overlapped,
verdicts joined by request id, keys from (seed, RL step, group)."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
from flax import nnx

from dice_jax.data import byte_tokenizer, code_extraction, prompts
from dice_jax.data.rl_stream import RLStreamConfig, make_rl_stream, next_step
from dice_jax.data.tasks import KernelTask
from dice_jax.data.tokenizer import Tokenizer
from dice_jax.diffusion.sampler import SamplerConfig
from dice_jax.model import Transformer, get_config
from dice_jax.rl import rewards, rollout


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  return Tokenizer.from_dir(
    byte_tokenizer.write_byte_tokenizer(str(tmp_path_factory.mktemp("tok")))
  )


@pytest.fixture(scope="module")
def model():
  cfg = get_config("tiny", dtype="float32", **byte_tokenizer.byte_model_overrides())
  return Transformer(cfg, rngs=nnx.Rngs(0))


def _tasks(n=3):
  return [
    KernelTask(f"t{i}", 1, f"class Model:\n    op = {i}\n", kind="e2e", origin="test")
    for i in range(n)
  ]


def _groups(tok, steps=1, group_size=4, tasks_per_step=3, tail=64):
  cfg = RLStreamConfig(
    group_size=group_size, tasks_per_step=tasks_per_step, num_steps=steps, prompt_style="chat"
  )
  it = iter(make_rl_stream(_tasks(), tok, cfg))
  return [
    rollout.groups_from_stream(next_step(it, cfg), tokenizer=tok, prompt_tail_chars=tail)
    for _ in range(steps)
  ]


def _sampler(tok, new=16):
  return SamplerConfig(
    block_size=4,
    steps=4,
    strategy="low_confidence_dynamic",
    threshold=0.9,
    temperature=1.0,
    max_new_tokens=new,
    stop_ids=tuple(tok.stop_token_ids),
    return_logprobs=True,
    pad_id=256,
  )


def test_prompt_width_rounds_the_longest_prompt_up_to_its_multiple():
  assert rollout.prompt_width([5, 130, 7], 128) == 256
  assert rollout.prompt_width([128, 3], 128) == 128
  assert rollout.prompt_width([5, 130, 7], 0) == 130  # the sampler rounds to its block itself
  with pytest.raises(ValueError, match="width_multiple must be >= 0"):
    rollout.StaticBatches(_sampler_for_width(), 1, 0, width_multiple=-1)


def _sampler_for_width():
  return SamplerConfig(
    block_size=4, steps=4, max_new_tokens=4, stop_ids=(), return_logprobs=True, pad_id=256
  )


def test_steps_with_other_prompt_lengths_reuse_the_sampler_of_their_width_multiple(tok, model):
  """Two steps whose longest prompts differ (39 and 51 tokens here): rounded to one multiple of
  128 the second step compiles nothing (unrounded, it compiled a second program: ~30 s at DICE's
  shape on an H200); the tokens are those of the unrounded sampler."""
  from dice_jax import compile_clock

  cfg = _sampler(tok, new=8)
  short, long_ = (_groups(tok, tail=t)[0][:1] for t in (20, 32))
  assert (len(short[0].prompt_ids), len(long_[0].prompt_ids)) == (39, 51)
  clock = compile_clock.shared()
  rounded = rollout.StaticBatches(cfg, 1, seed=3, width_multiple=128)
  first = _tokens(rounded, model, short, 1)
  mark = clock.mark()
  second = _tokens(rounded, model, long_, 2)
  assert clock.since(mark) < 0.5  # a sampler's compile takes seconds on this CPU
  plain = rollout.StaticBatches(cfg, 1, seed=3)
  assert _tokens(plain, model, short, 1) == first and _tokens(plain, model, long_, 2) == second
  mark = clock.mark()
  _tokens(plain, model, long_, 3)
  assert clock.since(mark) < 0.5  # its own width again: reused as well


def test_dice_extraction_matches_extract_first_code():
  ex = code_extraction.first_block_dice
  assert ex("Here:\n```python\nimport torch\nx = 1\n```\nand ```other```") == "import torch\nx = 1"
  assert ex("```cpp\nint f();\n```") == "int f();"
  assert ex("```\nplain\n```") == "plain"
  assert ex("```pythonic = 1```") == "ic = 1"  # DICE strips the tag without looking for a newline
  assert ex("```cuda\n__global__ void k();\n```") == "cuda\n__global__ void k();"  # stays, fails
  assert ex("no fence") is None and ex("```python\nunterminated") is None
  # the evaluation's lenient rule strips more tags (reported, not DICE's behaviour)
  first = code_extraction.first_block
  assert first("```py\nx = 1\n```") == "x = 1" and ex("```py\nx = 1\n```") == "py\nx = 1"
  assert code_extraction.extract("whole text", "whole_response") == "whole text"
  assert code_extraction.extract("```py\nx = 1\n```", "dice") == "py\nx = 1"
  with pytest.raises(ValueError, match="code extraction must be one of"):
    code_extraction.extract("x", "last_block")


def test_groups_from_stream_and_prompt_tail(tok):
  (groups,) = _groups(tok, tail=40)
  assert [(g.group, g.task_id, g.size) for g in groups] == [
    (0, "t0", 4),
    (1, "t1", 4),
    (2, "t2", 4),
  ]
  msg = prompts.e2e_user_message("class Model:\n    op = 1\n")[-40:]
  assert tok.decode(groups[1].prompt_ids.tolist()) == prompts.render_user_turn(msg, tok)
  bad = [
    {"group_index": 0, "task_id": "a", "member_index": 0, "prompt_ids": [1], "reference_code": ""},
    {"group_index": 0, "task_id": "b", "member_index": 1, "prompt_ids": [1], "reference_code": ""},
  ]
  with pytest.raises(ValueError, match="group 0 mixes tasks"):
    rollout.groups_from_stream(bad)


def test_infill_prompt_tail_renders_the_infilling_message(tok):
  task = KernelTask(
    "inf0",
    1,
    "class Model: pass\n",
    kind="infill",
    prefix="PREFIX\n",
    middle="M",
    suffix="SUFFIX\n",
  )
  cfg = RLStreamConfig(group_size=2, tasks_per_step=1, num_steps=1, prompt_style="chat")
  elements = next_step(iter(make_rl_stream([task], tok, cfg)), cfg)
  (g,) = rollout.groups_from_stream(elements, tokenizer=tok, prompt_tail_chars=500)
  msg = prompts.infilling_user_message("class Model: pass\n", "PREFIX\n", "SUFFIX\n")
  assert "SUFFIX" in msg[-500:]
  assert tok.decode(g.prompt_ids.tolist()) == prompts.render_user_turn(msg[-500:], tok)
  (full,) = rollout.groups_from_stream(elements)  # no tail: the stream's own (DICE) prompt
  assert full.prompt_ids.tolist() == elements[0]["prompt_ids"].tolist()


class _Recorder:
  """Wraps a backend and a judge function, recording the order of sampler calls and verdicts."""

  def __init__(self, backend):
    self.backend, self.events, self.lock = backend, [], threading.Lock()

  @property
  def forwards(self):
    return self.backend.forwards

  def sample(self, model, groups, rl_step):
    for sg in self.backend.sample(model, groups, rl_step):
      with self.lock:
        self.events.append(("sampled", sg.task.group))
      yield sg

  def judge(self, task_id, reference, candidate):
    with self.lock:
      self.events.append(("judged", task_id))
    return sum(candidate.encode()) % 2 == 0  # a deterministic toy verdict with variance


def test_collect_judges_each_group_while_the_next_samples_and_joins_by_request_id(tok, model):
  (groups,) = _groups(tok)
  rec = _Recorder(rollout.StaticBatches(_sampler(tok), groups_per_batch=1, seed=7))
  judge = rollout.FunctionJudge(rec.judge)
  r = rollout.collect(
    model,
    groups,
    backend=rec,
    judge=judge,
    tokenizer=tok,
    reward_fn=rewards.make_reward("binary"),
    rl_step=0,
    extraction="whole_response",
  )
  judge.close()
  assert len(r.trajectories) == 12 and r.rewards.shape == (12,)
  assert [(t.task_id, t.group, t.member) for t in r.trajectories[:5]] == [
    ("t0", 0, 0),
    ("t0", 0, 1),
    ("t0", 0, 2),
    ("t0", 0, 3),
    ("t1", 1, 0),
  ]
  # a verdict for group 0 was asked for before group 2 was sampled: judging overlaps sampling
  first_judged = rec.events.index(("judged", "t0"))
  assert first_judged < rec.events.index(("sampled", 2))
  # an empty response is no code (judged locally, never sent); the rest by the toy verdict
  expected = [0.0 if c is None else float(sum(c.encode()) % 2 == 0) for c in r.candidates]
  assert r.rewards.tolist() == expected and 0 < sum(expected) < 12
  assert all((c is None) == (not t) for c, t in zip(r.candidates, r.responses))
  assert [o.task_id for o in r.outcomes] == [t.task_id for t in r.trajectories]
  sent = {(t.task_id, c) for t, c in zip(r.trajectories, r.candidates) if c is not None}
  assert r.judge_requests == len(sent)
  assert r.responses == [rollout.response_text(t, tok) for t in r.trajectories]
  assert r.generated_tokens == sum(t.response_ids.size for t in r.trajectories)
  assert r.forwards > 0 and r.steps_used >= r.generated_tokens // 4
  for t in r.trajectories:
    t.check_grid(4)
    assert np.all(t.sampler_logp[t.loss_mask] <= 0) and t.loss_mask.sum() >= 1


def _tokens(backend, model, groups, step):
  return [
    (sg.task.group, [(t.response_ids.tolist(), t.step_map.tolist()) for t in sg.trajectories])
    for sg in backend.sample(model, groups, step)
  ]


def test_samples_depend_on_seed_step_group_member_not_on_batching_or_backend(tok, model):
  (groups,) = _groups(tok)
  cfg = _sampler(tok)
  three = rollout.StaticBatches(cfg, groups_per_batch=3, seed=3)
  a, again, other_step = (_tokens(three, model, groups, s) for s in (5, 5, 6))
  assert a == again and a != other_step
  assert _tokens(rollout.StaticBatches(cfg, 1, seed=3), model, groups, 5) == a
  assert _tokens(rollout.StaticBatches(cfg, 3, seed=4), model, groups, 5) != a
  engine = rollout.ContinuousBatches(cfg, slots=5, max_prompt_len=0, seed=3)
  assert sorted(_tokens(engine, model, groups, 5)) == sorted(a)  # groups may finish out of order
  assert engine.forwards > 0 and three.forwards > 0
  k = rollout.sample_key(3, 5, 0, 1)
  assert (
    jax.random.key_data(k).tolist()
    == jax.random.key_data(jax.random.fold_in(rollout.rollout_key(3, 5, 0), 1)).tolist()
  )


def test_no_code_responses_are_failures_without_a_judge_call(tok, model):
  (groups,) = _groups(tok)
  calls = []
  judge = rollout.FunctionJudge(lambda *a: calls.append(a) or True)
  r = rollout.collect(
    model,
    groups[:1],
    backend=rollout.StaticBatches(_sampler(tok), groups_per_batch=1, seed=0),
    judge=judge,
    tokenizer=tok,
    reward_fn=rewards.make_reward("binary"),
    rl_step=0,
    extraction="dice",  # a random byte model never closes a ``` fence
    max_prompt_len=10_000,
  )
  judge.close()
  assert calls == [] and r.judge_requests == 0
  assert {o.failure_kind for o in r.outcomes} == {rollout.NO_CODE} and r.rewards.sum() == 0


def test_long_prompts_are_skipped_and_counted(tok, model):
  (groups,) = _groups(tok)
  r = rollout.collect(
    model,
    groups,
    backend=rollout.StaticBatches(_sampler(tok, new=4), groups_per_batch=2, seed=0),
    judge=rollout.FunctionJudge(lambda *a: True),
    tokenizer=tok,
    reward_fn=rewards.make_reward("binary"),
    rl_step=0,
    extraction="whole_response",
    max_prompt_len=10,
  )
  assert r.groups_skipped == 3 and r.trajectories == [] and r.rewards.shape == (0,)


def test_static_batches_refuse_settings_traceRL_cannot_train_on(tok):
  import dataclasses

  with pytest.raises(ValueError, match="return_logprobs"):
    rollout.StaticBatches(dataclasses.replace(_sampler(tok), return_logprobs=False), 1, 0)
  absolute = dataclasses.replace(_sampler(tok), block_alignment="absolute")
  assert rollout.StaticBatches(absolute, 1, 0).cfg.block_alignment == "absolute"  # replayed exactly
  with pytest.raises(ValueError, match="response block grid"):
    rollout.ContinuousBatches(absolute, 4, 0, 0)
  with pytest.raises(ValueError, match="python:package.module:function"):
    rollout.load_function_judge("tests.rl:judge")
  with pytest.raises(ValueError, match="cannot load"):
    rollout.load_function_judge("python:no_such_module_here:judge")
