r"""One whole BiC-RL step on one device, measured phase by phase, written as ONE JSON record.

  python -m experiments.rl_step --config=sdar_1p7b --tasks=8 --group_size=16 --prompt_len=896 \
      --new_tokens=4096 --recipe=dice --verifier=local --out=DIR/rl_step.json \
      [--compilation_cache=DIR] [--profile_dir=DIR] [--deadline_s=500]

Random weights and synthetic prompts (no data files, no tokenizer, no grain), the RL loop's own
code for everything else (`dice_jax/rl/loop.py`):
  setup     the model, the update's memory plan (`loop.plan_update`, refused before sampling
            when it does not fit) and the jitted update (`loop.make_update`), under `--recipe`
  rollout   `rollout.collect` with `StaticBatches` (`--groups_per_batch` groups per sampler
            call, DICE's decoding), each group sent to the judge as soon as it is sampled: a
            local verifier service on the same device (`--verifier=local`). No stop id, so every
            row decodes `--new_tokens` (the worst case); every response is the candidate (random
            text: the verifier's static check refuses it, so its share is the round trip)
  rewards   random weights earn 0 everywhere and every group would be dropped, so the verdicts'
            rewards are replaced by seeded binary ones, 1 to G-1 correct members per group at
            random: the real advantage code then keeps every group (SYNTHETIC, recorded so)
  update    `loop.learn`: advantages, the recipe's TraceRL mini-batches, old log-probs (the
            rollout's unless `tracerl.old_logp=trainer`), every optimizer step the recipe asks
            for; its MFU counts `dice_jax/rl/flops.py`'s useful FLOPs over the chip's peak
  profile   (`--profile_dir`) one more optimizer step cut to `--profile_micro_steps`
            micro-batches, traced and summarised per micro-step (`experiments/trace_summary.py`)
  probe     the trainer's old log-prob forward on the first mini-batch: seconds per row and its
            gap to the sampler's log-probs (what `old_logp=sampler` saves, and what it changes)
A phase that would end past `--deadline_s` (from the start, estimated) is skipped and says so.
Compile seconds per phase come from JAX's compile events (`bench_common.CompileClock`); whether
the persistent cache was warm is recorded. The record ends with DICE's full step (`--dice_tasks`
x `--group_size`) extrapolated from the measured per-row costs (`extrapolate`).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from experiments import bench_common

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "sdar_1p7b", "model preset (random weights)")
flags.DEFINE_string("recipe", "dice", "dice | ours (dice_jax/recipe.py)")
flags.DEFINE_integer("tasks", 8, "tasks (groups) in the RL step")
flags.DEFINE_integer("group_size", 16, "samples per task")
flags.DEFINE_integer("prompt_len", 896, "prompt tokens per task (DICE e2e median: 883)")
flags.DEFINE_integer("new_tokens", 4096, "tokens decoded per sample")
flags.DEFINE_integer("groups_per_batch", 8, "groups per sampler call")
flags.DEFINE_integer("prefill_chunk", 16, "rows per prefill chunk")
flags.DEFINE_integer("rows_per_update", 256, "TraceRL rows per optimizer step (DICE)")
flags.DEFINE_string("attention_impl", "flash", "dense | flash")
flags.DEFINE_string("verifier", "local", "'local' (a child service), HOST:PORT, or 'none'")
flags.DEFINE_string("verifier_device", "", "local verifier device ('' = cuda when a GPU is seen)")
flags.DEFINE_list("verifier_args", ["--run-prewarm=4"], "extra `verifier serve` arguments")
flags.DEFINE_multi_string(  # repeatable, as the launchers' (a list flag kept only its last use)
  "set", [], "RLConfig override after the recipe, e.g. tracerl.old_logp=trainer; repeatable"
)
flags.DEFINE_integer("seed", 0, "seed")
flags.DEFINE_string("out", "", "the JSON record (written as each phase ends)")
flags.DEFINE_string("compilation_cache", "", "persistent JAX compilation cache directory")
flags.DEFINE_string("profile_dir", "", "trace one more optimizer step here")
flags.DEFINE_integer("profile_micro_steps", 3, "micro-batches in the profiled step")
flags.DEFINE_bool("probe_old_logp", True, "time the trainer's old log-prob forward (probe)")
flags.DEFINE_float("deadline_s", 0.0, "skip phases that would end later than this (0: none)")
flags.DEFINE_integer("dice_tasks", 64, "tasks of DICE's full RL step, for the extrapolation")
flags.DEFINE_float("target_tok_s", 8000.0, "the sampler's target rate, for the extrapolation")
flags.DEFINE_float("peak_tflops", 0.0, "bf16 peak TFLOP/s for the MFU (0: metrics.peak_flops)")


class IdText:
  """Stands in for a tokenizer: a response's text is its token ids (no vocabulary needed); its
  pad id is the model's (SDAR: `<|endoftext|>`, its eos)."""

  def __init__(self, pad_token_id: int):
    self.pad_token_id = pad_token_id

  def decode(self, ids, skip_special_tokens=True):
    return " ".join(map(str, ids))


