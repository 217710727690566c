"""Identical work in flight runs once: the first caller for a key does it, later callers await its result.

Results worth keeping (``keep(result)``) stay for later callers, least recently used first out above
``max_entries``; the others (timeouts, crashes) are dropped once delivered, so a retry does the work again.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Awaitable, Callable, Generic, TypeVar

T = TypeVar("T")


class SingleFlight(Generic[T]):
  def __init__(self, keep: Callable[[T], bool], max_entries: int = 20000):
    self.keep, self.max_entries = keep, max_entries
    self.entries: collections.OrderedDict[str, asyncio.Future] = collections.OrderedDict()
    self.hits = 0

  async def run(self, key: str, work: Callable[[], Awaitable[T]]) -> tuple[T, str]:
    """(result, how): ``how`` is "own" (this caller did the work), "joined" (another caller's work was in
    flight) or "kept" (a kept result of earlier work)."""
    fut = self.entries.get(key)
    if fut is not None:
      self.hits += 1
      self.entries.move_to_end(key)
      how = "kept" if fut.done() else "joined"
      return await asyncio.shield(fut), how
    fut = asyncio.get_running_loop().create_future()
    self.entries[key] = fut
    try:
      result = await work()
    except BaseException as e:
      self.entries.pop(key, None)
      fut.set_exception(e)
      fut.exception()  # retrieved: later waiters re-raise it themselves
      raise
    if not self.keep(result):
      self.entries.pop(key, None)
    fut.set_result(result)
    while len(self.entries) > self.max_entries and next(iter(self.entries.values())).done():
      self.entries.popitem(last=False)
    return result, "own"
