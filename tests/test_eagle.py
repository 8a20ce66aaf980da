"""EAGLE-3: the unrolled training forward against the proposer's inference path, checkpoints in SpecForge's
layout, bad input, lossless decoding, and a tiny end-to-end training run with resume."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import plain_greedy, tiny_model, tiny_tokenizer
from safetensors.torch import load_file, save_file

from specdec import SpecdecError, SpeculativeDecoder, TargetModel, tree
from specdec.budget import UNCUT
from specdec.cli import main
from specdec.contracts import DecodeState, Verdict, Verifier
from specdec.sampling import SamplingParams
from specdec_eagle.checkpoint import load_draft, save_draft
from specdec_eagle.model import Eagle3Cache, Eagle3Config, Eagle3DraftModel
from specdec_eagle.training import Eagle3Objective, step_weights, unrolled_inputs


def small_config(**overrides) -> Eagle3Config:
    values = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                  vocab_size=128, draft_vocab_size=128, target_layer_ids=[0, 1, 3], num_target_layers=4)
    values.update(overrides)
    return Eagle3Config(**values)


def random_draft(seed: int, **overrides) -> Eagle3DraftModel:
    torch.manual_seed(seed)
    model = Eagle3DraftModel(small_config(**overrides))
    with torch.no_grad():  # norms away from 1 so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    if model.config.draft_vocab_size < model.config.vocab_size:
        model.set_vocabulary(torch.arange(model.config.draft_vocab_size) * 3 % 128)
    return model.double().eval()


@pytest.fixture(scope="module")
def eagle_dirs(tmp_path_factory):
    """Random EAGLE-3 drafts for the tiny llama target: whole vocabulary, and a reduced one."""
    folders = []
    for seed, size in [(1, 128), (2, 40)]:
        folder = tmp_path_factory.mktemp(f"eagle{size}")
        save_draft(random_draft(seed, draft_vocab_size=size), folder, dtype=torch.float64)
        folders.append(str(folder))
    return folders


def test_unrolled_steps_equal_the_chain_the_proposer_runs():
    """Training step j at row i must compute what the proposer computes when it guesses j tokens past
    position i (teacher-forced here with the sequence's own tokens), keys and positions included."""
    model = random_draft(3)
    length, steps = 11, 4
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (1, length), generator=gen)
    embed = torch.nn.Embedding(128, 32).double()
    tapped = torch.randn(1, length - 1, 96, generator=gen, dtype=torch.float64)
    rows = length - 1
    positions = torch.arange(rows).unsqueeze(0)
    features, earlier, unrolled = model.fuse(tapped), [], []
    for step in range(steps):
        inputs, _, _ = unrolled_inputs(tokens, torch.tensor([length]), torch.ones(1, length), step)
        features, kv = model.forward_unrolled(embed(inputs), features, positions + step, earlier)
        earlier.append(kv)
        unrolled.append(features)
    for anchor in range(rows):
        cache = Eagle3Cache()
        out = model(embed(tokens[:, 1: anchor + 2]), model.fuse(tapped[:, : anchor + 1]),
                    torch.arange(anchor + 1).unsqueeze(0), cache)
        feature = out[:, -1:]
        torch.testing.assert_close(feature[0, 0], unrolled[0][0, anchor])
        for step in range(1, steps):
            if anchor + 1 + step >= length:
                break
            token = tokens[:, anchor + 1 + step: anchor + 2 + step]
            feature = model(embed(token), feature, torch.tensor([[anchor + step]]), cache)
            torch.testing.assert_close(feature[0, 0], unrolled[step][0, anchor], msg=f"anchor {anchor} step {step}")


