"""oneDNN-prepacked bfloat16 projections (specdec.prepacked): bit-identical to F.linear, used only where the
probe found them so, and never stale after a weight changes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from specdec import prepacked
from specdec.prepacked import PrepackedLinears, unpackable_reason
from specdec.target import TargetModel

ONEDNN_BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
needs_onednn = pytest.mark.skipif(not ONEDNN_BF16, reason="no oneDNN bfloat16 support on this CPU")


def linears(*shapes: tuple[int, int], bias: bool = False, dtype=torch.bfloat16) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(k, n, bias=bias).to(dtype).requires_grad_(False) for n, k in shapes]  # frozen, as a target


def packing_reason_here() -> str | None:
    """None where specdec packs the tests' projections (their linears and the tiny bf16 target's); else why not.
    On a CPU without bf16 matrix units (an Intel Xeon whose flags list no amx or avx512_bf16, seen in stop 34)
    oneDNN's packed product rounds differently from F.linear at one row, the probe keeps packing off, and the
    tests that check what packed products do have none to check; the tests of the probe itself still run."""
    if not ONEDNN_BF16:
        return "no oneDNN bfloat16 support on this CPU"
    packs = PrepackedLinears(linears((96, 64), (64, 96), (200, 64)))
    if packs.enabled:
        model = tiny_model("llama", dtype=torch.bfloat16, hidden=128)
        packs = TargetModel(model, cache="native").backend.forward_pass.prepacked
    return None if packs.enabled else f"specdec keeps packing off on this CPU: {packs.reason}"


PACKING_OFF_HERE = packing_reason_here()
needs_packing = pytest.mark.skipif(PACKING_OFF_HERE is not None, reason=str(PACKING_OFF_HERE))


def count_packed_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    original = prepacked._linear_pointwise

    def counted(x, packed, bias):
        calls.append(x.numel() // x.shape[-1])
        return original(x, packed, bias)

    monkeypatch.setattr(prepacked, "_linear_pointwise", counted)
    return calls


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
def test_packed_products_are_bit_identical_to_f_linear_at_every_row_count_they_serve(monkeypatch, bias):
    modules = linears((96, 64), (64, 96), (200, 64), bias=bias)
    packs = PrepackedLinears(modules)
    assert packs.enabled, packs.reason
    calls = count_packed_calls(monkeypatch)
    for module in modules:
        for rows in (1, 2, 7, 16, 19, 20, 33, 64, 65, 300):
            x = torch.randn(1, rows, module.in_features).to(torch.bfloat16)
            assert torch.equal(packs.linear(x, module), F.linear(x, module.weight, module.bias))
    assert sorted(set(calls)) == [1, 2, 7, 16, 19, 20, 33, 64]  # larger products keep F.linear


@needs_packing
def test_inexact_products_take_the_packed_weight_up_to_their_own_limit_as_accurately(monkeypatch):
    """exact=False (a forward of several rows) packs products past MAX_ROWS, up to INEXACT_MAX_ROWS; the result
    is as close to a float64 product as F.linear's."""
    (module,) = linears((96, 64))
    packs = PrepackedLinears([module])
    calls = count_packed_calls(monkeypatch)
    for rows in (3, 65, 96, 256, 257):
        x = torch.randn(1, rows, 64).to(torch.bfloat16)
        exact = (x.double() @ module.weight.double().T)
        got, plain = packs.linear(x, module, exact=False), F.linear(x, module.weight)
        assert (got.double() - exact).abs().max() <= (plain.double() - exact).abs().max() * 1.01 + 1e-6
    assert calls == [3, 65, 96, 256]  # 257 rows keep F.linear


@needs_packing
def test_a_weight_changed_in_place_or_replaced_is_never_read_stale(monkeypatch):
    (module,) = linears((96, 64))
    packs = PrepackedLinears([module])
    calls = count_packed_calls(monkeypatch)
    x = torch.randn(1, 5, 64).to(torch.bfloat16)
    with torch.no_grad():
        module.weight.mul_(2)
    assert torch.equal(packs.linear(x, module), F.linear(x, module.weight))
    assert calls == []  # stale: F.linear until packed again
    packs.refresh()
    assert torch.equal(packs.linear(x, module), F.linear(x, module.weight))
    assert calls == [5]
    module.weight = nn.Parameter(torch.randn(96, 64).to(torch.bfloat16))
    assert torch.equal(packs.linear(x, module), F.linear(x, module.weight))
    assert calls == [5]
    packs.refresh()
    module.weight.data = torch.randn(96, 64).to(torch.bfloat16)  # new storage, same version counter
    assert torch.equal(packs.linear(x, module), F.linear(x, module.weight))
    assert calls == [5]


