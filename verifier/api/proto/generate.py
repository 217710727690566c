"""Regenerate the committed gRPC stubs: ``python -m verifier.api.proto.generate`` (needs grpcio-tools)."""

from __future__ import annotations

import pathlib
import re
import sys

PROTOS = ("verifier/api/proto/verifier.proto", "verifier/api/proto/health.proto")
# The service stubs only use ``channel.unary_unary/stream_stream(..., _registered_method=True)`` and
# ``grpc.method_handlers_generic_handler``, present since grpcio 1.63; the generator pins its own version
# (1.85 here) as the floor, which would refuse GPU images with grpcio 1.84. Lower the gate to pyproject's pin.
GRPC_FLOOR = "1.66.0"


def main() -> int:
  from grpc_tools import protoc  # test extra; not needed at runtime

  root = pathlib.Path(__file__).resolve().parents[3]
  args = [
    "protoc",
    f"-I{root}",
    f"--python_out={root}",
    f"--grpc_python_out={root}",
    f"--pyi_out={root}",
  ]
  rc = protoc.main(args + [str(root / p) for p in PROTOS])
  if rc:
    print(f"protoc failed with status {rc}", file=sys.stderr)
    return rc
  for p in PROTOS:
    stub = root / p.replace(".proto", "_pb2_grpc.py")
    text = re.sub(
      r"GRPC_GENERATED_VERSION = '[^']*'",
      f"GRPC_GENERATED_VERSION = '{GRPC_FLOOR}'",
      stub.read_text(),
    )
    stub.write_text(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
