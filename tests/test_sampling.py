"""Lossless sampling: with any proposer, generated tokens are distributed exactly as plain sampling's.

Each statistical test compares empirical counts with the exact distribution (enumerated from the model)
by a chi-square test at significance 1e-4; with the few tests here the chance of a false alarm on a
correct implementation is below 0.1% per run, and seeds are fixed, so a run is reproducible.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import tiny_model
from helpers import RandomProposer, RandomTreeProposer, save_random_dflash2

from specdec import SamplingParams, SpeculativeDecoder, TargetModel
from specdec.sampling import logits_to_probs
from specdec_kernels.reference import rejection_sample_torch

VOCAB = 8
ALPHA = 1e-4


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Upper-tail p-value of Pearson's statistic; cells with tiny expectation are pooled."""
    n = counts.sum()
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    if (obs[~keep] > 0).any():
        return 0.0  # a token the target gives probability 0 was produced
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = max(1, obs.numel() - 1)
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def exact_marginals(model, prompt, steps, params):
    """P(token at position j) for j < steps, by enumerating every prefix."""
    marginals = []
    prefixes = {(): 1.0}
    with torch.no_grad():
        for _ in range(steps):
            marginal = torch.zeros(VOCAB, dtype=torch.float64)
            nxt = {}
            for prefix, weight in prefixes.items():
                logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1]
                p = logits_to_probs(logits, params).double()
                marginal += weight * p
                for t in range(VOCAB):
                    if p[t] > 0:
                        nxt[prefix + (t,)] = weight * float(p[t])
            marginals.append(marginal)
            prefixes = nxt
    return marginals


