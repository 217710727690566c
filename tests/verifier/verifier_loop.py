"""An asyncio loop in a background thread, for module-scoped verifier services shared by sync tests."""

import asyncio
import threading


class BackgroundLoop:
  def __init__(self):
    self.loop = asyncio.new_event_loop()
    self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
    self.thread.start()

  def run(self, coro, timeout=1800):
    return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

  def close(self):
    self.loop.call_soon_threadsafe(self.loop.stop)
    self.thread.join(10)
