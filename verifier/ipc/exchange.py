"""Tensors crossing between the checker and a candidate process through shared buffers.

The checker owns every buffer: it allocates one per tensor it sends (inputs) or expects (outputs), fills the
inputs from its private copies, and reads the outputs back into private memory before judging them. A
candidate maps only the buffers it is given, so it never sees the checker's reference, golden outputs or
anything else. Two kinds of buffer:

- ``memfd``: host shared memory (``memfd_create``), for the CPU backend and as the GPU fallback (the candidate
  stages to and from its device);
- ``cuda_vmm``: device memory exported as a file descriptor (``cuda_driver.DeviceMapping``), mapped by the
  candidate with no copy.

Arguments and outputs are described by ``records.Value`` (tensors by ``TensorRef``; numbers, strings, lists
and dtypes by value), so nothing is pickled.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import time

import torch
from torch.overrides import TorchFunctionMode

from verifier.ipc.records import BufferRef, TensorRef, Value

DTYPES = {
  str(d).removeprefix("torch."): d
  for d in (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
  )
}
PROBE_VALUE = 1234.5
FDS_PER_MESSAGE = 32  # buffer descriptors a candidate accepts with one message


class ExchangeError(ValueError):
  """A value that cannot cross (type, dtype, layout) or a reference outside its buffer."""


def dtype_name(dtype: torch.dtype) -> str:
  name = str(dtype).removeprefix("torch.")
  if name not in DTYPES:
    raise ExchangeError(f"tensors of dtype {name} cannot be exchanged")
  return name


def dtype_of(name: str) -> torch.dtype:
  try:
    return DTYPES[name]
  except KeyError:
    raise ExchangeError(f"unknown dtype {name!r}") from None


class SharedBuffer:
  """A buffer of ``nbytes`` bytes seen as a uint8 tensor (``raw``), on the host or the device."""

  kind = ""

  def __init__(self, buffer_id: int, nbytes: int):
    self.id, self.nbytes = buffer_id, nbytes
    self.raw: torch.Tensor | None = None

  def ref(self) -> BufferRef:
    raise NotImplementedError

  def export_fd(self) -> int:
    raise NotImplementedError

  def view(self, t: TensorRef) -> torch.Tensor:
    """The tensor ``t`` describes, over this buffer (bounds-checked)."""
    dtype = dtype_of(t.dtype)
    item = dtype.itemsize
    if len(t.shape) != len(t.stride) or any(s < 0 for s in t.shape) or any(s < 0 for s in t.stride):
      raise ExchangeError(f"bad tensor layout shape={t.shape} stride={t.stride}")
    numel = 1
    for s in t.shape:
      numel *= s
    extent = 0 if numel == 0 else 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride))
    if t.offset < 0 or (t.offset + extent) * item > self.nbytes:
      raise ExchangeError(
        f"tensor of {extent} elements at offset {t.offset} exceeds buffer {self.id}"
      )
    if numel == 0:
      return torch.empty(t.shape, dtype=dtype, device=self.raw.device)
    usable = self.nbytes - self.nbytes % item
    flat = self.raw[:usable].view(dtype)
    return flat.as_strided(t.shape, t.stride, t.offset)

  def close(self) -> None:
    self.raw = None


class HostBuffer(SharedBuffer):
  kind = "memfd"

  def __init__(self, buffer_id: int, nbytes: int, fd: int | None = None):
    super().__init__(buffer_id, nbytes)
    size = max(nbytes, 1)
    if fd is None:
      fd = os.memfd_create(f"verifier-{buffer_id}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
      os.ftruncate(fd, size)
      # its size fixed for good: a candidate holding the descriptor truncated it, and the checker's next
      # read of its mapping died of SIGBUS (blamed on the infrastructure; red team 42, round 2)
      fcntl.fcntl(
        fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
      )
    elif os.fstat(fd).st_size < size:
      os.close(fd)
      raise ExchangeError(f"buffer {buffer_id} is smaller than announced ({nbytes} bytes)")
    self.fd = fd
    self.map = mmap.mmap(fd, size)
    self.raw = torch.frombuffer(self.map, dtype=torch.uint8, count=size)

  def ref(self) -> BufferRef:
    return BufferRef(self.id, self.nbytes, self.kind)

  def export_fd(self) -> int:
    return os.dup(self.fd)

  def close(self) -> None:
    self.raw = None
    try:
      self.map.close()
    except BufferError:
      pass  # a view is still alive somewhere; the mapping goes with it
    if self.fd >= 0:
      os.close(self.fd)
      self.fd = -1


class DeviceBuffer(SharedBuffer):
  kind = "cuda_vmm"

  def __init__(self, buffer_id: int, nbytes: int, fd: int | None = None, map_bytes: int = 0):
    from verifier.ipc.cuda_driver import DeviceMapping

    super().__init__(buffer_id, nbytes)
    if fd is None:
      self.mapping = DeviceMapping.allocate(max(nbytes, 1))
    else:
      try:
        self.mapping = DeviceMapping.import_fd(fd, map_bytes)
      finally:
        os.close(fd)
    if self.mapping.size < nbytes:
      raise ExchangeError(f"buffer {buffer_id} maps {self.mapping.size} bytes, fewer than {nbytes}")
    self.raw = self.mapping.bytes_tensor()

  def ref(self) -> BufferRef:
    return BufferRef(self.id, self.nbytes, self.kind, self.mapping.size)

  def export_fd(self) -> int:
    return self.mapping.export_fd()

  def close(self) -> None:
    self.raw = None
    self.mapping.close()


def open_buffer(ref: BufferRef, fd: int) -> SharedBuffer:
  """The receiving side (a candidate): map a buffer the checker sent."""
  if ref.nbytes < 0 or ref.nbytes > 1 << 40:
    os.close(fd)
    raise ExchangeError(f"buffer {ref.buffer} has an implausible size {ref.nbytes}")
  if ref.kind == HostBuffer.kind:
    return HostBuffer(ref.buffer, ref.nbytes, fd)
  if ref.kind == DeviceBuffer.kind:
    return DeviceBuffer(ref.buffer, ref.nbytes, fd, ref.map_bytes)
  os.close(fd)
  raise ExchangeError(f"unknown buffer kind {ref.kind!r}")


def dense_layout(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """Shape and strides to give a copy of ``t``: its own when they are dense and non-overlapping (so a
  transposed input stays transposed), else contiguous ones."""
  shape = tuple(t.shape)
  stride = tuple(t.stride())
  if t.numel() and _dense(shape, stride):
    return shape, stride
  return shape, tuple(torch.empty(shape, device="meta").stride())


def _dense(shape, stride) -> bool:
  """Non-overlapping and dense: some permutation of the dimensions is contiguous."""
  expected = 1
  for st, sz in sorted((st, sz) for sz, st in zip(shape, stride) if sz != 1):
    if st != expected:
      return False
    expected *= sz
  return True


def nbytes_of(t: torch.Tensor) -> int:
  return t.numel() * t.element_size()


class BufferSet:
  """The checker's buffers for one job, reused across trials when a size repeats."""

  def __init__(self, device: torch.device, use_device_memory: bool):
    self.device, self.use_device_memory = device, use_device_memory
    self.buffers: dict[int, SharedBuffer] = {}
    self.free: list[SharedBuffer] = []
    self.sent: set[int] = set()
    self.next_id = 1
    self.alloc_s = 0.0  # time spent creating buffers (a diagnostic of the staging cost)

  @property
  def transport(self) -> str:
    return DeviceBuffer.kind if self.use_device_memory else HostBuffer.kind

  def take(self, nbytes: int) -> SharedBuffer:
    for b in self.free:
      if b.nbytes == nbytes:
        self.free.remove(b)
        return b
    cls = DeviceBuffer if self.use_device_memory else HostBuffer
    t0 = time.monotonic()
    b = cls(self.next_id, nbytes)
    self.alloc_s += time.monotonic() - t0
    self.next_id += 1
    self.buffers[b.id] = b
    return b

  def release_all(self, keep: set[int] = frozenset()) -> None:
    self.free = [b for b in self.buffers.values() if b.id not in keep]

  def new_refs(self, ids) -> tuple[list[BufferRef], list[int]]:
    """Buffers among ``ids`` the candidate has not mapped yet, with fresh descriptors to send (the caller
    closes them once sent)."""
    refs, fds = [], []
    for i in dict.fromkeys(ids):
      if i not in self.sent:
        b = self.buffers[i]
        refs.append(b.ref())
        fds.append(b.export_fd())
        self.sent.add(i)
    return refs, fds

  def staged(self, t: torch.Tensor) -> torch.Tensor:
    """``t`` as the candidate will read it: on the checker's device (device buffers) or the host."""
    return t if self.use_device_memory else t.cpu()

  def close(self) -> None:
    for b in self.buffers.values():
      b.close()
    self.buffers.clear()
    self.free.clear()


