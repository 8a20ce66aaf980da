"""Public entry points: choose the Triton kernel or the torch reference."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from .reference import (
    check_ragged,
    draw_randoms,
    draw_randoms_ragged,
    greedy_verify_ragged_torch,
    greedy_verify_torch,
    rejection_sample_ragged_torch,
    rejection_sample_torch,
)

BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend: str, device: torch.device) -> str:
    forced = os.environ.get("SPECDEC_KERNELS")
    if forced:
        backend = forced
    if backend not in BACKENDS:
        raise ValueError(f"Unknown kernel backend {backend!r}; choose one of {', '.join(BACKENDS)}.")
    if backend == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else "torch"
    return backend


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def greedy_verify(
    target_logits: torch.Tensor, draft_tokens: torch.Tensor, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """target_logits [B, k+1, V], draft_tokens [B, k] -> (num_accepted [B], emitted [B, k+1], -1 padded)."""
    if resolve_backend(backend, target_logits.device) == "triton":
        from .triton_kernels import greedy_verify_triton

        return greedy_verify_triton(target_logits, draft_tokens)
    return greedy_verify_torch(target_logits, draft_tokens)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan et al. 2023 Algorithm 1; see `reference.rejection_sample_torch` for the exact meaning."""
    batch, k = draft_tokens.shape
    uniforms, exponentials = draw_randoms(batch, k, target_probs.shape[-1], target_probs.device, generator)
    if resolve_backend(backend, target_probs.device) == "triton":
        from .triton_kernels import rejection_sample_triton

        return rejection_sample_triton(target_probs, draft_tokens, draft_probs, uniforms, exponentials)
    return rejection_sample_torch(target_probs, draft_tokens, draft_probs, uniforms=uniforms, exponentials=exponentials)


def greedy_verify_ragged(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    backend: str = "auto",
    *,
    max_num_draft_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of B rows with k_b draft tokens each, in vLLM's ragged layout.

    target_logits [M + B, V] (row b's k_b + 1 positions at cu[b] + b .. cu[b+1] + b, its last committed
    token's first); draft_tokens [M] (row b's at cu[b] .. cu[b+1] - 1); cu_num_draft_tokens [B + 1], rising
    from 0 to M. Returns num_accepted [B] and emitted [B, max_k + 1] (int64): row b is exactly
    `greedy_verify` on that row alone, padded with -1. max_k is `max_num_draft_tokens` when given (no host
    sync; it must be >= every k_b), else the longest row's k_b. Rows with k_b = 0 emit the target's token."""
    if resolve_backend(backend, target_logits.device) == "triton":
        from .triton_ragged import greedy_verify_ragged_triton

        return greedy_verify_ragged_triton(target_logits, draft_tokens, cu_num_draft_tokens, max_num_draft_tokens)
    return greedy_verify_ragged_torch(target_logits, draft_tokens, cu_num_draft_tokens, max_num_draft_tokens)


def rejection_sample_ragged(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    backend: str = "auto",
    *,
    max_num_draft_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling (Leviathan et al. 2023, Algorithm 1) of B rows with k_b draft tokens each, in
    vLLM's ragged layout: target_probs [M + B, V], draft_tokens [M], cu_num_draft_tokens [B + 1] as in
    `greedy_verify_ragged`; draft_probs [M, V] aligned with draft_tokens, or None for point-mass drafts.

    The draws are `reference.draw_randoms_ragged`'s. With one generator (or None) they are `torch.rand(M)`
    then Exp(1) on [B, V]: for B = 1, and for a batch whose rows all hold the same k, the result is
    bit-identical to `rejection_sample` on the padded batch with the same generator; otherwise row b is
    `rejection_sample` on that row alone given its slice of the same draws (uniforms[cu[b]:cu[b+1]],
    exponentials[b]). With a sequence of B generators, row b draws from generators[b] alone and is
    bit-identical to `rejection_sample(row b, generator=generators[b])`. Either way each row's emitted
    tokens are distributed exactly as the target's. Outputs as `greedy_verify_ragged`'s."""
    _, m, vocab = check_ragged(target_probs, draft_tokens, cu_num_draft_tokens, "target_probs")
    uniforms, exponentials = draw_randoms_ragged(cu_num_draft_tokens, m, vocab, target_probs.device, generator)
    if resolve_backend(backend, target_probs.device) == "triton":
        from .triton_ragged import rejection_sample_ragged_triton

        return rejection_sample_ragged_triton(target_probs, draft_tokens, cu_num_draft_tokens, draft_probs,
                                              uniforms, exponentials, max_num_draft_tokens)
    return rejection_sample_ragged_torch(target_probs, draft_tokens, cu_num_draft_tokens, draft_probs,
                                         uniforms=uniforms, exponentials=exponentials,
                                         max_num_draft_tokens=max_num_draft_tokens)