@needs_onednn
def test_products_that_need_a_gradient_and_inference_tensor_weights_keep_f_linear(monkeypatch):
    (module,) = linears((96, 64))
    packs = PrepackedLinears([module])
    calls = count_packed_calls(monkeypatch)
    x = torch.randn(1, 3, 64).to(torch.bfloat16).requires_grad_()
    packs.linear(x, module).sum().backward()
    assert calls == [] and x.grad is not None
    with torch.inference_mode():
        (frozen,) = linears((96, 64))
        frozen.weight = nn.Parameter(frozen.weight.detach().clone(), requires_grad=False)
    assert frozen.weight.is_inference()
    packs = PrepackedLinears([frozen])
    calls.clear()  # the probe's own products
    with torch.inference_mode():
        packs.linear(x.detach(), frozen)
    assert calls == []


@needs_onednn
def test_a_probe_that_finds_a_difference_turns_packing_off(monkeypatch):
    # a stand-in "packed" product: F.linear itself (bit-identical on every CPU, so that the one difference the
    # probe can find is the one planted here), off by one at 20 rows
    def different_at_20_rows(x, packed, bias):
        out = F.linear(x, packed, bias)
        return out + 1 if x.shape[-2] == 20 else out

    monkeypatch.setattr(prepacked, "_pack", lambda weight: weight.clone())
    monkeypatch.setattr(prepacked, "_linear_pointwise", different_at_20_rows)
    modules = linears((96, 64))
    packs = PrepackedLinears(modules)
    assert not packs.enabled
    assert "differs from F.linear" in packs.reason and "20 rows" in packs.reason
    x = torch.randn(1, 20, 64).to(torch.bfloat16)
    assert torch.equal(packs.linear(x, modules[0]), F.linear(x, modules[0].weight))


@needs_onednn
def test_the_probe_catches_the_products_that_do_differ_here():
    # 32-wide products at one row take a different kernel than F.linear's on this project's CPU; a probe
    # of random inputs alone let one through (the near-tie found by tests/test_native.py's hypothesis run)
    (module,) = linears((128, 32))
    packed = prepacked._pack(module.weight)
    inputs = torch.randn(4000, 1, 1, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    if all(torch.equal(prepacked._linear_pointwise(x, packed, None), F.linear(x, module.weight)) for x in inputs):
        pytest.skip("on this CPU the two products agreed on 4,000 random inputs")
    packs = PrepackedLinears([module])
    assert not packs.enabled and "128x32 weight, 1 rows" in packs.reason


def test_what_packing_does_not_apply_to_is_named(monkeypatch):
    assert "not bfloat16" in unpackable_reason(linears((8, 8), dtype=torch.float32))
    assert unpackable_reason([]) == "there are no projections"
    if ONEDNN_BF16:
        monkeypatch.setattr(prepacked, "_available_memory_bytes", lambda: 1000)
        assert "half the available memory" in unpackable_reason(linears((64, 64)))


@needs_packing
def test_a_bfloat16_target_runs_packed_and_fine_tuning_in_place_is_picked_up_at_the_next_generation():
    model = tiny_model("llama", dtype=torch.bfloat16, hidden=128)  # 32-wide products differ: the probe says no
    native, reference = TargetModel(model, cache="native"), TargetModel(model, cache="dynamic")
    assert native.backend.forward_pass.prepacked.enabled, native.backend.forward_pass.prepacked.reason
    prompt = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    for target in (native, reference):
        target.reset()
    assert torch.equal(native.prefill(prompt).logits, reference.prefill(prompt).logits)
    with torch.no_grad():  # a fine-tuning step between generations
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.01)
    for target in (native, reference):
        target.reset()
    assert torch.equal(native.prefill(prompt).logits, reference.prefill(prompt).logits)
    feed = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    assert torch.equal(native.forward(feed).logits, reference.forward(feed).logits)


