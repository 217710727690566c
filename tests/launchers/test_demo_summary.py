"""The demo's closing lines point at the committed learning-signal plot and state its numbers."""

import os

from experiments import demo


def test_signal_summary_names_the_committed_plot_and_its_numbers():
  text = demo.signal_summary()
  assert demo.SIGNAL_PNG in text
  assert os.path.isfile(demo.SIGNAL_PNG), demo.SIGNAL_PNG
  assert "9/64" in text and "44/64" in text and "30 RL steps" in text
  assert "make signal" in text


def test_make_signal_runs_the_rl_signal_launcher_as_documented():
  with open(os.path.join(demo.REPO, "Makefile")) as f:
    makefile = f.read()
  assert "\nsignal: setup\n" in makefile
  assert "experiments.rl_signal --workdir=$(SIGNAL_DIR) --sft_steps=300 --rl_steps=30" in makefile


def test_the_demos_sft_rows_are_the_rl_tasks_prompt_and_the_known_candidates(tmp_path):
  """What makes the demo's RL phase train: its SFT rows start with exactly the prompt the RL run
  gives the model (the chat-rendered tail of the task's user message) and answer it with the
  known candidates, whose code the RL reward extracts unchanged."""
  import json

  from dice_jax.data import code_extraction, rl_stream
  from dice_jax.data.byte_tokenizer import load_byte_tokenizer
  from dice_jax.data.sft_pipeline import sft_texts
  from dice_jax.data.tasks import load_sft_samples
  from dice_jax.rl.loop import load_tasks
  from dice_jax.rl.rollout import groups_from_stream
  from experiments.configs import rl_tiny

  tok = load_byte_tokenizer()
  cfg = rl_tiny.get_config()
  assert demo.sft_rows(str(tmp_path / "sft.jsonl")) == 2
  samples, _ = load_sft_samples(str(tmp_path / "sft.jsonl"))
  stream = iter(rl_stream.make_rl_stream(load_tasks(cfg), tok, cfg.stream))
  groups = groups_from_stream(
    rl_stream.next_step(stream, cfg.stream),
    tokenizer=tok,
    prompt_tail_chars=cfg.prompt_tail_chars,
  )
  assert [g.task_id for g in groups] == ["cpu_rl_task/1_ReLU"] * 2
  with open(demo.RL_CANDIDATES) as f:
    known = {r["variant"]: r for r in map(json.loads, f)}
  assert {k: r["expected"] for k, r in known.items()} == {
    "correct": "OK",
    "wrong_output": "WRONG_OUTPUT",
  }
  for s in samples:
    prompt, response = sft_texts(s, tok)
    assert tok.encode(prompt) == groups[0].prompt_ids.tolist()
    code = code_extraction.extract(response, cfg.code_extraction)
    assert code == known[s.sample_id]["candidate"].strip()
  a, b = (known[v]["candidate"] for v in ("correct", "wrong_output"))
  assert len(a) == len(b) and sum(x != y for x, y in zip(a, b)) == 1  # '>' vs '<'


def test_the_demo_prints_each_rl_steps_verdicts_and_updates():
  record = {
    "step": 2,
    "samples": 8.0,
    "judge_requests": 2.0,
    "correct_rate": 0.625,
    "failure/wrong_output": 0.25,
    "failure/syntax_error": 0.125,
    "reward_mean": 0.625,
    "groups": 1.0,
    "groups_dropped": 0.0,
    "updates": 1.0,
    "trained_tokens": 3208.0,
    "grad_norm": 0.1234,
  }
  assert demo.rl_step_line(record) == (
    "  RL step 2: 8 samples, 2 candidates to the verifier, verdicts ok 5, wrong_output 2, "
    "syntax_error 1; reward 0.625; groups kept 1/1, updates 1 (3208 tokens trained, grad norm 0.123)"
  )
