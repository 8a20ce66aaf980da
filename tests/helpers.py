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


def save_random_dflash2(folder, seed: int = 0, dtype=torch.float64, vocab_ids=None, **fields):
    """A random-weight DFlash2 draft in z-lab's layout: every weight perturbed (convolutions around identity, the
    selector's codebooks non-zero), so that each part of the architecture moves the numbers."""
    from specdec_dflash.checkpoint import save_draft
    from specdec_dflash.dflash2_model import DFlash2Config, DFlash2DraftModel, GroupedDynamicCausalConv
    from specdec_dflash.vocab import save_vocab

    values = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  intermediate_size=48, block_size=6, mask_token_id=5, target_layer_ids=[0, 2], num_target_layers=4,
                  vocab_size=128, rope_theta=10000.0, conv_kernel_size=2, conv_group_size=8, selector_rank=6,
                  selector_top_k=5)
    torch.manual_seed(seed)
    model = DFlash2DraftModel(DFlash2Config(**(values | fields)))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, GroupedDynamicCausalConv):
                module.reset_to_identity()
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    save_draft(model, folder, dtype=dtype)
    if vocab_ids is not None:
        save_vocab(torch.as_tensor(vocab_ids), folder)
    return str(folder)
