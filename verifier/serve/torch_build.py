"""What this host's torch can run, and the one-line refusal of a CUDA request it cannot serve
(``--device cuda`` or ``--gpus`` on a CPU-only torch, or on a host where torch sees no GPU)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TorchBuild:
  version: str  # torch.__version__
  cuda: str | None  # torch.version.cuda: None for a CPU-only build
  gpu_visible: bool  # torch.cuda.is_available()
  arch: str = ""  # compute capability of GPU 0, e.g. "9.0"

  @classmethod
  def detect(cls) -> "TorchBuild":
    import torch

    visible = bool(torch.cuda.is_available())
    arch = ""
    if visible:
      try:
        major, minor = torch.cuda.get_device_capability(0)
        arch = f"{major}.{minor}"
      except Exception:  # noqa: BLE001 - a GPU that cannot say: builds use torch's own list
        pass
    return cls(str(torch.__version__), torch.version.cuda, visible, arch)

  def describe(self) -> str:
    return f"torch {self.version}, torch.version.cuda {self.cuda}"


def cuda_refusal(device: str | None, gpus: str | None, build: TorchBuild) -> str:
  """Why ``--device`` / ``--gpus`` (None: not given) ask for CUDA that ``build`` cannot give, in one
  line; '' when they do not (no CUDA asked for, or a GPU is there)."""
  if device == "cuda":
    asked = "--device cuda"
  elif device is None and gpus is not None:
    asked = f"--gpus {gpus}"
  else:
    return ""
  if build.gpu_visible:
    return ""
  if build.cuda is None:
    return (
      f"{asked} needs CUDA, but this torch is a CPU-only build ({build.describe()}): install a "
      "CUDA build of torch on this host, or pass --device cpu"
    )
  return (
    f"{asked} needs a GPU, but torch sees none ({build.describe()}, torch.cuda.is_available() "
    "False): check the driver and CUDA_VISIBLE_DEVICES, or pass --device cpu"
  )
