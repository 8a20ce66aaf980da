"""Torch references for the verification kernels: the definition each Triton kernel must match."""

from __future__ import annotations

import torch


def _emit(num_accepted: torch.Tensor, draft_tokens: torch.Tensor, final_tokens: torch.Tensor) -> torch.Tensor:
    """[B, k+1]: accepted draft tokens, then `final_tokens` [B] at index num_accepted, then -1."""
    batch, k = draft_tokens.shape
    index = torch.arange(k + 1, device=draft_tokens.device).expand(batch, k + 1)
    padded = torch.cat([draft_tokens, draft_tokens.new_full((batch, 1), -1)], dim=1)
    n = num_accepted.unsqueeze(1)
    return torch.where(index < n, padded, torch.where(index == n, final_tokens.unsqueeze(1), -1))


def greedy_verify_torch(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target_logits [B, k+1, V], draft_tokens [B, k] -> (num_accepted [B], emitted [B, k+1]).

    The accepted prefix is the longest run of draft tokens equal to the target's argmax (first index on
    ties); the emitted row ends with the target's argmax after that prefix.
    """
    k = draft_tokens.shape[1]
    argmax = target_logits.max(dim=-1).indices  # argmax semantics, several times faster on bf16 CPU tensors
    matches = (draft_tokens == argmax[:, :k]).to(torch.int64)
    num_accepted = matches.cumprod(dim=1).sum(dim=1)
    final = argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    return num_accepted, _emit(num_accepted, draft_tokens, final)


def rejection_sample_torch(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
    exponentials: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan et al. 2023, Algorithm 1, for a batch of chains.

    target_probs [B, k+1, V]; draft_tokens [B, k]; draft_probs [B, k, V] or None for point-mass drafts.
    Draft token j is accepted when u_j * q_j(x_j) < p_j(x_j) (u_j uniform in [0, 1), float64), i.e. with
    probability min(1, p/q). At the first rejection the token is drawn from norm(max(0, p - q)); after a
    fully accepted draft, from p at position k. Sampling uses an exponential race,
    argmax(w / E) with E ~ Exp(1), which draws index i with probability w_i / sum(w).
    `uniforms` [B, k] and `exponentials` [B, V] may be given (the Triton kernel is tested with the same draws).
    """
    batch, k = draft_tokens.shape
    device = target_probs.device
    if uniforms is None or exponentials is None:
        uniforms, exponentials = draw_randoms(batch, k, target_probs.shape[-1], device, generator)
    p = target_probs.double()
    p_tok = p[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    if draft_probs is None:
        q_tok = torch.ones_like(p_tok)
    else:
        q_tok = draft_probs.double().gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    accepted = (uniforms * q_tok < p_tok).to(torch.int64)
    num_accepted = accepted.cumprod(dim=1).sum(dim=1)
    p_at = p.gather(1, num_accepted.view(batch, 1, 1).expand(batch, 1, p.shape[-1])).squeeze(1)
    if k == 0:
        residual = p_at
    else:
        if draft_probs is None:
            q_full = torch.zeros_like(p[:, :k]).scatter(-1, draft_tokens.unsqueeze(-1), 1.0)
        else:
            q_full = draft_probs.double()
        q_full = torch.cat([q_full, torch.zeros_like(p[:, :1])], dim=1)  # nothing to subtract after the last
        q_at = q_full.gather(1, num_accepted.view(batch, 1, 1).expand(batch, 1, p.shape[-1])).squeeze(1)
        residual = (p_at - q_at).clamp_min(0.0)
    final = (residual / exponentials).argmax(dim=-1)
    return num_accepted, _emit(num_accepted, draft_tokens, final)


def draw_randoms(
    batch: int, k: int, vocab: int, device: torch.device, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 uniforms [B, k] and Exp(1) draws [B, V] one rejection-sampling step consumes."""
    uniforms = torch.rand(batch, k, dtype=torch.float64, device=device, generator=generator)
    exponentials = torch.empty(batch, vocab, dtype=torch.float64, device=device).exponential_(generator=generator)
    # E = 0 would make 0/0 = NaN win the race for a zero-probability token; the smallest normal double keeps
    # every zero weight at exactly zero and changes nothing else.
    exponentials.clamp_min_(torch.finfo(torch.float64).tiny)
    return uniforms, exponentials
