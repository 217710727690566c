"""Confinement of worker processes (rlimits, namespaces, seccomp) and the pools that start them."""
