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


class RandomTreeProposer(Proposer):
    """Random tree drafts: random shapes, random tokens, and (when `reference` is set) the true greedy
    continuation planted along one random root-to-node path, so some steps accept several tokens."""

    name = "test-random-tree"

    class Config(ProposerConfig):
        num_tokens: int = 6
        seed: int = 0

    reference: list[int] = []

    def __init__(self, config, target):
        super().__init__(config, target)
        self.gen = torch.Generator().manual_seed(config.seed)

    def _randint(self, high: int) -> int:
        return int(torch.randint(0, high, (), generator=self.gen))

    def propose(self, state: DecodeState) -> Draft:
        from specdec import tree

        k = self._randint(self.config.num_tokens + 1)
        parents = [self._randint(j + 1) - 1 for j in range(k)]  # -1 .. j-1
        # keep the tree within the allowed depth: re-hang too-deep nodes under the root
        depths = tree.depths(parents)
        for j in range(k):
            if depths[j] > state.max_draft_tokens:
                parents[j] = -1
            depths = tree.depths(parents)
        if state.max_draft_tokens == 0:
            parents = []
        k = len(parents)
        tokens = torch.randint(0, self.target.vocab_size, (k,), generator=self.gen).tolist()
        done = state.length - state.prompt_length
        truth = self.reference[done:]
        if k and truth:
            node, chain = self._randint(k), []
            while node >= 0:
                chain.append(node)
                node = parents[node]
            for depth, j in enumerate(reversed(chain)):
                if depth < len(truth):
                    tokens[j] = truth[depth]
        return Draft(tokens=torch.tensor([tokens], dtype=torch.long).view(1, k), parents=parents)