def make_config(mcfg_name: str):
  """The RLConfig of the measured step: `--recipe`'s fields, this shape, then `--set`."""
  from dice_jax import recipe as recipe_lib
  from dice_jax.data.rl_stream import RLStreamConfig
  from dice_jax.rl.config import DICE_SAMPLER, RLConfig
  from dice_jax.train.config import apply_overrides
  from dice_jax.train.run_config import RunConfig

  base = RLConfig(
    run=RunConfig(
      model=mcfg_name,
      model_overrides={
        "dtype": "bfloat16",
        "param_dtype": "float32",
        "attention_impl": FLAGS.attention_impl,
      },
      seed=FLAGS.seed,
    ),
    stream=RLStreamConfig(group_size=FLAGS.group_size, tasks_per_step=FLAGS.tasks, num_steps=1),
    max_prompt_len=FLAGS.prompt_len,
    sampler=dataclasses.replace(DICE_SAMPLER, max_new_tokens=FLAGS.new_tokens),
    groups_per_batch=FLAGS.groups_per_batch,
    code_extraction="whole_response",
    rows_per_update=FLAGS.rows_per_update,
  )
  cfg = recipe_lib.apply_recipe(base, FLAGS.recipe)
  cfg = dataclasses.replace(cfg, eval_every=0)  # the step alone, no in-loop evaluation
  return apply_overrides(cfg, list(FLAGS.set)) if FLAGS.set else cfg


def extrapolate(*, n_tasks: int, group_size: int, new_tokens: int, rate: float, measured: dict):
  """DICE's full step from the measured one: sampling at `rate` generated tok/s, the verifier's
  tail wait as measured (it overlaps sampling), and the per-response costs of building rows,
  old log-probs and the optimizer steps (compiles excluded: once per run), times the responses.
  """
  n = n_tasks * group_size
  per = measured["per_response_s"]
  sample = n * new_tokens / rate
  rest = measured["verify_wait_s"] + n * (per["build_rows"] + per["old_logp"] + per["update"])
  return dict(
    responses=n,
    rate_tok_s=round(rate, 1),
    sample_s=round(sample, 1),
    verify_wait_s=round(measured["verify_wait_s"], 1),
    update_s=round(n * per["update"], 1),
    other_s=round(n * (per["build_rows"] + per["old_logp"]), 1),
    step_s=round(sample + rest, 1),
    step_min=round((sample + rest) / 60, 2),
  )


EXTRAPOLATION_FORMULA = (
  "T = N*L/r + t_verify_wait + N*(t_rows + t_old_logp + t_update): N = dice_tasks*group_size "
  "responses, L = new_tokens, r = generated tok/s; t_* = the measured step's phase seconds "
  "(compiles excluded) / the responses it trained; t_verify_wait as measured"
)


class Phases:
  """Wall and compile seconds of each phase, and the deadline check."""

  def __init__(self, report, clock, start):
    self.report, self.clock, self.start = report, clock, start
    self.data: dict = {}

  def fits(self, name: str, estimate_s: float) -> bool:
    left = FLAGS.deadline_s - (time.perf_counter() - self.start) if FLAGS.deadline_s else None
    if left is not None and estimate_s > left:
      self.report.update(**{f"{name}_skipped": f"needs ~{estimate_s:.0f} s, {left:.0f} s left"})
      return False
    return True

  def end(self, name: str, t0: float, **extra):
    self.data[name] = dict(wall_s=round(time.perf_counter() - t0, 1), **self.clock.split(), **extra)
    self.report.update(phases=self.data, elapsed_s=round(time.perf_counter() - self.start, 1))


