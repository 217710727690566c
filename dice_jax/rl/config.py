"""The BiC-RL run config: one frozen dataclass nesting the sampler, stream, optimizer and TraceRL
configs, validated on construction (errors name the field), saved with every checkpoint.

Defaults are DICE's (reference §1.7 table): 64 tasks x 16 rollouts per step, temperature 1.0,
block 4 / 4 steps, `low_confidence_dynamic` 0.9, 4,096 new tokens, binary reward, group z-score
advantages, TraceRL (eps 0.2, k3 KL beta 0.01, shrink 1), AdamW lr 1e-6 (constant, wd 0, clip 1),
256 rows per optimizer step, one epoch over the rollout, seed 10086. Phases: `infill` (the kernel
infilling tasks, 20 steps, prompts up to 2,000 tokens) then `e2e` (end-to-end tasks, 100 steps,
prompts up to 1,500 tokens), the second initialised from the first's checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dice_jax.data.code_extraction import EXTRACTIONS
from dice_jax.data.rl_stream import RLStreamConfig
from dice_jax.diffusion.sampler import SamplerConfig
from dice_jax.model.config import REMAT_POLICIES
from dice_jax.model.flash_decode import DecodeTiles
from dice_jax.rl import advantages as advantages_lib
from dice_jax.rl import rewards as rewards_lib
from dice_jax.rl.tracerl import TAIL_ROWS, TraceRLConfig
from dice_jax.train.optimizer import OptimizerConfig
from verifier.api.waiting import RetryPolicy
from dice_jax.train.run_config import FIELDS as RUN_FIELDS
from dice_jax.train.run_config import RunConfig, nest_flat_fields

PHASES = ("infill", "e2e")
BACKENDS = ("static", "continuous")
SCHEDULES = ("sequential", "sequential_by_stage")
STOP_TOKENS = ("chat", "eos", "im_end")

DICE_SAMPLER = SamplerConfig(
  block_size=0,  # the model's (SDAR's 4): resolved at start-up, the one check with it
  steps=4,
  strategy="low_confidence_dynamic",
  threshold=0.9,
  temperature=1.0,
  top_k=0,
  top_p=1.0,
  max_new_tokens=4096,
  return_logprobs=True,
  # a group's prompt tiles attended once with all its members' queries (`cascade`, one device), else
  # read from the group's first row (`share_prompts`, meshes): exact; at the RL shape share 1.06x its
  # base, cascade 1.02x share (H100, float8 cache; docs/performance.md, issue 39 sessions 27-29)
  decode_tiles=DecodeTiles(share_prompts=True, cascade=True),
)
DICE_OPTIMIZER = OptimizerConfig(
  learning_rate=1e-6, schedule="constant", warmup_ratio=0.0, weight_decay=0.0, clip_norm=1.0
)


@dataclasses.dataclass(frozen=True)
class VerifierConfig:
  """How candidates are judged. `options` are `VerifyOptions` fields sent with every request
  (DICE: one correctness trial, atol = rtol = 1e-2, no timing); endpoints and how long to wait for
  them at start (`--verifier_wait_s`) come from the launcher."""

  options: dict = dataclasses.field(default_factory=lambda: {"num_correct_trials": 1})
  retry: RetryPolicy = RetryPolicy()
  local_device: str = ""  # --verifier=local: "cpu" | "cuda" ("" = cuda when a GPU is visible)
  local_compile_workers: int = 0  # 0: the service's default

  def __post_init__(self):
    if not isinstance(self.options, dict):
      raise ValueError("RLConfig.verifier.options must be a dict of VerifyOptions fields")
    from verifier.api.proto import verifier_pb2  # generated stubs only

    try:
      verifier_pb2.VerifyOptions(**self.options)
    except (ValueError, TypeError) as e:
      raise ValueError(f"RLConfig.verifier.options: {e}") from None
    if self.local_device not in ("", "cpu", "cuda"):
      raise ValueError(
        f"RLConfig.verifier.local_device must be '', 'cpu' or 'cuda', got {self.local_device!r}"
      )


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """Everything a BiC-RL run needs besides its workdir and verifier endpoints.

  `recipe` names the defaults of the fields where DICE's recipe and ours differ
  (`dice_jax/recipe.py`, docs/dice_recipe.md); it is a label here: the launchers apply it.
  """

  recipe: str = "ours"

  # model, tokenizer, seed, mesh, checkpoints (RL steps; shared with SFTConfig); the model is
  # ignored with --init_hf / --init_checkpoint, which bring their own
  run: RunConfig = RunConfig(seed=10086, checkpoint_every=1)
  # phase and data
  phase: str = "e2e"
  infill_tasks: str = ""  # DICE kernel_infilling_*.json
  e2e_tasks: str = ""  # DICE end_to_end_kernel_generation_4000.json (or {id, pytorch_code} rows)
  task_default_level: int = 1  # for task files without levels
  schedule: str = "sequential"  # DICE's file order; sequential_by_stage sorts by curriculum stage
  stream: RLStreamConfig = RLStreamConfig(group_size=16, tasks_per_step=64, num_steps=100)
  max_prompt_len: int = 1500  # tokens; longer prompts are skipped (and counted)
  prompt_tail_chars: int = 0  # tiny CPU runs: keep the user message's last N characters
  # rollout and reward
  sampler: SamplerConfig = DICE_SAMPLER
  sampler_backend: str = "static"  # "static" (groups per generate call) | "continuous" (engine)
  groups_per_batch: int = 8  # static: groups per sampler call (x group_size rows)
  # static: a step's prompt width rounded up to this many tokens, so that steps share compiled
  # samplers (one program per width; 0: the block size, i.e. a new program for most steps)
  prompt_width_multiple: int = 128
  slots: int = 128  # continuous: rows decoding at once
  code_extraction: str = "dice"  # data/code_extraction.py EXTRACTIONS
  judge: str = "verifier"  # or "python:package.module:function" (tests, toy rewards)
  reward: str = "binary"
  reward_options: dict = dataclasses.field(default_factory=dict)
  advantage: str = "group_zscore"
  verifier: VerifierConfig = VerifierConfig()
  # policy update
  # old log-probs from the rollout (no second forward; tracerl.py docstring)
  tracerl: TraceRLConfig = TraceRLConfig(layout="packed", old_logp="sampler")
  optim: OptimizerConfig = DICE_OPTIMIZER
  rows_per_update: int = 256  # TraceRL rows (responses when packed) per optimizer step
  shuffle: bool = True  # shuffle the rows of an RL step before batching (DICE: file order)
  reset_optimizer: bool = False  # a fresh optimizer state at every RL step (DICE: new AdamW)
  # rows after the last whole update: "apply" (a last, partial update), "drop", or "even_batches"
  # (DICE: padded to a multiple of `even_batches_rows` with the first rows, then as "drop";
  # tracerl.tail_units)
  tail_rows: str = "apply"
  even_batches_rows: int = 8  # DICE's 8 processes x 1 row per device
  # "chat": the tokenizer's stop ids; "eos": its eos only; "im_end": <|im_end|> only (DICE: its
  # SFT checkpoint's eos, set by LLaMA-Factory's qwen3 template)
  stop_tokens: str = "chat"
  train_stop_token: bool = True  # False: the final stop token is not trained
  train_pad_tokens: bool = True  # False: tokens equal to the pad id are not trained (DICE)
  # micro-batches per optimizer step; 0: chosen by the update's memory estimate (rl/memory.py),
  # with `tracerl.layout='auto'` and `update_remat='auto'` (1 where the device limit is unknown)
  accum_steps: int = 0
  update_remat: str = "auto"  # the update's remat policy: auto | none | full | dots
  memory_limit_gb: float = 0.0  # device memory for the update's plan (0: the device's own)
  length_multiple: int = 128  # row lengths are bucketed in these units (few compiles)
  # bookkeeping
  snapshot_every: int = 0  # RL steps; checkpoints at multiples are never deleted (0: none)
  eval_every: int = 0  # RL steps; greedy evaluation inside the loop (0: none; rl/evaluation.py)
  eval_tasks: str = ""  # its tasks: the phase's kind (infill: infilling rows; e2e: {pytorch_code})
  samples_per_step: int = 4  # responses written to samples.jsonl per RL step

  def __post_init__(self):
    def need(cond, msg):
      if not cond:
        raise ValueError(f"RLConfig: {msg}")

    from dice_jax.recipe import RECIPES

    need(self.recipe in RECIPES, f"recipe must be one of {RECIPES}, got {self.recipe!r}")
    need(
      self.tail_rows in TAIL_ROWS, f"tail_rows must be one of {TAIL_ROWS}, got {self.tail_rows!r}"
    )
    need(
      self.stop_tokens in STOP_TOKENS,
      f"stop_tokens must be one of {STOP_TOKENS}, got {self.stop_tokens!r}",
    )
    for name in ("shuffle", "reset_optimizer", "train_stop_token", "train_pad_tokens"):
      need(isinstance(getattr(self, name), bool), f"{name} must be True or False")
    need(self.phase in PHASES, f"phase must be one of {PHASES}, got {self.phase!r}")
    need(self.schedule in SCHEDULES, f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
    need(
      self.sampler_backend in BACKENDS,
      f"sampler_backend must be one of {BACKENDS}, got {self.sampler_backend!r}",
    )
    need(
      self.code_extraction in EXTRACTIONS,
      f"code_extraction must be one of {EXTRACTIONS}, got {self.code_extraction!r}",
    )
    need(
      self.advantage in advantages_lib.ADVANTAGES,
      f"advantage must be one of {sorted(advantages_lib.ADVANTAGES)}, got {self.advantage!r}",
    )
    need(isinstance(self.reward_options, dict), "reward_options must be a dict")
    try:
      rewards_lib.make_reward(self.reward, **self.reward_options)
    except ValueError as e:
      raise ValueError(f"RLConfig.reward: {e}") from None
    need(
      self.judge == "verifier" or self.judge.startswith("python:"),
      f"judge must be 'verifier' or 'python:package.module:function', got {self.judge!r}",
    )
    for name, kind in (
      ("run", RunConfig),
      ("stream", RLStreamConfig),
      ("sampler", SamplerConfig),
      ("tracerl", TraceRLConfig),
      ("optim", OptimizerConfig),
      ("verifier", VerifierConfig),
    ):
      need(isinstance(getattr(self, name), kind), f"{name} must be a {kind.__name__}")
    for name in (
      "groups_per_batch",
      "slots",
      "rows_per_update",
      "length_multiple",
      "even_batches_rows",
    ):
      v = getattr(self, name)
      need(isinstance(v, int) and v >= 1, f"{name} must be a positive int, got {v!r}")
    for name in (
      "max_prompt_len",
      "prompt_width_multiple",
      "prompt_tail_chars",
      "samples_per_step",
      "snapshot_every",
      "eval_every",
    ):
      v = getattr(self, name)
      need(isinstance(v, int) and v >= 0, f"{name} must be an int >= 0, got {v!r}")
    need(
      isinstance(self.accum_steps, int) and self.accum_steps >= 0,
      f"accum_steps must be an int >= 0 (0: chosen by memory), got {self.accum_steps!r}",
    )
    need(
      self.update_remat in ("auto",) + REMAT_POLICIES,
      f"update_remat must be one of {('auto',) + REMAT_POLICIES}, got {self.update_remat!r}",
    )
    need(
      isinstance(self.memory_limit_gb, (int, float)) and self.memory_limit_gb >= 0,
      f"memory_limit_gb must be >= 0 (0: the device's), got {self.memory_limit_gb!r}",
    )
    need(
      self.tail_rows != "even_batches" or self.rows_per_update % self.even_batches_rows == 0,
      f"rows_per_update ({self.rows_per_update}) must be a multiple of even_batches_rows "
      f"({self.even_batches_rows}) with tail_rows='even_batches'",
    )
    need(
      self.accum_steps == 0 or self.rows_per_update % self.accum_steps == 0,
      f"rows_per_update ({self.rows_per_update}) must be a multiple of accum_steps "
      f"({self.accum_steps})",
    )
    s = self.sampler
    need(s.return_logprobs, "sampler.return_logprobs must be True (TraceRL checks log-probs)")
    need(
      s.block_alignment == "response" or self.sampler_backend == "static",
      f"sampler.block_alignment {s.block_alignment!r} needs sampler_backend 'static' (the "
      f"continuous backend is wired for the response grid only)",
    )
    need(self.stream.group_size >= 2, "stream.group_size must be >= 2 (advantages are per group)")
    need(
      (self.stream.process_index, self.stream.process_count) == (0, 1),
      "stream.process_index/process_count must stay 0/1: every JAX process draws the whole RL "
      "step (the sampler runs on all processes' devices at once)",
    )
    if self.reward in rewards_lib.NEEDS_TIMING:
      need(
        bool(self.verifier.options.get("measure_performance")),
        f"reward {self.reward!r} needs verifier.options.measure_performance=True",
      )

  @property
  def tasks_path(self) -> str:
    return self.infill_tasks if self.phase == "infill" else self.e2e_tasks

  @property
  def num_steps(self) -> int:
    return self.stream.num_steps

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d: dict) -> "RLConfig":
    d = nest_flat_fields(d)  # configs saved before the run section
    d["stream"] = RLStreamConfig(**d["stream"])
    sampler = dict(d["sampler"])
    sampler["stop_ids"] = tuple(sampler.get("stop_ids", ()))
    if isinstance(sampler.get("decode_tiles"), dict):
      sampler["decode_tiles"] = DecodeTiles(**sampler["decode_tiles"])
    d["sampler"] = SamplerConfig(**sampler)
    d["tracerl"] = TraceRLConfig(**d["tracerl"])
    d["optim"] = OptimizerConfig(**d["optim"])
    v = dict(d["verifier"])
    v.pop("ready_timeout_s", None)  # configs saved before --verifier_wait_s
    v["retry"] = RetryPolicy(**v["retry"])
    d["verifier"] = VerifierConfig(**v)
    return cls(**d)


def dice_phase_config(phase: str, model: str, **overrides: Any) -> RLConfig:
  """DICE's numbers for `phase` and model preset (reference §1.7 table; `max_active` is the
  rollout engine's concurrency and has no counterpart here: `groups_per_batch` plays its part).
  `overrides` naming a run-section field (`tokenizer`, `model_overrides`, ...) go into `run`."""
  if phase not in PHASES:
    raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
  steps = 20 if phase == "infill" else 100
  run = dict(model=model, seed=10086, checkpoint_every=1)
  run.update({k: overrides.pop(k) for k in list(overrides) if k in RUN_FIELDS})
  base = dict(
    run=RunConfig(**run),
    phase=phase,
    stream=RLStreamConfig(group_size=16, tasks_per_step=64, num_steps=steps, prompt_style="dice"),
    max_prompt_len=2000 if phase == "infill" else 1500,
  )
  base.update(overrides)
  return RLConfig(**base)
