"""Tree drafts: the mask, the walk, the trie, and lossless decoding under random trees."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import plain_greedy, tiny_model
from helpers import RandomTreeProposer
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import Draft, PluginError, Proposer, SpeculativeDecoder, TargetModel, tree
from specdec.budget import UNCUT
from specdec.verifiers import GreedyVerifier

parents_lists = st.integers(0, 9).flatmap(
    lambda k: st.tuples(*[st.integers(-1, j - 1) for j in range(k)]).map(list))


def ancestors(parents, j):
    out = set()
    while j >= 0:
        out.add(j)
        j = parents[j]
    return out


@given(parents=parents_lists, past=st.integers(0, 5))
def test_mask_lets_each_node_see_the_context_the_root_and_its_ancestors_only(parents, past):
    mask = tree.attention_mask(parents, past, torch.float32, torch.device("cpu"))[0, 0]
    k = len(parents)
    assert mask.shape == (k + 1, past + k + 1)
    for row in range(k + 1):
        visible = ancestors(parents, row - 1)
        for col in range(past + k + 1):
            sees = col <= past or (col - past - 1) in visible
            assert (mask[row, col] == 0) == sees, (row, col)


@given(parents=parents_lists)
def test_depths_and_chains(parents):
    assert tree.check_parents(parents) is None
    assert tree.depths(parents) == [len(ancestors(parents, j)) for j in range(len(parents))]
    assert tree.is_chain(list(range(-1, len(parents) - 1)))


def test_malformed_parents_are_named():
    assert "parents[1] is 1" in tree.check_parents([-1, 1])
    assert "parents[0] is -2" in tree.check_parents([-2])


def test_trie_shares_prefixes_and_keeps_candidate_order():
    tokens, parents = tree.from_paths([[5, 6, 7], [5, 6, 8], [9], [5, 2]])
    assert tokens == [5, 6, 7, 8, 9, 2]
    assert parents == [-1, 0, 1, 1, -1, 0]


def test_walk_follows_the_first_matching_child():
    tokens, parents = [5, 6, 7, 6, 9], [-1, 0, 1, 0, 3]
    # at the root the target says 5, after 5 it says 6 (first child 1), after 6 it says 9: no such child of 1
    asked = []

    def choose(i):
        asked.append(i)
        return [5, 6, 9, 0, 0, 0][i]

    assert tree.walk(choose, tokens, parents) == ([0, 1], 9)
    assert asked == [0, 1, 2]  # the target's choice is asked for the nodes the walk reaches only
    assert tree.walk(lambda i: [4, 0, 0, 0, 0, 0][i], tokens, parents) == ([], 4)
    chosen = [[5, 6, 9, 0, 0, 0]]
    n, emitted, path = tree.verify_tree(lambda b, i: chosen[b][i], torch.tensor([tokens]), parents)
    assert n.tolist() == [2] and emitted.tolist() == [[5, 6, 9, -1, -1, -1]]
    assert path.tolist() == [[0, 1, -1, -1, -1]]


@settings(max_examples=15, deadline=None)
@given(parents=parents_lists.filter(lambda p: len(p) > 0), kind=st.sampled_from(["llama", "qwen3"]),
       seed=st.integers(0, 100))
def test_a_tree_forward_scores_each_node_as_its_own_chain_would(parents, kind, seed):
    model = tiny_model(kind, seed=3)
    target = TargetModel(model)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 128, (1, 7), generator=gen)
    tokens = torch.randint(0, 128, (len(parents),), generator=gen)
    target.request_taps([1])
    target.prefill(prompt[:, :-1])
    out = target.forward(torch.cat([prompt[:, -1:], tokens.view(1, -1)], dim=1), tree_parents=parents)
    for j in range(len(parents)):
        path = sorted(ancestors(parents, j))
        ids = torch.cat([prompt, tokens[path].view(1, -1)], dim=1)
        with torch.no_grad():
            expected = model(ids, output_hidden_states=True)
        torch.testing.assert_close(out.logits[0, j + 1], expected.logits[0, -1], rtol=1e-9, atol=1e-9)
        # the taps too: after the walk the proposer reads the accepted path's hidden states
        torch.testing.assert_close(out.taps[1][0, j + 1], expected.hidden_states[2][0, -1], rtol=1e-9, atol=1e-9)
    assert target.cache_length == 6 + 1 + len(parents)


@settings(max_examples=12, deadline=None)
@given(kind=st.sampled_from(["llama", "qwen3"]), prompt=st.lists(st.integers(0, 127), min_size=1, max_size=12),
       max_new=st.integers(1, 30), k=st.integers(1, 10), seed=st.integers(0, 50), plant=st.booleans())
def test_random_trees_are_lossless(kind, prompt, max_new, k, seed, plant):
    model = tiny_model(kind, seed=0)
    expected = plain_greedy(model, prompt, max_new)
    RandomTreeProposer.reference = expected if plant else []
    target = TargetModel(model)
    proposer = RandomTreeProposer(RandomTreeProposer.Config(num_tokens=k, seed=seed), target)
    out = SpeculativeDecoder(target, proposer).generate_ids(prompt, max_new_tokens=max_new)
    assert out.token_ids == expected
    if plant and max_new > 12:
        assert out.stats.mean_acceptance_length > 1.0


def test_a_planted_path_is_accepted_in_full_and_the_cache_follows_it():
    model = tiny_model("llama", seed=0)
    prompt, max_new = [1, 2, 3], 40
    expected = plain_greedy(model, prompt, max_new)

    class Planted(Proposer):
        name = "test-planted"

        def propose(self, state):
            truth = expected[state.length - state.prompt_length:][:3]
            # decoys first at every level, the truth as the last child: the walk must skip them
            tokens, parents = tree.from_paths([[(t + 1) % 128 for t in truth], truth[:1] + [0, 0], truth])
            depth_ok = [j for j, d in enumerate(tree.depths(parents)) if d <= state.max_draft_tokens]
            keep = {j: i for i, j in enumerate(depth_ok)}
            return Draft(tokens=torch.tensor([[tokens[j] for j in depth_ok]]),
                         parents=[keep.get(parents[j], -1) for j in depth_ok])

    target = TargetModel(model)
    decoder = SpeculativeDecoder(target, Planted(Planted.Config(), target))
    # the whole tree every step (the truth is its last path: a budget's cut to the first nodes would drop it)
    out = decoder.generate_ids(prompt, max_new_tokens=max_new, draft_budget=UNCUT)
    assert out.token_ids == expected
    assert out.stats.acceptance_lengths[:-1] == [4] * (len(out.stats.acceptance_lengths) - 1)
    assert target.cache_length == len(prompt) + max_new - 1


class _Fixed(Proposer):
    name = "test-fixed-tree"
    draft: Draft

    def propose(self, state):
        return self.draft


@pytest.mark.parametrize("draft, message", [
    (Draft(tokens=torch.tensor([[1, 2]]), parents=[-1, 1]), "malformed tree draft: parents[1] is 1"),
    (Draft(tokens=torch.tensor([[1, 2]]), parents=[-1]), "not a list of 2 ints"),
    (Draft(tokens=torch.tensor([[1, 2]]), parents=[-1, -1], probs=torch.full((1, 2, 128), 1 / 128)),
     "tree drafts must be point masses"),
    (Draft(tokens=torch.tensor([[1, 2, 3]]), parents=[-1, 0, 1]), "3 tokens deep but at most 2"),
])
def test_bad_tree_drafts_are_refused(draft, message):
    target = TargetModel(tiny_model("llama", seed=0))
    proposer = _Fixed(_Fixed.Config(), target)
    proposer.draft = draft
    with pytest.raises(PluginError, match=re.escape(message)):
        SpeculativeDecoder(target, proposer).generate_ids([1, 2], max_new_tokens=4)  # first step: 2 may be drafted


def test_a_chain_only_verifier_refuses_trees():
    class ChainOnly(GreedyVerifier):
        name = "test-chain-only"
        supports_trees = False

    target = TargetModel(tiny_model("llama", seed=0))
    proposer = _Fixed(_Fixed.Config(), target)
    proposer.draft = Draft(tokens=torch.tensor([[1, 2]]), parents=[-1, -1])
    decoder = SpeculativeDecoder(target, proposer)
    decoder.engine.greedy_verifier = ChainOnly()
    with pytest.raises(PluginError, match="takes chains only"):
        decoder.generate_ids([1, 2], max_new_tokens=5)


def test_sampled_tree_walk_draws_each_path_with_the_targets_probability():
    """The joint law of everything one tree step emits, against its exact value (chi-square, as in
    test_sampling): a walk that reused one random draw at every node could pass a per-position check."""
    from test_sampling import ALPHA, chi_square_p_value

    from specdec import SamplingParams
    from specdec.verifiers import RejectionSamplingVerifier

    vocab, rows = 3, 12000
    tokens, parents = [0, 1, 0, 2, 1], [-1, -1, 0, 0, 2]  # root -> {0, 1}; 0 -> {0, 2}; 0,0 -> {1}
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(1, len(tokens) + 1, vocab, generator=gen, dtype=torch.float64) * 1.5
    probs = logits.softmax(-1)[0]
    draft = Draft(tokens=torch.tensor([tokens]).expand(rows, -1), parents=parents)
    verdict = RejectionSamplingVerifier().verify(logits.expand(rows, -1, -1), draft, SamplingParams(1.0), gen)

    # exact law of the emitted sequence, by walking every branch
    law: dict[tuple[int, ...], float] = {}

    def expand(node: int, prefix: tuple[int, ...], weight: float) -> None:
        for x in range(vocab):
            child = next((c for c, p in enumerate(parents) if p == node and tokens[c] == x), None)
            w = weight * float(probs[node + 1, x])
            if child is None:
                law[prefix + (x,)] = law.get(prefix + (x,), 0.0) + w
            else:
                expand(child, prefix + (x,), w)

    expand(-1, (), 1.0)
    outcomes = sorted(law)
    seen = [tuple(t for t in row if t >= 0) for row in verdict.emitted.tolist()]
    counts = torch.tensor([seen.count(o) for o in outcomes], dtype=torch.float64)
    assert counts.sum() == rows
    assert chi_square_p_value(counts, torch.tensor([law[o] for o in outcomes])) > ALPHA


def test_a_sliding_window_target_refuses_trees_before_the_forward():
    from transformers import MistralConfig, MistralForCausalLM

    from specdec import SpecdecError

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=4, max_position_embeddings=64)
    target = TargetModel(MistralForCausalLM(config).eval())
    proposer = _Fixed(_Fixed.Config(), target)
    proposer.draft = Draft(tokens=torch.tensor([[1, 2]]), parents=[-1, -1])
    with pytest.raises(SpecdecError, match="cannot keep a tree's accepted path"):
        SpeculativeDecoder(target, proposer).generate_ids([1, 2], max_new_tokens=5)
