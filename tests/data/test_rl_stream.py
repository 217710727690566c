"""RL task stream: groups of G, DICE's sequential schedule, stage curricula, exact resume."""

import collections

import numpy as np
import pytest

pytest.importorskip("grain", reason="the data pipelines need grain (not on the GPU image)")

from dice_jax.data import prompts
from dice_jax.data.curriculum import StageSchedule, TaskScheduler, apportion
from dice_jax.data.rl_stream import RLStreamConfig, make_rl_stream, next_step
from dice_jax.data.tasks import KernelTask


def _tasks(levels):
  return [
    KernelTask(task_id=f"t{i}", level=lv, reference_code=f"class Model: # {i}\n    pass\n")
    for i, lv in enumerate(levels)
  ]


def dice_sequential_select(data, select_k, current_epoch, num_node, node_index):
  """Independent transcription of DICE's sequential_select (DICE `training/RL/`), 1-based epochs."""
  start = ((current_epoch - 1) * select_k * num_node + node_index * select_k) % len(data)
  return [data[(start + i) % len(data)] for i in range(select_k)]


def test_groups_are_g_consecutive_copies_with_prompt_ids(tiny_tokenizer):
  tasks = _tasks([1, 1, 2, 2, 3])
  cfg = RLStreamConfig(group_size=4, tasks_per_step=3, num_steps=2)
  els = list(make_rl_stream(tasks, tiny_tokenizer, cfg))
  assert len(els) == 2 * 3 * 4
  for g in range(6):
    grp = els[4 * g : 4 * g + 4]
    assert {e["task_id"] for e in grp} == {grp[0]["task_id"]}
    assert [e["member_index"] for e in grp] == [0, 1, 2, 3] and {e["group_index"] for e in grp} == {
      g
    }
  e = els[0]
  assert e["prompt"] == prompts.e2e_prompt(tasks[0].reference_code, style="dice")
  assert e["prompt_ids"].dtype == np.int32 and e["prompt_ids"].tolist() == tiny_tokenizer.encode(
    e["prompt"]
  )
  assert e["reference_code"] == tasks[0].reference_code and e["level"] == 1 and e["stage"] == 0


def test_infilling_elements_carry_prefix_suffix_middle(tiny_tokenizer):
  t = KernelTask(
    task_id="i0",
    level=1,
    reference_code="class Model: pass",
    kind="infill",
    prefix="import torch\n",
    middle='source = """__global__ void k(){}"""',
    suffix="\nclass ModelNew: pass\n",
  )
  e = next(
    iter(
      make_rl_stream(
        [t],
        tiny_tokenizer,
        RLStreamConfig(group_size=2, tasks_per_step=1, num_steps=1, prompt_style="chat"),
      )
    )
  )
  assert (e["prefix"], e["suffix"], e["middle"]) == (t.prefix, t.suffix, t.middle)
  assert e["prompt"] == prompts.infilling_prompt(
    t.reference_code, t.prefix, t.suffix, tiny_tokenizer
  )


def test_sequential_schedule_matches_dice_sequential_select(tiny_tokenizer):
  tasks = _tasks([0] + [1] * 9 + [2] * 15 + [3])  # 26 tasks, sorted like DICE's end-to-end file
  k, steps = 8, 7  # wraps around the file
  for nodes in (1, 2):
    for node in range(nodes):
      cfg = RLStreamConfig(
        group_size=2, tasks_per_step=k, num_steps=steps, process_index=node, process_count=nodes
      )
      it = iter(make_rl_stream(tasks, tiny_tokenizer, cfg))
      for s in range(steps):
        got = [e["task_id"] for e in next_step(it, cfg)][::2]
        want = [t.task_id for t in dice_sequential_select(tasks, k // nodes, s + 1, nodes, node)]
        assert got == want, (nodes, node, s)


def test_stage_schedule_composition_follows_weights(tiny_tokenizer):
  tasks = _tasks([1] * 10 + [2] * 20 + [3] * 5)
  sched = StageSchedule(milestones=((0, (1, 0, 0)), (4, (0, 1, 0)), (8, (0, 0.5, 0.5))))
  cfg = RLStreamConfig(group_size=3, tasks_per_step=8, num_steps=12)
  it = iter(make_rl_stream(tasks, tiny_tokenizer, cfg, schedule=sched))
  for s in range(12):
    comp = collections.Counter(e["stage"] for e in next_step(it, cfg))
    want = apportion(sched.weights(s), 8)
    assert [comp[st] for st in range(3)] == [3 * c for c in want], s
  assert apportion(sched.weights(0), 8) == [8, 0, 0]
  assert apportion(sched.weights(2), 8) == [4, 4, 0]  # linear interpolation half way
  assert apportion(sched.weights(6), 8) == [0, 6, 2]
  assert apportion(sched.weights(100), 8) == [0, 4, 4]
  step_fn = StageSchedule(milestones=((0, (1, 0, 0)), (4, (0, 1, 0))), interpolate=False)
  assert [apportion(step_fn.weights(s), 4) for s in (0, 3, 4)] == [[4, 0, 0], [4, 0, 0], [0, 4, 0]]


def test_stage_schedule_draws_each_task_once_per_pass():
  tasks = _tasks([1] * 6 + [2] * 4)
  sched = TaskScheduler(
    tasks, StageSchedule(milestones=((0, (0.6, 0.4, 0)),)), tasks_per_step=5, seed=3
  )
  drawn = [i for s in range(4) for i in sched.indices_for_step(s)]  # 12 single-op, 8 fused draws
  c = collections.Counter(drawn)
  assert all(c[i] == 2 for i in range(10))
  assert sched.indices_for_step(2) == TaskScheduler(
    tasks, sched.schedule, 5, seed=3
  ).indices_for_step(2)


def test_missing_stage_weight_goes_to_available_stages():
  s = StageSchedule(milestones=((0, (0, 0, 1)),))
  assert s.stage_counts(0, 4, available=(True, True, False)) == [2, 2, 0]
  with pytest.raises(ValueError, match="strictly increasing"):
    StageSchedule(milestones=((5, (1, 0, 0)), (5, (0, 1, 0))))


def test_resume_rl_stream_exactly(tiny_tokenizer):
  tasks = _tasks([1] * 7 + [2] * 9 + [3] * 3)
  cfg = RLStreamConfig(group_size=4, tasks_per_step=6, num_steps=10, seed=5)
  sched = StageSchedule(milestones=((0, (1, 0, 0)), (6, (0, 0, 1))))
  it = iter(make_rl_stream(tasks, tiny_tokenizer, cfg, schedule=sched))
  for _ in range(37):
    next(it)
  state = it.get_state()
  want = [next(it) for _ in range(50)]
  it2 = iter(make_rl_stream(tasks, tiny_tokenizer, cfg, schedule=sched))
  it2.set_state(state)
  got = [next(it2) for _ in range(50)]
  for a, b in zip(want, got):
    assert a.keys() == b.keys()
    for k in a:
      assert np.array_equal(a[k], b[k]) if k == "prompt_ids" else a[k] == b[k]
