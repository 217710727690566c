"""Writes the golden prompt files from the reference text (run once; outputs are committed).

The strings below are transcribed from the reference prompts, NOT produced by dice_jax:
  * KernelBench v0 one-shot prompt (`src/prompt_constructor.py::prompt_generate_custom_cuda`, ScalingIntelligence/KernelBench
    branch v0), as DICE wraps it in raw Qwen markup
    (DICE-code training/RL/sample/sdar_rl_rollout_kernel.py: PROBLEM_STATEMENT / PROBLEM_INSTRUCTION);
  * DICE's KERNEL_INFILLING_SYSTEM_PROMPT from the same file, Jinja-rendered.
The example pair is KernelBench's model_ex_add.py / model_new_ex_add.py (../shared/data/kernelbench).

Usage: python tests/data/golden/write_golden.py   (from the repo root)
"""

import json
import pathlib

from jinja2 import Template

HERE = pathlib.Path(__file__).parent
KB = HERE.parents[3] / "shared" / "data" / "kernelbench"
DICE = HERE.parents[3] / "shared" / "data" / "dice_rl"

PROBLEM_STATEMENT = """<|im_start|>user\nYou write custom CUDA kernels to replace the pytorch operators in the given architecture to get speedups. \n
    You have complete freedom to choose the set of operators you want to replace. You may make the decision to replace some operators with custom CUDA kernels and leave others unchanged. You may replace multiple operators with custom implementations, consider operator fusion opportunities (combining multiple operators into a single kernel, for example, combining matmul+relu), or algorithmic changes (such as online softmax). You are only limited by your imagination.\n
"""
PROBLEM_INSTRUCTION = """
Optimize the architecture named Model with custom CUDA operators! Name your optimized output architecture ModelNew. Output the new code in codeblocks. Please generate real code, NOT pseudocode, make sure the code compiles and is fully functional. Just output the new model code, no other text, and NO testing code! <|im_end|>\n<|im_start|>assistant\n
"""


def reference_e2e(arc_src, example_arch_src, example_new_arch_src):
  prompt = PROBLEM_STATEMENT
  prompt += f"""
        Here's an example to show you the syntax of inline embedding custom CUDA operators in torch: The example given architecture is: \n
        ``` \n
        {example_arch_src}
        ``` \n
        The example new arch with custom CUDA kernels looks like this: 
        ```
        {example_new_arch_src}
        ``` \n
        """
  prompt += f"""
    You are given the following architecture: \n
    ```
    {arc_src}
    ```
    """
  return prompt + PROBLEM_INSTRUCTION


