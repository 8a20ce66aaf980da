"""DFlash2: the cached proposer against a plain full-recompute reference written from the architecture's
description (convolutions, selector walk, sampled q, trees), checkpoints in z-lab's layout, refusals."""

from __future__ import annotations

import heapq
import json
import math

import pytest
import torch
from conftest import plain_greedy, tiny_model
from helpers import save_random_dflash2
from safetensors.torch import load_file, save_file
from test_dflash import rms, rope, zlab_value

from specdec import SpecdecError, SpeculativeDecoder
from specdec.budget import UNCUT
from specdec_dflash.checkpoint import load_draft, save_draft

TREE_WIDTH = 5  # a tree node's children: the 5 best-scored candidates (1 + the proposer's TREE_RUNNER_UPS)


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=3)


# ---------------------------------------------------------------------------------------------------------
# The reference: no cache, loops where the description has sums.
# ---------------------------------------------------------------------------------------------------------
def conv(x, h, base, projection, side, taps, group):
    """out[t, c] = sum_{j <= t} (base[side, j, c] + (projection h[t])[side, j, c // group]) * x[t - j, c]."""
    n, hidden = x.shape
    dynamic = (h @ projection.T).view(n, 2, taps, hidden // group)
    out = torch.zeros_like(x)
    for t in range(n):
        for j in range(min(taps, t + 1)):
            out[t] += (base[side, j] + dynamic[t, side, j].repeat_interleave(group)) * x[t - j]
    return out


def reference_block(weights, cfg, target, committed):
    """(final-normed block states [n, H], their transformed logits [n, V]) for the block after `committed`."""
    eps, taps, group = cfg["rms_norm_eps"], zlab_value(cfg, "conv_kernel_size"), zlab_value(cfg, "conv_group_size")
    with torch.no_grad():
        states = target(torch.tensor([committed]), output_hidden_states=True).hidden_states
        raw = torch.cat([states[i + 1][0, :-1] for i in zlab_value(cfg, "target_layer_ids")], dim=-1)
        context = rms(raw @ weights["fc.weight"].T, weights["hidden_norm.weight"], eps)
        n, c = zlab_value(cfg, "block_size"), len(committed)
        ids = torch.tensor([committed[-1]] + [zlab_value(cfg, "mask_token_id")] * (n - 1))
        x = target.get_input_embeddings()(ids) * zlab_value(cfg, "input_embedding_scale", 1.0)
        blk_pos = torch.arange(c - 1, c - 1 + n)
        key_pos = torch.cat([torch.arange(c - 1), blk_pos])
        heads, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        for layer in range(cfg["num_hidden_layers"]):
            w = {name.split(f"layers.{layer}.", 1)[1]: t for name, t in weights.items()
                 if name.startswith(f"layers.{layer}.")}
            sliding = cfg["layer_types"][layer] == "sliding_attention"
            causal = cfg.get("is_causal")  # z-lab reads it at the top level only
            causal = sliding if causal is None else causal
            window = cfg["sliding_window"] if sliding and cfg.get("use_sliding_window") else None
            gap = blk_pos.unsqueeze(1) - key_pos.unsqueeze(0)
            visible = torch.ones_like(gap, dtype=torch.bool)
            if causal:
                visible &= gap >= 0
            if window:
                visible &= gap.abs() < window
            normed = rms(x, w["input_layernorm.weight"], eps)
            h = conv(normed, normed, w["attention_conv.base_kernel"], w["attention_conv.kernel_projection.weight"],
                     0, taps, group)
            q = rms((h @ w["self_attn.q_proj.weight"].T).view(n, heads, d), w["self_attn.q_norm.weight"], eps)
            both = torch.cat([context, h])
            key = rms((both @ w["self_attn.k_proj.weight"].T).view(-1, kv, d), w["self_attn.k_norm.weight"], eps)
            val = (both @ w["self_attn.v_proj.weight"].T).view(-1, kv, d)
            q, key = rope(q, blk_pos, cfg["rope_theta"]), rope(key, key_pos, cfg["rope_theta"])
            out = torch.empty(n, heads, d, dtype=x.dtype)
            for head in range(heads):
                g = head // (heads // kv)
                scores = ((q[:, head] @ key[:, g].T) / math.sqrt(d)).masked_fill(~visible, float("-inf"))
                out[:, head] = scores.softmax(-1) @ val[:, g]
            attended = out.reshape(n, heads * d) @ w["self_attn.o_proj.weight"].T
            x = x + conv(attended, normed, w["attention_conv.base_kernel"],
                         w["attention_conv.kernel_projection.weight"], 1, taps, group)
            normed = rms(x, w["post_attention_layernorm.weight"], eps)
            h = conv(normed, normed, w["mlp_conv.base_kernel"], w["mlp_conv.kernel_projection.weight"], 0, taps, group)
            mlp = (torch.nn.functional.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T)) \
                @ w["mlp.down_proj.weight"].T
            x = x + conv(mlp, normed, w["mlp_conv.base_kernel"], w["mlp_conv.kernel_projection.weight"], 1, taps, group)
        x = rms(x, weights["norm.weight"], eps)
        logits = target.get_output_embeddings()(x) * zlab_value(cfg, "output_multiplier", 1.0)
        cap = zlab_value(cfg, "final_logit_softcapping")
        return x, (cap * torch.tanh(logits / cap) if cap else logits)


