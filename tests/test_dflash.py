"""DFlash: the cached proposer against a plain full-recompute reference, checkpoints, and bad drafts."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import plain_greedy, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from specdec import SpecdecError, SpeculativeDecoder
from specdec.budget import UNCUT
from specdec_dflash.checkpoint import load_draft, save_draft
from specdec_dflash.model import DFlashConfig, DFlashDraftModel
from specdec_dflash.vocab import load_vocab, save_vocab

HIDDEN, HEADS, KV, HEAD_DIM, LAYERS, VOCAB = 32, 4, 2, 8, 4, 128


def make_config(**overrides) -> DFlashConfig:
    values = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=KV,
                  head_dim=HEAD_DIM, intermediate_size=48, block_size=6, mask_token_id=5,
                  target_layer_ids=[0, 2], num_target_layers=LAYERS, vocab_size=VOCAB, rope_theta=10000.0)
    values.update(overrides)
    return DFlashConfig(**values)


def write_draft(folder, seed=0, dtype=torch.float64, **overrides):
    torch.manual_seed(seed)
    model = DFlashDraftModel(make_config(**overrides))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # norms away from 1, sharper attention
    save_draft(model, folder, dtype=dtype)
    return folder


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=3)


# ---------------------------------------------------------------------------------------------------------
# A plain reference written from the paper's description: no cache, everything recomputed at every step.
# ---------------------------------------------------------------------------------------------------------
def rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta):
    # x [n, heads, d]; rotate pairs (i, i + d/2) by angle p * theta^(-2i/d)
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = positions.double().unsqueeze(-1) * freqs  # [n, d/2]
    cos, sin = angle.cos().unsqueeze(1), angle.sin().unsqueeze(1)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def zlab_value(cfg, key, default=None):
    """A key as z-lab's code reads it: `dflash_config` first, then the top level."""
    return cfg["dflash_config"].get(key, cfg.get(key, default))


