"""The RL launcher command the subprocess tests share: `rl_tiny` with a toy judge, 2 tasks x 4
samples of up to 16 tokens per step (tasks from the demo pairs, so that steps differ in data), so a
step takes about a second on CPU after compiling."""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rl_cmd(workdir, num_steps: int, *extra: str) -> list[str]:
  return [
    sys.executable,
    "-m",
    "experiments.rl",
    "--config=rl_tiny",
    f"--workdir={workdir}",
    f"--set=e2e_tasks={REPO}/experiments/demo_data/pairs.jsonl",
    "--set=judge=python:tests.rl.toy_judges:byte_parity",
    "--set=code_extraction=whole_response",
    f"--set=stream.num_steps={num_steps}",
    "--set=stream.group_size=4",
    "--set=stream.tasks_per_step=2",
    "--set=sampler.max_new_tokens=16",
    "--set=prompt_tail_chars=48",
    "--set=max_prompt_len=256",
    "--set=rows_per_update=4",
    "--set=length_multiple=32",
    "--set=optim.learning_rate=1e-3",
    *extra,
  ]
