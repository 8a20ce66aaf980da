"""Public entry points: choose the Triton kernel or the torch reference."""

from __future__ import annotations

import os

import torch

from .reference import draw_randoms, greedy_verify_torch, rejection_sample_torch

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
