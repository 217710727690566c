"""The candidate source in a model's response: the one code extractor of RL, evaluation and CuKe.

Rules (`EXTRACTIONS`):
  * `first_block`: the first fenced block without its language tag (KernelBench's and DICE's
    evaluation `extract_first_code`); None when there is no closed fence;
  * `dice`: DICE's RL reward (`extract_first_code(output, ["python", "cpp"])` of its rollout
    script): the first fenced span, stripped, then a leading "python" and then a leading "cpp"
    removed (no newline needed; other tags such as "cuda" stay and fail to run);
  * `first_block_or_raw`: `first_block`, else the whole response when it is not blank (a model
    that never writes fences still reaches the verifier, e.g. a smoke test);
  * `whole_response`: the response as it is (toy judges).
"""

from __future__ import annotations

import re

EXTRACTIONS = ("dice", "first_block", "first_block_or_raw", "whole_response")
_FENCE = re.compile(r"```(.*?)```", re.DOTALL)
_LANG_TAGS = frozenset({"python", "py", "cpp", "c++", "cuda", "cu", "c"})


def first_block(response: str) -> str | None:
  """The first fenced code block of a response, without its language tag; None when none."""
  m = _FENCE.search(response.strip())
  if m is None:
    return None
  code = m.group(1)
  first, nl, rest = code.partition("\n")
  if nl and first.strip().lower() in _LANG_TAGS:
    code = rest
  elif not nl and first.strip().lower() in _LANG_TAGS:
    code = ""
  return code.strip()


def first_block_dice(response: str) -> str | None:
  """DICE's RL rule (see the module doc); None when there is no closed fence (DICE sends a
  placeholder sentence that fails)."""
  m = _FENCE.search(response.strip())
  if m is None:
    return None
  code = m.group(1).strip()
  for tag in ("python", "cpp"):
    if code.startswith(tag):
      code = code[len(tag) :].strip()
  return code


def check_rule(rule: str, where: str = "code extraction") -> None:
  if rule not in EXTRACTIONS:
    raise ValueError(f"{where} must be one of {EXTRACTIONS}, got {rule!r}")


def extract(response: str, rule: str = "first_block") -> str | None:
  """The candidate source of `response` under `rule` (one of `EXTRACTIONS`); None: no candidate."""
  check_rule(rule)
  if rule == "dice":
    return first_block_dice(response)
  if rule == "whole_response":
    return response
  code = first_block(response)
  if code is None and rule == "first_block_or_raw" and response.strip():
    return response
  return code