def send_value(
  value, buffers: BufferSet, used: list[int], pairs: list | None = None, drawn=None
) -> Value:
  """Describe an argument for the candidate; a tensor is copied into a buffer (``used`` collects the
  buffer ids, ``pairs`` the (private tensor, buffer view) pairs for the mutation check), unless
  ``drawn`` (a ``DrawInto`` the value was drawn under) holds it in a buffer already: then it goes as it
  is, paired with itself (the caller re-draws a private copy for the mutation check)."""
  if isinstance(value, torch.Tensor):
    ref = drawn.claim(value) if drawn is not None else None
    if ref is not None:
      used.append(ref.buffer)
      if pairs is not None:
        pairs.append((value, value))
      return Value(tensor=ref, kind="tensor")
    shape, stride = dense_layout(value)
    b = buffers.take(nbytes_of(value))
    ref = TensorRef(b.id, dtype_name(value.dtype), shape, stride)
    view = b.view(ref)
    view.copy_(buffers.staged(value.detach()))
    used.append(b.id)
    if pairs is not None:
      pairs.append((value, view))
    return Value(tensor=ref, kind="tensor")
  if isinstance(value, torch.dtype):
    return Value(data=dtype_name(value), kind="dtype")
  if isinstance(value, (list, tuple)):
    kind = "list" if isinstance(value, list) else "tuple"
    return Value(kind=kind, items=tuple(send_value(v, buffers, used, pairs, drawn) for v in value))
  if value is None or isinstance(value, (bool, int, float, str)):
    return Value(data=value)
  raise ExchangeError(f"an argument of type {type(value).__name__} cannot be sent to the candidate")