@pytest.fixture(scope="module")
def small_target():
    model = tiny_model("llama", vocab=VOCAB, hidden=16, heads=2, kv_heads=1, layers=2, seed=11)
    with torch.no_grad():  # peaked but not degenerate: some tokens likely, rejections still frequent
        model.lm_head.weight.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def proposer_cases(tmp_path_factory, small_target):
    from specdec_dflash.checkpoint import load_draft, save_draft
    from specdec_dflash.model import DFlashConfig, DFlashDraftModel
    from specdec_dflash.vocab import save_vocab

    draft_dir = tmp_path_factory.mktemp("draft8")
    tiny_model("llama", vocab=VOCAB, hidden=16, heads=2, kv_heads=1, layers=1, seed=12).save_pretrained(draft_dir)
    dflash_dir = tmp_path_factory.mktemp("dflash8")
    torch.manual_seed(13)
    config = DFlashConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=8, intermediate_size=16, block_size=4, mask_token_id=7, target_layer_ids=[0],
                          num_target_layers=2, vocab_size=VOCAB, rope_theta=10000.0)
    save_draft(DFlashDraftModel(config), dflash_dir, dtype=torch.float64)
    # the same draft restricted to every third token: q is zero on the rest, which only the target can emit
    reduced_dir = tmp_path_factory.mktemp("dflash8-vocab")
    save_draft(load_draft(dflash_dir, dtype=torch.float64), reduced_dir, dtype=torch.float64)
    save_vocab(torch.arange(0, VOCAB, 3), reduced_dir)
    from specdec_eagle.checkpoint import save_draft as save_eagle
    from specdec_eagle.model import Eagle3Config, Eagle3DraftModel

    eagle_dirs = {}
    for size in (VOCAB, VOCAB // 3):
        torch.manual_seed(14)
        eagle = Eagle3DraftModel(Eagle3Config(hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                                              head_dim=8, intermediate_size=16, vocab_size=VOCAB,
                                              draft_vocab_size=size, target_layer_ids=[0, 1], num_target_layers=2))
        if size < VOCAB:  # every third token: q is zero on the rest
            eagle.set_vocabulary(torch.arange(0, VOCAB, 3)[:size])
        eagle_dirs[size] = tmp_path_factory.mktemp(f"eagle{size}")
        save_eagle(eagle, eagle_dirs[size], dtype=torch.float64)
    # DFlash2: q is the selector's over 4 candidates per slot (sparse), conditioned on the token drawn before
    dflash2_dir = save_random_dflash2(
        tmp_path_factory.mktemp("dflash2-8"), seed=15, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, intermediate_size=16, block_size=4, mask_token_id=7, target_layer_ids=[0],
        num_target_layers=2, vocab_size=VOCAB, conv_group_size=4, selector_rank=3, selector_top_k=4)
    return {"autoregressive": {}, "ngram": {"num_tokens": 3, "min_n": 1, "max_n": 2},
            "dflash2": {"draft": dflash2_dir},
            "dflash2-chain": {"draft": dflash2_dir, "tree_size": 0, "lookup": 0},  # sampled by the selector
            "dflash2-tree": {"draft": dflash2_dir, "tree_size": 6, "lookup": 1, "drafting": "greedy"},
            "ngram-tree": {"num_tokens": 3, "min_n": 1, "max_n": 2, "candidates": 3},
            "draft": {"draft": str(draft_dir), "num_tokens": 3}, "dflash": {"draft": str(dflash_dir)},
            "dflash-chain": {"draft": str(dflash_dir), "tree_size": 0, "lookup": 0},  # sampled drafts, with q
            "dflash-vocab": {"draft": str(reduced_dir), "tree_size": 0, "lookup": 0},
            "dflash-lookup": {"draft": str(dflash_dir), "tree_size": 0, "lookup": 1},
            "dflash-tree": {"draft": str(reduced_dir), "tree_size": 6, "lookup": 1, "drafting": "greedy"},
            "eagle3": {"draft": str(eagle_dirs[VOCAB]), "num_tokens": 3},  # a sampled chain, with q
            "eagle3-vocab": {"draft": str(eagle_dirs[VOCAB // 3]), "num_tokens": 3},
            "eagle3-tree": {"draft": str(eagle_dirs[VOCAB // 3]), "tree_size": 6, "tree_width": 3,
                            "drafting": "greedy"}}


def sample_counts(decoder, prompt, steps, params, runs):
    counts = torch.zeros(steps, VOCAB)
    for seed in range(runs):
        out = decoder.generate_ids(prompt, max_new_tokens=steps, temperature=params.temperature, top_k=params.top_k,
                                   top_p=params.top_p, seed=seed)
        for j, token in enumerate(out.token_ids):
            counts[j, token] += 1
    return counts


def test_every_registered_proposer_is_covered(proposer_cases):
    from specdec.plugins import get_registry

    assert set(get_registry().proposers) <= set(proposer_cases)


@pytest.mark.parametrize("name", ["autoregressive", "ngram", "ngram-tree", "draft", "dflash", "dflash-chain",
                                  "dflash-vocab", "dflash-lookup", "dflash-tree", "dflash2-chain", "dflash2-tree",
                                  "eagle3", "eagle3-vocab",
                                  "eagle3-tree", "test-random", "test-random-tree"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=5, top_p=0.9)], ids=["T1", "T07k5p09"])
def test_sampled_distribution_equals_the_targets(small_target, proposer_cases, name, params):
    prompt, steps, runs = [1, 2, 1, 2, 1], 3, 700
    if name == "test-random":
        target = TargetModel(small_target)
        decoder = SpeculativeDecoder(target, RandomProposer(RandomProposer.Config(num_tokens=3, seed=5), target))
    elif name == "test-random-tree":  # random trees over 8 tokens: paths of several tokens are often accepted
        target = TargetModel(small_target)
        RandomTreeProposer.reference = []
        decoder = SpeculativeDecoder(target, RandomTreeProposer(RandomTreeProposer.Config(num_tokens=6, seed=5),
                                                                target))
    else:
        decoder = SpeculativeDecoder.from_model(small_target, proposer=name.partition("-")[0],
                                                **proposer_cases[name])
    counts = sample_counts(decoder, prompt, steps, params, runs)
    for j, marginal in enumerate(exact_marginals(small_target, prompt, steps, params)):
        p = chi_square_p_value(counts[j], marginal)
        assert p > ALPHA, (name, j, counts[j].tolist(), (marginal * runs).tolist())


def test_the_check_can_fail(small_target):
    """The same statistic rejects a plausible bug: sampling at the wrong temperature."""
    decoder = SpeculativeDecoder.from_model(small_target, proposer="autoregressive")
    counts = sample_counts(decoder, [1, 2, 1, 2, 1], 1, SamplingParams(temperature=0.5), 700)
    marginal = exact_marginals(small_target, [1, 2, 1, 2, 1], 1, SamplingParams(temperature=1.0))[0]
    assert chi_square_p_value(counts[0], marginal) < ALPHA


@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_sampler_output_is_p(with_q):
    gen = torch.Generator().manual_seed(3)
    vocab, n = 6, 20000
    p = torch.rand(1, 2, vocab, generator=gen, dtype=torch.float64) ** 3
    p /= p.sum(-1, keepdim=True)
    q = torch.rand(1, 1, vocab, generator=gen, dtype=torch.float64) ** 3
    q /= q.sum(-1, keepdim=True)
    counts = torch.zeros(vocab)
    for _ in range(n // 500):
        # 500 independent chains at once: batch rows share nothing
        pb, qb = p.expand(500, -1, -1), q.expand(500, -1, -1)
        draft = torch.multinomial(qb[:, 0], 1, generator=gen) if with_q else torch.full((500, 1), 2)
        _, emitted = rejection_sample_torch(pb, draft, qb if with_q else None, gen)
        counts += torch.bincount(emitted[:, 0], minlength=vocab)
    assert chi_square_p_value(counts, p[0, 0]) > ALPHA


def test_seed_reproduces_a_run_and_other_seeds_differ(small_target, proposer_cases):
    decoder = SpeculativeDecoder.from_model(small_target, proposer="dflash", **proposer_cases["dflash"])
    runs = [decoder.generate_ids([1, 2, 3], max_new_tokens=12, temperature=1.0, seed=s).token_ids
            for s in (7, 7, 8, 9)]
    assert runs[0] == runs[1]
    assert runs[2] != runs[0] or runs[3] != runs[0]


def test_top_k_and_top_p_edge_cases():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, -float("inf")]])
    one = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=1))
    # as transformers' TopKLogitsWarper: values tied with the k-th largest are kept
    assert one[0, 1] == one[0, 3] == 0.5 and one[0, [0, 2, 4]].sum() == 0
    assert logits_to_probs(torch.tensor([[1.0, 3.0, 2.0]]), SamplingParams(temperature=1.0, top_k=1))[0, 1] == 1.0
    tiny_p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=1e-6))
    assert (tiny_p > 0).sum() == 1
    full = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=1.0))
    assert torch.allclose(full, logits.softmax(-1))
    both = logits_to_probs(logits, SamplingParams(temperature=2.0, top_k=3, top_p=0.5))
    assert both[0, 4] == 0 and both[0, 0] == 0 and torch.isclose(both.sum(), torch.tensor(1.0))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=0.0)