@needs_packing
@settings(max_examples=15, deadline=None)
@given(kind=st.sampled_from(["llama", "qwen3"]), prompt_length=st.integers(1, 70),
       steps=st.lists(st.tuples(st.integers(1, 20), st.integers(0, 19)), min_size=1, max_size=5),
       seed=st.integers(0, 1000))
def test_a_packed_target_matches_transformers_bit_for_bit(kind, prompt_length, steps, seed):
    model = tiny_model(kind, dtype=torch.bfloat16, hidden=128, seed=seed % 3)
    native, reference = TargetModel(model, cache="native"), TargetModel(model, cache="dynamic")
    assert native.backend.forward_pass.prepacked.enabled, native.backend.forward_pass.prepacked.reason
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 128, (1, prompt_length), generator=gen)
    for target in (native, reference):
        target.reset()
    assert torch.equal(native.prefill(prompt).logits, reference.prefill(prompt).logits)
    for n, rejected in steps:
        feed = torch.randint(0, 128, (1, n), generator=gen)
        assert torch.equal(native.forward(feed).logits, reference.forward(feed).logits)
        keep = native.cache_length - min(rejected, n - 1)
        native.crop(keep)
        reference.crop(keep)


@needs_packing
def test_a_forward_of_several_rows_packs_products_past_the_exact_limit(monkeypatch):
    """One row keeps products past MAX_ROWS on F.linear (bit-identity to transformers); several rows pack them
    (INEXACT_MAX_ROWS), and each row's logits stay as close to that row run alone as rounding allows."""
    model = tiny_model("llama", dtype=torch.bfloat16, hidden=128)
    target = TargetModel(model, cache="native")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (length,), generator=gen) for length in (9, 14, 11)]
    feed = torch.randint(0, 128, (3, 70), generator=gen)  # 210 rows of products, 70 for a row alone
    target.add_rows(prompts)
    calls = count_packed_calls(monkeypatch)
    batched = target.forward(feed).logits.double()
    assert 210 in calls
    for row, prompt in enumerate(prompts):
        alone = TargetModel(model, cache="native")
        alone.prefill(prompt.unsqueeze(0))
        calls.clear()
        expected = alone.forward(feed[row: row + 1]).logits.double()
        assert 70 not in calls  # F.linear, as transformers
        assert (batched[row] - expected[0]).abs().max() < 0.1 * expected.abs().max()


@needs_packing
def test_a_dflash_draft_runs_packed_and_proposes_what_it_proposes_unpacked(tmp_path):
    from test_dflash import write_draft

    from specdec.contracts import DecodeState, Verdict
    from specdec_dflash.proposer import DFlashProposer
    from specdec_dflash.vocab import save_vocab

    folder = write_draft(tmp_path, dtype=torch.bfloat16, hidden_size=128, head_dim=32, intermediate_size=256)
    save_vocab(torch.arange(10, 106), folder)  # the head's rows for a 96-token draft vocabulary
    target = TargetModel(tiny_model("llama", dtype=torch.bfloat16, hidden=128, seed=1))
    config = DFlashProposer.Config(draft=str(folder), tree_size=0, lookup=0)
    packed, plain = DFlashProposer(config, target), DFlashProposer(config, target)
    assert packed.prepacked.enabled, packed.prepacked.reason
    for module in [*plain.model.modules(), plain.head]:
        module.__dict__.pop("forward", None)  # back to nn.Linear's own product
    tokens = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    target.reset()
    out = target.prefill(tokens[:, :-1])
    for proposer in (packed, plain):
        proposer.prefill(DecodeState(tokens=tokens, max_draft_tokens=0, prompt_length=19), out)
    for _ in range(6):
        state = DecodeState(tokens=tokens, max_draft_tokens=5, prompt_length=19)
        draft = packed.propose(state)
        assert torch.equal(draft.tokens, plain.propose(state).tokens)
        out = target.forward(torch.cat([tokens[:, -1:], draft.tokens], dim=1))
        bonus = out.logits[:, -1:].argmax(-1)
        tokens = torch.cat([tokens, draft.tokens, bonus], dim=1)
        verdict = Verdict(num_accepted=torch.tensor([draft.num_tokens]), emitted=torch.cat([draft.tokens, bonus], 1))
        for proposer in (packed, plain):
            proposer.observe(DecodeState(tokens=tokens, max_draft_tokens=0, prompt_length=19), verdict, out)