def test_the_proposers_chain_is_the_argmax_of_the_unrolled_steps(eagle_dirs):
    """The real proposer's chain, appended to the sequence, read back by the training forward: at the last
    committed row, unrolled step j's argmax must be the chain's token j (same features, keys, positions)."""
    model = tiny_model("llama", seed=0)
    decoder = SpeculativeDecoder.from_model(model, proposer="eagle3", draft=eagle_dirs[1], tree_size=0, num_tokens=5)
    proposer, target = decoder.proposer, decoder.target
    for prompt in ([3, 9, 27, 81, 50, 60, 70], [5]):
        prompt = torch.tensor([prompt])
        out = target.prefill(prompt)
        committed = torch.cat([prompt, out.logits[:, -1:].argmax(-1)], dim=1)
        proposer.reset()
        proposer.prefill(None, out)
        state = DecodeState(tokens=committed, max_draft_tokens=5, prompt_length=prompt.shape[1],
                            sampling=SamplingParams())
        chain = proposer.propose(state).tokens
        sequence = torch.cat([committed, chain], dim=1)
        last = committed.shape[1] - 2  # the row that read the last committed token
        draft = proposer.model
        features = draft.fuse(target.tap_hidden_states(sequence).tapped(proposer.layer_ids)[:, :-1])
        positions, earlier = torch.arange(sequence.shape[1] - 1).unsqueeze(0), []
        for step in range(5):
            inputs, labels, _ = unrolled_inputs(sequence, torch.tensor([sequence.shape[1]]), torch.ones_like(sequence),
                                                step)
            features, kv = draft.forward_unrolled(target.embed_tokens(inputs), features, positions + step, earlier)
            earlier.append(kv)
            pick = proposer.vocab_ids[draft.logits(features[0, last]).argmax()]
            assert int(pick) == int(chain[0, step]) == int(labels[0, last]), (prompt, step)


class AcceptAtRandom(Verifier):
    """Accepts a random prefix of a chain, or a random walk down a tree: not lossless, but it makes every
    accepted length happen, which a random draft alone almost never does."""

    name = "test-accept-at-random"
    supports_trees = True

    def __init__(self, seed: int) -> None:
        import random

        self.random = random.Random(seed)

    def verify(self, logits, draft, sampling, generator):
        k, tokens = draft.num_tokens, draft.tokens[0].tolist()
        if draft.parents is None:
            path = list(range(self.random.randint(0, k)))
        else:
            children: dict[int, list[int]] = {}
            for j, parent in enumerate(draft.parents):
                children.setdefault(parent, []).append(j)
            node, path = -1, []
            while children.get(node) and self.random.random() < 0.8:
                node = self.random.choice(children[node])
                path.append(node)
        n = len(path)
        bonus = int(logits[0, path[-1] + 1 if path else 0].argmax())
        emitted = torch.tensor([[tokens[j] for j in path] + [bonus] + [-1] * (k - n)])
        chain_path = None if draft.parents is None else torch.tensor([path + [-1] * (k - n)])
        return Verdict(torch.tensor([n]), emitted, chain_path)


@pytest.mark.parametrize("options", [{"tree_size": 0}, {"tree_size": 0, "num_tokens": 1}, {},
                                     {"tree_size": 12, "tree_width": 3, "num_tokens": 5}])
def test_the_draft_cache_holds_exactly_the_committed_context(eagle_dirs, options):
    """After every propose, whatever was accepted before: the draft's cache equals a from-scratch read of
    the committed tokens, and a tree is never deeper than allowed."""
    model = tiny_model("llama", seed=0)
    decoder = SpeculativeDecoder.from_model(model, proposer="eagle3", draft=eagle_dirs[1], **options)
    decoder.engine.greedy_verifier = AcceptAtRandom(seed=len(options))
    proposer, target = decoder.proposer, decoder.target
    propose, checked = proposer.propose, []

    def propose_and_check(state):
        draft = propose(state)
        length = state.length
        assert proposer.cache.length() == length - 1
        fresh = Eagle3Cache()
        taps = target.tap_hidden_states(state.tokens[:, : length - 1]).tapped(proposer.layer_ids)
        proposer.model(target.embed_tokens(state.tokens[:, 1:length]), proposer.model.fuse(taps),
                       torch.arange(length - 1).unsqueeze(0), fresh)
        torch.testing.assert_close(proposer.cache.keys, fresh.keys)
        torch.testing.assert_close(proposer.cache.values, fresh.values)
        if draft.parents is not None:
            assert max(tree.depths(draft.parents)) <= state.max_draft_tokens
        checked.append(draft.num_tokens)
        return draft

    proposer.propose = propose_and_check
    accepted = []
    for prompt in ([5], [7, 8, 9, 10, 7, 8, 9], list(range(20, 40))):
        out = decoder.generate_ids(prompt, max_new_tokens=30, draft_budget=UNCUT)  # asked every step
        assert len(out.token_ids) == 30
        accepted += out.stats.acceptance_lengths
    # draft tokens were accepted, several at once where the draft is longer than one
    assert len(checked) > 10 and max(accepted) >= min(3, options.get("num_tokens", 6) + 1)