class Selector:
    """The selector's scores at each slot of one block, given any predecessor token."""

    def __init__(self, weights, cfg, target, committed, k, vocab_ids=None):
        hidden, logits = reference_block(weights, cfg, target, committed)
        hidden, logits = hidden[1: 1 + k], logits[1: 1 + k]
        if vocab_ids is not None:  # a reduced draft vocabulary: the top-k among its tokens
            logits = logits[:, vocab_ids]
        width = min(zlab_value(cfg, "selector_top_k"), logits.shape[-1])
        self.unary, picks = logits.topk(width, dim=-1)
        self.candidates = picks if vocab_ids is None else torch.as_tensor(vocab_ids)[picks]
        self.projected = hidden @ weights["candidate_selector.hidden_projection.weight"].T  # [k, r]
        self.pred = weights["candidate_selector.predecessor_codebook"]
        self.succ = weights["candidate_selector.successor_codebook"]
        self.anchor = committed[-1]

    def scores(self, slot, previous):
        """{candidate token: its score} at `slot` after token `previous`."""
        return {int(c): float(self.unary[slot, i] + (self.pred[previous] * self.projected[slot] * self.succ[c]).sum())
                for i, c in enumerate(self.candidates[slot])}

    def logq(self, slot, previous):
        scores = self.scores(slot, previous)
        norm = math.log(sum(math.exp(v) for v in scores.values()))
        return {c: v - norm for c, v in scores.items()}

    def walk(self, start_slot=0, previous=None, slots=None):
        previous = self.anchor if previous is None else previous
        path, estimate = [], 0.0
        for slot in range(start_slot, len(self.candidates) if slots is None else slots):
            logq = self.logq(slot, previous)
            previous = max(logq, key=logq.get)
            path.append(previous)
            estimate += logq[previous]
        return path, estimate


def record(decoder):
    seen = []
    original = decoder.proposer.propose

    def recording(state):
        draft = original(state)
        seen.append((state.tokens[0].tolist(), draft))
        return draft

    decoder.proposer.propose = recording
    return seen


def checkpoint(folder):
    weights = {k: v.double() for k, v in load_file(folder / "model.safetensors").items()}
    return weights, json.loads((folder / "config.json").read_text())


CASES = {
    "two taps, groups of 8": {},
    "one tap": dict(conv_kernel_size=1),
    "three taps, one group": dict(conv_kernel_size=3, conv_group_size=32, block_size=4),
    "taps longer than the block": dict(conv_kernel_size=5, block_size=3),
    "groups of one channel": dict(conv_group_size=1, num_hidden_layers=1),
    "causal": dict(is_causal=True),
    "windowed sliding layer": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                                   is_causal=False),
    "logit transforms": dict(output_multiplier=0.4, final_logit_softcapping=1.2, input_embedding_scale=1.7),
    "top-k over a reduced vocabulary": dict(selector_top_k=3),
}
REDUCED = [0, 3, 5, 7, 8, 9, 10, 11, 64, 100, 127]


