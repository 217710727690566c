r"""One BiC-RL step at scale with random weights, timed: rollout -> verifier -> TraceRL update.

  python -m experiments.bench_rl --config=sdar_1p7b --tasks=64 --group_size=16 --prompt_len=896 \
      --new_tokens=512 --verifier=local --out=DIR

What it runs is the RL loop's own code (`rl.rollout.collect` with `StaticBatches` and the verifier
client, `rl.tracerl.build_batches`, `jit_token_logprobs`, the generic train step with DICE's
optimizer), on synthetic prompts (random token ids, one per task; the data stack and grain are
not needed) and a model with random weights:
  * no stop ids, so every row decodes exactly `--new_tokens` (as `bench_sampler` does);
  * every response is sent to the verifier as the candidate (`whole_response`: random text fails
    its static check at once, so the verifier's share is the gRPC round trip, not compilation);
  * random weights earn reward 0 everywhere, so every group would be dropped: the update is timed
    on the same rollouts with SYNTHETIC advantages (standard normal per response).
The update is DICE's: 256 TraceRL rows per optimizer step; old log-probs the rollout's
(`--old_logp=sampler`, the RL loop's default) or a forward of a mini-batch before its update
(`trainer`); layout, micro_rows and the remat policy are chosen by the update's memory estimate
(`dice_jax/rl/memory.py`, as the RL loop does) unless given, before anything is sampled: a setting
that does not fit stops the benchmark there. The estimate is recorded beside the measured peak;
only `--update_steps` optimizer steps are run (the first includes compiling), and the time of all
of them is extrapolated from the steady ones; the host-side row building (`build_batches`) runs on
those mini-batches' responses only and is extrapolated by count. The update's MFU counts the
useful FLOPs of `dice_jax/rl/flops.py` (no recomputation, no masked attention, no padding) over
the chip's peak (`train/metrics.peak_flops`, as bench_train). `--profile_dir`: one more optimizer
step, all but `--profile_micro_steps` of its micro-batches emptied (skipped), under
`jax.profiler`, summarised by `experiments/trace_summary.py` per micro-step.
Results go to DIR/bench_rl.json as each phase finishes.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
flags.DEFINE_integer("tasks", 64, "tasks (groups) in the RL step")
flags.DEFINE_integer("group_size", 16, "samples per task")
flags.DEFINE_integer("prompt_len", 896, "prompt tokens per task (DICE e2e median: 883)")
flags.DEFINE_integer("new_tokens", 512, "tokens decoded per sample")
flags.DEFINE_integer("groups_per_batch", 8, "groups per sampler call")
flags.DEFINE_integer(
  "prefill_chunk", 0, "rows per prefill chunk (0: all, as the RL loop's sampler, DICE_SAMPLER)"
)
flags.DEFINE_bool(
  "prefill_once_per_group",
  True,
  "prefill a group's shared prompt once (SamplerConfig.prefill_once_per_group); false: every row",
)
flags.DEFINE_integer(
  "commit_rows", 0, "rollout: rows committing per forward (SamplerConfig.commit_rows; 0: no cap)"
)
flags.DEFINE_string(
  "decode_tiles",
  "",
  "rollout: DecodeTiles as JSON or a JSON file's path (empty: the RL config's, DICE_SAMPLER)",
)
flags.DEFINE_string(
  "kv_cache_dtype",
  "",
  "rollout: SamplerConfig.kv_cache_dtype ('': the compute dtype; float8_e4m3fn)",
)
flags.DEFINE_string("attention_impl", "flash", "dense | flash")
flags.DEFINE_string("verifier", "local", "'local' (a child service), HOST:PORT, or 'none'")
flags.DEFINE_string("verifier_device", "", "local verifier device ('' = cuda when a GPU is seen)")
flags.DEFINE_list(
  "verifier_args", ["--run-prewarm=4"], "extra `verifier serve` arguments for the local service"
)
flags.DEFINE_integer("rows_per_update", 256, "TraceRL rows per optimizer step (DICE)")
flags.DEFINE_integer("micro_rows", 0, "rows per micro-batch (accumulation); 0: by the estimate")
flags.DEFINE_string(
  "rollout",
  "sample",
  "sample | synthetic (random responses, no sampler or verifier: the update alone)",
)
flags.DEFINE_string(
  "layout", "packed", "TraceRL layout: packed | per_round | auto (by the estimate)"
)
flags.DEFINE_bool("gather_trained", True, "LM head on the trained positions only (TraceRLConfig)")
flags.DEFINE_string("old_logp", "sampler", "old log-probs: sampler (the rollout's) | trainer")
flags.DEFINE_string("batch_units", "rows", "what rows_per_update counts: rows | rounds (DICE)")
flags.DEFINE_bool("flash_live_only", True, "flash kernel: loop over live tiles only (ModelConfig)")
flags.DEFINE_string("remat", "auto", "the update's remat policy: auto or a REMAT_POLICIES name")
flags.DEFINE_float("memory_limit_gb", 0.0, "device memory for the update plan (0: the device's)")
flags.DEFINE_integer(
  "update_steps", 2, "optimizer steps actually run (the rest extrapolated); 0: the rollout alone"
)
flags.DEFINE_integer("seed", 0, "seed")
flags.DEFINE_string("out", "", "directory for bench_rl.json")
flags.DEFINE_float("peak_tflops", 0.0, "bf16 peak TFLOP/s for the MFU (0: metrics.peak_flops)")
flags.DEFINE_string("profile_dir", "", "trace one more optimizer step here (module docstring)")
flags.DEFINE_integer("profile_micro_steps", 3, "micro-batches left in the profiled step")
flags.DEFINE_string("compilation_cache", "", "persistent JAX compilation cache directory")
flags.DEFINE_bool(
  "gc_before_rollout",
  False,
  "run Python's garbage collector before the timed rollout (is device memory held by a cycle?)",
)
flags.DEFINE_float(
  "lm_head_scale",
  1.0,
  "the sampling model's LM head x this (bench_sampler's sharpening, 40 there): a random model at "
  "temperature 1 never passes the dynamic threshold, so at 1.0 the rollout decodes one token a "
  "row-forward, as static does; a trained model's confidence lies between",
)
flags.DEFINE_integer(
  "rollouts",
  1,
  "timed rollouts in a row (RL steps 0, 1, ...; the report's rates are the first's, every one's "
  "per-call seconds in `rollout_call_s`): does a stall open every step's rollout?",
)
flags.DEFINE_float(
  "stack_every_s",
  0.0,
  "> 0: write where the main thread is every this many seconds to OUT/stacks.txt (names a stall)",
)
flags.DEFINE_bool(
  "explain_cache_misses",
  True,
  "log why JAX traced or compiled again (`jax_explain_cache_misses`) from the sampler's first call "
  "on: a compile inside the timed rollout names its cause",
)


class IdText:
  """Stands in for a tokenizer: a response's text is its token ids (no vocabulary needed)."""

  def decode(self, ids, skip_special_tokens=True):
    return " ".join(map(str, ids))


