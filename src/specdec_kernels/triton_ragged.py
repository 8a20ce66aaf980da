"""Triton verification of rows with ragged draft lengths, of exactly the same meaning as
`reference.greedy_verify_ragged_torch` and `reference.rejection_sample_ragged_torch` (the layout is described
in `reference`).

The kernels are `triton_kernels`' (they take per-row offsets; the padded entry points there are the case of
uniform offsets). Row b reads its draft length k_b = cu[b+1] - cu[b] from the offsets on the device, its
draft tokens (and draft probabilities and uniforms) at cu[b], and its k_b + 1 target rows at cu[b] + b, so
nothing is padded and nothing crosses to the host except the output width (max_k + 1, which the caller may
pass). A row with k_b = 0 masks every draft-side load (its pointers are never dereferenced), races p itself
without a clamp, and emits one token, as a padded batch with k = 0 does.
"""

from __future__ import annotations

import torch

from .reference import check_ragged, max_draft_length
from .triton_kernels import _last_contiguous, launch_greedy, launch_rejection


def _prepare(draft_tokens: torch.Tensor, cu_num_draft_tokens: torch.Tensor, batch: int, width: int,
             device: torch.device):
    draft = draft_tokens.to(torch.int64).contiguous()
    cu = cu_num_draft_tokens.to(device=device, dtype=torch.int64).contiguous()
    num_accepted = torch.empty(batch, dtype=torch.int64, device=device)
    emitted = torch.empty(batch, width, dtype=torch.int64, device=device)
    return draft, cu, num_accepted, emitted


def greedy_verify_ragged_triton(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    max_num_draft_tokens: int | None = None,
    *,
    block_v: int | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """target_logits [M + B, V], draft_tokens [M], cu_num_draft_tokens [B + 1] -> (num_accepted [B],
    emitted [B, max_k + 1]); same meaning as `reference.greedy_verify_ragged_torch`. The offsets are trusted
    (the reference checks them); `max_num_draft_tokens` saves the one host read of the longest row."""
    batch, m, _ = check_ragged(target_logits, draft_tokens, cu_num_draft_tokens, "target_logits")
    width = max_draft_length(cu_num_draft_tokens, max_num_draft_tokens) + 1
    device = target_logits.device
    logits = _last_contiguous(target_logits)
    draft, cu, num_accepted, emitted = _prepare(draft_tokens, cu_num_draft_tokens, batch, width, device)
    if batch == 0:
        return num_accepted, emitted
    rows = m + batch  # the flat rows are the [1, M + B, V] case
    launch_greedy(logits, 0, logits.stride(0), rows, rows, draft, cu, num_accepted, emitted, block_v, num_splits)
    return num_accepted, emitted


def rejection_sample_ragged_triton(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
    exponentials: torch.Tensor,
    max_num_draft_tokens: int | None = None,
    *,
    block_v: int | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same meaning and same draws as `reference.rejection_sample_ragged_torch(..., uniforms=, exponentials=)`.

    target_probs [M + B, V]; draft_tokens [M]; cu_num_draft_tokens [B + 1]; draft_probs [M, V] or None
    (point masses); uniforms [M] float64; exponentials [B, V] float64."""
    batch, m, vocab = check_ragged(target_probs, draft_tokens, cu_num_draft_tokens, "target_probs")
    if draft_probs is not None:
        if tuple(draft_probs.shape) != (m, vocab):
            raise ValueError(f"draft_probs must be {(m, vocab)}, got {tuple(draft_probs.shape)}")
        if not draft_probs.is_floating_point():
            raise TypeError(f"draft_probs must be floating point, got {draft_probs.dtype}")
    if tuple(uniforms.shape) != (m,) or tuple(exponentials.shape) != (batch, vocab):
        raise ValueError(f"uniforms must be [M] = {(m,)} and exponentials [B, V] = {(batch, vocab)}")
    width = max_draft_length(cu_num_draft_tokens, max_num_draft_tokens) + 1
    device = target_probs.device
    p = _last_contiguous(target_probs)
    draft, cu, num_accepted, emitted = _prepare(draft_tokens, cu_num_draft_tokens, batch, width, device)
    if batch == 0:
        return num_accepted, emitted
    q = _last_contiguous(draft_probs) if draft_probs is not None and m > 0 else None
    q_strides = (0, q.stride(0), q.stride(0)) if q is not None else (0, 0, 0)
    launch_rejection(p, (0, p.stride(0), p.stride(0)), q, q_strides, draft, uniforms.to(torch.float64).contiguous(),
                     exponentials.to(torch.float64).contiguous(), cu, num_accepted, emitted, block_v, num_splits)
    return num_accepted, emitted