@pytest.mark.parametrize("case", list(CASES))
def test_cached_proposer_matches_full_recompute(tmp_path, target, case):
    vocab_ids = REDUCED if "reduced" in case else None
    folder = tmp_path / "d"
    save_random_dflash2(folder, seed=len(case), vocab_ids=vocab_ids, **CASES[case])
    weights, cfg = checkpoint(folder)
    decoder = SpeculativeDecoder.from_model(target, proposer="dflash2", draft=str(folder), tree_size=0, lookup=0)
    seen = record(decoder)
    prompt = [11, 12, 13, 14, 15, 16, 17, 18]
    out = decoder.generate_ids(prompt, max_new_tokens=24, draft_budget=UNCUT)
    assert out.token_ids == plain_greedy(target, prompt, 24)
    assert len(seen) >= 5
    for committed, draft in seen:
        k = draft.num_tokens
        assert draft.tokens[0].tolist() == Selector(weights, cfg, target, committed, k, vocab_ids).walk()[0], case
    # sampled: each slot's q is softmax(score / T) over its candidates given the token drawn before it
    seen.clear()
    decoder.generate_ids(prompt, max_new_tokens=16, temperature=0.7, seed=3)
    assert seen
    for committed, draft in seen:
        tokens, probs = draft.tokens[0].tolist(), draft.probs[0]
        selector = Selector(weights, cfg, target, committed, len(tokens), vocab_ids)
        for slot, token in enumerate(tokens):
            scores = selector.scores(slot, tokens[slot - 1] if slot else selector.anchor)
            norm = sum(math.exp(v / 0.7) for v in scores.values())
            expected = torch.zeros(probs.shape[-1], dtype=torch.float64)
            for c, v in scores.items():
                expected[c] = math.exp(v / 0.7) / norm
            torch.testing.assert_close(probs[slot].double(), expected, rtol=1e-5, atol=1e-7)
            assert token in scores  # drawn among the candidates


def draft_paths(draft):
    tokens, parents = draft.tokens[0].tolist(), draft.parents
    paths = []
    for i, token in enumerate(tokens):
        parent = parents[i]
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return set(paths)


def reference_chain_tree(weights, cfg, target, committed, slots, size):
    """expansion=chain: the `size` likeliest of the walk's prefixes and of (a runner-up at one slot, scored
    after the walk before it, then the walk from it), estimates summing the selector's log-probabilities."""
    selector = Selector(weights, cfg, target, committed, slots)
    chain, _ = selector.walk()
    found, estimate, previous = [], 0.0, selector.anchor
    for j in range(slots):
        logq = selector.logq(j, previous)
        ranked = sorted(logq, key=logq.get, reverse=True)
        for rank, token in enumerate(ranked[:TREE_WIDTH]):
            path, value = chain[:j] + [token], estimate + logq[token]
            found.append((value, tuple(path)))
            if rank == 0:
                continue  # the walk's own prefix; its continuation is the walk
            for d in range(j + 1, slots):
                rest_logq = selector.logq(d, path[-1])
                best = max(rest_logq, key=rest_logq.get)
                path, value = path + [best], value + rest_logq[best]
                found.append((value, tuple(path)))
        estimate += logq[chain[j]]
        previous = chain[j]
    found.sort(key=lambda f: (-f[0], len(f[1])))
    return {p for _, p in found[:size]}


def test_chain_tree_is_the_likeliest_walk_prefixes_and_branches(tmp_path, target):
    folder = tmp_path / "d"
    save_random_dflash2(folder, seed=21, block_size=5)
    weights, cfg = checkpoint(folder)
    decoder = SpeculativeDecoder.from_model(target, proposer="dflash2", draft=str(folder), tree_size=11, lookup=0)
    seen = record(decoder)
    prompt = [21, 22, 23, 24, 25, 26]
    assert decoder.generate_ids(prompt, max_new_tokens=20).token_ids == plain_greedy(target, prompt, 20)
    for committed, draft in seen:
        slots = max(len(p) for p in draft_paths(draft))
        assert draft_paths(draft) == reference_chain_tree(weights, cfg, target, committed, slots, 11), committed


def test_rows_drafted_together_get_each_rows_own_tree(tmp_path, target, monkeypatch):
    """A batch's chain-expanded trees are scored for all rows at once (DFlash2Proposer._finish_rows): each
    row's tree is still its own reference tree, whatever the other rows hold, and the batch stays lossless."""
    from specdec_dflash.dflash2_proposer import DFlash2Proposer

    folder = tmp_path / "d"
    save_random_dflash2(folder, seed=22, block_size=5)
    weights, cfg = checkpoint(folder)
    decoder = SpeculativeDecoder.from_model(target, proposer="dflash2", draft=str(folder), tree_size=9, lookup=0)
    seen, batches = [], []
    original = DFlash2Proposer.propose_batch.__func__

    def recording(cls, proposers, states):
        drafts = original(cls, proposers, states)
        batches.append(len(states))
        seen.extend((state.tokens[0].tolist(), draft) for state, draft in zip(states, drafts, strict=True))
        return drafts

    monkeypatch.setattr(DFlash2Proposer, "propose_batch", classmethod(recording))
    prompts = [[31, 32, 33], [40, 41, 42, 43, 44, 45, 46], [50, 51, 52, 53, 54], [60, 61]]
    outputs = decoder.generate_ids(prompts, max_new_tokens=12, batch_size=3, draft_budget=4)
    assert [o.token_ids for o in outputs] == [plain_greedy(target, p, 12) for p in prompts]
    assert max(batches) == 3 and len(seen) >= 8
    for committed, draft in seen:
        slots = max(len(p) for p in draft_paths(draft))
        assert draft_paths(draft) == reference_chain_tree(weights, cfg, target, committed, slots, 9), committed


