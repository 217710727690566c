"""KernelBench evaluation: metrics, run records, the evaluation loop and its report."""
