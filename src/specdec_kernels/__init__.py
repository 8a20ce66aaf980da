"""Verification kernels: a torch reference and a Triton kernel of exactly the same meaning for each op.

`backend="auto"` runs Triton on CUDA tensors and torch elsewhere; the environment variable
``SPECDEC_KERNELS=torch|triton`` forces one.
"""

from .dispatch import greedy_verify, rejection_sample, resolve_backend

__all__ = ["greedy_verify", "rejection_sample", "resolve_backend"]
