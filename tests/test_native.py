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
from specdec import native as native_module
from specdec.errors import SpecdecError
from specdec.native import unsupported_reason
from specdec.native_cache import NativeKVCache
from specdec.target import TargetModel
from specdec.tree import from_paths


@pytest.fixture(autouse=True)
def transformers_attention_kernel(request, monkeypatch):
    """Bit-identity to transformers is the claim of the path that runs transformers' attention kernel: batches of
    few new tokens per row take specdec's grouped attention or the fused kernel with query heads folded on a CPU
    instead (faster, as accurate; tested below against their own claims), so these comparisons switch them off
    unless a test is about them."""
    if "grouped" in request.node.name:
        monkeypatch.setattr(native_module, "GROUPED_ATTENTION", "grouped")
    else:
        monkeypatch.setattr(native_module, "GROUPED_MAX_QUERIES", 0)
    if "folded" not in request.node.name:  # the folded layout: the same kernel, but rounding may differ by shape
        monkeypatch.setattr(native_module, "FOLDED_ATTENTION", "fused")


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
    assert native.backend.cache.keys.shape[3] == 512


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


def build(kind: str, dtype: torch.dtype = torch.float32, **overrides):
    """A tiny model of one of the architectures the native forward covers, with config overrides."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    config_class, model_class = classes[kind]
    fields = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
    fields.update(overrides)
    torch.manual_seed(0)
    model = model_class(config_class(**fields))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)  # norms and biases away from their 1/0 defaults
    return model.to(dtype).eval()


VARIANTS = {
    "qwen2 (q/k/v bias, tied embeddings)": lambda dt: build("qwen2", dt, tie_word_embeddings=True),
    "llama (attention and MLP bias, head 16, one kv head)": lambda dt: build(
        "llama", dt, attention_bias=True, mlp_bias=True, head_dim=16, num_key_value_heads=1),
    "llama (no GQA)": lambda dt: build("llama", dt, num_key_value_heads=4),
    "llama (llama3 rope scaling)": lambda dt: build("llama", dt, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)),
    "qwen3 (GQA heads of 288)": lambda dt: build("qwen3", dt, head_dim=288),
    "llama (config runs 2 of 3 layers)": lambda dt: build("llama", dt, num_hidden_layers=3),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_architecture_variants_match_transformers_bit_for_bit(variant, dtype):
    model = VARIANTS[variant](dtype)
    if variant.startswith("llama (config runs 2"):
        model.config.num_hidden_layers = 2  # transformers then runs only the first two layers
    assert unsupported_reason(model) is None
    native, reference = TargetModel(model, cache="native"), TargetModel(model, cache="dynamic")
    for target in (native, reference):
        target.request_taps([0, 1])
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 128, (2, 90), generator=gen)  # 90 + 3 steps: past 64 (llama3 scaling) and a batch
    tokens, parents = from_paths([[5, 6, 7], [5, 9], [11]])
    tree_feed = torch.cat([prompt[:, -1:], torch.tensor([tokens, tokens])], dim=1)
    assert_same(native.prefill(prompt[:, :-1]), reference.prefill(prompt[:, :-1]))
    assert_same(native.forward(tree_feed, tree_parents=parents), reference.forward(tree_feed, tree_parents=parents))
    for target in (native, reference):
        target.retain(89, torch.tensor([0, 1, 2]))  # the root and the path 5, 9
    for n in (1, 4):
        feed = torch.randint(0, 128, (2, n), generator=gen)
        assert_same(native.forward(feed), reference.forward(feed))


def test_what_the_native_forward_does_not_cover_falls_back_with_the_reason():
    causal_off = build("qwen3", is_causal=False)
    assert "is_causal=False" in unsupported_reason(causal_off)
    sliding = build("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert "sliding" in unsupported_reason(sliding)
    hooked = build("llama")
    hooked.model.layers[1].register_forward_hook(lambda module, args, output: output)  # e.g. steering
    assert "module model.layers.1 has forward hooks" in unsupported_reason(hooked)
    assert TargetModel(hooked).cache_name == "dynamic"
    replaced = build("llama")
    replaced.model.layers[0].mlp.up_proj = torch.nn.Sequential(replaced.model.layers[0].mlp.up_proj)
    assert "not plain nn.Linear" in unsupported_reason(replaced)


def test_specdec_tap_hooks_do_not_stop_other_adapters_from_going_native():
    model = build("llama")
    TargetModel(model, cache="dynamic").request_taps([1])  # transformers' path taps with forward hooks
    assert TargetModel(model).cache_name == "native"


def test_transformers_output_capturing_hooks_do_not_stop_the_native_forward():
    """transformers leaves inert output-capturing hooks on the layers after a forward with output_hidden_states
    (a user's own call, or a reference in a test); they record only inside its own forward."""
    model = build("llama")
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), output_hidden_states=True)
    assert any(m._forward_hooks for m in model.modules()) or pytest.skip("this transformers leaves no hooks")
    assert unsupported_reason(model) is None and TargetModel(model).cache_name == "native"


