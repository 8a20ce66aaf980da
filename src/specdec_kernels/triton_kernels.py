"""Triton kernels of exactly the same meaning as `reference.greedy_verify_torch` / `rejection_sample_torch`.

Both ops are memory-bound reductions over the vocabulary, so each is two launches:

1. a *partials* kernel, grid ``(rows, num_splits)``: program ``(r, s)`` streams vocabulary slice ``s`` of
   row ``r`` in ``BLOCK_V`` chunks and writes that slice's (max value, first index of the max). Splitting
   the vocabulary keeps the GPU busy when there are few rows (batch 1: k+1 rows of 150k entries);
2. an *accept* kernel, one program per batch row: combines the slices' partials into the argmax, finds the
   accepted prefix and writes ``num_accepted`` and the ``-1``-padded ``emitted`` row.

Every kernel takes vLLM's ragged layout: row b's draft length k_b = cu[b+1] - cu[b] comes from per-row offsets
on the device. A padded batch ``[B, k+1, V]`` is the case cu = (0, k, 2k, ...) with its own strides, so
the padded entry points here and the ragged ones in `triton_ragged` launch the same kernels
(`launch_greedy`, `launch_rejection`).

Exactness. ``torch.argmax`` returns the first index of the maximum and treats NaN as larger than
everything (first NaN wins); `_argmax_update` / `_argmax_reduce` implement that order: within a lane the
indices only grow, so a strict ``>`` keeps the earlier index, and across lanes/slices the smallest index among
the maxima wins. Rejection sampling runs in float64 like the reference (``u * q < p``, ``max(0, p - q) / E``);
inputs are widened exactly (bf16/fp16 -> fp32 -> fp64) and fp64 mul/sub/div are correctly rounded on both
the GPU and the interpreter, so the same draws give bit-identical results. A draft token outside ``[0, V)`` is
undefined behaviour here (the reference raises); the kernels do not check to avoid a host sync.

Seam for a tree variant (not built). The vocabulary-side work does not know about chains:
`_argmax_partials_kernel` reduces any set of ``[rows, V]`` logits rows (a tree's nodes are just more rows per
batch element), `_race_weights` takes "which target row, which draft row to subtract (or none)" as plain
pointers / scalars, and `_argmax_update` / `_argmax_reduce` / the two-level slice combine are shared. The chain
lives only in `_chain_prefix_len` (greedy: first mismatch among the k positions), `_chain_accept_count`
(rejection: leading run of u*q < p accepts, via the same prefix rule) and `_emit_row` (accepted prefix, then
the final token). A tree verifier would swap those three for a walk over parent pointers that returns the
accepted node and writes its root-to-node path, and pass the accepted node (not the depth n) as the race
position. (Multi-child rejection as in SpecInfer would also update the residual per rejected sibling.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# "No index yet": larger than any vocabulary index, so `min` over candidate indices ignores it.
_NO_INDEX = tl.constexpr(2**31 - 1)


# --------------------------------------------------------------------------------------------------------------
# Shared building blocks (reusable by a tree variant).
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _widen(x, TO_F64: tl.constexpr):
    """Exact widening: bf16/fp16/fp32 -> fp32 (-> fp64 if TO_F64); fp64 stays fp64."""
    if x.dtype != tl.float64:
        x = x.to(tl.float32)  # via fp32 also for bf16: exact, and the interpreter's bf16 path expects it
    if TO_F64:
        x = x.to(tl.float64)
    return x


@triton.jit
def _argmax_update(acc_val, acc_idx, x, idx):
    """Per-lane running argmax in torch.argmax order. `idx` grows with each call, so a strict `>` keeps the
    first index on ties; a NaN (torch's maximum) replaces a number and is never replaced."""
    take = (x > acc_val) | ((x != x) & (acc_val == acc_val))
    return tl.where(take, x, acc_val), tl.where(take, idx, acc_idx)


@triton.jit
def _argmax_reduce(vals, idxs, axis: tl.constexpr):
    """(value, index) of the torch.argmax winner along `axis`: first NaN if any, else the smallest index among
    the maxima. Entries with index `_NO_INDEX` (masked lanes, empty slices) never win."""
    is_nan = vals != vals
    nan_idx = tl.min(tl.where(is_nan, idxs, _NO_INDEX), axis=axis)
    best = tl.max(tl.where(is_nan, float("-inf"), vals), axis=axis, keep_dims=True)
    best_idx = tl.min(tl.where((vals == best) & ~is_nan, idxs, _NO_INDEX), axis=axis)
    best_val = tl.max(tl.where(is_nan, float("-inf"), vals), axis=axis)
    has_nan = nan_idx < _NO_INDEX
    return tl.where(has_nan, float("nan"), best_val), tl.where(has_nan, nan_idx, best_idx)


# --------------------------------------------------------------------------------------------------------------
# Greedy verification.
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _argmax_partials_kernel(
    x_ptr, stride_xb, stride_xp,  # logits [B, P, V], last stride 1
    part_val_ptr, part_idx_ptr,  # [B * P, S]
    P, V, SPLIT, S,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    b = row // P
    pos = row % P
    x_row = x_ptr + b.to(tl.int64) * stride_xb + pos.to(tl.int64) * stride_xp
    lo = split * SPLIT
    hi = tl.minimum(lo + SPLIT, V)

    # First chunk peeled: it initialises the per-lane accumulators (masked lanes: -inf, no index).
    offs = lo + tl.arange(0, BLOCK_V)
    mask = offs < hi
    acc_val = _widen(tl.load(x_row + offs, mask=mask, other=float("-inf")), False)
    acc_idx = tl.where(mask, offs, _NO_INDEX)
    for start in range(lo + BLOCK_V, hi, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < hi
        x = _widen(tl.load(x_row + offs, mask=mask, other=float("-inf")), False)
        acc_val, acc_idx = _argmax_update(acc_val, acc_idx, x, offs)

    val, idx = _argmax_reduce(acc_val, acc_idx, 0)
    tl.store(part_val_ptr + row * S + split, val)
    tl.store(part_idx_ptr + row * S + split, idx)


@triton.jit
def _chain_prefix_len(match, offs, K):
    """Greedy chain acceptance: index of the first mismatch among the k draft positions, else k."""
    return tl.min(tl.where((offs < K) & ~match, offs, K), axis=0)


@triton.jit
def _emit_row(out_ptr, draft_row, K, n, final, W, BLOCK_P: tl.constexpr):
    """Row of `reference._emit` at width W: draft[:n], then `final` at index n, then -1 up to W."""
    offs = tl.arange(0, BLOCK_P)
    draft = tl.load(draft_row + offs, mask=offs < K, other=-1)
    row = tl.where(offs < n, draft, tl.where(offs == n, final.to(tl.int64), -1))
    tl.store(out_ptr + offs, row, mask=offs < W)


@triton.jit
def _greedy_accept_kernel(
    part_val_ptr, part_idx_ptr,  # [M + B, S]: row b's k_b + 1 positions at cu[b] + b ...
    draft_ptr,  # [M] int64
    cu_ptr,  # [B + 1] int64
    num_acc_ptr, out_ptr, stride_ob,  # [B] int64, [B, W] int64
    W, S,
    BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.load(cu_ptr + b)
    K = tl.load(cu_ptr + b + 1) - start
    first = start + b  # partials row of position 0 (the last committed token)
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
    _emit_row(out_ptr + b.to(tl.int64) * stride_ob, draft_row, K, n, final, W, BLOCK_P)


# --------------------------------------------------------------------------------------------------------------
# Rejection sampling.
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _chain_accept_count(p_row, stride_pp, q_row, stride_qp, draft_row, u_row, K, HAS_Q: tl.constexpr,
                        BLOCK_P: tl.constexpr):
    """Algorithm 1's acceptance loop, vectorised: all k tests u_j * q_j(x_j) < p_j(x_j) (float64) at once,
    then the length of the leading run of accepts (the same prefix rule as greedy)."""
    offs = tl.arange(0, BLOCK_P)
    valid = offs < K
    tok = tl.load(draft_row + offs, mask=valid, other=0)
    p_tok = _widen(tl.load(p_row + offs.to(tl.int64) * stride_pp + tok, mask=valid, other=0.0), True)
    u = tl.load(u_row + offs, mask=valid, other=1.0)
    if HAS_Q:
        q_tok = _widen(tl.load(q_row + offs.to(tl.int64) * stride_qp + tok, mask=valid, other=0.0), True)
        accept = u * q_tok < p_tok
    else:
        accept = u < p_tok  # point mass: q = 1 and u * 1.0 == u exactly
    return _chain_prefix_len(accept, offs, K)


@triton.jit
def _race_weights(p_at, q_at, e_row, sub_tok, q_end, floor, offs, mask, HAS_Q: tl.constexpr):
    """Exponential-race weights max(0, p - q) / E over one chunk (float64), -inf on masked lanes.

    HAS_Q: q is read from `q_at` below `q_end` (0: nothing to subtract); point mass: q = 1 at `sub_tok`.
    Entries below `floor` become 0: floor = 0 is the clamp; the reference does not clamp when k == 0 (it
    races p itself), mirrored with floor = -inf for bit-exactness. (Masks are only ever combined vector with
    vector: the interpreter mistypes `vector_bool & scalar_bool`.)"""
    p = _widen(tl.load(p_at + offs, mask=mask, other=0.0), True)
    if HAS_Q:
        q = _widen(tl.load(q_at + offs, mask=offs < q_end, other=0.0), True)
    else:
        q = tl.where(offs == sub_tok, 1.0, 0.0).to(tl.float64)
    r = p - q
    r = tl.where(r < floor, 0.0, r)
    e = tl.load(e_row + offs, mask=mask, other=1.0)
    return tl.where(mask, r / e, float("-inf"))


@triton.jit
def _rejection_partials_kernel(
    p_ptr, stride_pb, stride_pr, stride_pp,  # target_probs: row b's position j at b*pb + (cu[b] + b)*pr + j*pp
    q_ptr, stride_qb, stride_qr, stride_qp,  # draft_probs, likewise at b*qb + cu[b]*qr + j*qp (unless HAS_Q)
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
    b64 = b.to(tl.int64)
    start = tl.load(cu_ptr + b)
    K = tl.load(cu_ptr + b + 1) - start
    p_row = p_ptr + b64 * stride_pb + (start + b64) * stride_pr
    q_row = q_ptr + b64 * stride_qb + start * stride_qr
    draft_row = draft_ptr + start
    # Every slice recomputes the acceptance count (k gathers) rather than waiting for another launch.
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
    e_row = e_ptr + b64 * stride_eb

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
def _rejection_emit_kernel(
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
    _emit_row(out_ptr + b.to(tl.int64) * stride_ob, draft_ptr + start, K, n, final, W, BLOCK_P)


# --------------------------------------------------------------------------------------------------------------
# Host wrappers.
# --------------------------------------------------------------------------------------------------------------


def _split_plan(rows: int, vocab: int, device: torch.device, block_v: int | None, num_splits: int | None):
    """(BLOCK_V, slice length, number of slices): enough programs to fill the GPU when rows are few."""
    if block_v is None:  # at least 16 lanes: tiny vocabularies share one compiled variant
        block_v = min(1024, max(16, triton.next_power_of_2(vocab)))
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    chunks = triton.cdiv(vocab, block_v)
    if num_splits is None:
        if device.type == "cuda":
            target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
            num_splits = triton.cdiv(target, rows)
        else:
            num_splits = 1  # the CPU interpreter runs programs one after another: fewest is fastest
    num_splits = max(1, min(num_splits, chunks))
    split = triton.cdiv(chunks, num_splits) * block_v
    return block_v, split, triton.cdiv(vocab, split)


def _check_common(probs: torch.Tensor, draft_tokens: torch.Tensor, name: str) -> tuple[int, int, int]:
    if probs.dim() != 3 or draft_tokens.dim() != 2:
        raise ValueError(f"{name} must be [B, k+1, V] and draft_tokens [B, k]")
    batch, k = draft_tokens.shape
    if probs.shape[0] != batch or probs.shape[1] != k + 1:
        raise ValueError(f"{name} {tuple(probs.shape)} does not match draft_tokens {tuple(draft_tokens.shape)}")
    if not probs.is_floating_point():
        raise TypeError(f"{name} must be floating point, got {probs.dtype}")
    if probs.shape[2] == 0:
        raise ValueError("empty vocabulary")
    if draft_tokens.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"draft_tokens must be an integer tensor, got {draft_tokens.dtype}")
    return batch, k, probs.shape[2]


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def launch_greedy(logits: torch.Tensor, stride_b: int, stride_p: int, positions: int, rows: int,
                  draft: torch.Tensor, cu: torch.Tensor, num_accepted: torch.Tensor, emitted: torch.Tensor,
                  block_v: int | None, num_splits: int | None) -> None:
    """The two greedy launches. Logits row r = b * positions + p sits at b * stride_b + p * stride_p (a
    flat [M + B, V] tensor is the case positions = M + B, stride_b = 0); row b of the batch owns partials
    rows cu[b] + b .. cu[b+1] + b. draft [M] int64, cu [B + 1] int64 on the logits' device."""
    batch, vocab = num_accepted.shape[0], logits.shape[-1]
    block, split, n_splits = _split_plan(rows, vocab, logits.device, block_v, num_splits)
    part_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    part_val = torch.empty(rows, n_splits, dtype=part_dtype, device=logits.device)
    part_idx = torch.empty(rows, n_splits, dtype=torch.int32, device=logits.device)
    _argmax_partials_kernel[(rows, n_splits)](
        logits, stride_b, stride_p,
        part_val, part_idx,
        positions, vocab, split, n_splits,
        BLOCK_V=block, num_warps=8 if block >= 2048 else 4,
    )
    width = emitted.shape[1]
    _greedy_accept_kernel[(batch,)](
        part_val, part_idx,
        draft if draft.numel() else num_accepted,  # a stand-in never dereferenced when M == 0 (loads masked)
        cu,
        num_accepted, emitted, emitted.stride(0),
        width, n_splits,
        BLOCK_P=max(2, triton.next_power_of_2(width)), BLOCK_S=max(2, triton.next_power_of_2(n_splits)),
        num_warps=4,
    )


def launch_rejection(p: torch.Tensor, p_strides: tuple[int, int, int], q: torch.Tensor | None,
                     q_strides: tuple[int, int, int], draft: torch.Tensor, uniforms: torch.Tensor,
                     exponentials: torch.Tensor, cu: torch.Tensor, num_accepted: torch.Tensor,
                     emitted: torch.Tensor, block_v: int | None, num_splits: int | None) -> None:
    """The two rejection-sampling launches. Row b's position j of p is at b * pb + (cu[b] + b) * pr + j * pp
    for p_strides = (pb, pr, pp) (padded [B, k+1, V]: (stride 0, 0, stride 1); flat [M + B, V]: (0, stride 0,
    stride 0)); q likewise without the "+ b". q None: point-mass drafts. uniforms [M], exponentials [B, V]
    float64; draft [M] int64; cu [B + 1] int64."""
    batch, vocab = num_accepted.shape[0], p.shape[-1]
    has_q = q is not None and draft.numel() > 0
    q_arg = q if has_q else p  # p is a never-dereferenced stand-in when not has_q
    block, split, n_splits = _split_plan(batch, vocab, p.device, block_v, num_splits)
    part_val = torch.empty(batch, n_splits, dtype=torch.float64, device=p.device)
    part_idx = torch.empty(batch, n_splits, dtype=torch.int32, device=p.device)
    e = exponentials
    draft_arg, u_arg = (draft, uniforms) if draft.numel() else (num_accepted, e)  # stand-ins: no loads
    width = emitted.shape[1]
    block_p = max(2, triton.next_power_of_2(width))
    _rejection_partials_kernel[(batch, n_splits)](
        p, *p_strides,
        q_arg, *q_strides,
        draft_arg, u_arg,
        e, e.stride(0),
        cu, num_accepted,
        part_val, part_idx,
        vocab, split, n_splits,
        HAS_Q=has_q, BLOCK_V=block, BLOCK_P=block_p, num_warps=8 if block >= 2048 else 4,
        enable_fp_fusion=False,  # no contraction into FMAs: the float64 math must round like torch's
    )
    _rejection_emit_kernel[(batch,)](
        part_val, part_idx,
        draft_arg, cu,
        num_accepted, emitted, emitted.stride(0),
        width, n_splits,
        BLOCK_P=block_p, BLOCK_S=max(2, triton.next_power_of_2(n_splits)),
        num_warps=4,
    )


def _uniform_offsets(batch: int, k: int, device: torch.device) -> torch.Tensor:
    """cu [B + 1] of a padded batch: every row holds k draft tokens (the ragged kernels' uniform case)."""
    return torch.arange(batch + 1, dtype=torch.int64, device=device) * k


def greedy_verify_triton(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    *,
    block_v: int | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """target_logits [B, k+1, V], draft_tokens [B, k] -> (num_accepted [B] int64, emitted [B, k+1] int64).

    Same meaning as `reference.greedy_verify_torch`: the ragged kernels with every row holding k tokens.
    `block_v` / `num_splits` override the launch plan (tests use them to exercise many chunks and slices on
    small vocabularies)."""
    batch, k, _ = _check_common(target_logits, draft_tokens, "target_logits")
    device = target_logits.device
    logits = _last_contiguous(target_logits)
    num_accepted = torch.empty(batch, dtype=torch.int64, device=device)
    emitted = torch.empty(batch, k + 1, dtype=torch.int64, device=device)
    if batch == 0:
        return num_accepted, emitted
    draft = draft_tokens.to(torch.int64).reshape(-1).contiguous()
    launch_greedy(logits, logits.stride(0), logits.stride(1), k + 1, batch * (k + 1), draft,
                  _uniform_offsets(batch, k, device), num_accepted, emitted, block_v, num_splits)
    return num_accepted, emitted


def rejection_sample_triton(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
    exponentials: torch.Tensor,
    *,
    block_v: int | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same meaning and same draws as `reference.rejection_sample_torch(..., uniforms=, exponentials=)`.

    target_probs [B, k+1, V]; draft_tokens [B, k]; draft_probs [B, k, V] or None (point-mass drafts);
    uniforms [B, k] float64; exponentials [B, V] float64."""
    batch, k, vocab = _check_common(target_probs, draft_tokens, "target_probs")
    device = target_probs.device
    if draft_probs is not None:
        if tuple(draft_probs.shape) != (batch, k, vocab):
            raise ValueError(f"draft_probs must be {(batch, k, vocab)}, got {tuple(draft_probs.shape)}")
        if not draft_probs.is_floating_point():
            raise TypeError(f"draft_probs must be floating point, got {draft_probs.dtype}")
    if tuple(uniforms.shape) != (batch, k) or tuple(exponentials.shape) != (batch, vocab):
        raise ValueError("uniforms must be [B, k] and exponentials [B, V]")
    num_accepted = torch.empty(batch, dtype=torch.int64, device=device)
    emitted = torch.empty(batch, k + 1, dtype=torch.int64, device=device)
    if batch == 0:
        return num_accepted, emitted
    p = _last_contiguous(target_probs)
    q = _last_contiguous(draft_probs) if draft_probs is not None and k > 0 else None
    q_strides = (q.stride(0), 0, q.stride(1)) if q is not None else (0, 0, 0)
    launch_rejection(p, (p.stride(0), 0, p.stride(1)), q, q_strides,
                     draft_tokens.to(torch.int64).reshape(-1).contiguous(),
                     uniforms.to(torch.float64).reshape(-1).contiguous(), exponentials.to(torch.float64).contiguous(),
                     _uniform_offsets(batch, k, device), num_accepted, emitted, block_v, num_splits)
    return num_accepted, emitted
