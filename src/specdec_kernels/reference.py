"""Torch references for the verification kernels: the definition each Triton kernel must match."""

from __future__ import annotations

from collections.abc import Sequence

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


# --------------------------------------------------------------------------------------------------------------
# Ragged layout (vLLM's rejection sampler): rows of different draft lengths, no padding in the inputs.
#
#   draft_tokens         [M]        every row's draft tokens, row after row (M = sum of k_b)
#   cu_num_draft_tokens  [B + 1]    offsets: row b's drafts are draft_tokens[cu[b]:cu[b+1]], cu[0] = 0, cu[B] = M
#   target logits/probs  [M + B, V] row b's k_b + 1 positions contiguous, starting at cu[b] + b: first the
#                                   position of its last committed token (which judges draft token 0), then
#                                   one per draft token (the last one gives the bonus token)
#   draft_probs          [M, V]     optional, aligned with draft_tokens
#   uniforms [M] float64 (aligned with draft_tokens), exponentials [B, V] float64 (one race per row)
#
# Outputs are padded as the padded functions': num_accepted [B] and emitted [B, max_k + 1] (-1 after the
# final token), where max_k is the longest row's k_b (or `max_num_draft_tokens` when given).
# --------------------------------------------------------------------------------------------------------------


def check_ragged(target: torch.Tensor, draft_tokens: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
                 name: str) -> tuple[int, int, int]:
    """Shape and dtype checks shared by the ragged reference and kernels (no host sync): (B, M, V)."""
    if target.dim() != 2 or draft_tokens.dim() != 1 or cu_num_draft_tokens.dim() != 1:
        raise ValueError(f"{name} must be [M + B, V], draft_tokens [M] and cu_num_draft_tokens [B + 1]")
    if cu_num_draft_tokens.numel() == 0:
        raise ValueError("cu_num_draft_tokens needs B + 1 >= 1 entries (its first is 0)")
    batch, m = cu_num_draft_tokens.numel() - 1, draft_tokens.numel()
    if target.shape[0] != m + batch:
        raise ValueError(f"{name} has {target.shape[0]} rows; {m} draft tokens in {batch} rows need {m + batch}")
    if not target.is_floating_point():
        raise TypeError(f"{name} must be floating point, got {target.dtype}")
    if target.shape[1] == 0:
        raise ValueError("empty vocabulary")
    for what, t in (("draft_tokens", draft_tokens), ("cu_num_draft_tokens", cu_num_draft_tokens)):
        if t.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{what} must be an integer tensor, got {t.dtype}")
    return batch, m, target.shape[1]


def max_draft_length(cu_num_draft_tokens: torch.Tensor, max_num_draft_tokens: int | None) -> int:
    """The padded width minus one: `max_num_draft_tokens` as given (no host sync), else the longest row's k_b."""
    if max_num_draft_tokens is not None:
        if max_num_draft_tokens < 0:
            raise ValueError(f"max_num_draft_tokens must be >= 0, got {max_num_draft_tokens}")
        return int(max_num_draft_tokens)
    if cu_num_draft_tokens.numel() < 2:
        return 0
    return int((cu_num_draft_tokens[1:] - cu_num_draft_tokens[:-1]).max())


def _ragged_index(cu_num_draft_tokens: torch.Tensor, m: int, max_k: int):
    """(counts [B], row of each draft token [M], its position in the row [M]); checks the offsets (syncs)."""
    cu = cu_num_draft_tokens.to(torch.int64)
    counts = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != m or bool((counts < 0).any()):
        raise ValueError(f"cu_num_draft_tokens must rise from 0 to the number of draft tokens ({m}), "
                         f"got {cu.tolist()}")
    if counts.numel() and int(counts.max()) > max_k:
        raise ValueError(f"a row has {int(counts.max())} draft tokens, more than max_num_draft_tokens={max_k}")
    batch = counts.numel()
    row_of = torch.repeat_interleave(torch.arange(batch, device=cu.device), counts, output_size=m)
    position = torch.arange(m, device=cu.device) - cu[:-1][row_of]
    return counts, row_of, position