def reference_logits(weights, cfg, target, committed, k):
    """The draft's logits [k, V] for the block after `committed`, everything recomputed, written from z-lab's
    description: a layer is causal inside the block where is_causal says so (absent: where it is a
    sliding_attention layer); a window lets position p see p' only when |p - p'| < window; the block's
    embeddings are scaled by input_embedding_scale; the logits multiplied by output_multiplier, then capped."""
    # hidden_states[L + 1] is decoder layer L's output, except for the last layer, whose entry transformers
    # stores after the final norm; the tests therefore never tap the last layer (z-lab's defaults never do).
    eps = cfg["rms_norm_eps"]
    with torch.no_grad():
        states = target(torch.tensor([committed]), output_hidden_states=True).hidden_states
        taps = [states[i + 1][0, :-1] for i in zlab_value(cfg, "target_layer_ids")]
        if cfg["dflash_config"].get("tap_norm"):  # specdec's own option: each tap RMS-normed before fc
            taps = [rms(tap, weights[f"tap_norms.{j}.weight"], eps) for j, tap in enumerate(taps)]
        raw = torch.cat(taps, dim=-1)
        context = rms(raw @ weights["fc.weight"].T, weights["hidden_norm.weight"], eps)
        block_size = zlab_value(cfg, "block_size")
        c = len(committed)
        ids = torch.tensor([committed[-1]] + [zlab_value(cfg, "mask_token_id")] * (block_size - 1))
        x = target.get_input_embeddings()(ids) * zlab_value(cfg, "input_embedding_scale", 1.0)
        blk_pos = torch.arange(c - 1, c - 1 + block_size)
        key_pos = torch.cat([torch.arange(c - 1), blk_pos])
        heads, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        window_on = cfg.get("use_sliding_window") and cfg.get("sliding_window")
        for layer in range(cfg["num_hidden_layers"]):
            if cfg.get("layer_types") is None:  # as transformers' Qwen3Config derives them
                sliding = bool(window_on) and layer >= cfg.get("max_window_layers", 28)
            else:
                sliding = cfg["layer_types"][layer] == "sliding_attention"
            causal = cfg.get("is_causal")  # z-lab reads it at the top level only
            causal = sliding if causal is None else causal
            window = cfg["sliding_window"] if sliding and cfg.get("use_sliding_window") else None
            visible = torch.ones(block_size, len(key_pos), dtype=torch.bool)
            gap = blk_pos.unsqueeze(1) - key_pos.unsqueeze(0)  # query position - key position
            if causal:
                visible &= gap >= 0
            if window:
                visible &= gap.abs() < window
            w = {name.split(f"layers.{layer}.", 1)[1]: t for name, t in weights.items()
                 if name.startswith(f"layers.{layer}.")}
            h = rms(x, w["input_layernorm.weight"], eps)
            q = rms((h @ w["self_attn.q_proj.weight"].T).view(block_size, heads, d), w["self_attn.q_norm.weight"], eps)
            both = torch.cat([context, h])
            key = rms((both @ w["self_attn.k_proj.weight"].T).view(-1, kv, d), w["self_attn.k_norm.weight"], eps)
            val = (both @ w["self_attn.v_proj.weight"].T).view(-1, kv, d)
            q = rope(q, blk_pos, cfg["rope_theta"])
            key = rope(key, key_pos, cfg["rope_theta"])
            out = torch.empty(block_size, heads, d, dtype=x.dtype)
            for head in range(heads):
                g = head // (heads // kv)
                scores = (q[:, head] @ key[:, g].T) / math.sqrt(d)
                scores = scores.masked_fill(~visible, float("-inf"))
                out[:, head] = scores.softmax(-1) @ val[:, g]
            x = x + out.reshape(block_size, heads * d) @ w["self_attn.o_proj.weight"].T
            h = rms(x, w["post_attention_layernorm.weight"], eps)
            gate = torch.nn.functional.silu(h @ w["mlp.gate_proj.weight"].T)
            x = x + (gate * (h @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
        x = rms(x, weights["norm.weight"], eps)
        logits = target.get_output_embeddings()(x[1: 1 + k]) * zlab_value(cfg, "output_multiplier", 1.0)
        cap = zlab_value(cfg, "final_logit_softcapping")
        return cap * torch.tanh(logits / cap) if cap else logits


def reference_draft(weights, cfg, target, committed, k):
    return reference_logits(weights, cfg, target, committed, k).argmax(-1).tolist()


@pytest.mark.parametrize("layers,block,taps,window", [(1, 4, [1], None), (2, 6, [0, 2], None),
                                                      (3, 3, [2, 1, 0], None), (2, 5, [1, 2], 6)])
def test_cached_proposer_matches_full_recompute(tmp_path, target, layers, block, taps, window):
    folder = write_draft(tmp_path, seed=layers, num_hidden_layers=layers, block_size=block, target_layer_ids=taps,
                         sliding_window=window)
    weights = {k: v.double() for k, v in load_file(folder / "model.safetensors").items()}
    cfg = json.loads((folder / "config.json").read_text())
    decoder = SpeculativeDecoder.from_model(target, proposer="dflash", draft=str(folder), tree_size=0, lookup=0)
    seen = []
    original = decoder.proposer.propose

    def recording(state):
        draft = original(state)
        seen.append((state.tokens[0].tolist(), draft.tokens[0].tolist()))
        return draft

    decoder.proposer.propose = recording
    prompt = [11, 12, 13, 14, 15, 16, 17]
    out = decoder.generate_ids(prompt, max_new_tokens=25, draft_budget=UNCUT)
    assert out.token_ids == plain_greedy(target, prompt, 25)
    assert len(seen) >= 5
    for committed, drafted in seen:
        assert drafted == reference_draft(weights, cfg, target, committed, len(drafted)), committed


def test_round_trip_and_zlab_layout(tmp_path, target):
    folder = write_draft(tmp_path / "a", seed=4)
    model = load_draft(folder, dtype=torch.float64)
    again = save_draft(model, tmp_path / "b", dtype=torch.float64)
    first, second = load_file(folder / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    cfg = json.loads((again / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"mask_token_id": 5, "target_layer_ids": [0, 2], "block_size": 6}
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{name}.weight" for i in range(2) for name in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
            "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
            "post_attention_layernorm")}
    assert set(second) == expected


def test_zlab_checkpoint_with_auto_map_runs_without_its_code(tmp_path, target):
    folder = write_draft(tmp_path, seed=5)
    cfg = json.loads((folder / "config.json").read_text())
    # z-lab's published layout: block_size at the top level only, auto_map pointing at remote code
    cfg["dflash_config"].pop("block_size")
    cfg["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}
    (folder / "config.json").write_text(json.dumps(cfg))
    marker = tmp_path / "executed"
    (folder / "dflash.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\nraise SystemExit(3)\n")
    out = SpeculativeDecoder.from_model(target, proposer="dflash", draft=str(folder)).generate_ids(
        [3, 4, 5], max_new_tokens=12)
    assert out.token_ids == plain_greedy(target, [3, 4, 5], 12)
    assert not marker.exists()


def test_block_size_in_dflash_config_is_read(tmp_path):
    folder = write_draft(tmp_path, seed=6, block_size=8)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("block_size")
    (folder / "config.json").write_text(json.dumps(cfg))
    assert load_draft(folder).config.block_size == 8


def test_default_target_layer_ids():
    assert DFlashConfig.default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B, 5-layer draft
    assert DFlashConfig.default_target_layer_ids(30, 1) == [15]
    assert DFlashConfig.default_target_layer_ids(30, 3) == [1, 14, 27]


def break_checkpoint(folder, how):
    weights = load_file(folder / "model.safetensors")
    cfg = json.loads((folder / "config.json").read_text())
    if how == "missing":
        weights.pop("layers.1.mlp.up_proj.weight")
    elif how == "shape":
        weights["fc.weight"] = weights["fc.weight"][:, :-1].contiguous()
    elif how == "layer":
        cfg["dflash_config"]["target_layer_ids"] = [0, LAYERS]
    elif how == "hidden":
        cfg["hidden_size"] = 48
    elif how == "mask":
        cfg["dflash_config"]["mask_token_id"] = VOCAB
    elif how == "pickle":
        (folder / "model.safetensors").unlink()
        (folder / "pytorch_model.bin").write_bytes(b"not read")
        return
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("how,message", [
    ("missing", "lacks the tensor 'layers.1.mlp.up_proj.weight'"),
    ("shape", "Tensor 'fc.weight' .* has shape"),
    ("layer", r"taps target layers \[4\] but the target has only 4 layers"),
    ("hidden", "hidden size 48 but the target has 32"),
    ("mask", "mask token 128, outside the target's vocabulary of 128"),
    ("pickle", "only pickle weights .*pytorch_model.bin"),
])
def test_bad_checkpoints_fail_with_one_clear_sentence(tmp_path, target, how, message):
    folder = write_draft(tmp_path, seed=7)
    break_checkpoint(folder, how)
    with pytest.raises(SpecdecError, match=message):
        SpeculativeDecoder.from_model(target, proposer="dflash", draft=str(folder))


def test_block_size_option(tmp_path, target):
    folder = write_draft(tmp_path, seed=8, block_size=6)
    with pytest.raises(SpecdecError, match="block_size 8 is larger than the 6"):
        SpeculativeDecoder.from_model(target, proposer="dflash", draft=str(folder), block_size=8)
    out = SpeculativeDecoder.from_model(target, proposer="dflash", draft=str(folder), block_size=3,
                                        lookup=0).generate_ids([9, 10], max_new_tokens=15)
    assert out.token_ids == plain_greedy(target, [9, 10], 15)
    assert max(out.stats.acceptance_lengths) <= 3


def test_tree_takes_the_tokens_likeliest_to_be_accepted(tmp_path, target):
    folder = write_draft(tmp_path, seed=8, block_size=4)
    proposer = SpeculativeDecoder.from_model(target, proposer="dflash", draft=str(folder), tree_size=5,
                                             lookup=1).engine.proposer
    logq = torch.full((3, VOCAB), -40.0)
    for slot, token, q in [(0, 7, 0.6), (0, 8, 0.4), (1, 9, 0.9), (1, 10, 0.1), (2, 11, 0.55), (2, 12, 0.45)]:
        logq[slot, token] = math.log(q)
    draft = proposer._tree(logq, [])
    # estimates: 7: .6, 7-9: .54, 8: .4, 8-9: .36 (a runner-up, then the chain), 7-9-11: .297; next would be
    # 7-9-12: .243, 8-9-11: .198, 7-10: .06
    assert draft.tokens.tolist() == [[7, 9, 8, 9, 11]]
    assert draft.parents == [-1, 0, -1, 2, 1]
    # a prompt-lookup continuation joins the tree, sharing the chain's prefix where they agree
    draft = proposer._tree(logq, [np.array([7, 3])])
    assert draft.tokens.tolist() == [[7, 3, 9, 8, 9, 11]]
    assert draft.parents == [-1, 0, 0, -1, 3, 2]


def test_best_first_expansion_may_branch_twice_on_one_path(tmp_path, target):
    folder = write_draft(tmp_path, seed=8, block_size=4)
    proposer = SpeculativeDecoder.from_model(target, proposer="dflash", draft=str(folder), tree_size=8,
                                             lookup=1, expansion="best_first").engine.proposer
    logq = torch.full((3, VOCAB), -40.0)
    for slot, token, q in [(0, 7, 0.6), (0, 8, 0.4), (1, 9, 0.9), (1, 10, 0.1), (2, 11, 0.55), (2, 12, 0.45)]:
        logq[slot, token] = math.log(q)
    # the 8 best: 7 .6, 7-9 .54, 8 .4, 8-9 .36, 7-9-11 .297, 7-9-12 .243, 8-9-11 .198, 8-9-12 .162; the chain
    # expansion cannot hold 8-9-12 (two runner-ups) and takes 7-10 (.06) instead
    draft = proposer._tree(logq, [])
    assert draft.tokens.tolist() == [[7, 9, 8, 9, 11, 12, 11, 12]]
    assert draft.parents == [-1, 0, -1, 2, 1, 1, 3, 3]
    chain_expansion = SpeculativeDecoder.from_model(target, proposer="dflash", draft=str(folder), tree_size=8,
                                                    lookup=1).engine.proposer
    assert chain_expansion._tree(logq, []).tokens.tolist() == [[7, 9, 8, 9, 11, 12, 11, 10]]


@pytest.mark.parametrize("expansion", ["chain", "best_first"])
def test_rows_ranked_together_get_each_rows_own_tree(tmp_path, target, monkeypatch, expansion):
    """A batch's trees rank every row's candidates in one top-k (DFlashProposer._finish_rows): each row's tree
    equals the one built from its own logits alone, with its own prompt-lookup continuations, and the batch
    stays lossless."""
    from specdec_dflash.proposer import DFlashProposer

    folder = write_draft(tmp_path, seed=8, block_size=5)
    decoder = SpeculativeDecoder.from_model(target, proposer="dflash", draft=str(folder), tree_size=7, lookup=1,
                                            lookup_after=1, expansion=expansion)
    original, checked, together = DFlashProposer._finish_rows, [], []

    def checking(self, rows, logits, hidden):
        drafts = original(self, rows, logits, hidden)
        together.append(len(rows))
        for r, (proposer, job) in enumerate(rows):
            alone = proposer._tree(logits[r, 1: 1 + job.k], job.found, proposer._seeded_depth(job))
            assert drafts[r].tokens.tolist() == alone.tokens.tolist() and drafts[r].parents == alone.parents
            checked.append(r)
        return drafts

    monkeypatch.setattr(DFlashProposer, "_finish_rows", checking)
    prompts = [[31, 32, 33, 31, 32], [40, 41, 42, 43, 44, 45, 46], [50, 51, 52, 53, 54], [60, 61, 60, 61]]
    outputs = decoder.generate_ids(prompts, max_new_tokens=12, batch_size=3, draft_budget=4)
    assert [o.token_ids for o in outputs] == [plain_greedy(target, p, 12) for p in prompts]
    assert max(together) == 3 and len(checked) >= 8 and max(checked) == 2


@settings(max_examples=60, deadline=None)
@given(slots=st.integers(1, 4), width=st.integers(1, 3), size=st.integers(1, 30), data=st.data())
def test_best_first_paths_are_the_likeliest_nodes(slots, width, size, data):
    """Against brute force: every path through each slot's candidates, ranked by summed log-probability."""
    from itertools import product

    from specdec_dflash.proposer import best_first_paths

    values = [sorted(data.draw(st.lists(st.floats(-6, 0), min_size=width, max_size=width, unique=True)),
                     reverse=True) for _ in range(slots)]
    ids = [[10 * d + r for r in range(width)] for d in range(slots)]
    paths = best_first_paths(values, ids, size)
    every = {tuple(ids[d][r] for d, r in enumerate(ranks)): sum(values[d][r] for d, r in enumerate(ranks))
             for depth in range(1, slots + 1) for ranks in product(range(width), repeat=depth)}
    assert len(paths) == min(size, len(every)) and len({tuple(p) for p in paths}) == len(paths)
    assert all(tuple(p[:-1]) in {tuple(q) for q in paths[:i]} for i, p in enumerate(paths) if len(p) > 1)
    kept = sorted((every[tuple(p)] for p in paths), reverse=True)
    best = sorted(every.values(), reverse=True)[: len(paths)]
    assert kept == pytest.approx(best)  # the likeliest set (up to ties, which may pick either)


def test_lookup_after_seeds_prompt_lookup_with_the_draft_chain(tmp_path, target):
    folder = write_draft(tmp_path, seed=8, block_size=4)
    proposer = SpeculativeDecoder.from_model(target, proposer="dflash", draft=str(folder), tree_size=5,
                                             lookup=1, lookup_after=2).engine.proposer
    context = np.array([5, 6, 7, 8, 9, 5, 6])
    # chain [7, 1]: context + [7] ends with 5 6 7, seen at the start and followed by 8 9 5; context + [7, 1]
    # was never seen. The path is capped at the 4 tokens a step may propose.
    proposer._lookup_index.extend(context)
    paths = proposer._lookups_after([7, 1], max_depth=4)
    assert [p.tolist() for p in paths] == [[7, 8, 9, 5]]
    assert proposer._lookups_after([7, 1], max_depth=1) == []  # no room past the chain's token
    # in a step, those paths join the tree beside the draft's candidates
    logq = torch.full((3, VOCAB), -40.0)
    logq[0, 7] = logq[1, 1] = logq[2, 2] = 0.0
    draft = proposer._tree(logq, paths)
    assert draft.tokens.tolist()[0][:4] == [7, 8, 9, 5] and draft.parents[:4] == [-1, 0, 1, 2]


@pytest.mark.parametrize("fmt", ["zlab", "speculators"])
def test_export(tmp_path, fmt):
    from click.testing import CliRunner

    from specdec.cli import main

    folder = write_draft(tmp_path / "src", seed=9)
    save_vocab(torch.tensor([1, 5, 9]), folder)
    result = CliRunner().invoke(main, ["export", "--draft", str(folder), "--format", fmt, "--out",
                                       str(tmp_path / "out"), "--verifier", "tiny/target"])
    assert result.exit_code == 0, result.output
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    weights = load_file(tmp_path / "out" / "model.safetensors")
    assert set(weights) == set(load_file(folder / "model.safetensors"))
    if fmt == "zlab":
        assert cfg["dflash_config"]["target_layer_ids"] == [0, 2]
        assert load_draft(tmp_path / "out").config.block_size == 6
        assert load_vocab(tmp_path / "out", VOCAB).tolist() == [1, 5, 9]
    else:
        assert cfg["speculators_model_type"] == "dflash" and cfg["aux_hidden_state_layer_ids"] == [0, 2]
        assert cfg["block_size"] == 6 and cfg["mask_token_id"] == 5
        assert cfg["transformer_layer_config"]["num_hidden_layers"] == 2
        assert cfg["speculators_config"]["verifier"]["name_or_path"] == "tiny/target"
        assert load_vocab(tmp_path / "out", VOCAB) is None


# ---------------------------------------------------------------------------------------------------------
# Every config.json field honoured or refused (issue 25), before any weights load.
# ---------------------------------------------------------------------------------------------------------
def set_config(folder, update=None, dflash=None, drop=()):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(update or {})
    cfg["dflash_config"].update(dflash or {})
    for key in drop:
        cfg.pop(key, None)
    (folder / "config.json").write_text(json.dumps(cfg))
    return cfg


def test_every_field_of_zlabs_published_layout_is_read_or_inert(tmp_path, target):
    """z-lab's published configs carry what transformers writes for a Qwen3 config: token ids, dtype,
    initializer_range, use_cache, full_attention layer_types, max_window_layers, a null rope_scaling."""
    folder = write_draft(tmp_path, seed=5)
    cfg = set_config(folder, {
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "bos_token_id": 1, "eos_token_id": 2, "dtype": "bfloat16",
        "initializer_range": 0.02, "layer_types": ["full_attention", "full_attention"], "max_window_layers": 2,
        "rope_scaling": None, "sliding_window": None, "use_sliding_window": False, "transformers_version": "4.57.1",
        "use_cache": True, "pad_token_id": None, "attention_dropout": 0.0, "tie_word_embeddings": False})
    assert load_draft(folder).config.layer_types == ["full_attention", "full_attention"]
    out = SpeculativeDecoder.from_model(target, proposer="dflash", draft=str(folder)).generate_ids(
        [3, 4, 5], max_new_tokens=12)
    assert out.token_ids == plain_greedy(target, [3, 4, 5], 12)
    # transformers 5 writes the RoPE base in rope_parameters
    set_config(folder, {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}}, drop=("rope_theta",))
    assert load_draft(folder).config.rope_theta == 5000.0
    assert cfg["hidden_act"] == "silu"


def test_no_window_when_use_sliding_window_is_false(tmp_path):
    folder = write_draft(tmp_path, seed=5)
    set_config(folder, {"sliding_window": 4, "use_sliding_window": False})
    assert load_draft(folder).config.sliding_window is None  # as transformers' Qwen3 config reads it


def corrupt_weights(folder):
    """Weights that cannot be read: a refusal that names a config field came before any weights load."""
    (folder / "model.safetensors").write_bytes(b"not safetensors")


def record_drafts(decoder):
    """(committed tokens, drafted tokens, draft probabilities or None) of every draft the proposer makes."""
    seen = []
    original = decoder.proposer.propose

    def recording(state):
        draft = original(state)
        seen.append((state.tokens[0].tolist(), draft.tokens[0].tolist(), draft.probs))
        return draft

    decoder.proposer.propose = recording
    return seen


def chain_matches_reference(target, folder, cfg, weights):
    """The dflash chain on `folder`'s draft decodes a prompt losslessly, and every draft it made equals the
    full-recompute reference's; returns the decoder, its recorded drafts and the prompt."""
    decoder = SpeculativeDecoder.from_model(target, proposer="dflash", draft=str(folder), tree_size=0, lookup=0)
    seen = record_drafts(decoder)
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    out = decoder.generate_ids(prompt, max_new_tokens=20, draft_budget=UNCUT)
    assert out.token_ids == plain_greedy(target, prompt, 20)
    assert len(seen) >= 4
    for committed, drafted, _ in seen:
        assert drafted == reference_draft(weights, cfg, target, committed, len(drafted)), committed
    return decoder, seen, prompt


NEWER_FIELDS = {  # (top-level update, dflash_config update): each honoured as z-lab's code honours it
    "output_multiplier": ({}, {"output_multiplier": 0.3}),
    "output_multiplier top-level": ({"output_multiplier": -0.7}, {}),  # negative: the chain is the argmin
    "softcapping": ({}, {"final_logit_softcapping": 1.5}),
    "softcapping top-level": ({"final_logit_softcapping": 0.8, "output_multiplier": 2.0}, {}),
    "softcapping 0 is off": ({"final_logit_softcapping": 0.0}, {}),
    "input_embedding_scale": ({}, {"input_embedding_scale": 3.0}),
    "input_embedding_scale top-level": ({"input_embedding_scale": 0.25}, {}),
    "is_causal": ({"is_causal": True}, {}),
    "is_causal in dflash_config agreeing with z-lab's reading": ({"layer_types": ["sliding_attention"] * 2},
                                                                 {"is_causal": True}),
    "sliding layer causal by default": ({"layer_types": ["sliding_attention", "full_attention"]}, {}),
    "sliding layer windowed": ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 3,
                                "use_sliding_window": True}, {}),
    "window both ways": ({"layer_types": ["sliding_attention"] * 2, "sliding_window": 2, "use_sliding_window": True,
                          "is_causal": False}, {}),
    # no layer_types: transformers' Qwen3Config makes layers max_window_layers.. sliding, where a window is used
    "max_window_layers": ({"sliding_window": 4, "use_sliding_window": True, "max_window_layers": 1,
                           "layer_types": None}, {}),
    "window without use_sliding_window": ({"sliding_window": 2, "layer_types": None}, {}),
}


