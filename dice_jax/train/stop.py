"""SIGTERM (pre-emption) and SIGINT (Ctrl-C) ask a training run to stop, without losing a step.

Inside `StopSignals()` both signals are handled the same way:
  * during start-up (`training` False: loading, building, restoring) there is nothing to save,
    so a signal raises `Interrupted` at once;
  * while training, the first signal sets `requested` (the signal's name): the loop finishes the
    step it is in, saves a checkpoint at that step and returns; a second signal raises
    `Interrupted` (stop now, the last saved checkpoint stands).
A signal that arrives inside a long native call (an XLA compile) is handled when it returns.
The previous handlers are restored on exit.
"""

from __future__ import annotations

import signal

from absl import logging

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(BaseException):
  """A stop signal arrived where the run cannot save first (start-up, or a second signal).

  A BaseException, like KeyboardInterrupt, so that `except Exception` in library code does not
  swallow it."""


class StopSignals:
  """Context manager: turns SIGTERM/SIGINT into a stop request (see the module doc)."""

  def __init__(self):
    self.training = False
    self.requested: str | None = None
    self._previous: dict[int, object] = {}

  def __enter__(self) -> "StopSignals":
    for sig in SIGNALS:
      try:
        self._previous[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread: leave signals alone
        break
    return self

  def _handle(self, signum, frame):
    name = signal.Signals(signum).name
    if not self.training:
      raise Interrupted(f"{name} during start-up: stopped before the first step (nothing to save)")
    if self.requested is not None:
      raise Interrupted(f"second stop signal ({name}): stopped at once; the last checkpoint stands")
    self.requested = name
    logging.warning(
      "%s: finishing this step, saving a checkpoint, then stopping (send it again to stop at once)",
      name,
    )

  def __exit__(self, *exc):
    for sig, previous in self._previous.items():
      signal.signal(sig, previous)
    self._previous.clear()


def run_stoppable(run, **stopped) -> dict:
  """`run(stop)` inside `StopSignals` (the SFT and RL loops' one entry): a stop that cannot save
  first (`Interrupted`) is logged and returns `{**stopped, "preempted": True, "stopped": why}`."""
  with StopSignals() as stop:
    try:
      return run(stop)
    except Interrupted as e:
      logging.warning("%s", e)
      return {**stopped, "preempted": True, "stopped": str(e)}