def pad_ragged(values: torch.Tensor, cu_num_draft_tokens: torch.Tensor, width: int, fill) -> torch.Tensor:
    """Flat values [M, ...] laid out by `cu_num_draft_tokens` -> padded [B, width, ...], `fill` elsewhere."""
    counts, row_of, position = _ragged_index(cu_num_draft_tokens, values.shape[0], width)
    out = values.new_full((counts.numel(), width, *values.shape[1:]), fill)
    out[row_of, position] = values
    return out


def _leading_run(flags: torch.Tensor, row_of: torch.Tensor, position: torch.Tensor, batch: int,
                 max_k: int) -> torch.Tensor:
    """[B]: length of each row's leading run of True among its own k_b flags (flat [M])."""
    padded = torch.zeros(batch, max_k, dtype=torch.int64, device=flags.device)
    padded[row_of, position] = flags.to(torch.int64)
    return padded.cumprod(dim=1).sum(dim=1)


def greedy_verify_ragged_torch(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    max_num_draft_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`greedy_verify_torch` on the ragged layout: target_logits [M + B, V], draft_tokens [M],
    cu_num_draft_tokens [B + 1] -> (num_accepted [B], emitted [B, max_k + 1], -1 padded).

    Row b's result is `greedy_verify_torch(target_logits[cu[b] + b : cu[b+1] + b + 1][None],
    draft_tokens[cu[b] : cu[b+1]][None])`, padded with -1 to max_k + 1 entries."""
    batch, m, _ = check_ragged(target_logits, draft_tokens, cu_num_draft_tokens, "target_logits")
    max_k = max_draft_length(cu_num_draft_tokens, max_num_draft_tokens)
    counts, row_of, position = _ragged_index(cu_num_draft_tokens, m, max_k)
    draft = draft_tokens.to(torch.int64)
    argmax = target_logits.max(dim=-1).indices  # argmax semantics, as greedy_verify_torch
    matches = draft == argmax[torch.arange(m, device=draft.device) + row_of]  # draft i is judged at row i + b
    num_accepted = _leading_run(matches, row_of, position, batch, max_k)
    first_row = cu_num_draft_tokens.to(torch.int64)[:-1] + torch.arange(batch, device=draft.device)
    final = argmax[first_row + num_accepted]
    padded = draft.new_full((batch, max_k), -1)
    padded[row_of, position] = draft
    return num_accepted, _emit(num_accepted, padded, final)


def rejection_sample_ragged_torch(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
    exponentials: torch.Tensor | None = None,
    max_num_draft_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rejection_sample_torch` on the ragged layout: target_probs [M + B, V], draft_tokens [M],
    cu_num_draft_tokens [B + 1], draft_probs [M, V] or None (point masses); uniforms [M] and exponentials
    [B, V] float64 (drawn by `draw_randoms_ragged(cu, M, V, device, generator)` when not given).

    Row b's result is `rejection_sample_torch` on row b alone with uniforms[cu[b]:cu[b+1]][None] and
    exponentials[b][None], padded with -1 to max_k + 1 entries: bit for bit, rows with k_b = 0 included
    (their race runs on p itself, unclamped, as the padded function's does for k = 0)."""
    batch, m, vocab = check_ragged(target_probs, draft_tokens, cu_num_draft_tokens, "target_probs")
    if draft_probs is not None and tuple(draft_probs.shape) != (m, vocab):
        raise ValueError(f"draft_probs must be {(m, vocab)}, got {tuple(draft_probs.shape)}")
    max_k = max_draft_length(cu_num_draft_tokens, max_num_draft_tokens)
    device = target_probs.device
    if uniforms is None or exponentials is None:
        uniforms, exponentials = draw_randoms_ragged(cu_num_draft_tokens, m, vocab, device, generator)
    if tuple(uniforms.shape) != (m,) or tuple(exponentials.shape) != (batch, vocab):
        raise ValueError(f"uniforms must be [M] = {(m,)} and exponentials [B, V] = {(batch, vocab)}")
    counts, row_of, position = _ragged_index(cu_num_draft_tokens, m, max_k)
    draft = draft_tokens.to(torch.int64)
    flat = torch.arange(m, device=device)
    p = target_probs.double()
    p_tok = p[flat + row_of, draft]
    q_tok = torch.ones_like(p_tok) if draft_probs is None else draft_probs[flat, draft].double()
    num_accepted = _leading_run(uniforms * q_tok < p_tok, row_of, position, batch, max_k)
    starts = cu_num_draft_tokens.to(torch.int64)[:-1]
    p_at = p[starts + torch.arange(batch, device=device) + num_accepted]  # [B, V]
    rejected = (num_accepted < counts).unsqueeze(1)  # something to subtract: the draft at the first rejection
    if m == 0:
        q_at = torch.zeros_like(p_at)
    else:
        at = (starts + num_accepted).clamp(max=m - 1)
        if draft_probs is None:
            q_at = torch.zeros_like(p_at).scatter(1, draft[at].unsqueeze(1), 1.0)
        else:
            q_at = draft_probs[at].double()
        q_at = torch.where(rejected, q_at, 0.0)
    residual = torch.where((counts > 0).unsqueeze(1), (p_at - q_at).clamp_min(0.0), p_at)
    final = (residual / exponentials).argmax(dim=-1)
    padded = draft.new_full((batch, max_k), -1)
    padded[row_of, position] = draft
    return num_accepted, _emit(num_accepted, padded, final)


def draw_randoms_ragged(
    cu_num_draft_tokens: torch.Tensor,
    num_draft_tokens: int,
    vocab: int,
    device: torch.device,
    generator: torch.Generator | Sequence[torch.Generator] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 uniforms [M] and Exp(1) draws [B, V] one ragged rejection-sampling step consumes.

    One generator (or None: torch's default): `torch.rand(M)`, then `exponential_` on [B, V], exactly the
    calls `draw_randoms(B, k, V)` makes. So for B = 1, and for any batch whose rows all hold k drafts, the
    draws are the padded function's, element for element; rows of different lengths take consecutive
    slices of the uniforms stream (row b: uniforms[cu[b]:cu[b+1]]) and row b of the exponentials. No host sync.

    A sequence of B generators: row b's draws come from generators[b] alone, exactly as
    `draw_randoms(1, k_b, V, device, generators[b])` makes them, so row b's result is bit-identical to the
    padded function on row b alone with that generator (per-row seeds reproduce per-row outputs whatever
    else is in the batch). Reads the row lengths on the host; two draws per row."""
    batch = cu_num_draft_tokens.numel() - 1
    if generator is None or isinstance(generator, torch.Generator):
        uniforms = torch.rand(num_draft_tokens, dtype=torch.float64, device=device, generator=generator)
        exponentials = torch.empty(batch, vocab, dtype=torch.float64, device=device).exponential_(generator=generator)
        exponentials.clamp_min_(torch.finfo(torch.float64).tiny)  # as draw_randoms: 0 would let 0/0 win the race
        return uniforms, exponentials
    generators = list(generator)
    if len(generators) != batch:
        raise ValueError(f"{len(generators)} generators for {batch} rows; pass one per row or a single one")
    counts = (cu_num_draft_tokens[1:] - cu_num_draft_tokens[:-1]).tolist()
    draws = [draw_randoms(1, k, vocab, device, g) for k, g in zip(counts, generators, strict=True)]
    uniforms = torch.cat([u.view(-1) for u, _ in draws]) if draws else torch.empty(0, dtype=torch.float64,
                                                                                  device=device)
    exponentials = torch.cat([e for _, e in draws]) if draws else torch.empty(0, vocab, dtype=torch.float64,
                                                                              device=device)
    if uniforms.numel() != num_draft_tokens:
        raise ValueError(f"cu_num_draft_tokens ends at {uniforms.numel()}, not at {num_draft_tokens} draft tokens")
    return uniforms, exponentials
