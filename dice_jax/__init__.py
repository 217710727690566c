"""dice-jax: block-diffusion LMs that write CUDA kernels (DICE), in JAX/Flax NNX."""
