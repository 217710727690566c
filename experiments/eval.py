r"""KernelBench evaluation of a model (or of known candidates) through the verifier service, with a report.

  python -m experiments.eval --hf_dir=DIR --levels=1,2,3 --verifier=HOST:PORT --out=RUN
  python -m experiments.eval --checkpoint=SFT_RUN --levels=1 --problems=1-10 --verifier=local --out=RUN
  python -m experiments.eval --candidates=known.jsonl --levels=1 --verifier=local --out=RUN
  python -m experiments.eval --report_only --out=RUN      # rebuild the report (e.g. after reviews)

Prompts: KernelBench's one-shot prompt in the tokenizer's chat template (as DICE evaluates). Decoding:
DICE's (greedy, low_confidence_static, block 4, 4 steps, 4,096 new tokens, blocks aligned to position 0,
unfiltered confidence); every setting is a flag. Verification: 5 correctness trials, 100 timing trials
after 3 warm-ups, atol = rtol = 1e-2, eager PyTorch baseline (and torch.compile with
--compile_baseline); the verifier caches reference timings per reference and GPU, and each record names
its GPU. RUN/records.jsonl gets one line per (problem, sample) as it is verified; a rerun with the same
flags resumes. RUN/report.md (+ metrics.json, PNGs) is written at the end. --verifier=local starts a
verifier service as a child process (device: --verifier_device). Nothing is written to RUN before the
verifier answers (up to --verifier_wait_s, a progress line every 10 s; --verifier=local: RUN/verifier/). Speedups above --review_speedup are
flagged, not counted in fast_p > 0 until accepted in RUN/reviews.json (see dice_jax/eval/metrics.py).
On a GPU host that also generates, give the verifier memory: XLA_PYTHON_CLIENT_MEM_FRACTION=0.4.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys

from absl import app, flags

from dice_jax.errors import UserError
from experiments import _cli
from experiments.data_root import data_path

FLAGS = flags.FLAGS

flags.DEFINE_string("hf_dir", None, "HF checkpoint directory of the model.")
flags.DEFINE_string("checkpoint", None, "SFT or RL run directory (its latest checkpoint).")
flags.DEFINE_string("tokenizer_dir", None, "Tokenizer (default: the model's).")
flags.DEFINE_string("candidates", None, "JSONL of known candidates instead of a model.")
flags.DEFINE_string(
  "kernelbench",
  None,
  "KernelBench problems: level{N}.jsonl file or directory, checkout "
  "(default: DATA_ROOT/kernelbench).",
)
flags.DEFINE_list("levels", ["1", "2", "3"], "KernelBench levels.")
flags.DEFINE_string("problems", "", "Problem ids within each level, e.g. 1-10,19 (default: all).")
flags.DEFINE_integer("samples", 1, "Samples per problem (k > 1 needs --temperature > 0).")
flags.DEFINE_list("pass_at_k", ["1", "5", "10"], "k values of pass@k (when --samples > 1).")
flags.DEFINE_string(
  "verifier", None, "Verifier address HOST:PORT[,HOST:PORT...] or 'local' (a child service)."
)
flags.DEFINE_enum("verifier_device", "cuda", ["cuda", "cpu"], "Device of --verifier=local.")
flags.DEFINE_string("out", None, "Run directory (records, report).")
flags.DEFINE_bool("allow_config_change", False, "Resume --out even if its settings differ.")
flags.DEFINE_bool("report_only", False, "Only rebuild the report of --out.")
flags.DEFINE_bool("progress", True, "Show a progress bar.")
_cli.define_compile_cache_flag()
# decoding (DICE's evaluation decoding by default)
flags.DEFINE_integer("block_size", 0, "Block size (0: the model's; another is refused).")
flags.DEFINE_integer("steps", 4, "Denoising steps per block.")
flags.DEFINE_string("strategy", "low_confidence_static", "Remasking strategy.")
flags.DEFINE_float("threshold", 0.9, "Confidence threshold (low_confidence_dynamic).")
flags.DEFINE_float("temperature", 0.0, "Temperature (0 = greedy).")
flags.DEFINE_integer("top_k", 0, "Top-k (0 = off).")
flags.DEFINE_float("top_p", 1.0, "Top-p (1 = off).")
flags.DEFINE_integer("max_new_tokens", 4096, "New tokens per sample at most.")
flags.DEFINE_integer(
  "max_prompt_tokens", 4096, "Prompt tokens kept, from the start (DICE's evaluation: 4096; 0: all)."
)
flags.DEFINE_enum("block_alignment", "absolute", ["absolute", "response"], "Block grid alignment.")
flags.DEFINE_enum("confidence", "unfiltered", ["unfiltered", "filtered"], "Confidence for ranking.")
flags.DEFINE_enum(
  "extract",
  "first_block",
  ["first_block", "first_block_or_raw"],
  "Candidate = the first fenced code block (KernelBench), or the raw response when there is none.",
)
flags.DEFINE_integer("batch_size", 8, "Prompts decoded together.")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_string("attention_impl", "dense", "Model attention: dense | flash | ...")
flags.DEFINE_string("param_dtype", "bfloat16", "Parameter dtype of --hf_dir models.")
# verification (KernelBench's eval_from_generations defaults, DICE's tolerance)
flags.DEFINE_integer("num_correct_trials", 5, "Correctness trials (random inputs) per candidate.")
flags.DEFINE_integer("num_perf_trials", 100, "Timing trials per candidate and baseline.")
flags.DEFINE_integer("num_warmup", 3, "Warm-up calls before timing.")
flags.DEFINE_float("atol", 1e-2, "Absolute tolerance of the correctness check.")
flags.DEFINE_float("rtol", 1e-2, "Relative tolerance of the correctness check.")
flags.DEFINE_float("timeout_s", 180.0, "Run-stage wall-clock limit per candidate, in seconds.")
flags.DEFINE_enum(
  "strictness",
  "strict",
  ["strict", "kernelbench", "off"],
  "Anti-cheating rules (off: correctness only, as DICE's vendored KernelBench).",
)
flags.DEFINE_string("device", None, "Verifier device for the requests (default: the server's).")
flags.DEFINE_bool("compile_baseline", False, "Also time correct kernels against torch.compile.")
flags.DEFINE_float("review_speedup", 10.0, "Flag speedups above this for review (KernelBench: 10).")
_cli.define_verifier_wait_flag()


def _kernelbench() -> str:
  return FLAGS.kernelbench or data_path("kernelbench")


def _problem_ids(spec: str) -> set[int] | None:
  if not spec.strip():
    return None
  ids: set[int] = set()
  for part in spec.split(","):
    lo, _, hi = part.strip().partition("-")
    try:
      ids.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
      raise UserError(f"--problems: {part!r} is not an id or a range like 1-10") from None
  return ids


def load_problems():
  from dice_jax.data.tasks import DataError, load_kernelbench

  try:
    levels = sorted({int(x) for x in FLAGS.levels})
  except ValueError:
    raise UserError(f"--levels must be integers, got {FLAGS.levels}") from None
  try:
    tasks, _ = load_kernelbench(_kernelbench(), levels)
  except DataError as e:
    raise UserError(f"--kernelbench: {e}") from None
  ids = _problem_ids(FLAGS.problems)
  if ids is not None:
    tasks = [t for t in tasks if int(t.task_id.rsplit("/", 1)[1]) in ids]
  if not tasks:
    raise UserError(f"no problems of levels {levels} {FLAGS.problems} in {_kernelbench()}")
  return tasks


def decoding():
  from dice_jax.eval.candidates import EvalDecoding

  if FLAGS.samples > 1 and FLAGS.temperature == 0:
    raise UserError("--samples > 1 needs --temperature > 0 (greedy decoding repeats one sample)")
  try:
    return EvalDecoding(
      block_size=FLAGS.block_size,
      steps=FLAGS.steps,
      strategy=FLAGS.strategy,
      threshold=FLAGS.threshold,
      temperature=FLAGS.temperature,
      top_k=FLAGS.top_k,
      top_p=FLAGS.top_p,
      max_new_tokens=FLAGS.max_new_tokens,
      max_prompt_tokens=FLAGS.max_prompt_tokens,
      block_alignment=FLAGS.block_alignment,
      confidence=FLAGS.confidence,
      extract=FLAGS.extract,
    )
  except ValueError as e:
    raise UserError(str(e)) from None


def verify_options() -> dict:
  from dice_jax.eval.verifying import EVAL_OPTIONS

  opts = dict(
    EVAL_OPTIONS,
    num_correct_trials=FLAGS.num_correct_trials,
    num_perf_trials=FLAGS.num_perf_trials,
    num_warmup=FLAGS.num_warmup,
    atol=FLAGS.atol,
    rtol=FLAGS.rtol,
    timeout_s=FLAGS.timeout_s,
    strictness=FLAGS.strictness,
  )
  if FLAGS.device:
    opts["device"] = FLAGS.device
  return opts


def check_model_paths() -> None:
  """--hf_dir / --checkpoint name directories: checked before anything is written or compiled."""
  for name in ("hf_dir", "checkpoint"):
    path = getattr(FLAGS, name)
    if path and not os.path.isdir(path):
      raise UserError(f"--{name} {path}: no such directory")


def load_model():
  """(model, tokenizer, description) of --hf_dir or --checkpoint."""
  from dice_jax.data.tokenizer import Tokenizer

  check_model_paths()
  if FLAGS.hf_dir:
    from dice_jax.hf import checkpoint as hf_ckpt

    try:
      model, _ = hf_ckpt.import_hf(
        FLAGS.hf_dir, param_dtype=FLAGS.param_dtype, attention_impl=FLAGS.attention_impl
      )
    except hf_ckpt.CheckpointError as e:
      raise UserError(f"--hf_dir: {e}") from None
    source, tok_dir = os.path.abspath(FLAGS.hf_dir), FLAGS.hf_dir
  else:
    from dice_jax.train.run_setup import restore_run_params
    from dice_jax import sharding

    try:
      model, _, tok_dir = restore_run_params(FLAGS.checkpoint, sharding.make_mesh())
    except FileNotFoundError as e:
      raise UserError(f"--checkpoint: {e}") from None
    if tok_dir is None and not FLAGS.tokenizer_dir:
      raise UserError(f"--checkpoint {FLAGS.checkpoint} has no tokenizer: pass --tokenizer_dir")
    source = os.path.abspath(FLAGS.checkpoint)
  tok_dir = FLAGS.tokenizer_dir or tok_dir
  try:
    tok = Tokenizer.from_dir(tok_dir)
  except Exception as e:  # missing files, or files of another kind of tokenizer
    raise UserError(f"no usable tokenizer in {tok_dir} ({e}); pass --tokenizer_dir") from None
  return model, tok, {"source": source, "num_params": int(model.cfg.num_params())}


def environment(with_model: bool) -> dict:
  """Hardware and versions for the report (JAX is not touched for known candidates: it would claim
  GPU memory that the verifier on the same host needs)."""
  env = {
    "python": platform.python_version(),
    "host": f"{platform.machine()}, {os.cpu_count()} CPUs",
  }
  if not with_model:
    return {**env, "learner_devices": "none (known candidates)"}
  import flax
  import jax

  return {
    **env,
    "learner_devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
    "jax": jax.__version__,
    "flax": flax.__version__,
  }


def _check_flags() -> None:
  if not FLAGS.out:
    raise UserError("--out is required")
  if FLAGS.report_only:
    return
  sources = [f for f in ("hf_dir", "checkpoint", "candidates") if getattr(FLAGS, f)]
  if len(sources) != 1:
    raise UserError("pass exactly one of --hf_dir, --checkpoint and --candidates")
  if not FLAGS.verifier:
    raise UserError("--verifier is required (HOST:PORT[,HOST:PORT...] or local)")
  if FLAGS.verifier != "local":
    _cli.verifier_endpoints(FLAGS.verifier)
  if FLAGS.candidates and not os.path.isfile(FLAGS.candidates):
    raise UserError(f"--candidates {FLAGS.candidates}: no such file")
  if FLAGS.review_speedup <= 1:
    raise UserError(f"--review_speedup must be > 1, got {FLAGS.review_speedup}")
  if FLAGS.samples < 1:
    raise UserError(f"--samples must be >= 1, got {FLAGS.samples}")
  _pass_at_k()
  _cli.verifier_wait_s()


def _pass_at_k() -> list[int]:
  """The k values of --pass_at_k (none for one sample); a UserError unless each is an integer >= 1."""
  try:
    ks = sorted({int(k) for k in FLAGS.pass_at_k})
  except ValueError:
    raise UserError(f"--pass_at_k must be integers, got {FLAGS.pass_at_k}") from None
  if ks and ks[0] < 1:
    raise UserError(f"--pass_at_k values must be >= 1, got {FLAGS.pass_at_k}")
  return ks if FLAGS.samples > 1 else []


def run() -> str:
  from dice_jax.eval import records, report
  from dice_jax.eval.candidates import FileCandidates, ModelCandidates
  from dice_jax.eval.runner import Evaluator

  _check_flags()
  if FLAGS.report_only:
    try:
      return report.write_report(FLAGS.out)
    except records.RunError as e:
      raise UserError(str(e)) from None
  tasks = load_problems()
  cache = None
  dec = None if FLAGS.candidates else decoding()
  opts = verify_options()
  ks = _pass_at_k()
  if FLAGS.candidates:
    try:
      source = FileCandidates(FLAGS.candidates, tasks)
    except ValueError as e:
      raise UserError(str(e)) from None
    model_desc = {"source": os.path.abspath(FLAGS.candidates), "num_params": 0}
  else:
    check_model_paths()
    cache = _cli.use_compile_cache(FLAGS.out)  # before the model's programs compile
    model, tok, model_desc = load_model()
    try:
      source = ModelCandidates(model, tok, dec, FLAGS.batch_size, FLAGS.seed)
    except ValueError as e:
      raise UserError(str(e)) from None
  settings = {
    "model": model_desc,
    "problems_source": os.path.abspath(_kernelbench()),
    "problems": [{"task_id": t.task_id, "level": t.level, "name": t.name} for t in tasks],
    "samples": FLAGS.samples,
    "pass_at_k": ks,
    "decoding": None if dec is None else dataclasses.asdict(dec),
    "verify": opts,
    "baselines": ["eager", "compile"] if FLAGS.compile_baseline else ["eager"],
    "review_speedup": FLAGS.review_speedup,
  }
  try:
    records.check_manifest(FLAGS.out, settings, FLAGS.allow_config_change)
  except records.RunError as e:
    raise UserError(str(e)) from None
  with _VerifierSession(opts) as verifier:  # reachable before anything is written
    records.write_manifest(FLAGS.out, settings, environment(not FLAGS.candidates))
    log = records.RecordLog(FLAGS.out)
    print(
      f"eval: {len(tasks)} problems x {FLAGS.samples} samples, {len(log)} already done; "
      f"records in {log.path}",
      flush=True,
    )
    s = Evaluator(
      log,
      source,
      verifier,
      compile_baseline=FLAGS.compile_baseline,
      review_speedup=FLAGS.review_speedup,
      progress=FLAGS.progress,
    ).run(tasks, FLAGS.samples)
  print(f"eval: {s.line()}")
  if cache:
    print(f"eval: {cache.summary()}", flush=True)
  return report.write_report(FLAGS.out)


def _say(line: str) -> None:
  print(f"eval: {line}", flush=True)


class _VerifierSession:
  """The verifier of --verifier: remote endpoints, or a local child service for the run."""

  def __init__(self, opts: dict):
    self.opts, self.local, self.client = opts, None, None

  def __enter__(self):
    from dice_jax.eval.verifying import GrpcCandidateVerifier

    addresses = FLAGS.verifier.split(",")
    if FLAGS.verifier == "local":
      from verifier.serve.local import LocalVerifier, VerifierStartError

      self.local = LocalVerifier(
        os.path.join(FLAGS.out, "verifier"),
        device=FLAGS.verifier_device,
        compile_workers=max(1, (os.cpu_count() or 2) // 2),
        start_timeout_s=_cli.verifier_wait_s(),
        report=_say,
      )
      print(f"eval: starting a local {FLAGS.verifier_device} verifier ...", flush=True)
      try:
        self.local.__enter__()
      except VerifierStartError as e:
        raise UserError(str(e).splitlines()[0]) from None
      addresses = [self.local.address]
    try:
      self.client = GrpcCandidateVerifier(
        addresses,
        self.opts,
        token=None if not self.local else "",
        ready_timeout_s=_cli.verifier_wait_s(),
        report=_say,
      )
    except ConnectionError as e:
      self.__exit__(None, None, None)
      raise UserError(str(e)) from None
    return self.client

  def __exit__(self, *exc):
    if self.client is not None:
      self.client.close()
    if self.local is not None:
      self.local.__exit__(*exc)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  _cli.quiet_orbax()
  try:
    path = run()
  except KeyboardInterrupt:
    print(
      f"eval: interrupted; the records so far are in {FLAGS.out}, a rerun resumes", file=sys.stderr
    )
    sys.exit(130)
  print(f"report: {path}")


if __name__ == "__main__":
  _cli.run(main)