@pytest.mark.parametrize("case", list(NEWER_FIELDS))
def test_newer_dflash_fields_are_honoured_as_zlab_defines_them(tmp_path, target, case):
    """Each field of z-lab's newer DFlash drafts, at the top level or in dflash_config: the cached proposer's
    greedy chain and its sampled draft distribution equal the full-recompute reference's."""
    update, dflash = NEWER_FIELDS[case]
    folder = write_draft(tmp_path, seed=7, block_size=5)
    cfg = set_config(folder, update, dflash, drop=() if "is_causal" in update else ("is_causal",))
    assert "is_causal" not in cfg["dflash_config"] or "is_causal" not in cfg
    weights = {k: v.double() for k, v in load_file(folder / "model.safetensors").items()}
    decoder, seen, prompt = chain_matches_reference(target, folder, cfg, weights)
    seen.clear()
    decoder.generate_ids(prompt, max_new_tokens=12, temperature=0.8, seed=1)
    assert seen
    for committed, drafted, probs in seen:
        expected = (reference_logits(weights, cfg, target, committed, len(drafted)) / 0.8).softmax(-1)
        torch.testing.assert_close(probs[0].double(), expected, rtol=1e-5, atol=1e-7)


def test_transforms_change_the_numbers_they_claim_to(tmp_path, target):
    """The reference tests above could pass with a transform that does nothing: each field must move the
    reference's own logits (and a causal or windowed layer its chain) on this draft."""
    folder = write_draft(tmp_path, seed=7, block_size=5)
    base_cfg = json.loads((folder / "config.json").read_text())
    weights = {k: v.double() for k, v in load_file(folder / "model.safetensors").items()}
    committed = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    base = reference_logits(weights, base_cfg, target, committed, 4)
    for case, (update, dflash) in NEWER_FIELDS.items():
        cfg = json.loads(json.dumps(base_cfg))
        cfg.update(update)
        cfg["dflash_config"].update(dflash)
        if "is_causal" not in update:
            cfg.pop("is_causal")
        moved = not torch.allclose(reference_logits(weights, cfg, target, committed, 4), base)
        assert moved == (case not in ("softcapping 0 is off", "window without use_sliding_window")), case


