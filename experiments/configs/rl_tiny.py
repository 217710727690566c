"""BiC-RL on CPU: the tiny model (byte tokenizer) against a local CPU verifier.

Sized for the 2-core dev machine: 4 tasks x 16 samples per RL step (64), up to 512 new tokens,
the last 64 characters of the end-to-end user message as the prompt (`experiments.rl_signal`
builds its SFT rows the same way; with several problems it uses 390, enough to name the
operation), 32 packed TraceRL rows per optimizer step, a learning rate for a small model trained
from scratch rather than DICE's 1e-6 fine-tuning rate. Tasks default to the embedded demo pairs (GPU references);
`experiments.rl_signal` points `e2e_tasks` at CPU-sized problems.
"""

import dataclasses
import os

from dice_jax.data.rl_stream import RLStreamConfig
from dice_jax.rl.config import DICE_SAMPLER, RLConfig, VerifierConfig
from dice_jax.rl.tracerl import TraceRLConfig
from dice_jax.train.optimizer import OptimizerConfig
from dice_jax.train.run_config import RunConfig

_PAIRS = os.path.join(os.path.dirname(__file__), "..", "demo_data", "pairs.jsonl")


def get_config() -> RLConfig:
  return RLConfig(
    run=RunConfig(model="tiny", model_overrides={"dtype": "float32"}, seed=0, checkpoint_every=1),
    phase="e2e",
    e2e_tasks=os.path.normpath(_PAIRS),
    stream=RLStreamConfig(group_size=16, tasks_per_step=4, num_steps=12, prompt_style="chat"),
    max_prompt_len=1024,
    prompt_tail_chars=64,
    sampler=dataclasses.replace(DICE_SAMPLER, max_new_tokens=512),
    groups_per_batch=4,
    verifier=VerifierConfig(local_device="cpu"),
    tracerl=TraceRLConfig(layout="packed", old_logp="sampler"),
    optim=OptimizerConfig(learning_rate=1e-4, schedule="constant", warmup_ratio=0.0),
    rows_per_update=32,
    length_multiple=64,
  )