def steer(module, args, output):  # a forward hook that changes activations
    return (output[0] + 0.5, *output[1:]) if isinstance(output, tuple) else output + 0.5


def test_a_hook_added_after_the_target_was_made_hands_auto_to_transformers_forward():
    model = tiny_model("llama", seed=5)
    decoder = SpeculativeDecoder.from_model(model, proposer="ngram")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    decoder.generate_ids(prompt, max_new_tokens=8)
    assert decoder.target.cache_name == "native"
    model.model.layers[2].register_forward_hook(steer)
    steered = plain_greedy(model, prompt, 30)
    assert decoder.generate_ids(prompt, max_new_tokens=30).token_ids == steered
    assert decoder.target.cache_name == "dynamic"


def test_taps_survive_the_hand_over_and_a_chosen_native_cache_refuses_a_late_hook():
    model = tiny_model("qwen3", seed=6)
    auto, reference = TargetModel(model), TargetModel(model, cache="dynamic")
    chosen = TargetModel(model, cache="native")
    for target in (auto, reference):
        target.request_taps([0, 2])
    model.model.layers[1].register_forward_hook(steer)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    assert_same(auto.tap_hidden_states(ids), reference.tap_hidden_states(ids))  # training checks too
    assert auto.cache_name == "dynamic"
    assert_same(auto.prefill(ids), reference.prefill(ids))
    with pytest.raises(SpecdecError, match="no longer covers this model.*model.layers.1 has forward hooks"):
        chosen.prefill(ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_rows_of_one_length_joining_with_add_rows_take_the_shared_length_path_bit_for_bit(kind, dtype):
    native, reference = paired(kind, dtype)
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 128, (2, 11), generator=gen)
    native.reset()
    assert_same(native.add_rows(list(prompt)), reference.prefill(prompt))
    feed = torch.randint(0, 128, (2, 4), generator=gen)
    assert_same(native.forward(feed), reference.forward(feed))
    for target in (native, reference):
        target.crop([13, 13])
    tokens, parents = from_paths([[5, 6], [7]])
    tree_feed = torch.cat([feed[:, :1], torch.tensor([tokens, tokens])], dim=1)
    assert_same(native.forward(tree_feed, tree_parents=parents), reference.forward(tree_feed, tree_parents=parents))
    for target in (native, reference):
        target.retain([14, 14], torch.tensor([[0, 1], [0, 1]]))
    step = torch.randint(0, 128, (2, 1), generator=gen)
    assert_same(native.forward(step), reference.forward(step))
    assert native.cache_lengths == reference.cache_lengths == [17, 17]


