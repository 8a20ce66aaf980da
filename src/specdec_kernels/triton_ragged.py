"""Triton kernels for the ragged layout, of exactly the same meaning as `reference.greedy_verify_ragged_torch`
and `reference.rejection_sample_ragged_torch` (the layout is described in `reference`).

They reuse `triton_kernels`' building blocks unchanged; only the row bookkeeping differs. Row b reads its
draft length k_b = cu[b+1] - cu[b] from the offsets on the device, its draft tokens (and draft
probabilities and uniforms) at cu[b], and its k_b + 1 target rows at cu[b] + b, so nothing is padded and
nothing crosses to the host except the output width (max_k + 1, which the caller may pass).

- Greedy: `_argmax_partials_kernel` over all M + B target rows (a flat [M + B, V] tensor is its [1, P, V]
  case), then `_ragged_greedy_accept_kernel`, one program per row: the leading run of matches among its
  k_b positions, then the emitted row.
- Rejection sampling: `_ragged_rejection_partials_kernel`, one program per row (and per vocabulary slice
  when few rows would leave a GPU idle; one slice on the CPU): Algorithm 1's k_b acceptance tests, then the
  exponential race over its slice at the row's first rejected position; `_ragged_rejection_emit_kernel`,
  one program per row, combines the slices and writes the emitted row.

A row with k_b = 0 masks every draft-side load (its pointers are never dereferenced), races p itself
without a clamp, and emits one token, as the padded kernels do for k = 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import check_ragged, max_draft_length
from .triton_kernels import (
    _NO_INDEX,
    _argmax_partials_kernel,
    _argmax_reduce,
    _argmax_update,
    _chain_accept_count,
    _chain_prefix_len,
    _last_contiguous,
    _race_weights,
    _split_plan,
)


@triton.jit
def _emit_ragged_row(out_ptr, draft_row, K, n, final, W, BLOCK_P: tl.constexpr):
    """Row of `reference._emit` at width W: draft[:n], then `final` at index n, then -1 up to W."""
    offs = tl.arange(0, BLOCK_P)
    draft = tl.load(draft_row + offs, mask=offs < K, other=-1)
    row = tl.where(offs < n, draft, tl.where(offs == n, final.to(tl.int64), -1))
    tl.store(out_ptr + offs, row, mask=offs < W)


@triton.jit
def _ragged_greedy_accept_kernel(
    part_val_ptr, part_idx_ptr,  # [M + B, S]
    draft_ptr,  # [M] int64
    cu_ptr,  # [B + 1] int64
    num_acc_ptr, out_ptr, stride_ob,  # [B] int64, [B, W] int64
    W, S,
    BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.load(cu_ptr + b)
    K = tl.load(cu_ptr + b + 1) - start
    first = start + b  # target row of position 0 (the last committed token)
    offs_p = tl.arange(0, BLOCK_P)
    offs_s = tl.arange(0, BLOCK_S)
    mask = (offs_p[:, None] < K + 1) & (offs_s[None, :] < S)
    ptrs = (first + offs_p[:, None]) * S + offs_s[None, :]
    vals = tl.load(part_val_ptr + ptrs, mask=mask, other=float("-inf"))
    idxs = tl.load(part_idx_ptr + ptrs, mask=mask, other=_NO_INDEX)
    _, target = _argmax_reduce(vals, idxs, 1)  # [BLOCK_P]: argmax at each of the k_b + 1 positions

    draft_row = draft_ptr + start
    draft = tl.load(draft_row + offs_p, mask=offs_p < K, other=-1)
    n = _chain_prefix_len(draft == target, offs_p, K)
    final = tl.min(tl.where(offs_p == n, target, _NO_INDEX), axis=0)
    tl.store(num_acc_ptr + b, n.to(tl.int64))
    _emit_ragged_row(out_ptr + b.to(tl.int64) * stride_ob, draft_row, K, n, final, W, BLOCK_P)


@triton.jit
def _ragged_rejection_partials_kernel(
    p_ptr, stride_pp,  # target_probs [M + B, V]
    q_ptr, stride_qp,  # draft_probs [M, V] (unused unless HAS_Q)
    draft_ptr,  # [M] int64
    u_ptr,  # uniforms [M] float64
    e_ptr, stride_eb,  # exponentials [B, V] float64
    cu_ptr,  # [B + 1] int64
    num_acc_ptr,  # [B] int64, written by slice 0
    part_val_ptr, part_idx_ptr,  # [B, S]
    V, SPLIT, S,
    HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_P: tl.constexpr,
):
    b = tl.program_id(0)
    split = tl.program_id(1)
    start = tl.load(cu_ptr + b)
    K = tl.load(cu_ptr + b + 1) - start
    p_row = p_ptr + (start + b) * stride_pp
    q_row = q_ptr + start * stride_qp
    draft_row = draft_ptr + start
    n = _chain_accept_count(p_row, stride_pp, q_row, stride_qp, draft_row, u_ptr + start, K, HAS_Q, BLOCK_P)
    if split == 0:
        tl.store(num_acc_ptr + b, n.to(tl.int64))

    # Race at position n: subtract the draft distribution there, nothing after a fully accepted draft.
    p_at = p_row + n.to(tl.int64) * stride_pp
    q_at = q_row + n.to(tl.int64) * stride_qp
    lo = split * SPLIT
    hi = tl.minimum(lo + SPLIT, V)
    q_end = tl.where(n < K, hi, 0)
    if HAS_Q:
        sub_tok = n * 0 - 1
    else:
        sub_tok = tl.load(draft_row + n, mask=n < K, other=-1)
    floor = tl.where(K > 0, 0.0, float("-inf")).to(tl.float64)
    e_row = e_ptr + b.to(tl.int64) * stride_eb

    offs = lo + tl.arange(0, BLOCK_V)
    mask = offs < hi
    acc_val = _race_weights(p_at, q_at, e_row, sub_tok, q_end, floor, offs, mask, HAS_Q)
    acc_idx = tl.where(mask, offs, _NO_INDEX)
    for chunk in range(lo + BLOCK_V, hi, BLOCK_V):
        offs = chunk + tl.arange(0, BLOCK_V)
        mask = offs < hi
        w = _race_weights(p_at, q_at, e_row, sub_tok, q_end, floor, offs, mask, HAS_Q)
        acc_val, acc_idx = _argmax_update(acc_val, acc_idx, w, offs)

    val, idx = _argmax_reduce(acc_val, acc_idx, 0)
    tl.store(part_val_ptr + b * S + split, val)
    tl.store(part_idx_ptr + b * S + split, idx)


@triton.jit
def _ragged_rejection_emit_kernel(
    part_val_ptr, part_idx_ptr,  # [B, S]
    draft_ptr,  # [M] int64
    cu_ptr,  # [B + 1] int64
    num_acc_ptr, out_ptr, stride_ob,
    W, S,
    BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.load(cu_ptr + b)
    K = tl.load(cu_ptr + b + 1) - start
    offs_s = tl.arange(0, BLOCK_S)
    mask = offs_s < S
    vals = tl.load(part_val_ptr + b * S + offs_s, mask=mask, other=float("-inf"))
    idxs = tl.load(part_idx_ptr + b * S + offs_s, mask=mask, other=_NO_INDEX)
    _, final = _argmax_reduce(vals, idxs, 0)
    n = tl.load(num_acc_ptr + b)
    _emit_ragged_row(out_ptr + b.to(tl.int64) * stride_ob, draft_ptr + start, K, n, final, W, BLOCK_P)


# --------------------------------------------------------------------------------------------------------------
# Host wrappers.
# --------------------------------------------------------------------------------------------------------------


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
    batch, m, vocab = check_ragged(target_logits, draft_tokens, cu_num_draft_tokens, "target_logits")
    width = max_draft_length(cu_num_draft_tokens, max_num_draft_tokens) + 1
    device = target_logits.device
    logits = _last_contiguous(target_logits)
    draft, cu, num_accepted, emitted = _prepare(draft_tokens, cu_num_draft_tokens, batch, width, device)
    if batch == 0:
        return num_accepted, emitted
    rows = m + batch
    block, split, n_splits = _split_plan(rows, vocab, device, block_v, num_splits)
    part_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    part_val = torch.empty(rows, n_splits, dtype=part_dtype, device=device)
    part_idx = torch.empty(rows, n_splits, dtype=torch.int32, device=device)
    _argmax_partials_kernel[(rows, n_splits)](
        logits, 0, logits.stride(0),  # the flat rows are the [1, M + B, V] case
        part_val, part_idx,
        rows, vocab, split, n_splits,
        BLOCK_V=block, num_warps=8 if block >= 2048 else 4,
    )
    _ragged_greedy_accept_kernel[(batch,)](
        part_val, part_idx,
        draft if m > 0 else num_accepted,  # a stand-in never dereferenced when M == 0 (all loads masked)
        cu,
        num_accepted, emitted, emitted.stride(0),
        width, n_splits,
        BLOCK_P=max(2, triton.next_power_of_2(width)), BLOCK_S=max(2, triton.next_power_of_2(n_splits)),
        num_warps=4,
    )
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
    u = uniforms.to(torch.float64).contiguous()
    e = exponentials.to(torch.float64).contiguous()
    has_q = draft_probs is not None and m > 0
    q = _last_contiguous(draft_probs) if has_q else p  # p is a never-dereferenced stand-in when not has_q
    block, split, n_splits = _split_plan(batch, vocab, device, block_v, num_splits)
    part_val = torch.empty(batch, n_splits, dtype=torch.float64, device=device)
    part_idx = torch.empty(batch, n_splits, dtype=torch.int32, device=device)
    draft_arg, u_arg = (draft, u) if m > 0 else (num_accepted, e)  # stand-ins: no loads when M == 0
    block_p = max(2, triton.next_power_of_2(width))
    _ragged_rejection_partials_kernel[(batch, n_splits)](
        p, p.stride(0),
        q, q.stride(0),
        draft_arg, u_arg,
        e, e.stride(0),
        cu, num_accepted,
        part_val, part_idx,
        vocab, split, n_splits,
        HAS_Q=has_q, BLOCK_V=block, BLOCK_P=block_p, num_warps=8 if block >= 2048 else 4,
        enable_fp_fusion=False,  # no contraction into FMAs: the float64 math must round like torch's
    )
    _ragged_rejection_emit_kernel[(batch,)](
        part_val, part_idx,
        draft_arg, cu,
        num_accepted, emitted, emitted.stride(0),
        width, n_splits,
        BLOCK_P=block_p, BLOCK_S=max(2, triton.next_power_of_2(n_splits)),
        num_warps=4,
    )
    return num_accepted, emitted
