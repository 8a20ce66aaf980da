"""Built-in verifiers: greedy (temperature 0) and rejection sampling (temperature > 0)."""

from __future__ import annotations

import torch
from specdec_kernels import greedy_verify, rejection_sample

from .contracts import Draft, Verdict, Verifier
from .sampling import SamplingParams, logits_to_probs


class GreedyVerifier(Verifier):
    name = "greedy"
    description = "longest draft prefix equal to the target's argmax, plus the target's next token"

    def verify(self, target_logits: torch.Tensor, draft: Draft, sampling: SamplingParams,
               generator: torch.Generator | None) -> Verdict:
        num_accepted, emitted = greedy_verify(target_logits, draft.tokens)
        return Verdict(num_accepted=num_accepted, emitted=emitted)


class RejectionSamplingVerifier(Verifier):
    name = "rejection"
    description = "Leviathan et al. 2023 rejection sampling; output distributed exactly as the target's"

    def verify(self, target_logits: torch.Tensor, draft: Draft, sampling: SamplingParams,
               generator: torch.Generator | None) -> Verdict:
        probs = logits_to_probs(target_logits, sampling)
        num_accepted, emitted = rejection_sample(probs, draft.tokens, draft.probs, generator)
        return Verdict(num_accepted=num_accepted, emitted=emitted)