def test_batched_loss_equals_the_mean_of_single_sequence_losses():
    """Right-padded sequences in one forward: the same loss and gradients as one at a time."""
    target = TargetModel(tiny_model("llama", seed=4), tiny_tokenizer())  # float64: autocast leaves it alone
    objective = Eagle3Objective(Eagle3Objective.Config(ttt_steps=3, draft_vocab_size=128), target)
    objective.draft.double()
    sequences = [([2, 30, 3] + list(range(31, 41)), 3), ([2, 7, 3, 8, 9, 10], 3), ([2, 5, 3], 3),
                 ([2, 11, 3] + list(range(12, 30)), 3), ([9, 9], 1)]
    batch = [(torch.tensor(t), torch.tensor([0] * p + [1] * (len(t) - p), dtype=torch.bool)) for t, p in sequences]

    def run(batched: bool):
        objective.draft.zero_grad(set_to_none=True)
        gen = torch.Generator().manual_seed(0)
        if batched:
            loss, _ = objective.batch_loss(batch, gen)
        else:  # the mean over sequences that have a label (the last two have none)
            losses = [objective.loss(tokens, mask, gen)[0] for tokens, mask in batch[:2] + batch[3:4]]
            loss = torch.stack(losses).mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in objective.draft.named_parameters() if p.grad is not None}

    loss_one, grads_one = run(batched=False)
    loss_all, grads_all = run(batched=True)
    assert loss_one > 0
    assert torch.allclose(loss_all.double(), loss_one.double(), rtol=1e-6, atol=0)
    assert grads_one.keys() == grads_all.keys()
    for name, grad in grads_one.items():
        assert torch.allclose(grads_all[name], grad, rtol=1e-5, atol=1e-9), name


def test_specforge_configs_are_read_and_unsupported_settings_refused(tmp_path):
    """SpecForge's configs name neither the target's depth nor the taps (vLLM defaults them from the
    target); scaled RoPE and norm_before_residual are refused rather than silently ignored."""
    save_draft(random_draft(8), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    bare = {k: v for k, v in raw.items() if k not in ("eagle_config", "num_target_layers")}
    (tmp_path / "config.json").write_text(json.dumps(bare))
    target = TargetModel(tiny_model("llama", seed=0))
    proposer = _proposer(target, str(tmp_path))
    assert proposer.layer_ids == Eagle3Config.default_target_layer_ids(4)
    for extra, message in [({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
                           ({"norm_before_residual": True}, "norm_before_residual")]:
        (tmp_path / "config.json").write_text(json.dumps({**raw, **extra}))
        with pytest.raises(SpecdecError, match=message):
            _proposer(target, str(tmp_path))


def test_unrolled_labels_are_two_ahead_and_masked():
    tokens = torch.tensor([[10, 11, 12, 13, 14, 0]])  # length 5, one padding
    mask = torch.tensor([[0, 0, 1, 1, 1, 0]])
    inputs, labels, valid = unrolled_inputs(tokens, torch.tensor([5]), mask, 1)
    # row i reads token i + 2 and predicts token i + 3
    assert inputs[0, :3].tolist() == [12, 13, 14] and labels[0, :2].tolist() == [13, 14]
    assert valid[0].tolist() == [True, True, False, False, False]
    assert step_weights(3, 0.8).tolist() == pytest.approx([1.0, 0.8, 0.64])


def test_checkpoint_round_trip_in_specforge_layout(tmp_path):
    model = random_draft(4, draft_vocab_size=40)
    save_draft(model, tmp_path, dtype=torch.float64)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["num_hidden_layers"] == 1
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]  # vLLM counts layer inputs
    tensors = load_file(tmp_path / "model.safetensors")
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "lm_head.weight", "d2t", "t2d"} <= set(tensors)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (32, 64)  # reads [embedding, feature]
    loaded = load_draft(tmp_path, dtype=torch.float64)
    assert loaded.config == model.config
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    assert loaded.target_ids(torch.tensor([0, 1, 2])).tolist() == [0, 3, 6]


def test_bad_checkpoints_are_refused_with_one_sentence(tmp_path, eagle_dirs):
    target = TargetModel(tiny_model("llama", seed=0))
    with pytest.raises(SpecdecError, match="does not exist"):
        SpeculativeDecoder(target, _proposer(target, str(tmp_path / "nowhere")))
    wide = tmp_path / "wide"
    save_draft(random_draft(5, hidden_size=64, head_dim=16), wide)
    with pytest.raises(SpecdecError, match="hidden size 64 but the target has 32"):
        _proposer(target, str(wide))
    deep = tmp_path / "deep"
    save_draft(random_draft(5, target_layer_ids=[0, 7], num_target_layers=8), deep)
    with pytest.raises(SpecdecError, match=r"taps target layers \[7\]"):
        _proposer(target, str(deep))
    two_layers = tmp_path / "two"
    save_draft(random_draft(5), two_layers)
    raw = json.loads((two_layers / "config.json").read_text())
    (two_layers / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 2}))
    with pytest.raises(SpecdecError, match="exactly one"):
        _proposer(target, str(two_layers))
    broken = tmp_path / "broken"
    save_draft(random_draft(5, draft_vocab_size=40), broken)
    tensors = load_file(broken / "model.safetensors")
    tensors["d2t"][3] = 500
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(SpecdecError, match="d2t table"):
        _proposer(target, str(broken))
    del tensors["fc.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(SpecdecError, match="lacks the tensor 'fc.weight'"):
        _proposer(target, str(broken))
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(raw))  # a config that fits the target
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(SpecdecError, match="never loads"):
        _proposer(target, str(pickled))


