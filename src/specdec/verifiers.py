"""Built-in verifiers: greedy (temperature 0) and rejection sampling (temperature > 0), for chains and trees."""

from __future__ import annotations

import torch
from specdec_kernels import greedy_verify, rejection_sample

from . import tree
from .contracts import Draft, Verdict, Verifier
from .sampling import SamplingParams, logits_to_probs


class GreedyVerifier(Verifier):
    name = "greedy"
    description = "longest draft prefix (or tree path) equal to the target's argmax, plus the target's next token"
    supports_trees = True

    def verify(self, target_logits: torch.Tensor, draft: Draft, sampling: SamplingParams,
               generator: torch.Generator | None) -> Verdict:
        if draft.parents is not None:
            chosen = target_logits.max(dim=-1).indices  # argmax semantics (first index on ties), faster on CPU
            return Verdict(*tree.verify_tree(chosen, draft.tokens, draft.parents))
        num_accepted, emitted = greedy_verify(target_logits, draft.tokens)
        return Verdict(num_accepted=num_accepted, emitted=emitted)


class RejectionSamplingVerifier(Verifier):
    name = "rejection"
    description = "Leviathan et al. 2023 rejection sampling; output distributed exactly as the target's"
    supports_trees = True

    def verify(self, target_logits: torch.Tensor, draft: Draft, sampling: SamplingParams,
               generator: torch.Generator | None) -> Verdict:
        probs = logits_to_probs(target_logits, sampling)
        if draft.parents is not None:
            # a tree of point masses: the target samples its own token at every node (independent draws, so
            # each node on the path is an exact sample given the path before it) and the walk follows them
            exponentials = torch.empty(probs.shape, dtype=torch.float64, device=probs.device)
            exponentials.exponential_(generator=generator).clamp_min_(torch.finfo(torch.float64).tiny)
            chosen = (probs.double() / exponentials).argmax(dim=-1)
            return Verdict(*tree.verify_tree(chosen, draft.tokens, draft.parents))
        num_accepted, emitted = rejection_sample(probs, draft.tokens, draft.probs, generator)
        return Verdict(num_accepted=num_accepted, emitted=emitted)
