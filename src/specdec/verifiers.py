"""Built-in verifiers: greedy (temperature 0) and rejection sampling (temperature > 0), for chains and trees."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from specdec_kernels import greedy_verify, greedy_verify_ragged, rejection_sample, rejection_sample_ragged

from . import tree
from .contracts import Draft, Verdict, Verifier
from .sampling import SamplingParams, logits_to_probs


class GreedyVerifier(Verifier):
    name = "greedy"
    description = "longest draft prefix (or tree path) equal to the target's argmax, plus the target's next token"
    supports_greedy, supports_sampling, supports_trees = True, False, True

    def verify(self, target_logits: torch.Tensor, draft: Draft, sampling: SamplingParams,
               generator: torch.Generator | None) -> Verdict:
        if draft.parents is not None:
            # argmax semantics (first index on ties), faster than argmax on bf16 CPU tensors; one host transfer
            chosen = target_logits.max(dim=-1).indices.tolist()
            return Verdict(*tree.verify_tree(lambda b, i: chosen[b][i], draft.tokens, draft.parents))
        num_accepted, emitted = greedy_verify(target_logits, draft.tokens)
        return Verdict(num_accepted=num_accepted, emitted=emitted)

    def verify_rows(self, target_logits: torch.Tensor, drafts: Sequence[Draft], sampling: SamplingParams,
                    generators: Sequence[torch.Generator | None]) -> list[Verdict]:
        if len(drafts) == 1 or any(draft.parents is not None for draft in drafts):
            return super().verify_rows(target_logits, drafts, sampling, generators)
        # every row a chain: one ragged verification (vLLM's flat layout) instead of a call per row
        flat, tokens, cu, counts = ragged_chains(target_logits, drafts)
        num_accepted, emitted = greedy_verify_ragged(flat, tokens, cu, max_num_draft_tokens=max(counts))
        return split_rows(num_accepted, emitted, counts)


class RejectionSamplingVerifier(Verifier):
    name = "rejection"
    description = "Leviathan et al. 2023 rejection sampling; output distributed exactly as the target's"
    supports_greedy, supports_sampling, supports_trees = False, True, True

    def verify(self, target_logits: torch.Tensor, draft: Draft, sampling: SamplingParams,
               generator: torch.Generator | None) -> Verdict:
        probs = logits_to_probs(target_logits, sampling)
        if draft.parents is not None:
            # a tree of point masses: the target draws its own token at each node the walk reaches (fresh,
            # independent draws, so each is an exact sample given the path before it) and the walk follows them
            def choose(b: int, i: int) -> int:
                return int(sample(probs[b, i], generator))

            return Verdict(*tree.verify_tree(choose, draft.tokens, draft.parents))
        num_accepted, emitted = rejection_sample(probs, draft.tokens, draft.probs, generator)
        return Verdict(num_accepted=num_accepted, emitted=emitted)

    def verify_rows(self, target_logits: torch.Tensor, drafts: Sequence[Draft], sampling: SamplingParams,
                    generators: Sequence[torch.Generator | None]) -> list[Verdict]:
        with_probs = [draft.probs is not None for draft in drafts]
        if (len(drafts) == 1 or any(draft.parents is not None for draft in drafts) or any(g is None for g in generators)
                or (any(with_probs) and not all(with_probs))):
            return super().verify_rows(target_logits, drafts, sampling, generators)
        # every row a chain: one ragged rejection-sampling call; each row draws from its own generator exactly
        # what `verify` draws for it alone (reference.draw_randoms_ragged), so the rows are bit-identical to it
        flat, tokens, cu, counts = ragged_chains(target_logits, drafts)
        probs = logits_to_probs(flat, sampling)  # [M + B, V]
        draft_probs = None
        if all(with_probs) and sum(counts):
            draft_probs = torch.cat([d.probs[0].to(flat.device) for d in drafts])  # type: ignore[index]  # [M, V]
        num_accepted, emitted = rejection_sample_ragged(probs, tokens, cu, draft_probs, list(generators),
                                                        max_num_draft_tokens=max(counts))
        return split_rows(num_accepted, emitted, counts)


def ragged_chains(target_logits: torch.Tensor, drafts: Sequence[Draft]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Chain drafts of B rows in vLLM's ragged layout: the logits at each row's own k_b + 1 positions
    [M + B, V], the draft tokens [M], the offsets cu [B + 1], and the k_b."""
    counts = [draft.num_tokens for draft in drafts]
    device = target_logits.device
    flat = target_logits.reshape(-1, target_logits.shape[-1])  # [B * (1 + max k), V]
    if any(k + 1 != target_logits.shape[1] for k in counts):  # padded rows: keep each row's k_b + 1
        positions = [b * target_logits.shape[1] + j for b, k in enumerate(counts) for j in range(k + 1)]
        flat = flat.index_select(0, torch.tensor(positions, device=device))  # [M + B, V]
    tokens = torch.cat([draft.tokens[0].to(device) for draft in drafts])  # [M]
    cu = torch.tensor([0, *itertools.accumulate(counts)], device=device)
    return flat, tokens, cu, counts


def split_rows(num_accepted: torch.Tensor, emitted: torch.Tensor, counts: list[int]) -> list[Verdict]:
    return [Verdict(num_accepted=num_accepted[b: b + 1], emitted=emitted[b: b + 1, : k + 1])
            for b, k in enumerate(counts)]


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw from probs [V] by an exponential race, argmax(p / E) with E ~ Exp(1), as the chain sampler."""
    exponentials = torch.empty(probs.shape, dtype=torch.float64, device=probs.device)
    exponentials.exponential_(generator=generator).clamp_min_(torch.finfo(torch.float64).tiny)
    return (probs.double() / exponentials).argmax(dim=-1)
