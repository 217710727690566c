"""Build CuKe: verify + time PyTorch->CUDA pairs through the verifier, keep correct ones >= --min_speedup.

  python -m experiments.build_cuke --pairs=pairs.jsonl --verifier=HOST:PORT[,HOST:PORT] --min_speedup=2.0 --out=DIR

Writes DIR/cuke.jsonl (atomic), DIR/summary.json, DIR/speedup_hist.png; DIR/measurements.jsonl is the resume
journal (a rerun skips pairs already measured). Nothing is written before the verifier answers (it
waits up to --verifier_wait_s, with a progress line every 10 s). See dice_jax/data/cuke.py.
"""

import os

from absl import flags, logging

from dice_jax.data.cuke import CukeConfig, build_cuke
from dice_jax.errors import UserError
from experiments import _cli

_PAIRS = flags.DEFINE_string(
  "pairs", None, "JSON/JSONL of {pytorch_code, cuda_code, reasoning?, speedup?, level?}"
)
_VERIFIER = flags.DEFINE_string(
  "verifier", None, "verifier gRPC address(es) HOST:PORT[,HOST:PORT...]"
)
_MIN_SPEEDUP = flags.DEFINE_float(
  "min_speedup", 2.0, "keep pairs with measured speedup >= this (DICE: 2.0)"
)
_OUT = flags.DEFINE_string("out", None, "output directory")
_BATCH = flags.DEFINE_integer(
  "batch_size", 16, "pairs per verifier batch (journal flush granularity)"
)
_ON_ERROR = flags.DEFINE_enum(
  "on_error", "skip", ["skip", "raise"], "bad input rows: skip (and report) or fail"
)
_TRIALS = flags.DEFINE_integer("num_perf_trials", 100, "timing trials per candidate")
_DEVICE = flags.DEFINE_string(
  "device", None, "verifier device ('cuda' | 'cpu'); default: the server's"
)
_cli.define_verifier_wait_flag()
flags.mark_flags_as_required(["pairs", "verifier", "out"])


def main(argv):
  del argv
  from dice_jax.verifier_client import ThreadedVerifier
  from verifier.api.client import VerifierUnavailable

  if not os.path.isfile(_PAIRS.value):  # said before waiting for the verifier
    raise UserError(f"--pairs {_PAIRS.value}: no such file")
  wait_s = _cli.verifier_wait_s()
  options = {"measure_performance": True, "num_perf_trials": _TRIALS.value}
  if _DEVICE.value:
    options["device"] = _DEVICE.value
  with _cli.user_errors_from(ValueError):  # a malformed --verifier address
    client = ThreadedVerifier(_VERIFIER.value, options=options)
  with client:
    logging.info("connecting to the verifier at %s ...", _VERIFIER.value)
    try:
      client.wait_ready(wait_s)
    except VerifierUnavailable as e:
      raise UserError(f"--verifier {_VERIFIER.value}: {e}") from None
    s = build_cuke(
      _PAIRS.value,
      client,
      _OUT.value,
      CukeConfig(min_speedup=_MIN_SPEEDUP.value, batch_size=_BATCH.value, on_error=_ON_ERROR.value),
    )
  print(
    f"pairs in: {s.pairs_in}  invalid rows: {len(s.invalid_rows)}  duplicates: {s.duplicates}  "
    f"unique: {s.unique}  measured now: {s.measured_now}  resumed: {s.resumed}"
  )
  print(
    f"correct: {s.correct}  kept (>= {s.min_speedup:g}x): {s.kept}  by level: {s.kept_by_level}"
  )
  print(f"failures: {s.failure_kinds}")
  logging.info("wrote %s", _OUT.value)


if __name__ == "__main__":
  _cli.run(main)
