"""The BiC-RL loop in process: config validation, one run's outputs, a reward that RL raises, and
the loop against the real CPU verifier over gRPC."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from dice_jax.data.rl_stream import RLStreamConfig
from dice_jax.rl.config import DICE_SAMPLER, RLConfig, VerifierConfig
from dice_jax.model.config import get_config
from dice_jax.rl.tracerl import TraceRLConfig
from dice_jax.train.config import apply_overrides
from dice_jax.train.optimizer import OptimizerConfig
from dice_jax.train.run_config import RunConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAIRS = os.path.join(REPO, "experiments", "demo_data", "pairs.jsonl")


def small_config(**kw) -> RLConfig:
  """A seconds-per-step CPU config on the demo pairs with a Python judge."""
  base = dict(
    run=RunConfig(
      model="tiny",
      model_overrides={"dtype": "float32"},
      seed=1,
      mesh_data=1,
      mesh_fsdp=8,  # the conftest's 8 fake devices: parameters and rows sharded
      async_checkpoint=False,
      checkpoint_every=1,
    ),
    e2e_tasks=PAIRS,
    stream=RLStreamConfig(group_size=4, tasks_per_step=2, num_steps=2, prompt_style="chat"),
    max_prompt_len=256,
    prompt_tail_chars=48,
    sampler=dataclasses.replace(DICE_SAMPLER, max_new_tokens=16),
    groups_per_batch=2,
    code_extraction="whole_response",
    judge="python:tests.rl.toy_judges:byte_parity",
    optim=OptimizerConfig(learning_rate=1e-3, schedule="constant", warmup_ratio=0.0),
    rows_per_update=8,
    length_multiple=32,
  )
  base.update(kw)
  return RLConfig(**base)


def test_config_errors_name_the_field():
  cases = {
    "phase": dict(phase="final"),
    "advantage": dict(advantage="zscore"),
    "RLConfig.reward": dict(reward="shaped"),
    "judge": dict(judge="module:fn"),
    "rows_per_update": dict(rows_per_update=0),
    "multiple of accum_steps": dict(rows_per_update=6, accum_steps=4),
    "block_alignment": dict(
      sampler=dataclasses.replace(DICE_SAMPLER, block_alignment="absolute"),
      sampler_backend="continuous",
    ),
    "return_logprobs": dict(sampler=dataclasses.replace(DICE_SAMPLER, return_logprobs=False)),
    "measure_performance": dict(reward="speed"),
    "group_size": dict(stream=RLStreamConfig(group_size=1)),
    "code_extraction": dict(code_extraction="last"),
  }
  for needle, kw in cases.items():
    with pytest.raises(ValueError, match=needle):
      RLConfig(**kw)
  with pytest.raises(ValueError, match="verifier.options"):
    VerifierConfig(options={"num_trials": 3})
  with pytest.raises(ValueError, match="unknown field 'num_step'"):
    apply_overrides(RLConfig(), ["stream.num_step=3"])
  speed = RLConfig(reward="speed", verifier=VerifierConfig(options={"measure_performance": True}))
  assert speed.reward == "speed"


def test_config_json_round_trip_and_dice_presets():
  from experiments.configs import rl_dice_e2e, rl_dice_infill, rl_tiny

  cfg = apply_overrides(small_config(), ["verifier.options.measure_performance=True"])
  assert RLConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg
  saved = json.loads(json.dumps(cfg.to_json()))
  saved["verifier"]["ready_timeout_s"] = 300.0  # saved before --verifier_wait_s replaced it
  assert RLConfig.from_json(saved) == cfg
  infill, e2e = rl_dice_infill.get_config(), rl_dice_e2e.get_config()
  for c in (infill, e2e):
    s = c.sampler
    assert get_config(c.run.model).block_size == 4  # the sampler's block: 0, the model's
    assert (s.temperature, s.block_size, s.steps, s.strategy, s.threshold, s.max_new_tokens) == (
      1.0,
      0,
      4,
      "low_confidence_dynamic",
      0.9,
      4096,
    )
    assert (c.stream.tasks_per_step, c.stream.group_size, c.rows_per_update) == (64, 16, 256)
    assert (c.optim.learning_rate, c.optim.schedule, c.optim.weight_decay) == (1e-6, "constant", 0)
    assert (c.tracerl.clip_eps, c.tracerl.kl_beta, c.tracerl.shrink) == (0.2, 0.01, 1)
    assert (c.reward, c.advantage, c.run.seed, c.schedule) == (
      "binary",
      "group_zscore",
      10086,
      "sequential",
    )
    assert c.verifier.options == {
      "num_correct_trials": 1,
      "strictness": "off",
      "seed": 42,
      "timeout_s": 300.0,
    }
  assert (infill.phase, infill.num_steps, infill.max_prompt_len) == ("infill", 20, 2000)
  assert (e2e.phase, e2e.num_steps, e2e.max_prompt_len) == ("e2e", 100, 1500)
  assert rl_tiny.get_config().stream.elements_per_step == 16


def test_run_waits_for_its_verifier_before_writing_anything(tmp_path, caplog):
  """An unreachable verifier: progress lines naming it, then VerifierUnavailable, and no workdir
  (no checkpoints/, model_config.json or tokenizer/ as before the wait came first)."""
  import logging
  import socket

  from dice_jax.rl.loop import run_rl
  from verifier.api.client import VerifierUnavailable

  cfg = small_config(judge="verifier")
  with socket.socket() as s, caplog.at_level(logging.INFO):
    s.bind(("127.0.0.1", 0))  # a bound port nobody listens on: connections are refused
    address = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(VerifierUnavailable, match=f"not ready after 0.5 s: {address} "):
      run_rl(cfg, str(tmp_path / "run"), endpoints=[address], verifier_wait_s=0.5)
  waits = [r.getMessage() for r in caplog.records if "waiting for the verifier" in r.getMessage()]
  assert waits and waits[0].startswith(f"waiting for the verifier at {address}: 0 s of 0.5 s")
  assert not os.path.exists(tmp_path / "run")


def test_run_writes_metrics_samples_and_checkpoints(tmp_path):
  from dice_jax.rl.loop import run_rl
  from dice_jax.train.metrics import read_metrics

  trainer = TraceRLConfig(layout="packed", old_logp="trainer")  # a forward for the old log-probs
  out = run_rl(small_config(tracerl=trainer), str(tmp_path))
  recs = read_metrics(str(tmp_path / "metrics.jsonl"))
  assert list(recs) == [1, 2] and out["rl_step"] == 2
  for r in recs.values():
    assert r["samples"] == 8 and 0 <= r["correct_rate"] <= 1
    assert r["correct_rate"] == r["reward_mean"]  # binary reward on a judge with no deception
    for k in ("time/sample_s", "time/verify_wait_s", "time/update_s", "tokens_per_forward"):
      assert k in r
    assert r["time/compile_s"] >= r["time/rollout_compile_s"] >= 0
    assert r["groups"] == 2 and r["updates"] == (r["groups_dropped"] < 2)
    if r["updates"]:
      assert r["sampler_logp_gap"] < 1e-4  # the trainer replays the sampler's log-probs (fp32)
  assert (
    recs[2]["time/rollout_compile_s"] < 0.5
  )  # the first step's sampler reused (a compile: seconds)
  samples = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
  assert len(samples) == 8 and {s["step"] for s in samples} == {1, 2}
  assert os.path.exists(tmp_path / "rl.png")
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2"]
  again = run_rl(small_config(tracerl=trainer), str(tmp_path))  # finished: resumes, does nothing
  assert again["rl_step"] == 2
  # the run directory initialises a next phase (--init_checkpoint): its params and tokenizer
  import jax
  from flax import nnx

  from dice_jax import sharding
  from dice_jax.model import Transformer
  from dice_jax.train.run_setup import restore_run_params

  model, mcfg, tok_dir = restore_run_params(str(tmp_path), sharding.make_mesh())
  assert tok_dir == str(tmp_path / "tokenizer") and mcfg.vocab_size == 264
  fresh = nnx.state(Transformer(mcfg, rngs=nnx.Rngs(1)), nnx.Param).to_pure_dict()
  trained = nnx.state(model, nnx.Param).to_pure_dict()
  diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(abs(a - b).max()), trained, fresh))
  assert max(diffs) > 0  # updated by RL, not a re-initialisation with the run's seed


@pytest.mark.slow
def test_rl_raises_a_toy_reward(tmp_path):
  """Reward: the first response byte is below 128 (about half, at random). A few RL steps with a
  large learning rate move the tiny model's first-token distribution toward it."""
  from dice_jax.rl.loop import run_rl
  from dice_jax.train.metrics import read_metrics

  cfg = small_config(
    judge="python:tests.rl.toy_judges:first_byte_low",
    stream=RLStreamConfig(group_size=8, tasks_per_step=2, num_steps=8, prompt_style="chat"),
    sampler=dataclasses.replace(DICE_SAMPLER, max_new_tokens=8),
    optim=OptimizerConfig(learning_rate=3e-2, schedule="constant", warmup_ratio=0.0),
    rows_per_update=8,
  )
  run_rl(cfg, str(tmp_path))
  rates = [r["correct_rate"] for r in read_metrics(str(tmp_path / "metrics.jsonl")).values()]
  assert np.mean(rates[-2:]) >= np.mean(rates[:2]) + 0.3, rates