def test_rows_asked_for_fewer_tokens_score_only_those_slots(tmp_path, target, monkeypatch):
    """A batch's draft budget asks each row's proposer for m tokens (specdec.engine): the head scores the block's
    first 1 + m positions only, and each row's tree is its reference tree over m slots."""
    from specdec_dflash.dflash2_proposer import DFlash2Proposer
    from specdec_dflash.proposer import DFlashProposer

    folder = tmp_path / "d"
    save_random_dflash2(folder, seed=23, block_size=6)
    weights, cfg = checkpoint(folder)
    decoder = SpeculativeDecoder.from_model(target, proposer="dflash2", draft=str(folder), tree_size=5, lookup=0)
    scored, seen = [], []
    head, batch = DFlashProposer._head_logits, DFlash2Proposer.propose_batch.__func__

    def scoring(self, hidden, k):
        logits = head(self, hidden, k)
        scored.append(logits.shape[1])
        return logits

    def recording(cls, proposers, states):
        drafts = batch(cls, proposers, states)
        seen.extend((state.tokens[0].tolist(), draft) for state, draft in zip(states, drafts, strict=True))
        return drafts

    monkeypatch.setattr(DFlashProposer, "_head_logits", scoring)
    monkeypatch.setattr(DFlash2Proposer, "propose_batch", classmethod(recording))
    prompts = [[31, 32, 33], [40, 41, 42, 43, 44], [60, 61]]
    outputs = decoder.generate_ids(prompts, max_new_tokens=10, batch_size=2, draft_budget=2)
    assert [o.token_ids for o in outputs] == [plain_greedy(target, p, 10) for p in prompts]
    assert scored and set(scored) <= {2, 3} and 3 in scored  # 1 + m positions of the block's 6
    assert len(seen) >= 6
    for committed, draft in seen:
        assert max(len(p) for p in draft_paths(draft)) <= 2
        slots = max(len(p) for p in draft_paths(draft))
        assert draft_paths(draft) == reference_chain_tree(weights, cfg, target, committed, slots, 5), committed


def test_best_first_tree_is_the_likeliest_nodes(tmp_path, target):
    """expansion=best_first: the tree_size nodes of largest estimate among all paths through each node's 5
    best-scored children, each scored after its own parent's token (brute force over every path)."""
    folder = tmp_path / "d"
    save_random_dflash2(folder, seed=22, block_size=4)
    weights, cfg = checkpoint(folder)
    decoder = SpeculativeDecoder.from_model(target, proposer="dflash2", draft=str(folder), tree_size=9, lookup=0,
                                            expansion="best_first")
    seen = record(decoder)
    prompt = [31, 32, 33, 34, 35]
    assert decoder.generate_ids(prompt, max_new_tokens=16).token_ids == plain_greedy(target, prompt, 16)
    for committed, draft in seen:
        slots = max(len(p) for p in draft_paths(draft))
        selector = Selector(weights, cfg, target, committed, 3)
        nodes, frontier = [], [((), 0.0)]
        while frontier:
            path, value = frontier.pop()
            if len(path) == 3:
                continue
            logq = selector.logq(len(path), path[-1] if path else selector.anchor)
            for token in heapq.nlargest(TREE_WIDTH, logq, key=logq.get):
                child = (path + (token,), value + logq[token])
                nodes.append(child)
                frontier.append(child)
        nodes.sort(key=lambda n: (-n[1], len(n[0])))
        expected = {p for p, _ in nodes if len(p) <= slots}
        assert draft_paths(draft) == set(sorted(expected, key=lambda p: -dict(nodes)[p])[:9]), committed


@pytest.mark.parametrize("options", [{}, {"tree_size": 0, "lookup": 1}, {"lookup_after": 2},
                                     {"expansion": "best_first", "tree_size": 7}])