def start_verifier():
  """The local verifier, started in a thread (`bench_common.start_local_verifier`)."""
  device = FLAGS.verifier_device or ("cuda" if jax.default_backend() == "gpu" else "cpu")
  t, holder = bench_common.start_local_verifier(
    os.path.join(FLAGS.out or "/tmp", "bench_rl_verifier"), device, FLAGS.verifier_args
  )
  holder["device"] = device
  return t, holder


def local_verifier(thread, holder: dict, report) -> str:
  """The address of the verifier `start_verifier` started; its start-up error, reported and
  raised, when it did not start."""
  thread.join()
  if "error" in holder:
    e = holder["error"]
    report.update(verifier_error=f"{type(e).__name__}: {e}"[-4000:])
    raise e
  report.update(verifier_start_s=round(holder["start_s"], 1), verifier_device=holder["device"])
  return holder["server"].address


def synthetic_rollout(mcfg, rng):
  """`--tasks` x `--group_size` worst-case responses without sampling (`experiments/rl_shapes.py`):
  for the update's time and peak memory alone."""
  from types import SimpleNamespace

  from experiments.rl_shapes import synthetic_trajectories

  trajs = synthetic_trajectories(
    rng,
    tasks=FLAGS.tasks,
    group_size=FLAGS.group_size,
    prompt_len=FLAGS.prompt_len,
    new_tokens=FLAGS.new_tokens,
    vocab_size=mcfg.vocab_size,
    block_size=mcfg.block_size,
  )
  return SimpleNamespace(trajectories=trajs, sample_s=0.0, verify_wait_s=0.0)


