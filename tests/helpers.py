"""Test-only proposers: adversarial and ideal drafts the engine must stay lossless under."""

from __future__ import annotations

import torch

from specdec import DecodeState, Draft, Proposer, ProposerConfig


class RandomProposer(Proposer):
    name = "test-random"

    class Config(ProposerConfig):
        num_tokens: int = 4
        seed: int = 0

    def __init__(self, config, target):
        super().__init__(config, target)
        self.gen = torch.Generator().manual_seed(config.seed)

    def propose(self, state: DecodeState) -> Draft:
        k = min(self.config.num_tokens, state.max_draft_tokens)
        tokens = torch.randint(0, self.target.vocab_size, (state.batch_size, k), generator=self.gen)
        return Draft(tokens=tokens)


class OracleProposer(Proposer):
    """Proposes the true greedy continuation (computed from a precomputed reference)."""

    name = "test-oracle"

    class Config(ProposerConfig):
        num_tokens: int = 4

    reference: list[int] = []

    def propose(self, state: DecodeState) -> Draft:
        k = min(self.config.num_tokens, state.max_draft_tokens)
        done = state.length - state.prompt_length
        tokens = self.reference[done: done + k]
        return Draft(tokens=torch.tensor([tokens], dtype=torch.long))


class EmptyProposer(Proposer):
    name = "test-empty"

    def propose(self, state: DecodeState) -> Draft:
        return Draft(tokens=state.tokens.new_empty(state.batch_size, 0))


class MaxProposer(Proposer):
    """Always proposes exactly max_draft_tokens tokens (a constant id)."""

    name = "test-max"

    def propose(self, state: DecodeState) -> Draft:
        return Draft(tokens=torch.full((state.batch_size, state.max_draft_tokens), 3, dtype=torch.long))
