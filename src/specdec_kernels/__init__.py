"""Verification kernels: a torch reference and a Triton kernel of exactly the same meaning for each op.

`backend="auto"` runs Triton on CUDA tensors and torch elsewhere; the environment variable
``SPECDEC_KERNELS=torch|triton`` forces one.

Two layouts: padded (`greedy_verify`, `rejection_sample`: every row holds k draft tokens) and ragged
(`greedy_verify_ragged`, `rejection_sample_ragged`: vLLM's flat token list with per-row offsets, rows of
different draft lengths, k_b = 0 allowed; `reference` documents the layout). Row by row the ragged ops mean
exactly what the padded ones mean.
"""

from .dispatch import (
    greedy_verify,
    greedy_verify_ragged,
    rejection_sample,
    rejection_sample_ragged,
    resolve_backend,
)
from .reference import draw_randoms_ragged, pad_ragged

__all__ = [
    "draw_randoms_ragged",
    "greedy_verify",
    "greedy_verify_ragged",
    "pad_ragged",
    "rejection_sample",
    "rejection_sample_ragged",
    "resolve_backend",
]