def _reference_attention(q, k, v, mask, scale):
    """Plain float64 attention with the kv heads repeated: [B, H, n, d]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = q.double() @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~(mask if mask.dim() == 3 else mask.unsqueeze(0))[:, None], float("-inf"))
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("per_row_mask", [False, True])
@pytest.mark.parametrize("n", [1, 3])
def test_grouped_attention_equals_attention_with_repeated_heads(n, per_row_mask):
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(3, 6, n, 8, dtype=torch.float64, generator=gen)
    total = 17 + n  # the longest row's 17 cached positions, then the new ones
    k, v = (torch.randn(3, 2, total, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    if per_row_mask:
        mask = native_module.row_mask([11, 17, 14], n, None, torch.device("cpu"))
    else:
        mask = None if n == 1 else torch.ones(n, total, dtype=torch.bool).tril_(total - n)
    got = native_module.grouped_attention(q, k, v, mask, 0.3)
    assert torch.allclose(got, _reference_attention(q, k, v, mask, 0.3), atol=1e-12, rtol=0)
    low = native_module.grouped_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 0.3)
    fused_mask = None if mask is None else (mask.unsqueeze(1) if mask.dim() == 3 else mask)  # [B, 1, n, T]
    fused = torch.nn.functional.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(),
                                                             attn_mask=fused_mask, scale=0.3, enable_gqa=True)
    reference = _reference_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 0.3)
    # as accurate as the fused kernel: both round the float32 result to bfloat16 once
    assert (low.double() - reference).abs().max() <= (fused.double() - reference).abs().max() * 1.5 + 1e-2


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_grouped_attention_decodes_batches_as_transformers_does_in_float64(kind):
    native, reference = paired(kind, torch.float64)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 128, (3, 30), generator=gen)
    native.prefill(prompt)
    reference.prefill(prompt)
    for n in (1, 2, 4):  # the grouped path (several rows, at most GROUPED_MAX_QUERIES new tokens each)
        feed = torch.randint(0, 128, (3, n), generator=gen)
        a, b = native.forward(feed), reference.forward(feed)
        assert torch.allclose(a.logits, b.logits, atol=1e-10, rtol=0)
        for layer in a.taps:
            assert torch.allclose(a.taps[layer], b.taps[layer], atol=1e-10, rtol=0)


def test_grouped_attention_is_taken_where_the_probe_measures_it_clearly_faster(monkeypatch):
    """"auto" asks the probe once per attention shape and takes grouped attention only at GROUPED_MARGIN times
    the fused kernel's speed; "fused" and "grouped" pin the choice without probing."""
    calls = []

    def probe(heads, kv_heads, head_dim, dtype):
        calls.append((heads, kv_heads, head_dim, dtype))
        return timings[head_dim]  # (fused seconds, grouped seconds)

    timings = {8: (1.0, 0.5), 16: (1.0, 0.8), 32: (0.2, 0.7)}
    monkeypatch.setattr(native_module, "_probe_attention", probe)
    monkeypatch.setattr(native_module, "_grouped_verdicts", {})
    monkeypatch.setattr(native_module, "GROUPED_ATTENTION", "auto")
    assert native_module.grouped_pays(6, 2, 8, torch.bfloat16)  # twice as fast: taken
    assert not native_module.grouped_pays(6, 2, 16, torch.bfloat16)  # 1.25x: within the margin, fused
    assert not native_module.grouped_pays(6, 2, 32, torch.bfloat16)  # slower: fused
    assert native_module.grouped_pays(6, 2, 8, torch.bfloat16)
    assert len(calls) == 3  # measured once per shape
    for pinned, expected in (("grouped", True), ("fused", False)):
        monkeypatch.setattr(native_module, "GROUPED_ATTENTION", pinned)
        assert native_module.grouped_pays(6, 2, 32, torch.bfloat16) is expected
    assert len(calls) == 3


@pytest.mark.parametrize("choice", ["fused", "grouped"])
def test_batched_forward_takes_the_attention_grouped_pays_chooses(choice, monkeypatch):
    monkeypatch.setattr(native_module, "GROUPED_ATTENTION", choice)
    used = []
    real = native_module.grouped_attention
    monkeypatch.setattr(native_module, "grouped_attention", lambda *a: used.append(1) or real(*a))
    native, reference = paired("llama", torch.float64)
    prompt = torch.randint(0, 128, (3, 12), generator=torch.Generator().manual_seed(5))
    native.prefill(prompt)
    reference.prefill(prompt)
    feed = torch.randint(0, 128, (3, 2), generator=torch.Generator().manual_seed(6))
    a, b = native.forward(feed), reference.forward(feed)
    assert torch.allclose(a.logits, b.logits, atol=1e-10, rtol=0)
    assert bool(used) is (choice == "grouped")


def test_attention_probe_times_both_kernels():
    fused, grouped = native_module._probe_attention(6, 2, 8, torch.float32)
    assert 0 < fused < 1 and 0 < grouped < 1


