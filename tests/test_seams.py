"""The target-backend, cache and engine seams: per-row caches, registered caches, the per-model lock, verifier
and proposer agreement, all checked before any work."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import plain_greedy, tiny_model

from specdec import SamplingParams, SpecdecError, SpeculativeDecoder, TargetModel
from specdec.caches import DynamicKVCache
from specdec.contracts import KVCache, cache_api_problem
from specdec.native_cache import NativeKVCache


def keys_of(target: TargetModel) -> torch.Tensor:
    """Layer 0's cached keys [B, kv_heads, length, head_dim], whichever cache holds them."""
    cache = target.backend.cache
    if isinstance(cache, NativeKVCache):
        return cache.keys[0, :, :, : cache.length()]
    return cache.hf_cache.layers[0].keys


@pytest.mark.parametrize("cache", ["native", "dynamic"])
def test_retain_keeps_each_rows_own_path(cache):
    target = TargetModel(tiny_model("llama", seed=0), cache=cache)
    prompt = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    target.prefill(prompt)
    target.forward(torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(1)))
    before = keys_of(target).clone()  # [2, heads, 11, d]
    indices = torch.tensor([[0, 2, 3], [1, 3, 4]])  # row 0 keeps nodes 0, 2, 3 after position 6; row 1 others
    target.retain([6, 6], indices)
    after = keys_of(target)
    assert target.cache_lengths == [9, 9]
    for row in range(2):
        expected = torch.cat([before[row, :, :6], before[row, :, 6 + indices[row]]], dim=1)
        assert torch.equal(after[row], expected)


def test_the_dynamic_cache_refuses_rows_of_different_lengths_and_the_native_one_keeps_them():
    dynamic = TargetModel(tiny_model("llama", seed=0), cache="dynamic")
    dynamic.prefill(torch.randint(0, 128, (2, 6)))
    with pytest.raises(NotImplementedError, match="keeps rows of one length"):
        dynamic.crop([5, 4])
    native = TargetModel(tiny_model("llama", seed=0), cache="native")
    native.prefill(torch.randint(0, 128, (2, 6)))
    native.crop([5, 4])
    assert native.cache_lengths == [5, 4]


def test_crop_takes_any_integer():
    target = TargetModel(tiny_model("llama", seed=0))
    target.prefill(torch.randint(0, 128, (1, 8)))
    for length in (np.int64(7), torch.tensor(6), 5):
        target.crop(length)
        assert target.cache_length == int(length)


def test_a_registered_native_cache_subclass_is_the_one_used():
    class Mine(NativeKVCache):
        name = "mine"

    target = TargetModel(tiny_model("llama", seed=0), cache=Mine)
    target.prefill(torch.randint(0, 128, (1, 4)))
    assert type(target.backend.cache) is Mine and target.cache_name == "mine"


def test_a_cache_written_for_the_single_length_api_is_refused():
    class Old(KVCache):
        name = "old"

        def length(self):
            return 0

        def crop(self, length):
            pass

    class OldCrop(DynamicKVCache):
        name = "old-crop"

        def crop(self, length):
            pass

    assert "implements length() but not lengths()" in cache_api_problem(Old)
    assert "takes one `length`" in cache_api_problem(OldCrop)
    assert cache_api_problem(DynamicKVCache) is None and cache_api_problem(NativeKVCache) is None
    with pytest.raises(SpecdecError, match="not lengths"):
        TargetModel(tiny_model("llama", seed=0), cache=Old)


def test_a_cache_without_hf_cache_is_refused_for_transformers_forward():
    class NoHf(KVCache):
        name = "no-hf"

        def lengths(self):
            return []

    target = TargetModel(tiny_model("llama", seed=0), cache=NoHf)
    with pytest.raises(SpecdecError, match="has no `hf_cache`"):
        target.prefill(torch.randint(0, 128, (1, 4)))


def test_a_generation_started_inside_another_on_the_same_model_is_refused():
    model = tiny_model("llama", seed=0)
    outer, inner = (SpeculativeDecoder.from_model(model, proposer="ngram") for _ in range(2))
    seen = []

    def nested(_ids):
        with pytest.raises(SpecdecError, match="from inside a generation on the same model"):
            inner.generate_ids([1, 2, 3], max_new_tokens=2)
        seen.append(True)

    out = outer.engine.generate(torch.tensor([[4, 5, 6]]), 6, SamplingParams(),
                                on_tokens=nested)
    assert seen and out.token_ids == plain_greedy(model, [4, 5, 6], 6)


def test_prompt_ids_of_another_dtype_are_decoded_as_long():
    model = tiny_model("llama", seed=0)
    decoder = SpeculativeDecoder.from_model(model, proposer="ngram")
    out = decoder.generate_ids(torch.tensor([[2, 5, 9, 5]], dtype=torch.int32), max_new_tokens=6)
    assert out.token_ids == plain_greedy(model, [2, 5, 9, 5], 6)


def test_a_chains_only_verifier_with_a_tree_proposer_is_refused_before_the_prefill(monkeypatch):
    model = tiny_model("llama", seed=0)
    decoder = SpeculativeDecoder.from_model(model, proposer="ngram", candidates=3)
    decoder.engine.greedy_verifier = type("ChainOnly", (type(decoder.engine.greedy_verifier),),
                                          {"name": "chain-only", "supports_trees": False})()
    monkeypatch.setattr(decoder.target, "prefill", lambda *a: pytest.fail("the prefill ran"))
    with pytest.raises(SpecdecError, match="'chain-only' takes chains only but the proposer 'ngram' drafts trees.*"
                                           "candidates=1"):
        decoder.generate_ids([1, 2, 3], max_new_tokens=4)
