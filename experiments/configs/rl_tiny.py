"""BiC-RL on CPU: the tiny model (byte tokenizer) against a local CPU verifier.

The task is KernelBench's ReLU for the CPU backend (experiments/demo_data/cpu_rl_task.jsonl). An
untrained tiny model writes no code block, so start from the demo's SFT checkpoint, which learned
two known candidates for it (a correct one and a wrong one, cpu_rl_candidates.jsonl): its samples
reach the verifier, some pass, and groups of unequal rewards give TraceRL updates (docs/running.md):

  python -m experiments.demo --steps=sft --workdir=/tmp/demo        # the SFT checkpoint, ~1-2 min
  python -m experiments.rl --config=rl_tiny --verifier=local --workdir=/tmp/rl_tiny \\
      --init_checkpoint=/tmp/demo/sft

Sized for a 2-core machine: 2 tasks x 8 samples per RL step, up to 512 new tokens, the last 16
characters of the end-to-end user message as the prompt (~35 tokens with the chat template; what
the demo's SFT rows use; `experiments.rl_signal` sets its own and a longer `max_prompt_len`),
16 packed TraceRL rows per optimizer step, a learning rate for a small model trained from scratch
rather than DICE's 1e-6 fine-tuning rate.
"""

import dataclasses
import os

from dice_jax.data.rl_stream import RLStreamConfig
from dice_jax.rl.config import DICE_SAMPLER, RLConfig, VerifierConfig
from dice_jax.rl.tracerl import TraceRLConfig
from dice_jax.train.optimizer import OptimizerConfig
from dice_jax.train.run_config import RunConfig

TASKS = os.path.join(os.path.dirname(__file__), "..", "demo_data", "cpu_rl_task.jsonl")


def get_config() -> RLConfig:
  return RLConfig(
    run=RunConfig(model="tiny", model_overrides={"dtype": "float32"}, seed=0, checkpoint_every=1),
    phase="e2e",
    e2e_tasks=os.path.normpath(TASKS),
    stream=RLStreamConfig(group_size=8, tasks_per_step=2, num_steps=12, prompt_style="chat"),
    max_prompt_len=128,
    prompt_tail_chars=16,
    sampler=dataclasses.replace(DICE_SAMPLER, max_new_tokens=512),
    groups_per_batch=2,
    verifier=VerifierConfig(local_device="cpu"),
    tracerl=TraceRLConfig(layout="packed", old_logp="sampler"),
    optim=OptimizerConfig(learning_rate=1e-4, schedule="constant", warmup_ratio=0.0),
    rows_per_update=16,
    length_multiple=64,
  )