@pytest.mark.parametrize("update,dflash,message", [
    ({"hidden_act": "gelu"}, {}, "hidden_act to 'gelu', but specdec's DFlash draft implements only 'silu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, {}, "rope_scaling to .*yarn.*plain RoPE"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, {}, "rope_parameters"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}, {},
     "rope_parameters"),
    ({"attention_bias": True}, {}, "attention_bias to true"),
    ({"some_new_knob": 3}, {}, "some_new_knob to 3, a field specdec's DFlash draft neither reads nor knows"),
    ({}, {"conv_kernel_size": 2}, "dflash_config.conv_kernel_size"),
    ({"architectures": ["DFlash2DraftModel"]}, {}, "conv_kernel_size: Field required"),
    ({"layer_types": ["full_attention", "chunked_attention"]}, {}, "layer_types holds 'chunked_attention'"),
    ({"is_causal": "yes"}, {}, "is_causal"),
    ({"is_causal": False}, {"is_causal": True}, "sets dflash_config.is_causal to true, but z-lab's code reads "
                                                "is_causal at the top level only and makes every layer bidirectional"),
    ({"layer_types": ["sliding_attention", "full_attention"], "is_causal": None}, {"is_causal": False},
     "makes layers \\[0\\] causal and the rest bidirectional"),
])
def test_settings_the_draft_does_not_implement_are_refused_before_weights_load(tmp_path, target, update, dflash,
                                                                              message):
    folder = write_draft(tmp_path, seed=5)
    set_config(folder, update, dflash)
    corrupt_weights(folder)
    with pytest.raises(SpecdecError, match=message):
        SpeculativeDecoder.from_model(target, proposer="dflash", draft=str(folder))


