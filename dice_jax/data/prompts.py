"""Prompts for DICE: KernelBench one-shot end-to-end, DICE kernel infilling, CuKe SFT samples.

* End-to-end (BiC-RL stage 2, evaluation): KernelBench v0's one-shot prompt (problem statement, the
  element-wise-add example pair, the target architecture, "Optimize the architecture named Model with custom CUDA
  operators! Name your optimized output architecture ModelNew. ..."), KernelBench (ScalingIntelligence/KernelBench)
  `src/prompt_constructor.py::prompt_generate_custom_cuda`.
* Infilling (BiC-RL stage 1): DICE's kernel-infilling prompt (reference + prefix + suffix; the model re-emits the
  whole file), DICE `training/RL/sample/sdar_rl_rollout_kernel.py`.

Two renderings of the same user message:
  ``style="chat"``  the tokenizer's chat template (``<|im_start|>user\\n{msg}<|im_end|>\\n<|im_start|>assistant\\n``);
  ``style="dice"``  DICE's rollout strings byte for byte. They differ only for end-to-end, where DICE's raw string
                   ends ``assistant\\n\\n`` (one extra newline); for infilling both are identical.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
from typing import Literal, Protocol

import jinja2

from dice_jax.data.tokenizer import IM_END, IM_START, render_im_start

PromptStyle = Literal["chat", "dice"]


class ChatTemplater(Protocol):
  def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str: ...


@functools.cache
def _asset(name: str) -> str:
  return (
    importlib.resources.files("dice_jax.data")
    .joinpath("templates", name)
    .read_text(encoding="utf-8")
  )


def example_pair() -> tuple[str, str]:
  """KernelBench's one-shot example: (model_ex_add.py, model_new_ex_add.py)."""
  return _asset("model_ex_add.py.txt"), _asset("model_new_ex_add.py.txt")


# KernelBench v0 prompt pieces (whitespace as in the source, which builds them from indented f-strings).
_KB_STATEMENT = (
  "You write custom CUDA kernels to replace the pytorch operators in the given architecture to get speedups. \n\n"
  "    You have complete freedom to choose the set of operators you want to replace. You may make the decision to "
  "replace some operators with custom CUDA kernels and leave others unchanged. You may replace multiple operators "
  "with custom implementations, consider operator fusion opportunities (combining multiple operators into a single "
  "kernel, for example, combining matmul+relu), or algorithmic changes (such as online softmax). You are only "
  "limited by your imagination.\n\n"
)
_KB_EXAMPLE = (
  "\n        Here's an example to show you the syntax of inline embedding custom CUDA operators in torch: "
  "The example given architecture is: \n\n"
  "        ``` \n\n"
  "        {example_arch}\n"
  "        ``` \n\n"
  "        The example new arch with custom CUDA kernels looks like this: \n"
  "        ```\n"
  "        {example_new_arch}\n"
  "        ``` \n\n"
  "        "
)
_KB_ARCH = "\n    You are given the following architecture: \n\n    ```\n    {arch}\n    ```\n    "
_KB_INSTRUCTION = (
  "\nOptimize the architecture named Model with custom CUDA operators! Name your optimized output architecture "
  "ModelNew. Output the new code in codeblocks. Please generate real code, NOT pseudocode, make sure the code "
  "compiles and is fully functional. Just output the new model code, no other text, and NO testing code! "
)


def e2e_user_message(
  reference_code: str, example_arch: str | None = None, example_new_arch: str | None = None
) -> str:
  """The KernelBench one-shot user message for one PyTorch reference (``class Model``)."""
  if example_arch is None or example_new_arch is None:
    example_arch, example_new_arch = example_pair()
  msg = _KB_STATEMENT
  if example_arch and example_new_arch:
    msg += _KB_EXAMPLE.format(example_arch=example_arch, example_new_arch=example_new_arch)
  return msg + _KB_ARCH.format(arch=reference_code) + _KB_INSTRUCTION


@functools.cache
def _infill_template() -> jinja2.Template:
  # Plain jinja2.Template as DICE renders it (no autoescape; values are inserted verbatim).
  return jinja2.Template(_asset("kernel_infilling_user.jinja"))


def infilling_user_message(reference_code: str, prefix: str, suffix: str) -> str:
  """DICE's kernel-infilling user message: reference + prefix + suffix; the answer is the whole file."""
  return _infill_template().render(pytorch_code=reference_code, prefix=prefix, suffix=suffix)


def render_user_turn(message: str, tokenizer: ChatTemplater | None = None) -> str:
  """One user turn plus the generation prompt, through the tokenizer's chat template (built-in if None)."""
  msgs = [{"role": "user", "content": message}]
  if tokenizer is None:
    return render_im_start(msgs, add_generation_prompt=True)
  return tokenizer.apply_chat_template(msgs, add_generation_prompt=True)


def e2e_prompt(
  reference_code: str, tokenizer: ChatTemplater | None = None, style: PromptStyle = "chat"
) -> str:
  msg = e2e_user_message(reference_code)
  if style == "dice":
    return f"{IM_START}user\n{msg}{IM_END}\n{IM_START}assistant\n\n"
  _check_style(style)
  return render_user_turn(msg, tokenizer)


def infilling_prompt(
  reference_code: str,
  prefix: str,
  suffix: str,
  tokenizer: ChatTemplater | None = None,
  style: PromptStyle = "chat",
) -> str:
  msg = infilling_user_message(reference_code, prefix, suffix)
  if style == "dice":
    return f"{IM_START}user\n{msg}{IM_END}\n{IM_START}assistant\n"
  _check_style(style)
  return render_user_turn(msg, tokenizer)


def _check_style(style: str) -> None:
  if style not in ("chat", "dice"):
    raise ValueError(f"prompt style must be 'chat' or 'dice', got {style!r}")


# ------------------------------------------------------------------ responses
def code_response(cuda_code: str, reasoning: str | None = None) -> str:
  """A CuKe SFT response: optional reasoning, then the whole ModelNew file in one ```python block."""
  block = f"```python\n{cuda_code.strip()}\n```"
  return f"{reasoning.strip()}\n\n{block}" if reasoning and reasoning.strip() else block


@dataclasses.dataclass(frozen=True)
class SFTSample:
  """CuKe row (LLaMA-Factory columns ``prompt``/``response``): the user message and the assistant answer.

  ``prompt`` is the un-templated user message; the SFT pipeline renders it with the chat template."""

  prompt: str
  response: str
  level: int | None = None
  sample_id: str = ""

  def to_json(self) -> dict:
    return {
      "prompt": self.prompt,
      "response": self.response,
      "level": self.level,
      "id": self.sample_id,
    }


def sft_sample_from_pair(
  pytorch_code: str,
  cuda_code: str,
  reasoning: str | None = None,
  level: int | None = None,
  sample_id: str = "",
) -> SFTSample:
  """A CuKe sample: the KernelBench one-shot end-to-end message -> the verified fast kernel file."""
  return SFTSample(
    e2e_user_message(pytorch_code), code_response(cuda_code, reasoning), level, sample_id
  )
