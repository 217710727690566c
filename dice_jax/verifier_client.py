"""The learner's face of the one verifier client (``verifier.api.client.VerifierClient``): RL, eval and
the CuKe builder sample or build on the main thread while verification runs, so this adapter owns a
background event-loop thread and offers ``submit`` (a ``concurrent.futures.Future`` of a
``VerifyResult``) and blocking ``verify_batch``. Retries, endpoints and exactly-once delivery are the
client's (see its docstring).

  with ThreadedVerifier("127.0.0.1:50051", options={"measure_performance": True}) as verifier:
    verifier.wait_ready()   # up to verifier.api.waiting.VERIFIER_WAIT_S, logging progress lines
    fut = verifier.submit(task_id, reference, candidate)   # returns at once
    result = fut.result()
    results = verifier.verify_batch([(task_id, reference, candidate), ...])
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Sequence

from absl import logging

from verifier.api.client import VerifierClient
from verifier.api.waiting import VERIFIER_WAIT_S
from verifier.api.contract import VerifyResult


class ThreadedVerifier:
  """Thread-safe blocking face of ``VerifierClient``; keyword arguments go to the client."""

  def __init__(self, endpoints: str | Sequence[str], **kwargs):
    self._loop = asyncio.new_event_loop()
    self._thread = threading.Thread(
      target=self._loop.run_forever, name="verifier-client", daemon=True
    )
    self._thread.start()

    async def make():
      return VerifierClient(endpoints, **kwargs)

    try:
      self.client = self._call(make())
    except BaseException:
      self._stop_loop()
      raise
    self.options = self.client.options

  def _call(self, coro, timeout: float | None = None):
    return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

  @property
  def addresses(self) -> list[str]:
    return self.client.addresses

  def submit(self, task_id: str, reference: str, candidate: str) -> concurrent.futures.Future:
    """Starts verifying one candidate; the returned future holds its ``VerifyResult``."""
    out: concurrent.futures.Future = concurrent.futures.Future()

    async def run():
      try:
        out.set_result(await self.client.submit(task_id, reference, candidate))
      except asyncio.CancelledError:
        out.cancel()
      except Exception as e:  # noqa: BLE001 - handed to the caller
        out.set_exception(e)

    asyncio.run_coroutine_threadsafe(run(), self._loop)
    return out

  def verify(self, task_id: str, reference: str, candidate: str) -> VerifyResult:
    return self.submit(task_id, reference, candidate).result()

  def verify_batch(self, items: Sequence[tuple[str, str, str]]) -> list[VerifyResult]:
    """Results in item order for (task_id, reference, candidate) items (the CuKe builder's call)."""
    return self._call(self.client.verify_many(list(items)))

  def wait_ready(
    self, timeout_s: float = VERIFIER_WAIT_S, report: Callable[[str], None] = logging.info
  ) -> None:
    """Blocks until every endpoint answers (``VerifierClient.wait_ready``: a progress line to
    ``report`` while it waits; ``VerifierUnavailable`` after ``timeout_s``)."""
    self._call(self.client.wait_ready(timeout_s, report))

  def health(self) -> list[dict]:
    return self._call(_value(self.client.health))

  def stats(self) -> dict:
    return self._call(_value(lambda: dict(self.client.stats)))

  def _stop_loop(self) -> None:
    self._loop.call_soon_threadsafe(self._loop.stop)
    self._thread.join(timeout=10)
    self._loop.close()

  def close(self) -> None:
    if self._loop.is_closed():
      return
    self._call(self.client.close(), timeout=10)
    self._stop_loop()

  def __enter__(self) -> "ThreadedVerifier":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


async def _value(fn):
  return fn()