def test_a_dflash2_checkpoint_of_real_size_is_read_or_refused_at_once(tmp_path, target):
    """The layout of z-lab's DFlash2 fixture (hidden 6656, 5 layers), config only: read in well under a second
    with every field as z-lab's code resolves it; for a target it does not fit, refused before any weights."""
    cfg = {"architectures": ["DFlash2DraftModel"], "attention_bias": False, "is_causal": False,
           "dflash_config": {"block_size": 16, "conv_group_size": 16, "conv_kernel_size": 2,
                             "final_logit_softcapping": 20.0, "mask_token_id": 201818, "output_multiplier": 0.196,
                             "selector_rank": 256, "selector_top_k": 16, "target_layer_ids": [1, 13, 25, 37, 49]},
           "head_dim": 128, "hidden_act": "silu", "hidden_size": 6656, "intermediate_size": 19968,
           "layer_types": ["sliding_attention"] * 5, "max_position_embeddings": 131072, "max_window_layers": 5,
           "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 5, "num_key_value_heads": 8,
           "num_target_layers": 52, "rms_norm_eps": 1e-05,
           "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}, "sliding_window": 2048,
           "use_sliding_window": True, "vocab_size": 202048}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    import time

    from specdec_dflash.checkpoint import read_config
    from specdec_dflash.dflash2_model import DFlash2Config

    start = time.perf_counter()
    config = read_config(tmp_path)
    assert isinstance(config, DFlash2Config)
    assert (config.conv_kernel_size, config.conv_group_size, config.selector_rank, config.selector_top_k) == \
        (2, 16, 256, 16)
    assert (config.output_multiplier, config.final_logit_softcapping, config.rope_theta) == (0.196, 20.0, 5e5)
    assert [(config.causal_of(i), config.window_of(i)) for i in range(5)] == [(False, 2048)] * 5
    with pytest.raises(SpecdecError, match="hidden size 6656 but the target has 32"):
        SpeculativeDecoder.from_model(target, proposer="dflash2", draft=str(tmp_path))
    with pytest.raises(SpecdecError, match="holds a DFlash2 draft .*use --proposer dflash2"):
        SpeculativeDecoder.from_model(target, proposer="dflash", draft=str(tmp_path))
    assert time.perf_counter() - start < 1