def update_mfu(mcfg, batches, step_s: float) -> dict:
  """The optimizer step's useful FLOPs (`rl/flops.update_flops`, mean over `batches`) per second
  of `step_s`, and over the chip's peak."""
  from dice_jax.rl import flops
  from dice_jax.train import metrics

  useful = [flops.update_flops(mcfg, b) for b in batches]
  total = float(np.mean([u["total"] for u in useful]))
  peak = FLAGS.peak_tflops * 1e12 or metrics.peak_flops() or float("nan")
  return dict(
    update_useful_tflop_per_step=round(total / 1e12, 1),
    update_useful_split={k: round(useful[0][k] / useful[0]["total"], 3) for k in flops.PARTS},
    update_useful_tflops_per_s=round(total / step_s / 1e12, 1),
    update_mfu=round(flops.mfu(total, step_s, peak), 4),
    peak_tflops=round(peak / 1e12, 1),
  )


def _gib_in_use() -> float:
  """Device memory in use now, GiB (0 where the backend does not say)."""
  return round((jax.devices()[0].memory_stats() or {}).get("bytes_in_use", 0) / 2**30, 2)


def _peak() -> int:
  return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0)


def plan_gib(plan) -> dict:
  return {k: round(v / 2**30, 2) for k, v in plan.estimate.items()}


def plan_update(mcfg, report):
  """The update's layout / micro_rows / remat (`rl/memory.choose_plan`), before any sampling;
  exits naming the setting and its estimate when nothing given or tried fits."""
  from dice_jax.diffusion import memory as device_memory
  from dice_jax.rl import memory

  limit = (
    int(FLAGS.memory_limit_gb * memory.GIB)
    if FLAGS.memory_limit_gb
    else device_memory.device_limit()
  )
  layouts = ["packed", "per_round"] if FLAGS.layout == "auto" else [FLAGS.layout]
  micro = (
    [FLAGS.micro_rows] if FLAGS.micro_rows else memory.micro_row_options(FLAGS.rows_per_update)
  )
  remats = list(memory.REMAT_ORDER) if FLAGS.remat == "auto" else [FLAGS.remat]
  plan, tried = memory.choose_plan(
    mcfg,
    float("inf") if limit is None else limit,
    layouts=layouts,
    micro_rows=micro,
    remats=remats,
    rows_per_update=FLAGS.rows_per_update,
    prompt_len=FLAGS.prompt_len,
    new_tokens=FLAGS.new_tokens,
    steps=4,
    length_multiple=128,
  )
  if plan is None:
    smallest = min(tried, key=lambda p: p.estimate["total"])
    report.update(refused=smallest.describe(), refused_estimate_gib=plan_gib(smallest))
    raise SystemExit(
      f"bench_rl: the update does not fit in {limit / 2**30:.1f} GiB: smallest setting tried "
      f"{smallest.describe()}"
    )
  report.update(
    update_layout=plan.layout,
    update_micro_rows=plan.micro_rows,
    update_remat=plan.remat,
    update_plan=plan.describe(),
    update_estimate_gib=plan_gib(plan),
    device_limit_gib=None if limit is None else round(limit / 2**30, 1),
  )
  return plan


