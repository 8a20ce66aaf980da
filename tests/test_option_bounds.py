"""Every size-like option of every proposer is bounded by what one verification forward may hold
(specdec.limits): a larger value is refused with one sentence naming the option, the bound and why, when the
options are parsed (static bounds) or when the proposer is built for a target (bounds from its context window),
before anything loads."""

from __future__ import annotations

import time

import pytest
import torch
from click.testing import CliRunner
from conftest import plain_greedy, tiny_model

from specdec import SpecdecError, SpeculativeDecoder, TargetModel
from specdec.api import build_proposer_config
from specdec.limits import MAX_NGRAM, MAX_VERIFY_TOKENS, verify_capacity

# (proposer, option, the largest value allowed, other options it needs, a word of the reason)
STATIC_BOUNDS = [
    ("eagle3", "num_tokens", MAX_VERIFY_TOKENS, {}, "verification forward"),
    ("eagle3", "tree_size", MAX_VERIFY_TOKENS, {}, "verification forward"),
    ("eagle3", "tree_width", MAX_VERIFY_TOKENS, {}, "verification forward"),
    ("dflash", "block_size", MAX_VERIFY_TOKENS + 1, {}, "block_size - 1"),
    ("dflash", "tree_size", MAX_VERIFY_TOKENS, {}, "verification forward"),
    ("dflash", "lookup", MAX_NGRAM, {}, "n-gram"),
    ("dflash", "lookup_after", MAX_VERIFY_TOKENS // 20, {}, "seeded prefix"),
    ("ngram", "num_tokens", MAX_VERIFY_TOKENS, {}, "verification forward"),
    ("ngram", "candidates", MAX_VERIFY_TOKENS // 10, {"num_tokens": 10}, "verification forward"),
    ("ngram", "min_n", MAX_NGRAM, {"max_n": MAX_NGRAM}, "n-gram"),
    ("ngram", "max_n", MAX_NGRAM, {}, "n-gram"),
    ("draft", "num_tokens", MAX_VERIFY_TOKENS, {"draft": "some/draft"}, "verification forward"),
]


@pytest.mark.parametrize("proposer,option,bound,others,why", STATIC_BOUNDS,
                         ids=[f"{p}.{o}" for p, o, *_ in STATIC_BOUNDS])
def test_each_size_option_has_a_static_bound(proposer, option, bound, others, why):
    assert getattr(build_proposer_config(proposer, {**others, option: bound}), option) == bound
    with pytest.raises(SpecdecError) as info:
        build_proposer_config(proposer, {**others, option: bound + 1})
    message = str(info.value)
    assert f"'{option}'" in message and f"more than {bound}" in message and why in message, message
    assert message.count(". ") == 0 and message.endswith("."), message  # one sentence


def test_tree_width_100000_is_refused_at_once_before_any_model_loads(monkeypatch):
    from specdec import loading
    from specdec.cli import main

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(loading, "load_model", no_loading)
    start = time.perf_counter()
    result = CliRunner().invoke(main, ["run", "-p", "eagle3", "--opt", "tree_width=100000", "hello"])
    elapsed = time.perf_counter() - start
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "tree_width" in lines[0] and f"more than {MAX_VERIFY_TOKENS}" in lines[0]
    assert elapsed < 5, elapsed


def test_the_capacity_comes_from_the_context_window():
    assert verify_capacity(8192) == MAX_VERIFY_TOKENS == verify_capacity(2**31 - 1)
    assert verify_capacity(64) == 62  # a prompt token and the token prefill commits leave 62 for a draft
    assert verify_capacity(2) == 1


@pytest.fixture(scope="module")
def short_target():
    """A target whose context window (32 positions) leaves 30 draft tokens per verification forward."""
    return TargetModel(tiny_model("llama", seed=0, max_positions=32))


def _build(name, target, **options):
    from specdec.plugins import get_proposer_class

    cls = get_proposer_class(name)
    return cls(cls.Config(**options), target)


# (proposer, options within the static bounds but beyond a 32-token context window, the option named, its bound)
CONTEXT_BOUNDS = [
    ("eagle3", {"num_tokens": 31}, "num_tokens", 30),
    ("eagle3", {"tree_size": 31}, "tree_size", 30),
    ("eagle3", {"tree_width": 31}, "tree_width", 30),
    ("dflash", {"tree_size": 31}, "tree_size", 30),
    ("dflash", {"block_size": 32, "tree_size": 0}, "block_size", 31),
    ("dflash", {"lookup_after": 2}, "lookup_after", 1),
    ("ngram", {"num_tokens": 31}, "num_tokens", 30),
    ("ngram", {"num_tokens": 10, "candidates": 4}, "candidates", 30),
    ("draft", {"num_tokens": 31}, "num_tokens", 30),
]


@pytest.mark.parametrize("proposer,options,option,bound", CONTEXT_BOUNDS,
                         ids=[f"{p}.{o}" for p, _, o, _ in CONTEXT_BOUNDS])
def test_a_short_context_window_lowers_each_bound_before_the_draft_loads(short_target, tmp_path, proposer,
                                                                         options, option, bound):
    if proposer != "ngram":  # a draft folder that does not exist: the bound must be checked first
        options = {**options, "draft": str(tmp_path / "nowhere")}
    with pytest.raises(SpecdecError) as info:
        _build(proposer, short_target, **options)
    message = str(info.value)
    assert f"'{option}'" in message and f"more than {bound}" in message, message
    assert "does not exist" not in message


def test_options_within_a_short_window_still_run(short_target):
    decoder = SpeculativeDecoder(short_target, _build("ngram", short_target, num_tokens=30))
    out = decoder.generate_ids([3, 4, 5, 3, 4], max_new_tokens=20)
    assert out.token_ids == plain_greedy(short_target.model, [3, 4, 5, 3, 4], 20)


def test_a_dflash_draft_trained_with_a_block_beyond_the_window_is_refused(short_target, tmp_path):
    from specdec_dflash.checkpoint import save_draft
    from specdec_dflash.model import DFlashConfig, DFlashDraftModel

    config = DFlashConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, intermediate_size=48, block_size=40, mask_token_id=5, target_layer_ids=[1],
                          num_target_layers=4, vocab_size=128)
    save_draft(DFlashDraftModel(config), tmp_path)
    with pytest.raises(SpecdecError, match="trained with block_size 40, more than 31.*block_size=31"):
        _build("dflash", short_target, draft=str(tmp_path), tree_size=0)
    proposer = _build("dflash", short_target, draft=str(tmp_path), tree_size=0, block_size=31)
    assert proposer.block_size == 31


def test_the_widest_eagle3_tree_allowed_runs_losslessly(tmp_path):
    """tree_width and tree_size at their bound: the tree keeps only what can be verified per depth, so a step
    stays small (here the draft vocabulary, 128, caps the width)."""
    from specdec_eagle.checkpoint import save_draft
    from specdec_eagle.model import Eagle3Config, Eagle3DraftModel

    torch.manual_seed(1)
    config = Eagle3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          intermediate_size=48, vocab_size=128, draft_vocab_size=128, target_layer_ids=[0, 1, 3],
                          num_target_layers=4)
    save_draft(Eagle3DraftModel(config).double(), tmp_path, dtype=torch.float64)
    model = tiny_model("llama", seed=0)
    decoder = SpeculativeDecoder.from_model(model, proposer="eagle3", draft=str(tmp_path), num_tokens=4,
                                            tree_size=MAX_VERIFY_TOKENS, tree_width=MAX_VERIFY_TOKENS)
    sizes = []
    propose = decoder.proposer.propose
    decoder.proposer.propose = lambda state: sizes.append(draft := propose(state)) or draft
    out = decoder.generate_ids([5, 6, 7], max_new_tokens=10)
    assert out.token_ids == plain_greedy(model, [5, 6, 7], 10)
    assert sizes and max(d.num_tokens for d in sizes) <= MAX_VERIFY_TOKENS