def _proposer(target, folder):
    from specdec_eagle.proposer import Eagle3Proposer

    return Eagle3Proposer(Eagle3Proposer.Config(draft=folder), target)


@pytest.mark.parametrize("options", [{"tree_size": 0}, {"tree_size": 0, "num_tokens": 1}, {},
                                     {"tree_size": 5, "tree_width": 2, "num_tokens": 3},
                                     {"tree_size": 30, "tree_width": 5, "num_tokens": 8}])
@pytest.mark.parametrize("which", [0, 1])
def test_greedy_output_is_plain_greedy(eagle_dirs, options, which):
    model = tiny_model("llama", seed=which)
    for prompt in ([5], [7, 8, 9, 10, 7, 8, 9], list(range(20, 40))):
        decoder = SpeculativeDecoder.from_model(model, proposer="eagle3", draft=eagle_dirs[which], **options)
        out = decoder.generate_ids(prompt, max_new_tokens=25)
        assert out.token_ids == plain_greedy(model, prompt, 25), (options, prompt)


def test_tiny_training_run_lowers_loss_writes_a_loadable_draft_and_resumes(tiny_setup):
    root, model_dir, data_dir = tiny_setup
    run = root / "run"
    args = ["train", "--proposer", "eagle3", "--model", model_dir, "--data", data_dir, "--out", str(run),
            "--dtype", "float32", "--opt", "ttt_steps=3", "--opt", "draft_vocab_size=64", "--lr", "3e-3",
            "--save-every", "10", "--eval-prompts", "2", "--no-progress"]
    result = CliRunner().invoke(main, args + ["--steps", "20"])
    assert result.exit_code == 0, result.output
    state = json.loads((run / "trainer_state.json").read_text())
    history = state["history"]
    assert state["step"] == 20 and history[-1]["loss"] < history[0]["loss"]
    assert "acceptance" in history[-1]  # the final evaluation ran the real proposer on held-out prompts
    raw = json.loads((run / "draft" / "config.json").read_text())
    assert raw["draft_vocab_size"] == 64
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    decoder = SpeculativeDecoder.from_model(model, proposer="eagle3", draft=str(run / "draft"))
    out = decoder.generate_ids([2, 30, 3], max_new_tokens=12)
    assert out.token_ids == plain_greedy(model, [2, 30, 3], 12)
    vocabulary = load_draft(run / "draft").d2t.clone()
    result = CliRunner().invoke(main, args + ["--steps", "30", "--resume"])
    assert result.exit_code == 0, result.output
    resumed = json.loads((run / "trainer_state.json").read_text())
    assert resumed["step"] == 30 and [h["step"] for h in resumed["history"]] == [10, 20, 30]
    assert torch.equal(load_draft(run / "draft").d2t, vocabulary)  # the resumed run keeps its vocabulary


def test_init_from_a_draft_for_another_target_is_refused(tiny_setup, tmp_path):
    _, model_dir, _ = tiny_setup
    save_draft(random_draft(7, hidden_size=64, head_dim=16), tmp_path / "wide")
    target = TargetModel(tiny_model("llama", seed=4), tiny_tokenizer())
    with pytest.raises(SpecdecError, match="hidden size 64"):
        Eagle3Objective(Eagle3Objective.Config(), target, init=tmp_path / "wide")


@pytest.mark.parametrize("option", [{"intermediate_size": 40}, {"target_layer_ids": [0, 1, 1]},
                                    {"draft_vocab_size": 32}])