def main(argv):
  del argv
  from dice_jax import sharding
  from dice_jax.model import Transformer
  from dice_jax.rl import flops, loop, rollout
  from dice_jax.rl.rewards import make_reward
  from dice_jax.train import metrics as metrics_lib
  from dice_jax.train import optimizer as optim_lib
  from dice_jax.train import run_setup
  from dice_jax.train import train_step as ts

  start = time.perf_counter()
  report = bench_common.Report(FLAGS.out, "rl_step")
  clock = bench_common.CompileClock().install()
  if FLAGS.compilation_cache:
    report.update(compilation_cache=bench_common.use_compilation_cache(FLAGS.compilation_cache))
  phases = Phases(report, clock, start)
  verifier = holder = None
  if FLAGS.verifier == "local":
    device = FLAGS.verifier_device or ("cuda" if jax.default_backend() == "gpu" else "cpu")
    workdir = os.path.join(os.path.dirname(os.path.abspath(FLAGS.out or "/tmp/x")), "verifier")
    verifier, holder = bench_common.start_local_verifier(workdir, device, FLAGS.verifier_args)

  # --- setup: model, plan, update
  t0 = time.perf_counter()
  cfg = make_config(FLAGS.config)
  mesh = sharding.make_mesh()
  mcfg = run_setup.model_config(cfg.run)
  cfg, plan = loop.plan_update(cfg, mcfg, mesh)  # raises (exit) before sampling if nothing fits
  model = sharding.create_sharded(lambda: Transformer(mcfg, rngs=nnx.Rngs(FLAGS.seed)), mesh)
  total_updates = -(-cfg.stream.elements_per_step // cfg.rows_per_update) * 4  # rounds
  tx = optim_lib.make_optimizer(cfg.optim, total_updates)
  graphdef, state, shardings = ts.init_train_state(model, tx, mesh)
  del model
  update = loop.make_update(cfg, mcfg, mesh, graphdef, shardings, tx, total_updates, plan)
  jax.block_until_ready(state)
  report.update(
    config=FLAGS.config,
    recipe=cfg.recipe,
    device=jax.devices()[0].device_kind,
    params_b=round(mcfg.num_params() / 1e9, 3),
    shape=dict(
      tasks=FLAGS.tasks,
      group_size=FLAGS.group_size,
      prompt_len=FLAGS.prompt_len,
      new_tokens=FLAGS.new_tokens,
      rows_per_update=cfg.rows_per_update,
    ),
    update_plan=plan.describe(),
    update_estimate_gib={k: round(v / 2**30, 2) for k, v in plan.estimate.items()},
    tracerl=dataclasses.asdict(cfg.tracerl),
    sampler=dict(  # what the rollout decodes with (`--set=sampler.commit_rows=48`, ...)
      strategy=cfg.sampler.strategy,
      commit_rows=cfg.sampler.commit_rows,
      decode_tiles=dataclasses.asdict(cfg.sampler.decode_tiles),
      kv_cache_dtype=cfg.sampler.kv_cache_dtype,
      weights_dtype=cfg.sampler.weights_dtype,
    ),
    recipe_fields=dict(
      shuffle=cfg.shuffle,
      reset_optimizer=cfg.reset_optimizer,
      tail_rows=cfg.tail_rows,
      train_stop_token=cfg.train_stop_token,
      grad_scale=cfg.optim.grad_scale,
    ),
  )
  phases.end("setup", t0)

  # --- rollout (the verifier judges each group as it is sampled)
  rng = np.random.default_rng(FLAGS.seed)
  groups = [
    rollout.GroupTask(
      g,
      f"synthetic/{g}",
      rng.integers(2, min(mcfg.vocab_size - 2, 151_643), FLAGS.prompt_len).astype(np.int32),
      bench_common.RELU_REFERENCE,
      FLAGS.group_size,
    )
    for g in range(FLAGS.tasks)
  ]
  scfg = dataclasses.replace(
    cfg.sampler, stop_ids=(), pad_id=mcfg.pad_token_id or 0, prefill_chunk=FLAGS.prefill_chunk
  ).for_model(mcfg)
  backend = rollout.StaticBatches(
    scfg, cfg.groups_per_batch, FLAGS.seed, width_multiple=cfg.prompt_width_multiple
  )
  eos = mcfg.eos_token_id if isinstance(mcfg.eos_token_id, int) else mcfg.eos_token_id[0]
  tokenizer = IdText(mcfg.pad_token_id if mcfg.pad_token_id is not None else eos)
  judge = make_judge(cfg, verifier, holder, report)
  t0 = time.perf_counter()
  sample_params = rollout.sampling_params(state["params"], jnp.bfloat16)
  sample_model = nnx.merge(graphdef, sample_params)
  with jax.set_mesh(mesh):
    ro = rollout.collect(
      sample_model,
      groups,
      backend=backend,
      judge=judge,
      tokenizer=tokenizer,
      reward_fn=make_reward(cfg.reward, **cfg.reward_options),
      rl_step=0,
      extraction=cfg.code_extraction,
      progress_every_s=10.0,
    )
  # The rollout's weights (bf16) to host memory for the probe: the trainer's forward reads the
  # same bf16 values from the fp32 masters. Off the device before the update (the sampler's
  # cache died with its call).
  rollout_weights = jax.device_get(sample_params) if FLAGS.probe_old_logp else None
  del sample_model, sample_params
  gc.collect()
  kinds: dict = {}
  for o in ro.outcomes:
    kinds[o.failure_kind] = kinds.get(o.failure_kind, 0) + 1
  # The sampler compiles inside its first call: its sampling time is the loop's less that compile.
  compile_s = clock.since_split()
  sample_steady_s = max(ro.sample_s - compile_s, 1e-9)
  rate = ro.generated_tokens / sample_steady_s
  phases.end(
    "rollout",
    t0,
    sample_s=round(ro.sample_s, 1),
    sample_s_less_compile=round(sample_steady_s, 1),
    verify_wait_s=round(ro.verify_wait_s, 2),
    generated_tokens=ro.generated_tokens,
    generated_tok_s=round(rate, 1),
    tokens_per_forward=round(ro.generated_tokens / max(ro.steps_used, 1), 3),
    judge_requests=ro.judge_requests,
    failure_kinds=kinds,
    peak_gib=bench_common.peak_gib(),
  )
  if hasattr(judge, "close"):
    judge.close()
  if holder and "server" in holder:
    holder["server"].__exit__(None, None, None)

  # --- rewards: synthetic (random weights earn 0: every group would be dropped)
  ro.rewards = synthetic_rewards(rng, [t.group for t in ro.trajectories])
  report.update(rewards="SYNTHETIC: 1 to G-1 correct members per group at random (seeded)")

  # --- update: every optimizer step the recipe asks for
  t0 = time.perf_counter()
  trainer = loop.Trainer(
    cfg=cfg,
    mesh=mesh,
    mcfg=mcfg,
    state=state,
    **update._asdict(),
    backend=backend,
    tokenizer=tokenizer,
  )
  batches: list = []
  state, m = loop.learn(trainer, ro, 0, on_batches=batches.extend)
  wall = time.perf_counter() - t0
  timing = clock.split()
  useful = [flops.update_flops(mcfg, b) for b in batches]
  responses = len({int(i) for b in batches for i in b["traj_index"][:, 0] if i >= 0})
  steady = m["time/update_s"] - m["time/build_rows_s"] - m["time/old_logp_s"] - timing["compile_s"]
  peak = FLAGS.peak_tflops * 1e12 or metrics_lib.peak_flops() or float("nan")
  total = sum(u["total"] for u in useful)
  phases.data["update"] = dict(
    wall_s=round(wall, 1),
    **timing,
    build_rows_s=round(m["time/build_rows_s"], 2),
    old_logp_s=round(m["time/old_logp_s"], 2),
    optimizer_steps=int(m["updates"]),
    optimizer_steps_s=round(steady, 1),
    per_optimizer_step_s=round(steady / max(m["updates"], 1), 2),
    responses_trained=responses,
    rows=int(m["rows"]),
    micro_steps=int(m["updates"]) * cfg.accum_steps,
    real_tokens=int(sum(u["tokens"] for u in useful)),
    useful_tflop=round(total / 1e12, 1),
    useful_split={k: round(sum(u[k] for u in useful) / total, 3) for k in flops.PARTS},
    mfu=round(flops.mfu(total, steady, peak), 4) if steady > 0 and peak == peak else None,
    peak_tflops=round(peak / 1e12, 1) if peak == peak else None,
    loss=m.get("loss"),
    kl=m.get("kl"),
    note=None
    if cfg.tracerl.old_logp == "sampler"
    else "old_logp=trainer: old_logp_s includes that forward's compile, which is also subtracted "
    "from optimizer_steps_s (an underestimate by it)",
    peak_gib=bench_common.peak_gib(),
  )
  report.update(phases=phases.data, elapsed_s=round(time.perf_counter() - start, 1))

  # --- the extrapolation to DICE's full step
  per = dict(
    build_rows=m["time/build_rows_s"] / max(responses, 1),
    old_logp=m["time/old_logp_s"] / max(responses, 1),
    update=steady / max(responses, 1),
  )
  measured = dict(per_response_s=per, verify_wait_s=ro.verify_wait_s)
  kw = dict(n_tasks=FLAGS.dice_tasks, group_size=FLAGS.group_size, new_tokens=FLAGS.new_tokens)
  report.update(
    dice_step=dict(
      formula=EXTRAPOLATION_FORMULA,
      per_response_s={k: round(v, 4) for k, v in per.items()},
      at_measured_rate=extrapolate(rate=rate, measured=measured, **kw),
      at_target_rate=extrapolate(rate=FLAGS.target_tok_s, measured=measured, **kw),
    )
  )

  # --- profile: a few micro-steps, traced
  key = jax.random.key(FLAGS.seed)
  per_micro = steady / max(int(m["updates"]) * cfg.accum_steps, 1)
  if FLAGS.profile_dir and batches and phases.fits("profile", 10 + 4 * per_micro * 3):
    t0 = time.perf_counter()
    state, prof = bench_common.profile_step(
      trainer.step_fn,
      state,
      batches[0],
      mesh,
      cfg.accum_steps,
      key,
      FLAGS.profile_dir,
      FLAGS.profile_micro_steps,
    )
    phases.end("profile", t0, **prof)

  # --- probe: the trainer's old log-prob forward on the first mini-batch, and its gap
  if FLAGS.probe_old_logp and batches and phases.fits("probe", 60 + per_micro * cfg.accum_steps):
    t0 = time.perf_counter()
    params = jax.device_put(rollout_weights, shardings["params"])
    probe = probe_old_logp(graphdef, shardings, mesh, cfg, params, batches[0])
    del params
    phases.end("probe", t0, **probe)
  report.update(wall_s=round(time.perf_counter() - start, 1), peak_gib=bench_common.peak_gib())


def synthetic_rewards(rng, groups) -> np.ndarray:
  """Binary rewards with 1 to G-1 ones per group (at random members): no group has equal
  rewards, so none is dropped by the advantages."""
  groups = np.asarray(groups)
  out = np.zeros(groups.size, np.float32)
  for g in np.unique(groups):
    members = np.nonzero(groups == g)[0]
    ones = rng.integers(1, max(members.size, 2))
    out[rng.permutation(members)[:ones]] = 1.0
  return out


def make_judge(cfg, verifier, holder, report):
  """The verifier client (local service or `--verifier` address) or, for 'none', a judge that
  fails everything."""
  from dice_jax.rl import rollout

  if FLAGS.verifier == "none":
    return rollout.FunctionJudge(lambda *a: False)
  address = FLAGS.verifier
  if FLAGS.verifier == "local":
    verifier.join()
    if "error" in holder:
      e = holder["error"]
      report.update(verifier_error=f"{type(e).__name__}: {e}"[-4000:])
      raise e
    address = holder["server"].address
    report.update(verifier_start_s=round(holder["start_s"], 1))
  from dice_jax.verifier_client import ThreadedVerifier

  judge = ThreadedVerifier(address, options=cfg.verifier.options, token="")
  judge.wait_ready()
  return judge


def probe_old_logp(graphdef, shardings, mesh, cfg, params, batch) -> dict:
  """The trainer's old log-probs of one mini-batch with the rollout's weights `params`
  (`tracerl.jit_token_logprobs`, compiled then timed): seconds, seconds per row, and the mean /
  max |trainer - sampler| over trained tokens (bf16 kernels: the sampler's cached decode against
  the trainer's flash path)."""
  from dice_jax.rl import tracerl
  from dice_jax.train import train_step as ts

  run = tracerl.jit_token_logprobs(
    graphdef, shardings["params"], mesh, cfg.accum_steps, chunk=cfg.tracerl.logit_chunk
  )
  sb = ts.shard_batch(batch, mesh, cfg.accum_steps)
  jax.block_until_ready(run(params, sb))
  t0 = time.perf_counter()
  old = np.asarray(jax.block_until_ready(run(params, sb))).reshape(batch["p_mask"].shape)
  sec = time.perf_counter() - t0
  mask = batch["p_mask"].astype(bool)
  rows = int((batch["traj_index"] >= 0).sum())
  gap = np.abs(old - batch["sampler_logp"])[mask]
  return dict(
    forward_s=round(sec, 2),
    per_row_s=round(sec / max(rows, 1), 4),
    rows=rows,
    gap_mean=float(gap.mean()) if gap.size else None,
    gap_max=float(gap.max()) if gap.size else None,
  )


if __name__ == "__main__":
  app.run(main)
