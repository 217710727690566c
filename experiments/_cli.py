"""What the absl launchers share: a user error is one line and exit status 2, not a traceback.

  from experiments import _cli
  ...
  if __name__ == "__main__":
    _cli.run(main)

Inside `main`, bad input raises `dice_jax.errors.UserError` (or a subclass: DataError,
TokenizerError, CheckpointError, ConfigChangedError, ...), `absl.app.UsageError`, or one of the
OSErrors that name a path (missing file, existing output, file where a directory was expected).
`run` prints it as `<launcher>: error: <message>` on stderr and exits 2. Ctrl-C outside the
places that handle it prints `<launcher>: interrupted` and exits 130. Any other exception is a
bug and keeps its traceback. `user_errors_from(ValueError)` marks a block whose errors of those
types are the user's (e.g. building a config from `--set` overrides).

A launcher that runs as several JAX processes calls `define_multiprocess_flags()` where it
defines its flags and `join_processes()` first thing in `main`. A launcher that talks to a verifier
defines `--verifier_wait_s` with `define_verifier_wait_flag()` and reads it with `verifier_wait_s()`;
`verifier_endpoints()` reads its `--verifier` addresses. A launcher that compiles calls
`define_compile_cache_flag()` with its flags and `use_compile_cache(run_dir)` before anything is
compiled (JAX's persistent compilation cache, `dice_jax/compile_cache.py`).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import logging as std_logging
import os
import sys

from absl import app, flags, logging

from dice_jax.errors import UserError

JAX_BACKEND_LOGGER = "jax._src.xla_bridge"  # where JAX logs the backends it could not start
# Device nodes of an accelerator JAX could use: TPU chips (/dev/accel*, or /dev/vfio/N on newer TPU
# VMs), NVIDIA GPUs (/dev/nvidiaN, /proc/driver/nvidia/gpus/*) and AMD GPUs (/dev/kfd).
ACCELERATOR_NODES = (
  "/dev/accel*",
  "/dev/vfio/[0-9]*",
  "/dev/nvidia[0-9]*",
  "/proc/driver/nvidia/gpus/*",
  "/dev/kfd",
)
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
USER_ERRORS = (
  UserError,
  app.UsageError,
  FileNotFoundError,
  FileExistsError,
  NotADirectoryError,
  IsADirectoryError,
  PermissionError,
)


def _prog() -> str:
  main = sys.modules.get("__main__")
  spec = getattr(main, "__spec__", None)
  if spec is not None and spec.name:
    return spec.name.rsplit(".", 1)[-1]
  return os.path.basename(sys.argv[0]) or "dice_jax"


def message(e: BaseException) -> str:
  """The one-line text of a user error (an OSError as 'what: path')."""
  if isinstance(e, OSError) and e.filename is not None and e.strerror:
    text = f"{e.strerror}: {e.filename}"
  else:
    text = str(e) or type(e).__name__
  return " ".join(text.split())


def fail(text: str, code: int = EXIT_USER_ERROR):
  """Prints `<launcher>: error: text` on stderr and exits with `code`."""
  print(f"{_prog()}: error: {text}", file=sys.stderr, flush=True)
  sys.exit(code)


def guarded(main):
  """`main` with user errors turned into one line + exit 2 and Ctrl-C into one line + 130."""

  @functools.wraps(main)
  def wrapper(argv):
    try:
      return main(argv)
    except USER_ERRORS as e:
      fail(message(e))
    except KeyboardInterrupt:
      print(f"{_prog()}: interrupted", file=sys.stderr, flush=True)
      sys.exit(EXIT_INTERRUPTED)

  return wrapper


def run(main) -> None:
  """`absl.app.run(main)` with `guarded`; every launcher takes `--data_root` (data_root.py) and
  keeps JAX's note about a missing TPU off the console (`quiet_missing_tpu`), and libtpu's
  warnings too on a host with no accelerator (`default_platforms`)."""
  from experiments import data_root

  data_root.define_flag()
  quiet_jax_start()
  app.run(guarded(main))


def quiet_jax_start() -> None:
  """No note about a missing TPU (`quiet_missing_tpu`), and on a host with no accelerator the CPU
  alone for JAX (`default_platforms`), so no libtpu warnings either. Before JAX starts a backend."""
  quiet_missing_tpu()
  if default_platforms(os.environ, accelerator_nodes()) == "cpu":
    import jax

    jax.config.update("jax_platforms", "cpu")


def accelerator_nodes() -> list[str]:
  """The host's accelerator device nodes (`ACCELERATOR_NODES`)."""
  return [p for pattern in ACCELERATOR_NODES for p in glob.glob(pattern)]


def default_platforms(environ, nodes) -> str | None:
  """The platforms a launcher gives JAX when the user named none: "cpu" on a host with no
  accelerator device node (JAX could find nothing else there, and an installed libtpu, the
  `tpu-compile` extra, would otherwise start, find no TPU and print five lines of warnings on
  every launch), else None (JAX looks at every backend it knows). JAX_PLATFORMS, if set, wins."""
  if "JAX_PLATFORMS" in environ or nodes:
    return None
  return "cpu"


