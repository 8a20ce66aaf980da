"""Distillation from the target's distribution (issue 24): the soft targets and the draft's loss against them."""

from __future__ import annotations

import torch


def soft_targets(teacher_logits: torch.Tensor, k: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's K likeliest next tokens and their probabilities at `temperature`, renormalised over those
    K: [..., V] logits -> (probs [..., K], token ids [..., K])."""
    top = teacher_logits.topk(min(k, teacher_logits.shape[-1]), dim=-1)  # in its own dtype: no [.., V] copy
    return (top.values.float() / temperature).softmax(-1), top.indices


def distillation_ce(logits: torch.Tensor, probs: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of the draft's logits [..., V'] against soft targets (probs [..., K] over draft-vocabulary
    indices ids [..., K], -100 where a token is outside the draft vocabulary): the targets inside the draft
    vocabulary are renormalised (the draft can propose nothing else). Returns (loss [...], whether any target
    mass was inside [...]); a slot with none has loss 0."""
    inside = ids >= 0
    mass = (probs * inside).sum(-1, keepdim=True)
    weights = torch.where(inside, probs, 0.0) / mass.clamp(min=1e-12)
    logq = logits.float().log_softmax(-1).gather(-1, ids.clamp(min=0))
    return -(weights * logq).sum(-1), mass.squeeze(-1) > 0
