"""dice-jax verifier: sandboxed compile, check and timing of candidate kernels, served over gRPC.

Deployable alone (PyTorch, grpcio, protobuf, numpy); never imports ``dice_jax`` or JAX.
"""

__version__ = "0.1.0"
