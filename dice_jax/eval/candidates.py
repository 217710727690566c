"""Where the evaluated kernels come from: a model decoding KernelBench prompts, or a file of candidates.

Model side (``ModelCandidates``): the KernelBench one-shot prompt rendered with the tokenizer's chat
template, as DICE's ``evaluation/src/utils.py`` does for SDAR/DICE models
(``apply_chat_template(messages, add_generation_prompt=True)``), decoded by the block sampler with
``EvalDecoding`` (DICE's evaluation decoding by default: greedy, ``low_confidence_static``, block 4,
4 steps, up to 4,096 new tokens, blocks aligned to position 0 as SDAR's ``block_diffusion_generate``).
As DICE tokenizes that text (``truncation=True, max_length=4096``, the tokenizer's default right side), a
prompt over ``EvalDecoding.max_prompt_tokens`` keeps its first tokens only: its end, the assistant
header among them, is cut (some level-3 problems; ``Generation.prompt_cut`` counts what was cut).
The response is decoded without special tokens and the mask token, and the first fenced code block is
the candidate (KernelBench's ``extract_first_code``); no block means nothing is verified.

File side (``FileCandidates``): JSONL rows ``{"task_id" | "level" + "problem_id", "sample"?,
"candidate" | "response"}`` -- known kernels, or generations made elsewhere.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Sequence
from typing import Protocol

from dice_jax.data import code_extraction
from dice_jax.data import prompts
from dice_jax.data.tasks import KernelTask
from dice_jax.data.tokenizer import check_compatible


@dataclasses.dataclass(frozen=True)
class Generation:
  response: str
  candidate: str | None  # None: no fenced code block in the response
  prompt_tokens: int = 0  # as decoded, after any cut
  response_tokens: int = 0
  seconds: float = 0.0  # this sample's share of its batch's wall time
  prompt_cut: int = 0  # tokens cut from the prompt's end (EvalDecoding.max_prompt_tokens)


class CandidateSource(Protocol):
  batch_size: int

  def generate(self, work: Sequence[tuple[KernelTask, int]]) -> list[Generation | None]:
    """One generation per (task, sample index), in order; None: no candidate (left missing)."""
    ...


@dataclasses.dataclass(frozen=True)
class EvalDecoding:
  """Decoding settings of an evaluation (defaults: DICE's `evaluation/` and SDAR's `generate.py`).

  ``confidence``: which distribution ranks positions for unmasking: ``unfiltered`` (the model's
  softmax) or ``filtered`` (after temperature / top-k / top-p). With greedy decoding and no top-k /
  top-p the two are the same distribution."""

  block_size: int = 0  # 0: the model's
  steps: int = 4
  strategy: str = "low_confidence_static"
  threshold: float = 0.9
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  max_new_tokens: int = 4096
  # DICE's evaluation: `truncation=True, max_length=4096` (right side); 0: no limit
  max_prompt_tokens: int = 4096
  block_alignment: str = "absolute"
  confidence: str = "unfiltered"
  extract: str = "first_block"  # data/code_extraction.py EXTRACTIONS

  def __post_init__(self):
    if self.confidence not in ("unfiltered", "filtered"):
      raise ValueError(f"confidence must be 'unfiltered' or 'filtered', got {self.confidence!r}")
    if self.max_prompt_tokens < 0:
      raise ValueError(
        f"max_prompt_tokens must be >= 0 (0: no limit), got {self.max_prompt_tokens}"
      )
    code_extraction.check_rule(self.extract, "extract")

  def sampler_config(self, stop_ids: Sequence[int], pad_id: int):
    from dice_jax.diffusion import sampler

    return sampler.SamplerConfig(
      block_size=self.block_size,
      steps=self.steps,
      strategy=self.strategy,
      threshold=self.threshold,
      temperature=self.temperature,
      top_k=self.top_k,
      top_p=self.top_p,
      max_new_tokens=self.max_new_tokens,
      stop_ids=tuple(stop_ids),
      block_alignment=self.block_alignment,
      confidence=self.confidence,
      pad_id=pad_id,
    )


class ModelCandidates:
  """Decodes KernelBench prompts with a model; batches are padded to ``batch_size`` rows and prompts to
  a multiple of ``prompt_bucket`` tokens, so the sampler compiles once per prompt bucket."""

  def __init__(
    self,
    model,
    tokenizer,
    decoding: EvalDecoding,
    batch_size: int = 8,
    seed: int = 0,
    prompt_bucket: int = 256,
  ):
    check_compatible(tokenizer, model.cfg, where="eval")
    self.model, self.tokenizer, self.decoding = model, tokenizer, decoding
    self.batch_size, self.seed, self.prompt_bucket = batch_size, seed, prompt_bucket
    pad = model.cfg.pad_token_id
    self.cfg = decoding.sampler_config(tokenizer.stop_token_ids, 0 if pad is None else pad)
    self.cfg = self.cfg.for_model(model.cfg)  # the model's block size unless decoding sets one
    self._batches = 0

  def full_prompt_ids(self, task: KernelTask) -> list[int]:
    return self.tokenizer.encode(prompts.e2e_prompt(task.reference_code, self.tokenizer, "chat"))

  def prompt_ids(self, task: KernelTask) -> list[int]:
    """The decoded prompt: the first ``max_prompt_tokens`` of the full one (module docstring)."""
    return self._cut(self.full_prompt_ids(task))

  def _cut(self, ids: list[int]) -> list[int]:
    limit = self.decoding.max_prompt_tokens
    return ids[:limit] if limit else ids

  def generate(self, work: Sequence[tuple[KernelTask, int]]) -> list[Generation]:
    import jax
    import numpy as np

    from dice_jax.diffusion import sampler

    full = [self.full_prompt_ids(t) for t, _ in work]
    ids = [self._cut(f) for f in full]
    rows = ids + [ids[-1]] * (self.batch_size - len(ids))  # padded: one compile per bucket
    width = -(-max(map(len, rows)) // self.prompt_bucket) * self.prompt_bucket
    # a (problem, sample)-independent key per batch; greedy decoding ignores it
    rng = jax.random.fold_in(jax.random.key(self.seed), self._batches)
    self._batches += 1
    t0 = time.perf_counter()
    out = sampler.generate(self.model, rows, self.cfg, rng, prompt_width=width)
    responses = out.responses()
    n_tokens = np.asarray(out.response_lengths).tolist()
    share = (time.perf_counter() - t0) / len(work)
    gens = []
    for i in range(len(work)):
      text = self.tokenizer.decode(responses[i], skip_special_tokens=True)
      text = text.replace(self.tokenizer.mask_token, "")
      gens.append(
        Generation(
          text,
          code_extraction.extract(text, self.decoding.extract),
          len(ids[i]),
          int(n_tokens[i]),
          share,
          len(full[i]) - len(ids[i]),
        )
      )
    return gens


class FileCandidates:
  """Known candidates from a JSONL file (module docstring); a (task, sample) the file lacks stays
  without a result, i.e. counts as a failure (KernelBench's ``patch``)."""

  batch_size = 64

  def __init__(self, path: str, tasks: Sequence[KernelTask]):
    if not os.path.isfile(path):
      raise FileNotFoundError(f"{path}: no such candidates file")
    ids = {(t.level, int(t.task_id.rsplit("/", 1)[1])): t.task_id for t in tasks}
    self.candidates: dict[tuple[str, int], str | None] = {}
    with open(path, encoding="utf-8") as f:
      for n, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          row = json.loads(line)
          task_id = (
            row["task_id"]
            if "task_id" in row
            else ids.get((int(row["level"]), int(row["problem_id"])))
          )
          code = (
            row["candidate"] if "candidate" in row else code_extraction.first_block(row["response"])
          )
          key = (task_id, int(row.get("sample", 0)))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
          raise ValueError(
            f"{path}:{n}: expected {{task_id | level + problem_id, candidate | response, "
            f"sample?}} ({type(e).__name__}: {e})"
          ) from e
        if task_id is not None:  # None: a problem outside this run's selection
          self.candidates[key] = code

  def generate(self, work: Sequence[tuple[KernelTask, int]]) -> list[Generation | None]:
    out: list[Generation | None] = []
    for t, s in work:
      key = (t.task_id, s)
      out.append(None if key not in self.candidates else Generation("", self.candidates[key]))
    return out
