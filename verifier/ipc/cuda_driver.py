"""Device memory shared between the checker and a candidate process: CUDA virtual memory management with
POSIX file-descriptor handles, through ``libcuda`` (ctypes).

Legacy CUDA IPC handles (``cudaIpcGetMemHandle``) do not work across PID namespaces, and a candidate runs in
its own; an exported VMM allocation is a file descriptor, passed over a Unix socket (SCM_RIGHTS) like any
other. The exporter (the checker) allocates each buffer on its own (``cuMemCreate``), so importing one
reveals nothing else of the checker's memory; the candidate maps it (``cuMemImportFromShareableHandle``,
``cuMemMap``) and gets a tensor over it through ``__cuda_array_interface__`` (no copy). Both sides use the
primary context torch made current. The same calls as NCCL's ``ncclMemAlloc`` (CUDA >= 10.2 drivers).
"""

from __future__ import annotations

import ctypes
import os

CU_MEM_ALLOCATION_TYPE_PINNED = 0x1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1
CU_MEM_LOCATION_TYPE_DEVICE = 0x1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0
CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS = 88  # cuda.h


class CudaDriverError(RuntimeError):
  pass


class _Location(ctypes.Structure):
  _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
  _fields_ = [
    ("compressionType", ctypes.c_ubyte),
    ("gpuDirectRDMACapable", ctypes.c_ubyte),
    ("usage", ctypes.c_ushort),
    ("reserved", ctypes.c_ubyte * 4),
  ]


class _AllocationProp(ctypes.Structure):
  _fields_ = [
    ("type", ctypes.c_int),
    ("requestedHandleTypes", ctypes.c_int),
    ("location", _Location),
    ("win32HandleMetaData", ctypes.c_void_p),
    ("allocFlags", _AllocFlags),
  ]


class _AccessDesc(ctypes.Structure):
  _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_lib = None


def _driver():
  global _lib
  if _lib is None:
    try:
      _lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
      raise CudaDriverError(f"cannot load libcuda.so.1: {e}") from None
  return _lib


def _call(name: str, *args) -> None:
  fn = getattr(_driver(), name)
  rc = fn(*args)
  if rc != 0:
    msg = ctypes.c_char_p()
    getattr(_driver(), "cuGetErrorString")(rc, ctypes.byref(msg))
    text = msg.value.decode() if msg.value else "unknown error"
    raise CudaDriverError(f"{name} failed with CUresult {rc}: {text}")


def _device() -> int:
  import torch

  dev = ctypes.c_int()
  _call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(torch.cuda.current_device()))
  return dev.value


def pageable_memory_access() -> bool:
  """Whether the current device's kernels read and write pageable host memory coherently (HMM or ATS:
  ``CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS``): then a kernel reaches ``malloc``'d memory with no CUDA
  call at all, so no device record shows a candidate handing its inputs to the host that way."""
  v = ctypes.c_int()
  attr = ctypes.c_int(CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS)
  _call("cuDeviceGetAttribute", ctypes.byref(v), attr, ctypes.c_int(_device()))
  return bool(v.value)


def _prop(dev: int) -> _AllocationProp:
  prop = _AllocationProp()
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE
  prop.location.id = dev
  return prop


def granularity() -> int:
  g = ctypes.c_size_t()
  prop = _prop(_device())
  _call(
    "cuMemGetAllocationGranularity",
    ctypes.byref(g),
    ctypes.byref(prop),
    ctypes.c_int(CU_MEM_ALLOC_GRANULARITY_MINIMUM),
  )
  return g.value


class DeviceMapping:
  """A VMM allocation mapped into this process: ``ptr`` (device address), ``size`` (bytes, whole granules)."""

  def __init__(self, handle: int, size: int):
    self.handle, self.size, self.ptr = handle, size, 0
    dev = _device()
    ptr = ctypes.c_uint64()
    _call(
      "cuMemAddressReserve",
      ctypes.byref(ptr),
      ctypes.c_size_t(size),
      ctypes.c_size_t(0),
      ctypes.c_uint64(0),
      ctypes.c_ulonglong(0),
    )
    try:
      _call(
        "cuMemMap",
        ctypes.c_uint64(ptr.value),
        ctypes.c_size_t(size),
        ctypes.c_size_t(0),
        ctypes.c_ulonglong(handle),
        ctypes.c_ulonglong(0),
      )
      access = _AccessDesc()
      access.location.type = CU_MEM_LOCATION_TYPE_DEVICE
      access.location.id = dev
      access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
      _call(
        "cuMemSetAccess",
        ctypes.c_uint64(ptr.value),
        ctypes.c_size_t(size),
        ctypes.byref(access),
        ctypes.c_size_t(1),
      )
    except CudaDriverError:
      _call("cuMemAddressFree", ctypes.c_uint64(ptr.value), ctypes.c_size_t(size))
      raise
    self.ptr = ptr.value

  @classmethod
  def allocate(cls, nbytes: int) -> "DeviceMapping":
    g = granularity()
    size = max(g, -(-nbytes // g) * g)
    handle = ctypes.c_ulonglong()
    prop = _prop(_device())
    _call(
      "cuMemCreate",
      ctypes.byref(handle),
      ctypes.c_size_t(size),
      ctypes.byref(prop),
      ctypes.c_ulonglong(0),
    )
    try:
      return cls(handle.value, size)
    except CudaDriverError:
      _call("cuMemRelease", ctypes.c_ulonglong(handle.value))
      raise

  @classmethod
  def import_fd(cls, fd: int, size: int) -> "DeviceMapping":
    handle = ctypes.c_ulonglong()
    _call(
      "cuMemImportFromShareableHandle",
      ctypes.byref(handle),
      ctypes.c_void_p(fd),
      ctypes.c_int(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
    )
    try:
      return cls(handle.value, size)
    except CudaDriverError:
      _call("cuMemRelease", ctypes.c_ulonglong(handle.value))
      raise

  def export_fd(self) -> int:
    fd = ctypes.c_int(-1)
    _call(
      "cuMemExportToShareableHandle",
      ctypes.byref(fd),
      ctypes.c_ulonglong(self.handle),
      ctypes.c_int(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
      ctypes.c_ulonglong(0),
    )
    os.set_inheritable(fd.value, False)
    return fd.value

  def bytes_tensor(self):
    """A uint8 torch tensor over the whole mapping (no copy); it must not outlive ``close()``."""
    import torch

    return torch.as_tensor(
      _CudaBytes(self.ptr, self.size), device=f"cuda:{torch.cuda.current_device()}"
    )

  def close(self) -> None:
    if self.ptr:
      _call("cuMemUnmap", ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size))
      _call("cuMemAddressFree", ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size))
      _call("cuMemRelease", ctypes.c_ulonglong(self.handle))
      self.ptr = 0


class _CudaBytes:
  """Just enough of ``__cuda_array_interface__`` (v2) for ``torch.as_tensor``: ``n`` bytes at ``ptr``."""

  def __init__(self, ptr: int, n: int):
    self.__cuda_array_interface__ = {
      "shape": (int(n),),
      "strides": None,
      "typestr": "|u1",
      "data": (int(ptr), False),
      "version": 2,
    }
