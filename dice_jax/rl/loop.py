"""The BiC-RL loop (reference §1.7 "Loop per RL step"): sample -> verify -> learn, with exact resume.

Per RL step s:
  1. the step's tasks from the RL stream (DICE's sequential file order by default), G per group;
  2. rollout: the block sampler on every group, each group judged as soon as it is sampled;
  3. rewards -> group advantages (equal-reward groups dropped);
  4. TraceRL mini-batches of `rows_per_update` rows; the old log-probs (the rollout's, or with
     `tracerl.old_logp='trainer'` a forward of every mini-batch with the rollout parameters,
     before any update); one optimizer step per mini-batch (one epoch);
  5. metrics, samples, and an orbax checkpoint at the step boundary.

Several JAX processes (one mesh over all their devices) run the same steps: each draws the whole
RL stream and makes the same sampler calls, in which its devices decode their share of the rows
(rows over the mesh's data axes: `rollout.py`); the sampled rows are gathered to every process;
each judges every n-th distinct request and receives the others' verdicts, so rewards, advantages
and TraceRL batches are equal everywhere; each then feeds its devices' rows of every mini-batch. Process 0 writes metrics, samples, the plot
(`reporting.py`), the tokenizer and the model config; all write the orbax checkpoints together.
The stream state is the same on every process, so a checkpoint resumes on any process count.

Resume is exact: the checkpoint holds params, optimizer state, the optimizer-step counter, the
RL-stream iterator state taken after the step's tasks were drawn and the RL step; sampling keys
are (seed, RL step, group) and mini-batch shuffles are seeded by (seed, RL step), so a restarted
run draws the same tasks, samples the same tokens (same judge verdicts) and gets the same losses.
SIGINT or SIGTERM (to any process) finishes the current step, saves and stops; a second signal
stops at once (`train/stop.py`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, NamedTuple

import jax
import numpy as np
from absl import logging
from flax import nnx

from dice_jax import compile_clock, distributed
from dice_jax.data import rl_stream
from dice_jax.data import tasks as tasks_lib
from dice_jax.data.curriculum import SequentialSchedule
from dice_jax.data.tokenizer import check_compatible
from dice_jax.diffusion import memory as device_memory
from dice_jax.errors import UserError
from dice_jax.model.config import ModelConfig
from dice_jax.model.transformer import Transformer
from dice_jax.rl import advantages as advantages_lib
from dice_jax.rl import evaluation as eval_lib
from dice_jax.rl import reporting
from dice_jax.rl import memory as update_memory
from dice_jax.rl import rewards as rewards_lib
from dice_jax.rl import rollout as rollout_lib
from dice_jax.rl import tracerl
from dice_jax.rl.config import RLConfig
from dice_jax.rl.trajectory import Trajectory
from dice_jax.train import checkpoint as ckpt_lib
from dice_jax.train import metrics as metrics_lib
from dice_jax.train import optimizer as optim_lib
from dice_jax.train import resume, run_setup
from dice_jax.train import stop as stop_lib
from dice_jax.train import train_step as ts


# ------------------------------------------------------------------ model, tokenizer, tasks
def build_model(cfg: RLConfig, mesh):
  """(model, model config, inherited tokenizer dir or None): `run.init_checkpoint`'s parameters
  and tokenizer, or the run section's model (fresh or `run.init_hf`'s, with its tokenizer)."""
  if cfg.run.init_checkpoint:
    return run_setup.restore_run_params(cfg.run.init_checkpoint, mesh)
  mcfg = run_setup.model_config(cfg.run)
  model = run_setup.build_model(cfg.run, mcfg, mesh)
  init_hf = cfg.run.init_hf
  has_tok = bool(init_hf) and os.path.exists(os.path.join(init_hf, "tokenizer_config.json"))
  return model, mcfg, init_hf if has_tok else None


def load_tasks(cfg: RLConfig) -> list[tasks_lib.KernelTask]:
  path = cfg.tasks_path
  if not path:
    key = "infill_tasks" if cfg.phase == "infill" else "e2e_tasks"
    raise ValueError(f"phase {cfg.phase!r} needs a task file: pass --set={key}=FILE")
  if cfg.phase == "infill":
    tasks, _ = tasks_lib.load_infilling_tasks(path, default_level=cfg.task_default_level)
  else:
    tasks, _ = tasks_lib.load_e2e_tasks(path, default_level=cfg.task_default_level)
  if not tasks:
    raise ValueError(f"{path}: no tasks")
  return tasks


# ------------------------------------------------------------------ the loop
def make_judge(cfg: RLConfig, endpoints: list[str] | None, verifier_wait_s: float | None = None):
  """The run's judge: a python function, or a client of the verifier at `endpoints` once every
  endpoint answers (waits up to `verifier_wait_s`, default `waiting.VERIFIER_WAIT_S`, logging a
  progress line every 10 s; `VerifierUnavailable` after that)."""
  if cfg.judge != "verifier":
    return rollout_lib.load_function_judge(cfg.judge)
  from dice_jax.verifier_client import ThreadedVerifier
  from verifier.api.waiting import VERIFIER_WAIT_S

  if not endpoints:
    raise ValueError("judge 'verifier' needs verifier endpoints (--verifier=HOST:PORT or local)")
  client = ThreadedVerifier(endpoints, options=cfg.verifier.options, retry=cfg.verifier.retry)
  try:
    client.wait_ready(verifier_wait_s or VERIFIER_WAIT_S)
  except BaseException:
    client.close()
    raise
  return client


class Update(NamedTuple):
  """The jitted TraceRL update of a run (`make_update`)."""

  step_fn: Any  # (state, sharded mini-batch, rng) -> (state, metrics): one optimizer step
  old_logp_fn: Any  # (params, sharded mini-batch) -> old_logp; None: the rollout's are used
  init_opt: Any  # params -> a fresh optimizer state (reset_optimizer)
  row_len: int  # the longest TraceRL row the run can make (rl/memory.row_length)


@dataclasses.dataclass
class Trainer:
  """Everything one run holds between RL steps (built by `_prepare`; `learn` reads the first
  group of fields only)."""

  cfg: RLConfig  # with the update's plan resolved (`plan_update`)
  mesh: Any
  mcfg: ModelConfig
  state: dict
  step_fn: Any
  old_logp_fn: Any
  init_opt: Any
  row_len: int
  backend: rollout_lib.SamplerBackend  # its stop ids end responses (train_stop_token)
  tokenizer: Any = None
  graphdef: Any = None
  reward_fn: Any = None
  stream: Any = None  # the RL-stream iterator
  start: int = 0  # RL steps already done
  eval_backend: Any = None  # in-loop evaluation (eval_every > 0)
  eval_groups: list = dataclasses.field(default_factory=list)


def _prepare(cfg: RLConfig, workdir: str, ckpt) -> Trainer:
  """Model (fresh, imported, or restored with the stream position), optimizer, jitted steps (the
  resume's config already checked: `check_start`)."""
  mesh = run_setup.make_mesh(cfg.run)
  resuming = ckpt.latest_step() is not None
  if resuming:
    mcfg = ckpt_lib.read_model_config(workdir)
    inherited = _existing_dir(os.path.join(workdir, "tokenizer"))
  else:
    model, mcfg, inherited = build_model(cfg, mesh)
  tok = run_setup.load_tokenizer(inherited or cfg.run.tokenizer)
  check_compatible(tok, mcfg, where="rl")
  cfg, plan = plan_update(cfg, mcfg, mesh)  # refuses a setting that does not fit, before sampling
  if distributed.is_primary():  # written once the run is known to fit
    run_setup.save_tokenizer(cfg.run, workdir, inherited)
    if not resuming:
      ckpt_lib.save_model_config(mcfg, workdir)
  logging.info(
    "model %.2fM params (block %d, %s), mesh %s",
    mcfg.num_params() / 1e6,
    mcfg.block_size,
    mcfg.dtype,
    dict(mesh.shape),
  )
  total_updates = cfg.num_steps * -(-cfg.stream.elements_per_step // cfg.rows_per_update)
  tx = optim_lib.make_optimizer(cfg.optim, total_updates)
  if resuming:
    graphdef, target, shardings = ckpt_lib.abstract_train_state(mcfg, tx, mesh)
  else:
    graphdef, state, shardings = ts.init_train_state(
      model, tx, mesh, tolerance=cfg.run.shard_tolerance
    )
    del model
  tasks = load_tasks(cfg)
  eval_groups = []
  if cfg.eval_every:
    check_eval(cfg)
    eval_groups = eval_lib.eval_groups(eval_lib.load_eval_tasks(cfg), tok, cfg)
  sched = SequentialSchedule(sort_by_stage=cfg.schedule == "sequential_by_stage")
  stream = iter(rl_stream.make_rl_stream(tasks, tok, cfg.stream, sched))
  start = 0
  if resuming:  # the newest intact step; damaged newer ones are moved aside
    _, state, data, _ = ckpt.restore_intact(target, set_aside=True)
    stream.set_state(data["iterator"])
    start = int(data["rl_step"])
  logging.info(
    "BiC-RL phase %s: %d tasks from %s, %d x %d samples per RL step",
    cfg.phase,
    len(tasks),
    cfg.tasks_path,
    cfg.stream.local_tasks_per_step,
    cfg.stream.group_size,
  )
  update = make_update(cfg, mcfg, mesh, graphdef, shardings, tx, total_updates, plan)
  scfg = dataclasses.replace(
    cfg.sampler,
    stop_ids=cfg.sampler.stop_ids or stop_ids(cfg, tok),
    pad_id=mcfg.pad_token_id if mcfg.pad_token_id is not None else tok.pad_token_id,
  ).for_model(mcfg)  # the model's block size unless sampler.block_size says otherwise
  return Trainer(
    cfg=cfg,
    mesh=mesh,
    mcfg=mcfg,
    tokenizer=tok,
    graphdef=graphdef,
    state=state,
    **update._asdict(),
    backend=make_backend(cfg, scfg),
    reward_fn=rewards_lib.make_reward(cfg.reward, **cfg.reward_options),
    stream=stream,
    start=start,
    eval_backend=make_backend(cfg, eval_lib.eval_sampler(scfg)) if eval_groups else None,
    eval_groups=eval_groups,
  )


def make_update(
  cfg: RLConfig, mcfg: ModelConfig, mesh, graphdef, shardings, tx, total_updates, plan
):
  """The jitted update (`Update`) of `cfg` (resolved by `plan_update`, with its `plan`): the train
  step on the TraceRL loss under the plan's remat policy, empty micro-batches skipped; the old
  log-prob forward when `tracerl.old_logp='trainer'`; the optimizer's initialiser."""

  def loss_fn(model, batch, rng):
    return tracerl.tracerl_loss(model, batch, rng, cfg.tracerl)

  train_graphdef, _ = nnx.split(  # the same parameters; the update's remat policy
    nnx.eval_shape(lambda: Transformer(mcfg.replace(remat=plan.remat), rngs=nnx.Rngs(0))),
    nnx.Param,
  )
  step_fn = ts.jit_train_step(
    ts.make_train_step(
      train_graphdef,
      tx,
      loss_fn,
      accum_steps=cfg.accum_steps,
      schedule=optim_lib.make_schedule(cfg.optim, total_updates),
      means=tracerl.METRIC_MEANS,
      is_empty=tracerl.is_empty,
    ),
    shardings,
    mesh,
    cfg.accum_steps,
  )
  old_logp_fn = None
  if cfg.tracerl.old_logp == "trainer":
    old_logp_fn = tracerl.jit_token_logprobs(
      graphdef, shardings["params"], mesh, cfg.accum_steps, chunk=cfg.tracerl.logit_chunk
    )
  init_opt = jax.jit(tx.init, out_shardings=shardings["opt_state"])
  return Update(step_fn, old_logp_fn, init_opt, plan.row_len)


def plan_update(cfg: RLConfig, mcfg: ModelConfig, mesh):
  """(cfg with the update's layout / accum_steps / remat concrete, its `memory.UpdatePlan`):
  `rl/memory.resolve_update` against `memory_limit_gb` or the device's limit (raises, naming the
  setting and its estimate, when it does not fit)."""
  if cfg.memory_limit_gb:
    limit = int(cfg.memory_limit_gb * update_memory.GIB)
  else:
    limit = device_memory.device_limit()
  shape = dict(mesh.shape)
  cfg, plan = update_memory.resolve_update(
    cfg,
    mcfg,
    limit,
    param_shards=shape.get("fsdp", 1) * shape.get("tensor", 1),
    row_shards=shape.get("data", 1) * shape.get("fsdp", 1),
  )
  if limit is None:
    of = "memory limit unknown"
  else:
    where = "memory_limit_gb" if cfg.memory_limit_gb else device_memory.limit_name()
    of = f"of {limit / update_memory.GIB:.1f} GiB {where}"
  logging.info("RL update: %s (%s)", plan.describe(), of)
  return cfg, plan


def check_eval(cfg: RLConfig) -> None:
  if cfg.eval_every and not cfg.eval_tasks:
    raise ValueError(
      f"eval_every={cfg.eval_every} needs eval_tasks (the infilling evaluation set or "
      f"KernelBench level 1): pass --set=eval_tasks=FILE, or --set=eval_every=0"
    )


def evaluate(t: Trainer, judge, step: int) -> dict:
  """DICE's in-loop evaluation with the current parameters (`rl/evaluation.py`)."""
  params = rollout_lib.sampling_params(t.state["params"], t.mcfg.compute_dtype)
  with jax.set_mesh(t.mesh):
    ro = rollout_lib.collect(
      nnx.merge(t.graphdef, params),
      t.eval_groups,
      backend=t.eval_backend,
      judge=judge,
      tokenizer=t.tokenizer,
      reward_fn=t.reward_fn,
      rl_step=step,
      extraction=t.cfg.code_extraction,
      max_prompt_len=t.cfg.max_prompt_len,
    )
  return eval_lib.metrics(ro)


def stop_ids(cfg: RLConfig, tok) -> tuple[int, ...]:
  """The ids that end a response: the tokenizer's stop ids (`chat`: `<|im_end|>` and
  `<|endoftext|>` for SDAR), its eos only (`eos`), or `<|im_end|>` only (`im_end`: DICE's
  JetEngine stops at its SFT checkpoint's eos, which LLaMA-Factory's qwen3 template makes
  `<|im_end|>`; docs/dice_recipe.md, item 4)."""
  if cfg.stop_tokens == "eos":
    return (int(tok.eos_token_id),)
  if cfg.stop_tokens == "im_end":
    if tok.im_end_token_id is None:
      raise ValueError("stop_tokens='im_end': the tokenizer has no <|im_end|> token")
    return (int(tok.im_end_token_id),)
  return tuple(tok.stop_token_ids)


def training_view(traj: Trajectory, cfg: RLConfig, stop_ids, pad_id: int) -> Trajectory:
  """`traj` as the update trains it: without its final stop token unless `train_stop_token`,
  without the tokens equal to `pad_id` unless `train_pad_tokens` (DICE's `post_num: 0`)."""
  if not cfg.train_stop_token:
    traj = traj.without_stop_token(stop_ids)
  if not cfg.train_pad_tokens:
    traj = traj.without_token(pad_id)
  return traj


def make_backend(cfg: RLConfig, scfg) -> rollout_lib.SamplerBackend:
  if cfg.sampler_backend == "continuous":
    return rollout_lib.ContinuousBatches(scfg, cfg.slots, cfg.max_prompt_len, cfg.run.seed)
  return rollout_lib.StaticBatches(
    scfg, cfg.groups_per_batch, cfg.run.seed, width_multiple=cfg.prompt_width_multiple
  )


def _in_current_layout(saved: dict) -> dict:
  """A saved RL config as today's code reads it (fields added since take their defaults)."""
  try:
    return RLConfig.from_json(saved).to_json()
  except (TypeError, ValueError, KeyError):
    return saved


def check_start(cfg: RLConfig, workdir: str, allow_config_change: bool = False) -> int | None:
  """What can be checked of the run's checkpoints before anything is built, written or waited for:
  a resume's config (`train/resume.check_run`) or, for a new run, that `run.init_checkpoint` has
  an intact step. The step a resume starts from, or None. Raises a UserError naming the problem."""
  step = resume.check_run(
    workdir,
    cfg.to_json(),
    allow_change=allow_config_change,
    in_current_layout=_in_current_layout,
  )
  init = cfg.run.init_checkpoint
  if step is None and init and ckpt_lib.newest_saved_config(init) is None:
    raise UserError(f"run.init_checkpoint {init}: no checkpoint under {init}/checkpoints")
  return step


def run_one_step(t: Trainer, judge, step: int):
  """One RL step (0-based `step`): (metrics, stream state after its tasks, rollout)."""
  cfg = t.cfg
  t0 = time.perf_counter()
  clock = compile_clock.shared()
  at_start = clock.mark()
  elements = rl_stream.next_step(t.stream, cfg.stream)
  data_state = t.stream.get_state()
  groups = rollout_lib.groups_from_stream(
    elements, tokenizer=t.tokenizer, prompt_tail_chars=cfg.prompt_tail_chars
  )
  params = rollout_lib.sampling_params(t.state["params"], t.mcfg.compute_dtype)
  with jax.set_mesh(t.mesh):
    ro = rollout_lib.collect(
      nnx.merge(t.graphdef, params),
      groups,
      backend=t.backend,
      judge=judge,
      tokenizer=t.tokenizer,
      reward_fn=t.reward_fn,
      rl_step=step,
      extraction=cfg.code_extraction,
      max_prompt_len=cfg.max_prompt_len,
    )
  del params
  m = reporting.rollout_metrics(ro)
  m["time/rollout_compile_s"] = clock.since(at_start)  # 0 once the step's programs are known
  t.state, update_m = learn(t, ro, step)
  m.update(update_m)
  if t.eval_groups and eval_lib.due(step + 1, cfg.eval_every):
    m.update(evaluate(t, judge, step))
  m["data_fingerprint"] = reporting.fingerprint(
    [g.task_id.encode() for g in groups] + [g.prompt_ids for g in groups]
  )
  m["sample_fingerprint"] = reporting.fingerprint([tr.response_ids for tr in ro.trajectories])
  m["optimizer_step"] = float(distributed.to_host(t.state["step"]))
  m["time/step_s"] = time.perf_counter() - t0
  m["time/compile_s"] = clock.since(at_start)
  peak = device_memory.peak_bytes()  # what the plan's worst-case estimate bounds
  if peak:
    m["memory/peak_gib"] = peak / update_memory.GIB
  for k, v in m.items():
    if not np.isfinite(v):
      raise FloatingPointError(f"RL step {step + 1}: metric {k} is {v}")
  return m, data_state, ro


def run_rl(
  cfg: RLConfig,
  workdir: str,
  *,
  endpoints: list[str] | None = None,
  max_steps: int | None = None,
  allow_config_change: bool = False,
  verifier_wait_s: float | None = None,
) -> dict:
  """Runs RL steps up to `cfg.num_steps` (or `max_steps` more), resuming from `workdir` (a changed
  config as `train/resume.py` says: fields beyond the safe ones need `allow_config_change`).

  The checkpoints come first (`check_start`: a refused config change, no intact step), then the
  judge: nothing is written to `workdir` until the verifier at `endpoints` answers (`make_judge`;
  an unreachable one raises `VerifierUnavailable` and leaves `workdir` as it was).
  SIGINT or SIGTERM during an RL step finishes it, saves it and returns with `preempted` True;
  during start-up, or a second signal, returns at once (`train/stop.py`).
  """
  return stop_lib.run_stoppable(
    lambda stop: _run(
      cfg, workdir, stop, endpoints, max_steps, allow_config_change, verifier_wait_s
    ),
    rl_step=None,
  )


def _run(cfg, workdir, stop, endpoints, max_steps, allow_config_change, verifier_wait_s) -> dict:
  check_start(cfg, workdir, allow_config_change)
  judge = make_judge(cfg, endpoints, verifier_wait_s)
  ckpt = None
  last, preempted, done = {}, False, None
  try:
    os.makedirs(workdir, exist_ok=True)
    ckpt = run_setup.make_checkpointer(cfg.run, workdir, keep_period=cfg.snapshot_every or None)
    t = _prepare(cfg, workdir, ckpt)
    end = cfg.num_steps if max_steps is None else min(cfg.num_steps, t.start + max_steps)
    logging.info("RL steps %d -> %d (of %d)", t.start, end, cfg.num_steps)
    writer = metrics_lib.MetricWriter(workdir)
    config_json = cfg.to_json()
    done = t.start
    stop.training = True
    try:
      for step in range(t.start, end):
        m, data_state, ro = run_one_step(t, judge, step)
        done = step + 1
        writer.write(done, m)
        reporting.write_samples(
          os.path.join(workdir, "samples.jsonl"), done, ro, cfg.samples_per_step
        )
        logging.info(reporting.progress_line(done, cfg.num_steps, m))
        stop_any = distributed.any_process(stop.requested is not None)  # a collective
        preempted = stop_any or ckpt.reached_preemption(done)
        snapshot = bool(cfg.snapshot_every) and done % cfg.snapshot_every == 0
        ckpt.save(
          done,
          t.state,
          {"iterator": data_state, "rl_step": done, "seed": cfg.run.seed},
          config_json,
          force=preempted or done == end or snapshot,
        )
        last = m
        if preempted:
          logging.warning(
            "%s: stopped after RL step %d, checkpoint saved; rerun the same command to resume",
            stop.requested or "stop signal to another process or pre-emption notice",
            done,
          )
          break
    finally:
      stop.training = False  # a signal from here on stops at once
      writer.close()
  finally:
    if ckpt is not None:
      ckpt.wait()
      ckpt.close()
    if hasattr(judge, "close"):
      judge.close()
  if distributed.is_primary() and last:
    reporting.plot_rl(
      os.path.join(workdir, "metrics.jsonl"), os.path.join(workdir, "rl.png"), cfg.phase
    )
  return {"rl_step": done, "preempted": preempted, **last}


def _existing_dir(path: str) -> str | None:
  return path if os.path.isdir(path) else None


def learn(t: Trainer, ro: rollout_lib.Rollout, rl_step: int, on_batches=None):
  """Advantages -> TraceRL mini-batches -> old log-probs (the rollout's, or a forward of every
  mini-batch before any update) -> one update per mini-batch. `on_batches(host_batches)`, when
  given, sees the mini-batches before they are trained (benchmarks count their FLOPs)."""
  cfg, mcfg, mesh, state = t.cfg, t.mcfg, t.mesh, t.state
  t0 = time.perf_counter()
  adv = advantages_lib.compute(
    cfg.advantage, ro.rewards, np.asarray([tr.group for tr in ro.trajectories], np.int64)
  )
  kept = []
  for traj, a, keep in zip(ro.trajectories, adv.values, adv.keep):
    traj.advantage = float(a)
    if keep:
      kept.append(training_view(traj, cfg, t.backend.cfg.stop_ids, t.tokenizer.pad_token_id))
  if cfg.reset_optimizer:  # DICE: a new AdamW every RL step (one process per step)
    state = dict(state, opt_state=t.init_opt(state["params"]))
  batches = tracerl.build_batches(
    kept,
    cfg.tracerl,
    block_size=mcfg.block_size,
    mask_token_id=mcfg.mask_token_id,
    rows_per_batch=cfg.rows_per_update,
    pad_id=mcfg.pad_token_id or 0,
    length_multiple=cfg.length_multiple,
    rng=np.random.default_rng([cfg.run.seed, rl_step]) if cfg.shuffle else None,
    tail=cfg.tail_rows,
    even_batches_rows=cfg.even_batches_rows,
    max_length=t.row_len,
  )
  if on_batches is not None:
    on_batches(batches)
  t_build = time.perf_counter()
  rows = ts.local_rows(mesh, cfg.rows_per_update, cfg.accum_steps)  # this process's rows

  def shard(b):
    return ts.shard_batch({k: v[rows] for k, v in b.items()}, mesh, cfg.accum_steps)

  gap = {}
  if t.old_logp_fn is not None:  # old log-probs with the rollout parameters, for all first
    sharded = [shard(b) for b in batches]
    gap_sum, gap_n = 0.0, 0.0
    for host, b in zip(batches, sharded):
      b["old_logp"] = t.old_logp_fn(state["params"], b)
      old = distributed.to_host(b["old_logp"]).reshape(host["p_mask"].shape)
      mask = host["p_mask"]
      gap_sum += float(np.abs(old - host["sampler_logp"])[mask].sum())
      gap_n += float(mask.sum())
    gap = {"sampler_logp_gap": gap_sum / max(gap_n, 1.0)}
  else:  # the rollout's log-probs: each mini-batch goes to the devices when its update is queued
    sharded = map(shard, batches)
  t_old = time.perf_counter() - t_build
  rng = jax.random.key(cfg.run.seed)  # the TraceRL loss draws nothing; the step folds in its count
  step_metrics = []
  for b in sharded:  # queued without waiting; the metrics are read once, at the end
    state, m = t.step_fn(state, b, rng)
    step_metrics.append(m)
  stats = reporting.UpdateStats()
  for m in step_metrics:
    stats.add({k: float(v) for k, v in distributed.tree_to_host(m).items()})
  out = stats.metrics()
  out.update(
    {
      "groups": float(adv.groups),
      "groups_dropped": float(adv.dropped_groups),
      "rows": float(sum(int((b["traj_index"] >= 0).sum()) for b in batches)),
      **gap,
      "time/build_rows_s": t_build - t0,
      "time/old_logp_s": t_old,
      "time/update_s": time.perf_counter() - t0,
    }
  )
  return state, out
