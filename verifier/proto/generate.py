"""Regenerate the committed gRPC stubs: ``python -m verifier.proto.generate`` (needs grpcio-tools)."""

from __future__ import annotations

import pathlib
import sys

PROTOS = ("verifier/proto/verifier.proto", "verifier/proto/health.proto")


def main() -> int:
    from grpc_tools import protoc  # test extra; not needed at runtime

    root = pathlib.Path(__file__).resolve().parents[2]
    args = ["protoc", f"-I{root}", f"--python_out={root}", f"--grpc_python_out={root}", f"--pyi_out={root}"]
    rc = protoc.main(args + [str(root / p) for p in PROTOS])
    if rc:
        print(f"protoc failed with status {rc}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