def test_defaults_and_lookup_stay_lossless(tmp_path, target, options):
    folder = save_random_dflash2(tmp_path / "d", seed=5)
    decoder = SpeculativeDecoder.from_model(target, proposer="dflash2", draft=folder, **options)
    prompt = [7, 8, 9, 10, 7, 8, 9, 10, 7, 8]
    assert decoder.generate_ids(prompt, max_new_tokens=30).token_ids == plain_greedy(target, prompt, 30)
    together = decoder.generate_ids([prompt, [1, 2, 3], [4]], max_new_tokens=15, batch_size=3)
    assert [o.token_ids for o in together] == [plain_greedy(target, p, 15) for p in (prompt, [1, 2, 3], [4])]


# ---------------------------------------------------------------------------------------------------------
# Checkpoints in z-lab's layout.
# ---------------------------------------------------------------------------------------------------------
#: the tensors of z-lab's DFlash2 fixture header, per layer and at the top (no "model." prefix, bare codebooks)
ZLAB_LAYER_TENSORS = {
    "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
    "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "attention_conv.base_kernel",
    "attention_conv.kernel_projection.weight", "mlp_conv.base_kernel", "mlp_conv.kernel_projection.weight"}
ZLAB_TOP_TENSORS = {"fc.weight", "hidden_norm.weight", "norm.weight", "candidate_selector.hidden_projection.weight",
                    "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"}