@pytest.mark.parametrize("per_row_mask", [False, True])
@pytest.mark.parametrize("n", [2, 5])
def test_folded_attention_equals_attention_with_repeated_heads(n, per_row_mask):
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(3, 6, n, 8, dtype=torch.float64, generator=gen)
    total = 17 + n
    k, v = (torch.randn(3, 2, total, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    if per_row_mask:
        mask = native_module.row_mask([11, 17, 14], n, None, torch.device("cpu"))
    else:
        mask = torch.ones(n, total, dtype=torch.bool).tril_(total - n)
    folded = native_module.fold_mask(mask, 3)
    assert folded.shape == ((3 if per_row_mask else 1), 1, 3 * n, total)
    got = native_module.folded_attention(q, k, v, folded, 0.3)
    assert torch.allclose(got, _reference_attention(q, k, v, mask, 0.3), atol=1e-12, rtol=0)


def test_folded_attention_is_taken_where_the_probe_measures_it_faster(monkeypatch):
    """"auto" asks the probe once per attention shape and folds only at FOLD_MARGIN times the grouped-query
    layout's speed; "fused" and "folded" pin the choice without probing."""
    calls = []

    def probe(heads, kv_heads, head_dim, dtype):
        calls.append((heads, kv_heads, head_dim, dtype))
        return timings[head_dim]  # (grouped-query layout seconds, folded seconds)

    timings = {8: (1.0, 0.5), 16: (1.0, 0.9), 32: (0.2, 0.7)}
    monkeypatch.setattr(native_module, "_probe_folding", probe)
    monkeypatch.setattr(native_module, "_folded_verdicts", {})
    monkeypatch.setattr(native_module, "FOLDED_ATTENTION", "auto")
    assert native_module.folding_pays(6, 2, 8, torch.bfloat16)
    assert not native_module.folding_pays(6, 2, 16, torch.bfloat16)  # within the margin
    assert not native_module.folding_pays(6, 2, 32, torch.bfloat16)
    assert native_module.folding_pays(6, 2, 8, torch.bfloat16)
    assert len(calls) == 3
    for pinned, expected in (("folded", True), ("fused", False)):
        monkeypatch.setattr(native_module, "FOLDED_ATTENTION", pinned)
        assert native_module.folding_pays(6, 2, 32, torch.bfloat16) is expected
    assert len(calls) == 3


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("choice", ["fused", "folded"])
def test_batched_forward_takes_the_folded_layout_folding_pays_chooses(choice, ragged, monkeypatch):
    """Rows verifying 2 .. FOLD_MAX_QUERIES / group tokens each fold when chosen, and match transformers in
    float64 (one length, and rows of different lengths against each row alone); one token per row, or more
    than the limit, never folds."""
    monkeypatch.setattr(native_module, "FOLDED_ATTENTION", choice)
    monkeypatch.setattr(native_module, "FOLD_MAX_QUERIES", 8)  # group 2: up to 4 tokens per row
    used = []
    real = native_module.folded_attention
    monkeypatch.setattr(native_module, "folded_attention", lambda *a: used.append(a[0].shape[2]) or real(*a))
    native, reference = paired("llama", torch.float64)
    gen = torch.Generator().manual_seed(5)
    if ragged:
        prompts = [torch.randint(0, 128, (length,), generator=gen) for length in (12, 7, 10)]
        native.add_rows(prompts)
    else:
        prompt = torch.randint(0, 128, (3, 12), generator=gen)
        native.prefill(prompt)
        reference.prefill(prompt)
    for n in (1, 2, 4, 5):
        feed = torch.randint(0, 128, (3, n), generator=gen)
        got = native.forward(feed).logits
        if ragged:  # each row against that row alone through transformers
            for row, prompt in enumerate(prompts):
                alone = TargetModel(reference.model, cache="dynamic")
                alone.prefill(prompt.unsqueeze(0))
                expected = alone.forward(feed[row: row + 1]).logits
                assert torch.allclose(got[row: row + 1], expected, atol=1e-10, rtol=0)
                prompts[row] = torch.cat([prompt, feed[row]])
        else:
            assert torch.allclose(got, reference.forward(feed).logits, atol=1e-10, rtol=0)
    assert set(used) == ({2, 4} if choice == "folded" else set())  # new tokens per row of the folded forwards


def test_folding_probe_times_both_layouts():
    layout, folded = native_module._probe_folding(6, 2, 8, torch.float32)
    assert 0 < layout < 1 and 0 < folded < 1