# ---------------------------------------------------------------------------------------------------------
# `specdec export` never destroys or mixes (issue 25).
# ---------------------------------------------------------------------------------------------------------
def run_export(*args):
    from click.testing import CliRunner

    from specdec.cli import main

    return CliRunner().invoke(main, ["export", *map(str, args)])


def snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_one_error(result, *words):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for word in words:
        assert word in lines[0], lines[0]


def test_export_never_writes_into_the_draft_it_reads(tmp_path):
    folder = write_draft(tmp_path / "src", seed=9)
    save_vocab(torch.tensor([1, 5, 9]), folder)
    before = snapshot(folder)
    for out in (folder, folder / "sub", tmp_path):  # the folder, one inside it, one holding it
        for extra in ([], ["--overwrite"]):
            assert_one_error(run_export("--draft", folder, "--format", "zlab", "--out", out, *extra),
                             "is the draft folder", "choose a folder outside it")
    assert snapshot(folder) == before and not (folder / "sub").exists()


def test_export_into_a_folder_holding_other_files_needs_overwrite_and_leaves_no_stale_draft(tmp_path):
    folder = write_draft(tmp_path / "src", seed=9)  # no draft vocabulary
    out = tmp_path / "out"
    write_draft(out, seed=10)  # someone's draft, with its vocabulary, model card, notes and a second weights file
    save_vocab(torch.tensor([1, 2]), out)
    (out / "README.md").write_text("old model card\n")
    (out / "notes.txt").write_text("mine\n")
    save_file({"fc.weight": torch.zeros(2, 2)}, str(out / "zz-extra.safetensors"))
    before = snapshot(out)
    assert_one_error(run_export("--draft", folder, "--format", "zlab", "--out", out), "--overwrite",
                     "specdec did not write")
    assert snapshot(out) == before
    result = run_export("--draft", folder, "--format", "zlab", "--out", out, "--overwrite")
    assert result.exit_code == 0, result.output
    assert (out / "notes.txt").read_text() == "mine\n"  # not a draft file: left alone
    assert sorted(p.name for p in out.iterdir()) == [".specdec-owner", "config.json", "model.safetensors",
                                                      "notes.txt"]
    assert load_vocab(out, VOCAB) is None  # the old vocabulary does not apply to the new draft
    exported, source = load_draft(out), load_draft(folder)
    for name, value in source.state_dict().items():
        assert torch.equal(exported.state_dict()[name], value.to(torch.bfloat16).float()), name