KERNEL_INFILLING = """<|im_start|>user\nYou write custom CUDA kernels to replace the pytorch operators in the given architecture to get speedups. \n
You will be provided with a reference pytorch implementation, which serves as the ground truth for logical behavior, along with a partial CUDA kernel skeleton (prefix and suffix). \n
Your objective is to generate the core missing C++ code of custom CUDA kernels within the skeleton to ensure the custom CUDA kernel is functionally equivalent to the pytorch reference. You must adhere strictly to the provided kernel configuration.\n
Here's an example to show you the syntax for generating C++ code based on a given prefix and suffix: The example given architecture is: \n
```
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()

    def forward(self, a, b):
        return a + b


def get_inputs():
    # randomly generate input tensors based on the model architecture
    a = torch.randn(1, 128).cuda()
    b = torch.randn(1, 128).cuda()
    return [a, b]


def get_init_inputs():
    # randomly generate tensors required for initialization based on the model architecture
    return []
``` \n

The example give prefix is: \n
``` \n
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

# Define the custom CUDA kernel for element-wise addition
``` \n

The example give suffix is: \n
``` \n
elementwise_add_cpp_source = (
    "torch::Tensor elementwise_add_cuda(torch::Tensor a, torch::Tensor b);"
)

# Compile the inline CUDA code for element-wise addition
elementwise_add = load_inline(
    name="elementwise_add",
    cpp_sources=elementwise_add_cpp_source,
    cuda_sources=elementwise_add_source,
    functions=["elementwise_add_cuda"],
    verbose=True,
    extra_cflags=[""],
    extra_ldflags=[""],
)


class ModelNew(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.elementwise_add = elementwise_add

    def forward(self, a, b):
        return self.elementwise_add.elementwise_add_cuda(a, b)
``` \n
The example new arch with custom CUDA kernels looks like this (combine your generated C++ code with given prefix and suffix): \n
```
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

# Define the custom CUDA kernel for element-wise addition
elementwise_add_source = \"""
#include <torch/extension.h>
#include <cuda_runtime.h>

__global__ void elementwise_add_kernel(const float* a, const float* b, float* out, int size) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < size) {
        out[idx] = a[idx] + b[idx];
    }
}

torch::Tensor elementwise_add_cuda(torch::Tensor a, torch::Tensor b) {
    auto size = a.numel();
    auto out = torch::zeros_like(a);

    const int block_size = 256;
    const int num_blocks = (size + block_size - 1) / block_size;

    elementwise_add_kernel<<<num_blocks, block_size>>>(a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), size);

    return out;
}
\"""

elementwise_add_cpp_source = (
    "torch::Tensor elementwise_add_cuda(torch::Tensor a, torch::Tensor b);"
)

# Compile the inline CUDA code for element-wise addition
elementwise_add = load_inline(
    name="elementwise_add",
    cpp_sources=elementwise_add_cpp_source,
    cuda_sources=elementwise_add_source,
    functions=["elementwise_add_cuda"],
    verbose=True,
    extra_cflags=[""],
    extra_ldflags=[""],
)


class ModelNew(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.elementwise_add = elementwise_add

    def forward(self, a, b):
        return self.elementwise_add.elementwise_add_cuda(a, b)
``` \n

You are given the following architecture: \n
```
{{pytorch_code}}
``` \n
The corresponding CUDA kernel prefix: \n
```
{{prefix}}
``` \n
The corresponding CUDA kernel suffix: \n
```
{{suffix}}
``` \n
Generate the core C++ code of this custom CUDA kernel to make your optimized output architecture complete. Output the whole new architecture in codeblocks. Please generate real code, NOT pseudocode, make sure the code compiles and is fully functional. Just output the new model code, no other text, and NO testing code! <|im_end|>\n<|im_start|>assistant\n
"""

# A small self-contained target (so the golden test needs no shared data).
TOY_ARCH = """import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self):
        super(Model, self).__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)

batch_size = 16
dim = 16384

def get_inputs():
    x = torch.randn(batch_size, dim)
    return [x]

def get_init_inputs():
    return []"""
TOY_PREFIX = (
  "import torch\nimport torch.nn as nn\nfrom torch.utils.cpp_extension import load_inline\n\n"
)
TOY_SUFFIX = (
  '\n\ncpp_src = """\ntorch::Tensor relu_cuda(torch::Tensor x);\n"""\n\nrelu = load_inline(name="relu", '
  'cpp_sources=cpp_src, cuda_sources=source, functions=["relu_cuda"])\n\n\nclass ModelNew(nn.Module):\n'
  "    def forward(self, x):\n        return relu.relu_cuda(x)\n"
)


def main():
  ex_arch = (KB / "one_shot_model_ex_add.py.txt").read_text()
  ex_new = (KB / "one_shot_model_new_ex_add.py.txt").read_text()
  (HERE / "e2e_toy_relu.txt").write_text(reference_e2e(TOY_ARCH, ex_arch, ex_new))
  kb1 = json.loads((KB / "level1.jsonl").read_text().splitlines()[18])
  assert kb1["name"] == "19_ReLU", kb1["name"]
  (HERE / "e2e_kernelbench_l1_19_relu.txt").write_text(reference_e2e(kb1["code"], ex_arch, ex_new))
  t = Template(KERNEL_INFILLING)
  (HERE / "infill_toy_relu.txt").write_text(
    t.render(pytorch_code=TOY_ARCH, prefix=TOY_PREFIX, suffix=TOY_SUFFIX)
  )
  row = json.loads((DICE / "kernel_infilling_evaluation.json").read_text())[0]
  (HERE / "infill_dice_eval_0.txt").write_text(
    t.render(pytorch_code=row["pytorch_code"], prefix=row["prefix"], suffix=row["suffix"])
  )


if __name__ == "__main__":
  main()
