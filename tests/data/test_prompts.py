"""Prompts equal golden files transcribed from the reference text; split_infilling; extract_code."""

import json
import pathlib

import pytest

from dice_jax.data import code_extraction, prompts
from dice_jax.data.infilling import InfillSplit, NoCudaSourceError, split_infilling

from ._helpers import shared_path
from .golden import write_golden as ref

GOLDEN = pathlib.Path(__file__).parent / "golden"


def _golden(name: str) -> str:
  return (GOLDEN / name).read_text()


def test_e2e_prompt_dice_style_equals_golden():
  assert prompts.e2e_prompt(ref.TOY_ARCH, style="dice") == _golden("e2e_toy_relu.txt")


def test_infilling_prompt_dice_style_equals_golden():
  got = prompts.infilling_prompt(ref.TOY_ARCH, ref.TOY_PREFIX, ref.TOY_SUFFIX, style="dice")
  assert got == _golden("infill_toy_relu.txt")


def test_chat_style_through_builtin_renderer():
  # Infilling: identical to DICE's raw string. End-to-end: DICE's raw string has one extra trailing "\n".
  assert prompts.infilling_prompt(ref.TOY_ARCH, ref.TOY_PREFIX, ref.TOY_SUFFIX) == _golden(
    "infill_toy_relu.txt"
  )
  assert prompts.e2e_prompt(ref.TOY_ARCH) + "\n" == _golden("e2e_toy_relu.txt")


def test_prompts_with_real_tokenizer_chat_template_on_real_tasks(sdar_tokenizer):
  kb = [
    json.loads(line) for line in shared_path("kernelbench", "level1.jsonl").read_text().splitlines()
  ]
  relu = next(r for r in kb if r["name"] == "19_ReLU")
  assert prompts.e2e_prompt(relu["code"], style="dice") == _golden("e2e_kernelbench_l1_19_relu.txt")
  assert prompts.e2e_prompt(relu["code"], sdar_tokenizer) + "\n" == _golden(
    "e2e_kernelbench_l1_19_relu.txt"
  )
  row = json.loads(shared_path("dice_rl", "kernel_infilling_evaluation.json").read_text())[0]
  got = prompts.infilling_prompt(row["pytorch_code"], row["prefix"], row["suffix"], sdar_tokenizer)
  assert got == _golden("infill_dice_eval_0.txt")


def test_e2e_message_content():
  msg = prompts.e2e_user_message("class Model: pass")
  ex_arch, ex_new = prompts.example_pair()
  assert "return a + b" in ex_arch and "elementwise_add_kernel<<<" in ex_new
  assert ex_new in msg and ex_arch in msg
  assert (
    msg.index(ex_new)
    < msg.index("class Model: pass")
    < msg.index("Name your optimized output architecture")
  )
  assert msg.endswith("and NO testing code! ")
  with pytest.raises(ValueError, match="style"):
    prompts.e2e_prompt("x", style="raw")


def test_split_infilling_reproduces_all_99_given_splits():
  rows = json.loads(shared_path("dice_rl", "kernel_infilling_evaluation.json").read_text())
  assert len(rows) == 99
  for r in rows:
    got = split_infilling(r["cuda_code"])
    assert got == InfillSplit(r["prefix"], r["middle"], r["suffix"]), r["id"]


def test_split_infilling_on_the_one_shot_example_matches_dice_example_parts():
  s = split_infilling(prompts.example_pair()[1])
  assert s.prefix.endswith("# Define the custom CUDA kernel for element-wise addition\n")
  assert s.middle.startswith('elementwise_add_source = """\n#include <torch/extension.h>')
  assert s.middle.endswith('}\n"""')
  assert s.suffix.startswith("\n\nelementwise_add_cpp_source = (")
  assert s.join() == prompts.example_pair()[1]


def test_split_infilling_picks_cuda_not_cpp_and_handles_escapes():
  code = (
    'import torch\n\ncpp_src = """torch::Tensor f(torch::Tensor x);"""\n'
    'doc = """not cuda"""\n'
    "my_kernels = r'''\n#include <cuda.h>\n__global__ void k() { printf(\"\\''' \"); }\n'''\n"
    "mod = load_inline(cpp_sources=cpp_src, cuda_sources=my_kernels)\n"
  )
  s = split_infilling(code)
  assert s.middle.startswith("my_kernels = r'''") and s.middle.endswith("'''")
  assert s.prefix.endswith('doc = """not cuda"""\n')
  assert s.suffix == "\nmod = load_inline(cpp_sources=cpp_src, cuda_sources=my_kernels)\n"
  with pytest.raises(NoCudaSourceError):
    split_infilling("import torch\nx = 1\n")


def test_extract_code_takes_first_fenced_block():
  assert code_extraction.first_block("blah\n```python\nA = 1\n```\ntext\n```cpp\nB\n```") == "A = 1"
  assert code_extraction.first_block("```\nimport torch\n```") == "import torch"
  assert (
    code_extraction.first_block("```cuda\n__global__ void k(){}\n```") == "__global__ void k(){}"
  )
  assert code_extraction.first_block("no code here") is None
  assert code_extraction.first_block("```python\nunterminated") is None


def test_sft_sample_from_pair():
  s = prompts.sft_sample_from_pair(
    "class Model: pass", "class ModelNew: pass", reasoning="Fuse it.", level=2
  )
  assert s.prompt == prompts.e2e_user_message("class Model: pass")
  assert s.response == "Fuse it.\n\n```python\nclass ModelNew: pass\n```"
  assert code_extraction.first_block(s.response) == "class ModelNew: pass"
  assert s.to_json()["level"] == 2


def test_infilling_prompt_is_byte_identical_to_dice_on_all_99_evaluation_tasks():
  # `ref.KERNEL_INFILLING` is DICE's KERNEL_INFILLING_SYSTEM_PROMPT literal, copied verbatim from
  # training/RL/sample/sdar_rl_rollout_kernel.py @1abe887 and rendered as DICE renders it.
  from jinja2 import Template

  rows = json.loads(shared_path("dice_rl", "kernel_infilling_evaluation.json").read_text())
  assert len(rows) == 99
  dice = Template(ref.KERNEL_INFILLING)
  for r in rows:
    want = dice.render(pytorch_code=r["pytorch_code"], prefix=r["prefix"], suffix=r["suffix"])
    got = prompts.infilling_prompt(r["pytorch_code"], r["prefix"], r["suffix"], style="dice")
    assert got == want, r.get("task_id", r.get("problem_id"))
  # the five closing fences that ours once followed with an extra blank line
  assert "``` \n\n\nThe example new arch" not in got and "``` \n\nThe example new arch" in got