def test_zlab_layout_round_trip_and_shapes(tmp_path):
    folder = tmp_path / "a"
    save_random_dflash2(folder, seed=4, conv_kernel_size=3, conv_group_size=4, selector_rank=7)
    tensors = load_file(folder / "model.safetensors")
    assert set(tensors) == ZLAB_TOP_TENSORS | {f"layers.{i}.{t}" for i in range(2) for t in ZLAB_LAYER_TENSORS}
    assert tensors["layers.1.attention_conv.base_kernel"].shape == (2, 3, 32)  # [side, K, H]
    assert tensors["layers.0.mlp_conv.kernel_projection.weight"].shape == (2 * 3 * 8, 32)  # [2 K G, H]
    assert tensors["candidate_selector.predecessor_codebook"].shape == (128, 7)  # [V, r]
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["is_causal"] is False
    assert {k: cfg["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                  "selector_top_k")} == {"conv_kernel_size": 3, "conv_group_size": 4,
                                                                         "selector_rank": 7, "selector_top_k": 5}
    model = load_draft(folder, dtype=torch.float64)
    again = save_draft(model, tmp_path / "b", dtype=torch.float64)
    assert json.loads((again / "config.json").read_text()) == cfg
    reread = load_file(again / "model.safetensors")
    assert all(torch.equal(reread[k], tensors[k]) for k in tensors)


def test_codebooks_saved_with_a_weight_suffix_load_too(tmp_path, target):
    folder = tmp_path / "d"
    save_random_dflash2(folder, seed=6)
    reference = SpeculativeDecoder.from_model(target, proposer="dflash2", draft=str(folder), tree_size=0, lookup=0)
    expected = [d.tokens.tolist() for _, d in _drafts(reference)]
    tensors = load_file(folder / "model.safetensors")
    for name in ("predecessor_codebook", "successor_codebook"):
        tensors[f"candidate_selector.{name}.weight"] = tensors.pop(f"candidate_selector.{name}")
    save_file(tensors, folder / "model.safetensors")
    renamed = SpeculativeDecoder.from_model(target, proposer="dflash2", draft=str(folder), tree_size=0, lookup=0)
    assert [d.tokens.tolist() for _, d in _drafts(renamed)] == expected


def _drafts(decoder):
    seen = record(decoder)
    decoder.generate_ids([5, 6, 7, 8], max_new_tokens=10)
    return seen


def set_dflash_config(folder, **values):
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in values.items():
        if value is None:
            cfg["dflash_config"].pop(key)
        else:
            cfg["dflash_config"][key] = value
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("values,message", [
    ({"selector_rank": None}, "selector_rank: Field required"),
    ({"conv_group_size": 5}, "conv_group_size \\(5\\) must divide hidden_size \\(32\\)"),
    ({"conv_kernel_size": 0}, "conv_kernel_size"),
    ({"selector_top_k": 0}, "selector_top_k"),
    ({"some_dflash2_knob": 1}, "dflash_config.some_dflash2_knob to 1, a field"),
])
def test_bad_dflash2_configs_are_refused_before_weights_load(tmp_path, target, values, message):
    folder = tmp_path / "d"
    save_random_dflash2(folder)
    set_dflash_config(folder, **values)
    (folder / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(SpecdecError, match=message):
        SpeculativeDecoder.from_model(target, proposer="dflash2", draft=str(folder))


def test_proposers_refuse_each_others_drafts(tmp_path, target):
    from test_dflash import write_draft

    with pytest.raises(SpecdecError, match="holds a DFlash draft \\(DFlashDraftModel\\), not a DFlash2 one; use "
                                           "--proposer dflash"):
        SpeculativeDecoder.from_model(target, proposer="dflash2", draft=str(write_draft(tmp_path / "one")))
    with pytest.raises(SpecdecError, match="use --proposer dflash2"):
        SpeculativeDecoder.from_model(target, proposer="dflash", draft=save_random_dflash2(tmp_path / "two"))


def test_export_writes_zlabs_layout_back_and_refuses_the_others(tmp_path, target):
    from click.testing import CliRunner

    from specdec.cli import main

    source = save_random_dflash2(tmp_path / "src", seed=8, vocab_ids=REDUCED, dtype=torch.bfloat16)  # as exported
    result = CliRunner().invoke(main, ["export", "--draft", source, "--format", "zlab", "--out", str(tmp_path / "z")])
    assert result.exit_code == 0, result.output
    a = SpeculativeDecoder.from_model(target, proposer="dflash2", draft=source, tree_size=0, lookup=0)
    b = SpeculativeDecoder.from_model(target, proposer="dflash2", draft=str(tmp_path / "z"), tree_size=0, lookup=0)
    assert [d.tokens.tolist() for _, d in _drafts(a)] == [d.tokens.tolist() for _, d in _drafts(b)]
    assert (tmp_path / "z" / "draft_vocab.json").exists()
    for fmt in ("vllm", "speculators"):
        result = CliRunner().invoke(main, ["export", "--draft", source, "--format", fmt, "--out", str(tmp_path / fmt)])
        assert result.exit_code == 2 and "only the zlab layout holds" in result.output, result.output
        assert not (tmp_path / fmt).exists()


def test_the_shipped_dflash2_draft_is_the_default_for_the_embedded_target():
    from specdec.api import default_candidates, default_proposer
    from specdec_dflash.dflash2_proposer import DFlash2Proposer
    from specdec_dflash.proposer import DFlashProposer

    assert DFlash2Proposer.has_shipped_draft() and DFlash2Proposer.default_for(None)
    assert DFlash2Proposer.default_priority > DFlashProposer.default_priority
    assert default_proposer(None) == "dflash2" and default_candidates(None)[:2] == ["dflash2", "dflash"]
    assert not DFlash2Proposer.default_for("some/other-target")


def test_under_a_float16_target_the_draft_computes_in_float32(tmp_path):
    """DFlash2 drafts overflow in float16 (bf16-trained), so a float16 target's draft runs in float32: its
    embeddings and taps enter cast, its hidden states leave cast for the target's head."""
    half = tiny_model("llama", seed=3).half()
    decoder = SpeculativeDecoder.from_model(half, proposer="dflash2", draft=save_random_dflash2(tmp_path / "d"))
    proposer = decoder.engine.proposer
    assert {p.dtype for p in proposer.model.parameters()} == {torch.float32}
    reference = SpeculativeDecoder.from_model(half, proposer="autoregressive")
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    expected = [reference.generate_ids(prompt, max_new_tokens=16).token_ids for prompt in prompts]
    for prompt, tokens in zip(prompts, expected, strict=True):
        out = decoder.generate_ids(prompt, max_new_tokens=16)
        assert out.token_ids == tokens
        assert len(out.stats.acceptance_lengths) < 16  # the draft was used, and accepted at least once
    # both rows' blocks in one draft forward (propose_batch), the same casts
    batch = decoder.generate_ids(prompts, max_new_tokens=16, batch_size=2, draft_budget=4)  # pinned: drafts
    assert [o.token_ids for o in batch] == expected


def test_both_spellings_of_a_codebook_at_once_are_refused(tmp_path, target):
    folder = tmp_path / "d"
    save_random_dflash2(folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["candidate_selector.successor_codebook.weight"] = tensors["candidate_selector.successor_codebook"].clone()
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(SpecdecError, match="holds both candidate_selector.successor_codebook and"):
        SpeculativeDecoder.from_model(target, proposer="dflash2", draft=str(folder))
