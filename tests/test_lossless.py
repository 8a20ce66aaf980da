"""Greedy output is token-for-token plain greedy decoding, whatever the proposer suggests."""

from __future__ import annotations

import pytest
import torch
from conftest import plain_greedy, tiny_model
from helpers import EmptyProposer, MaxProposer, OracleProposer, RandomProposer, save_random_dflash2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec import SpeculativeDecoder, TargetModel
from specdec.api import build_proposer_config
from specdec.plugins import get_registry

MODELS = {}


def model_for(kind: str, seed: int):
    key = (kind, seed)
    if key not in MODELS:
        MODELS[key] = tiny_model(kind, seed=seed)
    return MODELS[key]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A smaller random causal LM with the same vocabulary, for the `draft` proposer."""
    folder = tmp_path_factory.mktemp("draft")
    tiny_model("llama", layers=1, hidden=16, heads=2, kv_heads=1, seed=9).save_pretrained(folder)
    return str(folder)


class DraftDirs(list):
    """DFlash draft folders, with DFlash2 ones as `.v2`."""

    v2: list[str]


@pytest.fixture(scope="module")
def dflash_dirs(tmp_path_factory):
    """Random-weight DFlash drafts of several shapes and block sizes for the llama tiny target."""
    from specdec_dflash.checkpoint import save_draft
    from specdec_dflash.model import DFlashConfig, DFlashDraftModel
    from specdec_dflash.vocab import save_vocab

    folders = []
    for layers, block, taps in [(1, 2, [1]), (2, 4, [0, 3]), (1, 8, [0, 1, 2])]:
        torch.manual_seed(layers * 100 + block)
        config = DFlashConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=8, intermediate_size=48, block_size=block, mask_token_id=5,
                              target_layer_ids=taps, num_target_layers=4, vocab_size=128, rope_theta=10000.0)
        folder = tmp_path_factory.mktemp(f"dflash{layers}-{block}")
        save_draft(DFlashDraftModel(config), folder, dtype=torch.float64)
        folders.append(str(folder))
    save_vocab(torch.tensor([0, 3, 5, 7, 8, 9, 10, 64, 100, 127]), folders[-1])  # a reduced draft vocabulary
    # DFlash2 drafts beside them (dflash_dirs.v2): a chain-only one, and one with a reduced vocabulary
    folders = DraftDirs(folders)
    folders.v2 = [save_random_dflash2(tmp_path_factory.mktemp("dflash2-a"), seed=1, num_target_layers=4,
                                      target_layer_ids=[1], block_size=4, conv_kernel_size=3, conv_group_size=32),
                  save_random_dflash2(tmp_path_factory.mktemp("dflash2-b"), seed=2, num_hidden_layers=1,
                                      target_layer_ids=[0, 2], block_size=7, selector_top_k=4,
                                      vocab_ids=[0, 3, 5, 7, 8, 9, 10, 64, 100, 127])]
    return folders


@pytest.fixture(scope="module")
def eagle_dirs(tmp_path_factory):
    """Random-weight EAGLE-3 drafts for the tiny targets: the whole vocabulary, and a reduced one."""
    from specdec_eagle.checkpoint import save_draft
    from specdec_eagle.model import Eagle3Config, Eagle3DraftModel

    folders = []
    for size, taps in [(128, [0, 1, 3]), (12, [2])]:
        torch.manual_seed(size)
        config = Eagle3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              intermediate_size=48, vocab_size=128, draft_vocab_size=size, target_layer_ids=taps,
                              num_target_layers=4)
        model = Eagle3DraftModel(config)
        if size < 128:
            model.set_vocabulary(torch.tensor([0, 3, 5, 7, 8, 9, 10, 64, 100, 110, 120, 127]))
        folder = tmp_path_factory.mktemp(f"eagle{size}")
        save_draft(model, folder, dtype=torch.float64)
        folders.append(str(folder))
    return folders


def registered_cases(draft_dir, dflash_dirs, eagle_dirs):
    cases = []
    for name in get_registry().proposers:
        if name == "draft":
            cases += [(name, {"draft": draft_dir, "num_tokens": k}) for k in (1, 3)]
        elif name == "dflash":
            cases += [(name, {"draft": d, "tree_size": 0, "lookup": 0}) for d in dflash_dirs]  # the paper's chain
            cases.append((name, {"draft": dflash_dirs[1], "tree_size": 0, "lookup": 1}))  # + lookup on matches
            cases.append((name, {"draft": dflash_dirs[1], "tree_size": 9, "lookup": 0}))  # a tree of 9 tokens
            cases += [(name, {"draft": d}) for d in dflash_dirs]  # the defaults: tree and lookup together
            cases.append((name, {"draft": dflash_dirs[1], "lookup_after": 3}))  # lookup seeded by the draft
            cases.append((name, {"draft": dflash_dirs[0], "expansion": "best_first", "tree_size": 12}))
        elif name == "dflash2":
            cases += [(name, {"draft": d, "tree_size": 0, "lookup": 0}) for d in dflash_dirs.v2]  # the chain
            cases += [(name, {"draft": d}) for d in dflash_dirs.v2]  # the defaults: tree and lookup together
            cases.append((name, {"draft": dflash_dirs.v2[1], "lookup_after": 2}))
            cases.append((name, {"draft": dflash_dirs.v2[0], "expansion": "best_first", "tree_size": 10}))
        elif name == "eagle3":
            cases += [(name, {"draft": d, "tree_size": 0}) for d in eagle_dirs]  # chains
            cases += [(name, {"draft": d}) for d in eagle_dirs]  # the default dynamic tree
            cases.append((name, {"draft": eagle_dirs[0], "tree_size": 40, "tree_width": 6, "num_tokens": 9}))
        elif name == "ngram":
            cases += [(name, {}), (name, {"num_tokens": 2, "min_n": 1, "max_n": 1}), (name, {"candidates": 3})]
        else:
            cases.append((name, {}))
    return cases


def test_every_registered_proposer_is_covered(draft_dir, dflash_dirs, eagle_dirs):
    names = {name for name, _ in registered_cases(draft_dir, dflash_dirs, eagle_dirs)}
    assert {"autoregressive", "ngram", "draft", "dflash", "dflash2", "eagle3"} <= names


prompts = st.lists(st.integers(min_value=0, max_value=127), min_size=1, max_size=12)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["llama", "qwen3"]), seed=st.integers(0, 2), prompt=prompts,
       max_new=st.integers(1, 24), case=st.integers(0, 100))
def test_registered_proposers_match_plain_greedy(draft_dir, dflash_dirs, eagle_dirs, kind, seed, prompt, max_new,
                                                case):
    model = model_for(kind, seed)
    expected = plain_greedy(model, prompt, max_new)
    cases = registered_cases(draft_dir, dflash_dirs, eagle_dirs)
    name, options = cases[case % len(cases)]
    if name in ("dflash", "dflash2") and kind != "llama":
        name, options = "ngram", {}
    decoder = SpeculativeDecoder.from_model(model, proposer=name, **options)
    out = decoder.generate_ids(prompt, max_new_tokens=max_new)
    assert out.token_ids == expected, (name, options)
    assert len(out.token_ids) == max_new


@pytest.mark.parametrize("name", ["autoregressive", "ngram", "draft", "dflash", "eagle3"])
def test_each_builtin_on_a_repetitive_prompt(draft_dir, dflash_dirs, eagle_dirs, name):
    model = model_for("llama", 0)
    prompt = [7, 8, 9, 10, 7, 8, 9, 10, 7, 8]
    drafts = {"draft": draft_dir, "dflash": dflash_dirs[1], "eagle3": eagle_dirs[1]}
    options = {"draft": drafts[name]} if name in drafts else {}
    out = SpeculativeDecoder.from_model(model, proposer=name, **options).generate_ids(prompt, max_new_tokens=30)
    assert out.token_ids == plain_greedy(model, prompt, 30)


@pytest.mark.parametrize("lookup", [1, 2, 4])
def test_dflash_with_prompt_lookup_on_a_repetitive_prompt(dflash_dirs, lookup):
    model = model_for("llama", 1)
    prompt = [7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8, 9]
    decoder = SpeculativeDecoder.from_model(model, proposer="dflash", draft=dflash_dirs[2], lookup=lookup,
                                            tree_size=0)
    out = decoder.generate_ids(prompt, max_new_tokens=40)
    assert out.token_ids == plain_greedy(model, prompt, 40)


@pytest.mark.parametrize("lookup_after", [1, 3])
def test_dflash_tree_with_seeded_lookup_on_a_repetitive_prompt(dflash_dirs, lookup_after):
    model = model_for("llama", 1)
    prompt = [7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 3, 9, 10]
    decoder = SpeculativeDecoder.from_model(model, proposer="dflash", draft=dflash_dirs[1], lookup_after=lookup_after)
    out = decoder.generate_ids(prompt, max_new_tokens=40)
    assert out.token_ids == plain_greedy(model, prompt, 40)


def run_with(proposer_cls, model, prompt, max_new, **options):
    target = TargetModel(model)
    proposer = proposer_cls(proposer_cls.Config(**options), target)
    return SpeculativeDecoder(target, proposer).generate_ids(prompt, max_new_tokens=max_new)


@settings(max_examples=10, deadline=None)
@given(kind=st.sampled_from(["llama", "qwen3"]), prompt=prompts, max_new=st.integers(1, 30),
       which=st.sampled_from(["random", "empty", "max"]), k=st.integers(1, 6), seed=st.integers(0, 50))
def test_adversarial_proposers_are_lossless(kind, prompt, max_new, which, k, seed):
    model = model_for(kind, 0)
    expected = plain_greedy(model, prompt, max_new)
    if which == "random":
        out = run_with(RandomProposer, model, prompt, max_new, num_tokens=k, seed=seed)
        steps = out.stats.acceptance_lengths
        if len(steps) >= 10:  # a random guess is right 1 time in 128: one or two steps may well accept one
            assert out.stats.mean_acceptance_length < 1.5
    elif which == "empty":
        out = run_with(EmptyProposer, model, prompt, max_new)
        # every step commits the target's own token only; the prefill made the first (max_new 1: no step)
        lengths = out.stats.acceptance_lengths
        assert set(lengths) <= {1} and len(lengths) == len(out.token_ids) - 1
    else:
        out = run_with(MaxProposer, model, prompt, max_new)
    assert out.token_ids == expected


@pytest.mark.parametrize("k", [1, 3, 7])
def test_oracle_reaches_k_plus_one(k):
    model = model_for("llama", 0)
    prompt, max_new = [1, 2, 3], 40
    OracleProposer.reference = plain_greedy(model, prompt, max_new)
    out = run_with(OracleProposer, model, prompt, max_new, num_tokens=k)
    assert out.token_ids == OracleProposer.reference
    # every step but the last commits k + 1 tokens; the last one only what is left
    lengths = out.stats.acceptance_lengths
    assert all(n == k + 1 for n in lengths[:-1])
    assert sum(lengths) + 1 == max_new  # the prefill produced the first token
    assert out.stats.num_target_forwards == len(lengths) + 1


def test_stops_at_eos_and_includes_it():
    model = model_for("llama", 0)
    prompt = [4, 5, 6]
    reference = plain_greedy(model, prompt, 20)
    eos = reference[5]
    model.generation_config.eos_token_id = eos
    try:
        expected = plain_greedy(model, prompt, 20, eos=eos)
        OracleProposer.reference = reference
        for cls, opts in [(OracleProposer, {"num_tokens": 6}), (MaxProposer, {})]:
            out = run_with(cls, model, prompt, 20, **opts)
            assert out.token_ids == expected
            assert out.token_ids[-1] == eos and out.stop_reason == "eos"
    finally:
        model.generation_config.eos_token_id = None


def test_options_are_validated_before_loading():
    from specdec.errors import SpecdecError

    with pytest.raises(SpecdecError, match="Unknown option 'bogus'"):
        build_proposer_config("ngram", {"bogus": 1})
    with pytest.raises(SpecdecError, match="num_tokens"):
        build_proposer_config("ngram", {"num_tokens": "zero"})
    with pytest.raises(SpecdecError, match="Unknown proposer 'nope'; choose one of: .*ngram"):
        build_proposer_config("nope", {})
