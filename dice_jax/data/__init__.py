"""Data for DICE: tokenizer + chat template, task/pair loaders, prompts, CuKe builder, grain pipelines.

Modules: ``tokenizer`` (Qwen2 BPE, chat template, mask token), ``tasks`` (KernelBench / DICE RL / ConCuR-style
loaders with row-level validation), ``prompts`` (KernelBench one-shot end-to-end, DICE infilling, SFT samples),
``code_extraction`` (the candidate in a response: RL, evaluation and CuKe), ``infilling`` (``split_infilling``), ``sft_pipeline`` (packed SFT batches; the batch contract is
in its docstring), ``rl_stream`` (grouped RL task stream), ``curriculum`` (data scheduling), ``cuke`` (CuKe builder).
"""