def test_a_second_export_replaces_the_first_entirely(tmp_path):
    first = write_draft(tmp_path / "a", seed=9)
    save_vocab(torch.tensor([1, 5, 9]), first)
    second = write_draft(tmp_path / "b", seed=10)  # no draft vocabulary
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    assert run_export("--draft", first, "--format", "zlab", "--out", out).exit_code == 0
    assert load_vocab(out, VOCAB).tolist() == [1, 5, 9]
    result = run_export("--draft", second, "--format", "zlab", "--out", out)  # a previous export: no --overwrite
    assert result.exit_code == 0, result.output
    assert run_export("--draft", second, "--format", "zlab", "--out", fresh).exit_code == 0
    assert snapshot(out) == snapshot(fresh)  # exactly what an export into a new folder holds: nothing stale
    assert sorted(p.name for p in out.iterdir()) == [".specdec-owner", "config.json", "model.safetensors"]
    # another format over it: the zlab export's files go too
    assert run_export("--draft", first, "--format", "speculators", "--out", out).exit_code == 0
    assert load_vocab(out, VOCAB) is None
    assert json.loads((out / "config.json").read_text())["speculators_model_type"] == "dflash"


def test_export_refuses_a_folder_another_command_wrote(tmp_path):
    from specdec.files import claim_output_dir

    folder = write_draft(tmp_path / "src", seed=9)
    out = claim_output_dir(tmp_path / "run", "train")
    (out / "trainer_state.json").write_text("{}\n")
    assert_one_error(run_export("--draft", folder, "--format", "zlab", "--out", out), "another specdec command",
                     "--overwrite")
    assert not (out / "config.json").exists()
    assert run_export("--draft", folder, "--format", "zlab", "--out", out, "--overwrite").exit_code == 0
    assert (out / "trainer_state.json").read_text() == "{}\n"


