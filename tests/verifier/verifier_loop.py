"""An asyncio loop in a background thread, for module-scoped verifier services shared by sync tests."""

import asyncio
import contextlib
import threading


class BackgroundLoop:
  def __init__(self):
    self.loop = asyncio.new_event_loop()
    self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
    self.thread.start()

  def run(self, coro, timeout=1800):
    """``coro``'s result; if the wait ends otherwise (a timeout, Ctrl-C, a time limit's SIGINT), the
    coroutine is cancelled in the loop, where it unwinds (a verifier's jobs kill their processes) rather
    than being destroyed pending when the loop stops."""
    fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
    try:
      return fut.result(timeout)
    except BaseException:
      fut.cancel()
      raise

  def close(self):
    self.loop.call_soon_threadsafe(self.loop.stop)
    self.thread.join(10)


@contextlib.contextmanager
def cpu_service(root, **config):
  """A started CPU verifier service under ``root`` (builds and scratch there; one compile worker, no
  PCH unless ``config`` says otherwise), as ``(loop, service)``; closed afterwards, and no scratch
  directory may be left behind."""
  from verifier.serve.service import ServiceConfig, VerifierService

  defaults = dict(
    device="cpu",
    cpu_slots=1,
    compile_workers=1,
    cache_dir=str(root / "builds"),
    scratch_root=str(root / "scratch"),
    mem_mb=3072,
    build_timeout_s=300,
    use_pch=False,
  )
  loop = BackgroundLoop()
  svc = VerifierService(ServiceConfig(**{**defaults, **config}))
  loop.run(svc.start())
  try:
    yield loop, svc
  finally:
    loop.run(svc.close())
    loop.close()
  assert not list((root / "scratch").glob("*")), "scratch directories left behind"