# Factories ``DrawInto`` allocates in a buffer, each run as its ``out=`` form (``torch.randn(size,
# out=t)`` is ``t.resize_(size).normal_()``, as ``torch.randn(size)`` is ``empty(size).normal_()``: the
# same values and the same draws from the generator); the ``_like`` ones as the plain factory on the
# input's shape where the input is contiguous (then ``empty_like`` is contiguous too). ``torch.empty``
# is left out: its values are whatever the buffer held, not what a re-draw under the seed gives.
_FACTORIES = frozenset(
  [torch.randn, torch.rand, torch.randint, torch.randperm, torch.zeros, torch.ones, torch.full]
)
_LIKE = {
  torch.randn_like: torch.randn,
  torch.rand_like: torch.rand,
  torch.randint_like: torch.randint,
  torch.zeros_like: torch.zeros,
  torch.ones_like: torch.ones,
  torch.full_like: torch.full,
}
_PLAIN_KWARGS = frozenset(["dtype", "device", "generator", "layout", "requires_grad", "pin_memory"])


def _device_of(d) -> torch.device:
  d = torch.device(d)
  if d.type == "cuda" and d.index is None:
    return torch.device("cuda", torch.cuda.current_device())
  return d


class DrawInto(TorchFunctionMode):
  """Inside it, tensor factories (``_FACTORIES``, ``_LIKE``) allocate their result in a buffer of
  ``buffers`` and draw straight into it, where the buffer lives on the device the factory would use:
  a reference's ``get_inputs()`` run inside it returns inputs that need no copy (``claim``), with the
  values and generator draws of a private run. Anything else (a keyword it does not know, a device or
  dtype the buffers cannot hold, ``torch.empty``) runs as it would outside. Scoped (a torch function
  mode), never a global patch; ``settle`` after the draw gives back the buffers of tensors that were
  not returned (intermediates)."""

  def __init__(self, buffers: BufferSet):
    super().__init__()
    self.buffers = buffers
    self.device = _device_of(buffers.device if buffers.use_device_memory else "cpu")
    self.drawn: dict[
      int, tuple[SharedBuffer, torch.Tensor]
    ] = {}  # storage address -> (buffer, view)
    self.claims: dict[int, TensorRef] = {}  # id of a returned tensor -> its place

  def __torch_function__(self, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    if func in _FACTORIES or func in _LIKE:
      out = self._draw(func, args, kwargs)
      if out is not None:
        return out
    return func(*args, **kwargs)

  def _draw(self, func, args, kwargs):
    plain = func
    if func in _LIKE:
      plain = _LIKE[func]
      if kwargs.keys() - _PLAIN_KWARGS - {"memory_format"} or not args:
        return None
      if kwargs.get("memory_format") not in (None, torch.preserve_format, torch.contiguous_format):
        return None
    elif kwargs.keys() - _PLAIN_KWARGS or "out" in kwargs:
      return None
    if kwargs.get("requires_grad") or kwargs.get("pin_memory"):
      return None
    if kwargs.get("layout") not in (None, torch.strided):
      return None
    device = kwargs.get("device")
    if device is None and func in _LIKE and isinstance(args[0], torch.Tensor):
      device = args[0].device
    if _device_of(device if device is not None else torch.get_default_device()) != self.device:
      return None
    try:
      meta = func(*args, **{**kwargs, "device": "meta"})  # the result's shape and dtype, no draw
    except Exception:  # noqa: BLE001 - the factory's own error comes from the real call
      return None
    if meta.dtype not in DTYPES.values() or (func in _LIKE and not meta.is_contiguous()):
      return None
    if func in _LIKE:
      args = self._plain_args(func, args, tuple(meta.shape))
      if args is None:
        return None
    b = self.buffers.take(nbytes_of(meta))
    ref = TensorRef(b.id, dtype_name(meta.dtype), tuple(meta.shape), tuple(meta.stride()))
    view = b.view(ref)
    rest = {k: v for k, v in kwargs.items() if k == "generator"}
    plain(*args, out=view, **rest)
    self.drawn[view.untyped_storage().data_ptr()] = (b, view)
    return view

  @staticmethod
  def _plain_args(func, args, shape):
    """A ``_like`` call's positional arguments for its plain factory on ``shape``."""
    if func is torch.randint_like:
      if len(args) == 2:
        return (0, args[1], shape)
      return (args[1], args[2], shape) if len(args) == 3 else None
    if func is torch.full_like:
      return (shape, args[1]) if len(args) == 2 else None
    return (shape,) if len(args) == 1 else None

  def settle(self, values) -> None:
    """After the draw: which tensors of ``values`` are whole buffers drawn here (each buffer sent
    once), and the others' buffers back to the set."""
    for t in _tensor_leaves(values):
      hit = self.drawn.get(t.untyped_storage().data_ptr()) if t.numel() else None
      if hit is None or id(t) in self.claims:
        continue
      b, view = hit
      shape, stride = tuple(t.shape), tuple(t.stride())
      if t.data_ptr() == view.data_ptr() and nbytes_of(t) == b.nbytes and _dense(shape, stride):
        if t.dtype in DTYPES.values() and not any(r.buffer == b.id for r in self.claims.values()):
          self.claims[id(t)] = TensorRef(b.id, dtype_name(t.dtype), shape, stride)
    claimed = {r.buffer for r in self.claims.values()}
    for b, _ in self.drawn.values():
      if b.id not in claimed:
        self.buffers.free.append(b)
    self.drawn.clear()

  def give_back(self) -> None:
    """Every buffer drawn into back to the set (a trial draw; its tensors must be gone)."""
    self.buffers.free += [b for b, _ in self.drawn.values()]
    self.drawn.clear()
    self.claims.clear()

  def claim(self, t: torch.Tensor) -> TensorRef | None:
    """Where ``t`` lies if it is one of the settled inputs (once: a second mention is copied)."""
    return self.claims.pop(id(t), None)


def _tensor_leaves(values) -> list:
  if isinstance(values, torch.Tensor):
    return [values]
  if isinstance(values, (list, tuple)):
    return [t for v in values for t in _tensor_leaves(v)]
  return []


# A timed call's large float output buffer is poisoned sparsely (``output_buffer``'s ``sparse``): one NaN
# in every SPARSE_POISON_EVERY elements from a secret offset drawn for the call, instead of a NaN in every
# element (a 4 GB fill a call, ~1.3 ms on an H100, on level-1's largest tasks). Any unwritten run of that
# many elements still holds a NaN, and what a shorter one holds is the previous call's output for other
# inputs; a fill costs about one 32-byte sector a poisoned element.
SPARSE_POISON_EVERY = 256
# under this many elements, the whole buffer: its fill costs nothing to speak of
SPARSE_POISON_MIN_ELEMENTS = 1 << 20


def output_buffer(
  expected: torch.Tensor, buffers: BufferSet, used: list[int], sparse=None
) -> TensorRef:
  """A buffer for an output the candidate must produce like ``expected``, poisoned (NaN, or random bytes
  for integers and booleans) so an output the candidate never writes cannot pass. ``sparse`` (a
  ``random.Random``; timed and calibration calls): a float output of ``SPARSE_POISON_MIN_ELEMENTS`` or more
  gets one NaN every ``SPARSE_POISON_EVERY`` elements from an offset drawn from it."""
  b = buffers.take(nbytes_of(expected))
  shape = tuple(expected.shape)
  ref = TensorRef(
    b.id, dtype_name(expected.dtype), shape, tuple(torch.empty(shape, device="meta").stride())
  )
  view = b.view(ref)
  if view.is_floating_point() or view.is_complex():
    if sparse is not None and view.numel() >= SPARSE_POISON_MIN_ELEMENTS:
      view.view(-1)[sparse.randrange(SPARSE_POISON_EVERY) :: SPARSE_POISON_EVERY].fill_(
        float("nan")
      )
    else:
      view.fill_(float("nan"))
  elif b.nbytes:
    b.raw[: b.nbytes].copy_(torch.randint(0, 256, (b.nbytes,), dtype=torch.uint8))
  used.append(b.id)
  return ref


def receive_value(v: Value, buffers: dict[int, SharedBuffer]):
  """The candidate's side of ``send_value``: tensors are views of mapped buffers."""
  if v.kind == "tensor":
    if v.tensor is None or v.tensor.buffer not in buffers:
      raise ExchangeError("tensor argument refers to a buffer that was not sent")
    return buffers[v.tensor.buffer].view(v.tensor)
  if v.kind == "dtype":
    return dtype_of(v.data)
  if v.kind in ("list", "tuple"):
    items = [receive_value(i, buffers) for i in v.items]
    return items if v.kind == "list" else tuple(items)
  if v.kind == "data":
    if v.data is not None and not isinstance(v.data, (bool, int, float, str)):
      raise ExchangeError(f"unexpected data value of type {type(v.data).__name__}")
    return v.data
  raise ExchangeError(f"unknown value kind {v.kind!r}")