def test_a_draft_that_cannot_be_read_leaves_out_alone(tmp_path):
    folder = write_draft(tmp_path / "src", seed=9)
    set_config(folder, {"hidden_act": "gelu"})
    assert_one_error(run_export("--draft", folder, "--format", "zlab", "--out", tmp_path / "out"), "hidden_act")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("attention", [dict(is_causal=True), dict(sliding_window=3),
                                       dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4),
                                       dict(input_embedding_scale=2.5)])
def test_forward_rows_is_forward_row_by_row_for_every_attention_kind(attention):
    """The batched draft forward (rows with their own caches and context lengths, padded and masked) gives each
    row what the single-row forward gives it, steps after steps, for causal, windowed and mixed layers."""
    from specdec_dflash.model import DraftCache

    torch.manual_seed(0)
    model = DFlashDraftModel(make_config(**attention)).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    lengths = [5, 1, 8]
    alone = [DraftCache(2) for _ in lengths]
    together = [DraftCache(2) for _ in lengths]
    n = model.config.block_size
    done = [0] * len(lengths)
    for step in range(3):
        news = [length if step == 0 else 1 + (r + step) % 3 for r, length in enumerate(lengths)]
        tapped = [torch.randn(1, c, 2 * HIDDEN, dtype=torch.float64) for c in news]
        ctx_pos = [torch.arange(done[r], done[r] + c).unsqueeze(0) for r, c in enumerate(news)]
        for r, c in enumerate(news):
            done[r] += c
        blocks = torch.randn(len(lengths), n, HIDDEN, dtype=torch.float64)
        blk_pos = torch.stack([torch.arange(d, d + n) for d in done])
        with torch.no_grad():
            rows = model.forward_rows(blocks, tapped, ctx_pos, blk_pos, together)
            for r in range(len(lengths)):
                one = model(blocks[r: r + 1], tapped[r], ctx_pos[r], blk_pos[r: r + 1], cache=alone[r])
                torch.testing.assert_close(rows[r: r + 1], one, rtol=1e-10, atol=1e-10)


def test_a_window_asked_for_without_a_size_is_transformers_default(tmp_path):
    folder = write_draft(tmp_path, seed=5)
    set_config(folder, {"use_sliding_window": True, "max_window_layers": 0}, drop=("layer_types", "sliding_window"))
    config = load_draft(folder).config
    assert [config.window_of(i) for i in range(2)] == [4096, 4096]


def test_masks_are_built_only_where_they_bind():
    from specdec_dflash.model import block_attention_mask

    assert block_attention_mask(3, 4, 7, False, torch.device("cpu")) is None  # every distance below 7
    assert block_attention_mask(3, 4, 6, False, torch.device("cpu"))[3, 0].item() is False
    assert block_attention_mask(3, 4, None, True, torch.device("cpu"))[0, 4].item() is False