def main(argv):
  del argv
  from dice_jax import trace_context
  from dice_jax.diffusion import sampler as sampler_lib
  from dice_jax.diffusion.sampler import SamplerConfig
  from dice_jax.model import Transformer, get_config
  from dice_jax.rl import rollout, tracerl
  from dice_jax.rl.config import DICE_SAMPLER
  from dice_jax.rl.rewards import make_reward
  from dice_jax import sharding
  from dice_jax.train import optimizer
  from dice_jax.train import train_step as ts

  report = bench_common.Report(
    os.path.join(FLAGS.out, "bench_rl.json") if FLAGS.out else "", "bench_rl"
  )
  t_all = time.perf_counter()
  server_thread = holder = None
  if FLAGS.verifier == "local" and FLAGS.rollout == "sample":
    server_thread, holder = start_verifier()

  if FLAGS.compilation_cache:
    report.update(compilation_cache=bench_common.use_compilation_cache(FLAGS.compilation_cache))
  mesh = sharding.make_mesh()
  mcfg = get_config(
    FLAGS.config,
    dtype="bfloat16",
    param_dtype="float32",
    attention_impl=FLAGS.attention_impl,
    flash_live_only=FLAGS.flash_live_only,
  )
  t0 = time.perf_counter()
  model = sharding.create_sharded(lambda: Transformer(mcfg, rngs=nnx.Rngs(FLAGS.seed)), mesh)
  ocfg = optimizer.OptimizerConfig(
    learning_rate=1e-6, schedule="constant", warmup_ratio=0.0, weight_decay=0.0
  )
  tx = optimizer.make_optimizer(ocfg, 100)
  graphdef, state, shardings = ts.init_train_state(model, tx, mesh)
  del model
  jax.block_until_ready(state)
  report.update(
    config=FLAGS.config,
    params_b=round(mcfg.num_params() / 1e9, 3),
    device=jax.devices()[0].device_kind,
    devices=jax.device_count(),
    init_s=round(time.perf_counter() - t0, 1),
  )

  plan = plan_update(mcfg, report)
  rng = np.random.default_rng(FLAGS.seed)
  if FLAGS.rollout == "synthetic":
    ro = synthetic_rollout(mcfg, rng)
    report.update(
      rows=len(ro.trajectories),
      new_tokens=FLAGS.new_tokens,
      prompt_len=FLAGS.prompt_len,
      rollout="synthetic",
    )
  else:
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
    scfg = SamplerConfig(
      block_size=mcfg.block_size,
      steps=4,
      strategy="low_confidence_dynamic",
      threshold=0.9,
      temperature=1.0,
      max_new_tokens=FLAGS.new_tokens,
      stop_ids=(),
      return_logprobs=True,
      pad_id=mcfg.pad_token_id or 0,
      prefill_chunk=FLAGS.prefill_chunk,
      prefill_once_per_group=FLAGS.prefill_once_per_group,
      commit_rows=FLAGS.commit_rows,
      decode_tiles=bench_common.decode_tiles(FLAGS.decode_tiles, default=DICE_SAMPLER.decode_tiles),
      kv_cache_dtype=FLAGS.kv_cache_dtype or None,
    )
    backend = rollout.StaticBatches(scfg, FLAGS.groups_per_batch, FLAGS.seed)
    sample_model = nnx.merge(graphdef, rollout.sampling_params(state["params"], jnp.bfloat16))
    if FLAGS.lm_head_scale != 1.0:
      if mcfg.tie_word_embeddings:
        raise ValueError(f"--lm_head_scale: {FLAGS.config} ties its LM head to the embedding")
      head = sample_model.lm_head[...]
      sample_model.lm_head[...] = (head * FLAGS.lm_head_scale).astype(head.dtype)
      report.update(lm_head_scale=FLAGS.lm_head_scale)
    clock = bench_common.CompileClock().install()
    if FLAGS.explain_cache_misses:
      jax.config.update("jax_explain_cache_misses", True)
    graphdef_before = nnx.graphdef(sample_model)
    context_before = trace_context.names()
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):  # compile (and run once) on one call's worth of groups
      for _ in backend.sample(sample_model, groups[: FLAGS.groups_per_batch], 1_000_000):
        pass
    # what a later call's compile would be keyed on: the model's graph and the sampler's cache
    report.update(
      graphdef_same_after_first_call=graphdef_before == nnx.graphdef(sample_model),
      # a trace-context state registered by the first call makes the next call trace again;
      # `settle` (cached: what it added inside the call) registers before anything is traced
      trace_context_added_by_settle=list(trace_context.settle()),
      trace_context_added_by_first_call=[
        n
        for n in trace_context.names()
        if n not in context_before and n not in trace_context.settle()
      ],
      compiled_decode_after_first_call=sampler_lib.compiled_decode.cache_info()._asdict(),
    )
    report.update(
      sampler_compile_and_first_call_s=round(time.perf_counter() - t0, 1),
      sampler_first_call_compile=clock.split(),
      sampler_first_call_forwards=backend.forwards,
    )

    if FLAGS.verifier == "local":
      address = local_verifier(server_thread, holder, report)
    else:
      address = None if FLAGS.verifier == "none" else FLAGS.verifier
    if address:
      from dice_jax.verifier_client import ThreadedVerifier

      judge = ThreadedVerifier(address, options={"num_correct_trials": 1}, token="")
      judge.wait_ready()
    else:
      judge = rollout.FunctionJudge(lambda *a: False)

    report.update(device_gib_in_use_before_rollout=_gib_in_use())
    if FLAGS.gc_before_rollout:
      import gc

      t_gc = time.perf_counter()
      gc.collect()
      report.update(
        gc_s=round(time.perf_counter() - t_gc, 2), device_gib_in_use_after_gc=_gib_in_use()
      )
    stacks = contextlib.nullcontext()
    if FLAGS.stack_every_s > 0:
      stacks = bench_common.StackSampler(
        os.path.join(FLAGS.out or ".", "stacks.txt"), FLAGS.stack_every_s
      )

    def timed_rollout(step: int):
      return rollout.collect(
        sample_model,
        groups,
        backend=backend,
        judge=judge,
        tokenizer=IdText(),
        reward_fn=make_reward("binary"),
        rl_step=step,
        extraction="whole_response",
        progress_every_s=10.0,
      )

    with jax.set_mesh(mesh), stacks:
      ro = timed_rollout(0)
      compiled = clock.split()  # compile seconds inside the timed calls (0 unless one recompiled)
      report.update(
        compiled_decode_after_rollout=sampler_lib.compiled_decode.cache_info()._asdict(),
        graphdef_same_after_rollout=graphdef_before == nnx.graphdef(sample_model),
      )
      repeat_call_s = [[round(t, 2) for t in backend.call_s]]
      for step in range(1, FLAGS.rollouts):
        timed_rollout(step)
        repeat_call_s.append([round(t, 2) for t in backend.call_s])
        report.update(rollout_call_s=repeat_call_s, rollouts_compile=clock.split())
    del sample_model
    kinds = {}
    for o in ro.outcomes:
      kinds[o.failure_kind] = kinds.get(o.failure_kind, 0) + 1
    calls = -(-FLAGS.tasks // FLAGS.groups_per_batch)
    run_s = max(ro.sample_s - compiled["compile_s"], 1e-9)
    report.update(
      rows=len(ro.trajectories),
      sampler_calls=calls,
      rows_per_call=FLAGS.groups_per_batch * FLAGS.group_size,
      commit_rows=FLAGS.commit_rows,
      decode_tiles=dataclasses.asdict(scfg.decode_tiles),
      prefill_chunk=scfg.prefill_chunk,
      prefill_once_per_group=scfg.prefill_once_per_group,
      # the groups `DecodeTiles.cascade` and the grouped prefill find in a call's rows (as
      # sampler.decode does)
      prompt_group=sampler_lib.prompt_group(
        sampler_lib.prompt_sources(
          [g.prompt_ids for g in groups[: FLAGS.groups_per_batch] for _ in range(g.size)]
        )
      ),
      kv_cache_dtype=str(scfg.cache_dtype(mcfg)),
      new_tokens=FLAGS.new_tokens,
      prompt_len=FLAGS.prompt_len,
      generated_tokens=ro.generated_tokens,
      forwards=ro.forwards,
      tokens_per_forward=round(ro.generated_tokens / max(ro.steps_used, 1), 3),
      sample_s=round(ro.sample_s, 2),
      sample_compile=compiled,
      sample_s_per_call=round(ro.sample_s / calls, 3),
      sample_call_s=repeat_call_s[0],
      # a batch forward, prefill included
      ms_per_forward=round(1e3 * ro.sample_s / max(ro.forwards, 1), 2),
      generated_tok_per_s=round(ro.generated_tokens / ro.sample_s, 1),
      # the same without what was compiled inside the timed calls (equal when nothing was)
      ms_per_forward_run=round(1e3 * run_s / max(ro.forwards, 1), 2),
      generated_tok_per_s_run=round(ro.generated_tokens / run_s, 1),
      verify_wait_s=round(ro.verify_wait_s, 2),
      judge_requests=ro.judge_requests,
      failure_kinds=kinds,
      reward_sum=float(ro.rewards.sum()),
    )
    if hasattr(judge, "close"):
      judge.close()
    if holder and "server" in holder:
      holder["server"].__exit__(None, None, None)

  # Update on the same rollouts with synthetic advantages (all groups would be dropped).
  for t in ro.trajectories:
    t.advantage = float(rng.standard_normal())
  report.update(peak_mem_gib_after_rollout=round(_peak() / 2**30, 1))
  if FLAGS.update_steps == 0:
    report.update(wall_s=round(time.perf_counter() - t_all, 1), update="skipped (--update_steps=0)")
    return
  tcfg = tracerl.TraceRLConfig(
    layout=plan.layout,
    gather_trained=FLAGS.gather_trained,
    old_logp=FLAGS.old_logp,
    batch_units=FLAGS.batch_units,
  )
  run_trajs = ro.trajectories[: max(1, FLAGS.update_steps) * FLAGS.rows_per_update]
  t0 = time.perf_counter()
  batches = tracerl.build_batches(
    run_trajs,
    tcfg,
    block_size=mcfg.block_size,
    mask_token_id=mcfg.mask_token_id,
    rows_per_batch=FLAGS.rows_per_update,
    pad_id=mcfg.pad_token_id or 0,
    length_multiple=128,
    rng=np.random.default_rng(FLAGS.seed),
    max_length=plan.row_len,
  )
  # packed: one row per response; per_round: one per (response, round), more batches
  n_batches = -(-len(batches) * len(ro.trajectories) // len(run_trajs))
  batches = batches[: max(1, FLAGS.update_steps)]
  accum = FLAGS.rows_per_update // plan.micro_rows
  build_s = time.perf_counter() - t0
  report.update(
    build_batches_s=round(build_s, 2),
    build_batches_s_extrapolated=round(build_s * len(ro.trajectories) / len(run_trajs), 1),
    optimizer_steps=n_batches,
    row_len=int(batches[0]["tokens"].shape[1]),
    trained_tokens_run=int(sum(b["p_mask"].sum() for b in batches)),
    input_tokens_run=int(sum(b["tokens"].size for b in batches)),
    real_tokens_run=int(sum((b["segment_ids"] > 0).sum() for b in batches)),
    accum_steps=accum,
    micro_rows=plan.micro_rows,
    rows_per_update=FLAGS.rows_per_update,
    estimate_row_len=plan.row_len,
    gather_trained=FLAGS.gather_trained,
    old_logp=FLAGS.old_logp,
    flash_live_only=FLAGS.flash_live_only,
    lm_head_positions=int(batches[0]["trained_index"].shape[1]) if FLAGS.gather_trained else None,
  )
  loss_fn = lambda m, b, r: tracerl.tracerl_loss(m, b, r, tcfg)  # noqa: E731
  train_graphdef, _ = nnx.split(  # the update's remat policy, the same parameters
    nnx.eval_shape(lambda: Transformer(mcfg.replace(remat=plan.remat), rngs=nnx.Rngs(0))),
    nnx.Param,
  )
  step_fn = ts.jit_train_step(
    ts.make_train_step(
      train_graphdef,
      tx,
      loss_fn,
      accum_steps=accum,
      means=tracerl.METRIC_MEANS,
      is_empty=tracerl.is_empty,
    ),
    shardings,
    mesh,
    accum,
  )
  key = jax.random.key(FLAGS.seed)
  run = batches
  old_s, step_s, losses = [], [], []
  sharded = [ts.shard_batch(b, mesh, accum) for b in run]
  if FLAGS.old_logp == "trainer":  # old log-probs of every mini-batch first, as the loop does
    old_fn = tracerl.jit_token_logprobs(graphdef, shardings["params"], mesh, accum)
    for sb in sharded:
      t0 = time.perf_counter()
      sb["old_logp"] = jax.block_until_ready(old_fn(state["params"], sb))
      old_s.append(time.perf_counter() - t0)
  for sb in sharded:
    t0 = time.perf_counter()
    state, m = step_fn(state, sb, key)
    m = jax.device_get(m)
    step_s.append(time.perf_counter() - t0)
    losses.append(float(m["loss"]))

  def steady(xs):  # the mean after the first (compiling) call
    return (float(np.mean(xs[1:])) if len(xs) > 1 else float(xs[0])) if xs else 0.0

  n = n_batches
  report.update(
    old_logp_s=[round(x, 2) for x in old_s],
    optimizer_step_s=[round(x, 2) for x in step_s],
    loss=losses,
    old_logp_steady_s=round(steady(old_s), 2),
    optimizer_step_steady_s=round(steady(step_s), 2),
    update_s_extrapolated=round(n * (steady(old_s) + steady(step_s)), 1),
    update_incl_rows_s_extrapolated=round(
      build_s * len(ro.trajectories) / len(run_trajs) + n * (steady(old_s) + steady(step_s)), 1
    ),
    update_input_tok_per_s=round(run[0]["tokens"].size / steady(step_s), 1),
    **update_mfu(mcfg, run, steady(step_s)),
    peak_mem_gib=round(_peak() / 2**30, 1),
    update_estimate_gib=plan_gib(plan),
  )
  if FLAGS.profile_dir:
    state, prof = bench_common.profile_step(
      step_fn, state, run[0], mesh, accum, key, FLAGS.profile_dir, FLAGS.profile_micro_steps
    )
    report.update(profile=prof)
  build_all = build_s * len(ro.trajectories) / len(run_trajs)
  update_all = build_all + n * (steady(old_s) + steady(step_s))
  if FLAGS.rollout == "synthetic":
    report.update(wall_s=round(time.perf_counter() - t_all, 1))
    return
  total = ro.sample_s + ro.verify_wait_s + update_all
  report.update(
    rl_step_s_extrapolated=round(total, 1),
    time_split={
      "sampling": round(ro.sample_s / total, 3),
      "verifier_wait": round(ro.verify_wait_s / total, 3),
      "update": round(update_all / total, 3),
    },
    wall_s=round(time.perf_counter() - t_all, 1),
  )


if __name__ == "__main__":
  from experiments import _cli

  _cli.quiet_jax_start()
  app.run(main)