@pytest.mark.slow
def test_loop_against_the_real_cpu_verifier(tmp_path):
  """Every response goes over gRPC to a real CPU verifier; its verdicts come back joined."""
  pytest.importorskip("torch", reason="the verifier service needs torch")
  from dice_jax.rl.loop import run_rl
  from dice_jax.train.metrics import read_metrics
  from verifier.serve.local import LocalVerifier

  cfg = small_config(
    judge="verifier",
    stream=RLStreamConfig(group_size=4, tasks_per_step=2, num_steps=1, prompt_style="chat"),
  )
  with LocalVerifier(str(tmp_path / "verifier"), device="cpu", start_timeout_s=120) as v:
    out = run_rl(cfg, str(tmp_path / "run"), endpoints=[v.address])
  (rec,) = read_metrics(str(tmp_path / "run" / "metrics.jsonl")).values()
  assert rec["correct_rate"] == 0 and out["rl_step"] == 1
  # random bytes are not a ModelNew file: the service's static check said so (an empty response
  # is judged locally, as no code, and not sent)
  kinds = ("failure/syntax_error", "failure/missing_model_new", "failure/no_code")
  assert sum(rec.get(k, 0) for k in kinds) == 1.0 and rec["failure/syntax_error"] > 0.5
  assert rec["judge_requests"] == 8 * (1 - rec.get("failure/no_code", 0))
  assert rec["groups_dropped"] == 2 and rec["updates"] == 0
  samples = [json.loads(line) for line in open(tmp_path / "run" / "samples.jsonl")]
  assert {s["failure_kind"] for s in samples} <= {"syntax_error", "missing_model_new", "no_code"}
  assert any(s["reason"].startswith("candidate is not valid Python") for s in samples)