class _NoMissingTpu(std_logging.Filter):
  """Drops JAX's INFO line `Unable to initialize backend 'tpu': ... libtpu.so ...` (JAX tries every
  backend it knows when JAX_PLATFORMS is unset, and logs each one that is not there)."""

  def filter(self, record):
    return not (
      record.levelno < std_logging.WARNING
      and str(record.msg).startswith("Unable to initialize backend 'tpu'")
    )


def quiet_missing_tpu() -> None:
  """Unless the user asked for a TPU (JAX_PLATFORMS names tpu), JAX's note that it found none is
  not printed. A filter on JAX's backend logger only: other JAX lines, and errors, still pass."""
  if "tpu" not in os.environ.get("JAX_PLATFORMS", "").lower():
    std_logging.getLogger(JAX_BACKEND_LOGGER).addFilter(_NoMissingTpu())


@contextlib.contextmanager
def user_errors_from(*types: type[BaseException]):
  """Re-raises exceptions of `types` from the block as UserError (same message)."""
  try:
    yield
  except types as e:
    raise UserError(message(e)) from e


class _QuietOrbax(std_logging.Filter):
  """Drops orbax's per-save INFO chatter (warnings and errors still pass)."""

  def filter(self, record):
    return record.levelno >= std_logging.WARNING or "/orbax/" not in record.pathname


def quiet_orbax() -> None:
  """Keeps orbax's INFO lines off the console of a training launcher."""
  quiet = _QuietOrbax()
  logging.get_absl_handler().addFilter(quiet)
  std_logging.getLogger("absl").addFilter(quiet)  # also when another handler prints absl records


def define_multiprocess_flags() -> None:
  """`--distributed`, `--coordinator_address`, `--num_processes`, `--process_id`,
  `--heartbeat_timeout_s` (read by `join_processes`)."""
  flags.DEFINE_bool("distributed", False, "call jax.distributed.initialize() (multi-host)")
  flags.DEFINE_string("coordinator_address", None, "multi-host coordinator host:port")
  flags.DEFINE_integer("num_processes", None, "multi-host: number of processes")
  flags.DEFINE_integer("process_id", None, "multi-host: this process's id")
  flags.DEFINE_integer(
    "heartbeat_timeout_s",
    100,
    "multi-host: a process that sent no heartbeat for this long is dead, and the others exit",
  )


def join_processes() -> None:
  """Joins the JAX cluster the multi-process flags name (before any other JAX call); processes
  other than 0 then log warnings and errors only. Without those flags: nothing."""
  f = flags.FLAGS
  if f.distributed or f.coordinator_address is not None:
    from dice_jax import distributed

    distributed.initialize(
      f.coordinator_address,
      f.num_processes,
      f.process_id,
      heartbeat_timeout_s=f.heartbeat_timeout_s,
    )
    distributed.primary_logs_only()
  elif f.num_processes is not None or f.process_id is not None:
    raise UserError("--num_processes/--process_id need --coordinator_address (or --distributed)")


def define_verifier_wait_flag() -> None:
  """`--verifier_wait_s`: how long to wait at start for the verifier to answer (the same flag and
  default in every launcher and `python -m verifier check`: `verifier.api.waiting`)."""
  from verifier.api import waiting

  flags.DEFINE_float(
    waiting.WAIT_FLAG.lstrip("-"),
    waiting.VERIFIER_WAIT_S,
    "seconds to wait at start for the verifier to answer (a progress line every "
    f"{waiting.WAIT_PROGRESS_EVERY_S:g} s meanwhile); --verifier=local: for it to start",
  )


def verifier_endpoints(value: str) -> list[str]:
  """`--verifier`'s HOST:PORT[,HOST:PORT...] as addresses; a UserError naming a malformed one."""
  from verifier.api.client import parse_endpoints

  try:
    return parse_endpoints(value)
  except ValueError as e:
    raise UserError(f"--verifier: {e}") from None


def verifier_wait_s() -> float:
  """The value of `--verifier_wait_s`; a UserError when it is not > 0."""
  from verifier.api import waiting

  try:
    return waiting.check_wait_s(flags.FLAGS.verifier_wait_s)
  except ValueError as e:
    raise UserError(str(e)) from None


def define_compile_cache_flag() -> None:
  """`--compile_cache` (read by `use_compile_cache`)."""
  flags.DEFINE_string(
    "compile_cache",
    "",
    "JAX's persistent compilation cache: a directory (shared by runs that use it), 'off', or "
    "empty for RUN_DIR/compile_cache (a restart of the run reads its programs back)",
  )


def use_compile_cache(run_dir: str):
  """Turns on the compilation cache `--compile_cache` names (default `run_dir/compile_cache`);
  returns its `CacheLog` (None when off). Call before anything is compiled."""
  where = flags.FLAGS.compile_cache
  if where == "off":
    return None
  from dice_jax import compile_cache

  return compile_cache.enable(where or os.path.join(run_dir, "compile_cache"))