def test_init_refuses_options_that_would_reshape_the_trained_draft(tmp_path, option):
    """With --init these options were silently ignored (training went on with the draft's own shape); now a
    differing one is refused and an agreeing one is fine."""
    save_draft(random_draft(7), tmp_path / "trained")
    target = TargetModel(tiny_model("llama", seed=4), tiny_tokenizer())
    (key, value), = option.items()
    have = getattr(load_draft(tmp_path / "trained").config, key)
    assert have != value
    with pytest.raises(SpecdecError, match=rf"has {key} .*; --opt {key}=.* cannot change a trained draft"):
        Eagle3Objective(Eagle3Objective.Config(**option), target, init=tmp_path / "trained")
    same = Eagle3Objective(Eagle3Objective.Config(**{key: have}), target, init=tmp_path / "trained")
    assert getattr(same.draft.config, key) == have


# ---------------------------------------------------------------------------------------------------------
# Every config.json field honoured or refused (issue 25), before any weights load.
# ---------------------------------------------------------------------------------------------------------
def test_every_field_of_specforges_layout_is_read_or_inert(tmp_path):
    """SpecForge's configs (e.g. its qwen3-8b-eagle3.json) carry what transformers writes for a Llama config:
    token ids, initializer_range, use_cache, pretraining_tp, a null rope_scaling, no window."""
    save_draft(random_draft(8), tmp_path, dtype=torch.float64)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update({"attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
                "initializer_range": 0.02, "max_window_layers": 36, "rope_scaling": None, "sliding_window": None,
                "use_sliding_window": False, "transformers_version": "4.51.0", "use_cache": True, "pretraining_tp": 1,
                "mlp_bias": False, "torch_dtype": "bfloat16", "model_type": "llama", "norm_before_residual": False})
    raw["eagle_config"]["use_aux_hidden_state"] = True
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model = tiny_model("llama", seed=0)
    decoder = SpeculativeDecoder.from_model(model, proposer="eagle3", draft=str(tmp_path))
    assert decoder.generate_ids([5, 6, 7], max_new_tokens=12).token_ids == plain_greedy(model, [5, 6, 7], 12)


@pytest.mark.parametrize("update,message", [
    ({"hidden_act": "gelu"}, "hidden_act to 'gelu', but specdec's EAGLE-3 draft implements only 'silu'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_parameters to .*yarn"),
    ({"attention_bias": True}, "attention_bias to true"),
    ({"mlp_bias": True}, "mlp_bias to true"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4], "use_aux_hidden_state": False}},
     "eagle_config.use_aux_hidden_state to false"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4], "something_else": 1}},
     "eagle_config.something_else"),
    ({"target_hidden_size": 64}, "target_hidden_size to 64 but hidden_size to 32"),
    ({"sliding_window": 8}, "sliding_window to 8"),
    ({"some_new_knob": "on"}, "some_new_knob to 'on', a field specdec's EAGLE-3 draft neither reads nor knows"),
])
def test_eagle3_settings_the_draft_does_not_implement_are_refused_before_weights_load(tmp_path, update, message):
    save_draft(random_draft(8), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, **update}))
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")  # never read: the config is refused first
    target = TargetModel(tiny_model("llama", seed=0))
    with pytest.raises(SpecdecError, match=message):
        _proposer(target, str(tmp_path))


def test_pruning_each_depth_to_what_can_be_verified_changes_no_tree(eagle_dirs):
    """The dynamic tree keeps max(tree_size, tree_width) nodes per depth; keeping every node gives the same
    drafts (here 5 x 5 = 25 children per depth, 6 kept)."""
    model = tiny_model("llama", seed=0)
    options = dict(tree_size=6, tree_width=5, num_tokens=5)
    drafts = {}
    for keep_all in (False, True):
        decoder = SpeculativeDecoder.from_model(model, proposer="eagle3", draft=eagle_dirs[0], **options)
        decoder.engine.greedy_verifier = AcceptAtRandom(seed=3)  # varied accepted lengths, the same in both runs
        if keep_all:
            decoder.proposer._kept_per_depth = lambda width: 10**9
        propose, seen = decoder.proposer.propose, []
        decoder.proposer.propose = lambda state, propose=propose, seen=seen: seen.append(d := propose(state)) or d
        for prompt in ([5], [7, 8, 9, 10, 7, 8, 9]):
            decoder.generate_ids(prompt, max_new_tokens=20, draft_budget=UNCUT)
        drafts[keep_all] = [(d.tokens.tolist(), d.parents) for d in seen]
    assert len(drafts[False]) > 5 and drafts[False] == drafts[True]
