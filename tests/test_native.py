"""specdec's native forward (specdec.native) against the transformers forward it replaces: bit-identical logits
and taps through prefill, chain and tree steps, rollback and retain, in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch
from conftest import plain_greedy, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tree import parents_lists

from specdec import SpeculativeDecoder
from specdec.errors import SpecdecError
from specdec.native import NativeKVCache, unsupported_reason
from specdec.target import TargetModel


def paired(kind: str, dtype: torch.dtype, seed: int = 0, **kwargs) -> tuple[TargetModel, TargetModel]:
    model = tiny_model(kind, seed=seed, dtype=dtype, **kwargs)
    native, reference = TargetModel(model, cache="native"), TargetModel(model, cache="dynamic")
    for target in (native, reference):
        target.request_taps([0, 2])
    return native, reference


def assert_same(a, b) -> None:
    assert torch.equal(a.logits, b.logits)
    assert a.taps.keys() == b.taps.keys()
    for layer in a.taps:
        assert torch.equal(a.taps[layer], b.taps[layer])


@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(["llama", "qwen3"]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       prompt_length=st.integers(1, 40), steps=st.lists(st.tuples(st.integers(1, 9), st.integers(0, 9)),
                                                        min_size=1, max_size=6), seed=st.integers(0, 1000))
def test_chain_steps_and_rollbacks_match_transformers_bit_for_bit(kind, dtype, prompt_length, steps, seed):
    native, reference = paired(kind, dtype)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 128, (1, prompt_length), generator=gen)
    assert_same(native.prefill(prompt), reference.prefill(prompt))
    for n, rejected in steps:
        feed = torch.randint(0, 128, (1, n), generator=gen)
        assert_same(native.forward(feed), reference.forward(feed))
        keep = native.cache_length - min(rejected, n - 1)
        native.crop(keep)
        reference.crop(keep)
        assert native.cache_length == reference.cache_length == keep


@settings(max_examples=20, deadline=None)
@given(parents=parents_lists.filter(lambda p: len(p) > 0), kind=st.sampled_from(["llama", "qwen3"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 1000))
def test_tree_steps_and_retain_match_transformers_bit_for_bit(parents, kind, dtype, seed):
    native, reference = paired(kind, dtype)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 128, (1, 9), generator=gen)
    native.prefill(prompt[:, :-1])
    reference.prefill(prompt[:, :-1])
    feed = torch.cat([prompt[:, -1:], torch.randint(0, 128, (1, len(parents)), generator=gen)], dim=1)
    assert_same(native.forward(feed, tree_parents=parents), reference.forward(feed, tree_parents=parents))
    # keep the root and the path to the last node, as the engine does after a walk
    path, node = [], len(parents) - 1
    while node >= 0:
        path.insert(0, node + 1)
        node = parents[node]
    indices = torch.tensor([0] + path)
    for target in (native, reference):
        target.retain(8, indices)
    after = torch.randint(0, 128, (1, 3), generator=gen)
    assert_same(native.forward(after), reference.forward(after))


def test_the_cache_grows_past_its_first_capacity_and_batches_rows():
    native, reference = paired("llama", torch.float32)
    prompt = torch.randint(0, 128, (2, 250), generator=torch.Generator().manual_seed(1))
    assert_same(native.prefill(prompt), reference.prefill(prompt))
    for _ in range(3):  # 250 + 3 x 5 crosses the first 256-position buffer
        feed = torch.randint(0, 128, (2, 5))
        assert_same(native.forward(feed), reference.forward(feed))
    assert native._cache.keys.shape[3] == 512


def test_taps_only_forward_matches_transformers():
    native, reference = paired("qwen3", torch.bfloat16)
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(2))
    assert_same(native.tap_hidden_states(ids), reference.tap_hidden_states(ids))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_decoding_through_the_native_forward_is_plain_greedy(kind):
    model = tiny_model(kind, seed=5)
    decoder = SpeculativeDecoder.from_model(model, proposer="ngram")
    assert decoder.target.cache_name == "native"
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    assert decoder.generate_ids(prompt, max_new_tokens=40).token_ids == plain_greedy(model, prompt, 40)


def test_auto_falls_back_to_transformers_for_models_it_does_not_cover():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    model = LlamaForCausalLM(config).eval()
    assert "'eager' is not 'sdpa'" in unsupported_reason(model)
    assert TargetModel(model).cache_name == "dynamic"
    with pytest.raises(SpecdecError, match="does not cover this model.*use cache='dynamic'"):
        TargetModel(model, cache="native")


def test_native_cache_rejects_a_different_batch_without_reset():
    cache = NativeKVCache(None)
    cache.reserve(2, 1, 2, 8, 4, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="batch of 1 rows"):
        cache.reserve(2, 3, 2, 8, 4, torch.float32, torch.device("cpu"))