def test_greedy_ignores_the_seed(small_target):
    decoder = SpeculativeDecoder.from_model(small_target, proposer="ngram")
    outs = {tuple(decoder.generate_ids([1, 2, 3], max_new_tokens=8, seed=s).token_ids) for s in range(3)}
    assert len(outs) == 1


def test_enumeration_is_a_distribution(small_target):
    for marginal in exact_marginals(small_target, [1, 2], 2, SamplingParams(temperature=1.0)):
        assert torch.isclose(marginal.sum(), torch.tensor(1.0, dtype=torch.float64))
    assert list(itertools.islice(range(3), 2)) == [0, 1]


@pytest.mark.parametrize("name", ["ngram-tree", "dflash-chain", "dflash-tree", "dflash2-chain", "eagle3",
                                  "test-random"])
def test_sampled_distribution_in_batches_equals_the_targets(small_target, proposer_cases, name):
    """Rows of a batch (two prompts of different lengths, interleaved, 8 rows at a time, each with its own seed,
    the adaptive draft budget cutting drafts) sample the target's distribution."""
    params, prompt, other, steps, runs = SamplingParams(temperature=1.0), [1, 2, 1, 2, 1], [3, 1], 3, 700
    if name == "test-random":
        target = TargetModel(small_target)
        decoder = SpeculativeDecoder(target, RandomProposer(RandomProposer.Config(num_tokens=3, seed=5), target))
    else:
        decoder = SpeculativeDecoder.from_model(small_target, proposer=name.partition("-")[0],
                                                **proposer_cases[name])
    prompts = [torch.tensor(prompt if i % 2 == 0 else other) for i in range(2 * runs)]
    results = decoder.engine.generate_batch(prompts, steps, params, seeds=list(range(len(prompts))), batch_size=8)
    counts = torch.zeros(steps, VOCAB)
    for result in results[::2]:
        for j, token in enumerate(result.token_ids):
            counts[j, token] += 1
    for j, marginal in enumerate(exact_marginals(small_target, prompt, steps, params)):
        p = chi_square_p_value(counts[j], marginal)
        assert p > ALPHA, (name, j, counts[j].tolist(), (marginal * runs).tolist())
