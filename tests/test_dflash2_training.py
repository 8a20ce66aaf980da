"""DFlash2 training: the selector's loss against its brute-force definition, the upgrade from a DFlash draft
drafts what that draft drafts, and a tiny run with resume."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner
from conftest import drafted_chains, plain_greedy, tiny_model, tiny_train_args, train_one_layer_dflash
from test_dflash import write_draft

from specdec import SpeculativeDecoder, TargetModel
from specdec.cli import main
from specdec_dflash.checkpoint import load_draft, save_draft
from specdec_dflash.dflash2_training import DFlash2Objective, upgrade_to_dflash2


def test_selector_loss_is_its_brute_force_definition(tmp_path):
    """Teacher forcing: at slot s the predecessor is the true token at s - 1 (the anchor at s = 0), candidates
    are the top-k of the draft logits, the loss is -log softmax(scores)[true token] where the true token is a
    candidate, weighted by the position weights and divided by the weight of every counted slot."""
    target = TargetModel(tiny_model("llama", seed=3))
    init = write_draft(tmp_path / "v1", seed=2)
    objective = DFlash2Objective(DFlash2Objective.Config(selector_top_k=6, selector_rank=5, conv_group_size=8,
                                                         selector_loss_weight=0.7), target, init=str(init))
    selector = objective.draft.candidate_selector
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a selector away from its zero start
        selector.successor_codebook.copy_(torch.randn(selector.successor_codebook.shape, generator=gen))
    n, a, s, hidden_size, vocab = 2, 3, 4, 32, 128
    hidden = torch.randn(n, a, s, hidden_size, generator=gen, dtype=torch.float64)  # the draft beside a float64
    logits = torch.randn(n, a, s, vocab, generator=gen, dtype=torch.float64) * 3  # target trains in float64
    labels = torch.randint(0, vocab, (n, a, s), generator=gen)
    for i in range(n):  # most true tokens among the candidates, some not
        for j in range(a):
            for k in range(s):
                if (i + j + k) % 3:
                    labels[i, j, k] = logits[i, j, k].topk(6).indices[(i + k) % 6]
    labels[1, 2, 3] = -100
    valid = labels >= 0
    valid[0, 1] = False  # a padding block
    weights = torch.tensor([1.0, 0.6, 0.36, 0.2]) * valid
    anchors = torch.randint(0, vocab, (n, a), generator=gen)
    loss, metrics = objective.extra_loss(hidden, logits, labels, valid, weights, anchors)
    with torch.no_grad():
        projected = selector.hidden_projection(hidden)
        total = 0.0
        for i in range(n):
            numerator = 0.0
            for j in range(a):
                for k in range(s):
                    truth = int(labels[i, j, k])
                    candidates = logits[i, j, k].topk(6).indices.tolist()
                    if not valid[i, j, k] or truth not in candidates:
                        continue
                    previous = int(anchors[i, j]) if k == 0 else int(labels[i, j, k - 1])
                    scores = [float(logits[i, j, k, c] + (selector.predecessor_codebook[previous] * projected[i, j, k]
                                                          * selector.successor_codebook[c]).sum()) for c in candidates]
                    log_norm = math.log(sum(math.exp(v) for v in scores))
                    numerator += float(weights[i, j, k]) * (log_norm - scores[candidates.index(truth)])
            total += numerator / float(weights[i].sum())
    assert math.isclose(float(loss.detach()), 0.7 * total / n, rel_tol=1e-5)
    assert 0 < metrics["selector_offered"] < 1


def test_a_dflash_draft_upgraded_to_dflash2_drafts_what_it_drafted(tmp_path):
    target = tiny_model("llama", seed=3)
    v1 = write_draft(tmp_path / "v1", seed=9)
    v2 = upgrade_to_dflash2(load_draft(v1, dtype=torch.float64), 2, 8, 4, 5)
    save_draft(v2, tmp_path / "v2", dtype=torch.float64)
    assert drafted_chains(target, "dflash2", tmp_path / "v2") == drafted_chains(target, "dflash", v1)


def test_tiny_dflash2_run_from_a_dflash_draft_lowers_loss_and_resumes(tiny_setup):
    root, model_dir, data_dir = tiny_setup
    base = tiny_train_args(model_dir, data_dir, save_every=10)
    v1 = train_one_layer_dflash(root, model_dir, data_dir, steps=10, name="v1")
    run = root / "v2"
    args = base + ["--proposer", "dflash2", "--out", str(run), "--init", str(v1),
                   "--opt", "conv_group_size=8", "--opt", "selector_rank=4", "--opt", "selector_top_k=4"]
    result = CliRunner().invoke(main, args + ["--steps", "20"])
    assert result.exit_code == 0, result.output
    state = json.loads((run / "trainer_state.json").read_text())
    first, last = state["history"][0], state["history"][-1]
    # the selector's loss counts only slots whose true token is offered, so it grows as the draft learns to
    # offer it; the draft's own part falls
    assert state["step"] == 20 and last["draft_loss"] < first["draft_loss"]
    assert last["selector_offered"] > 0 and last["selector_loss"] > 0 and last["acceptance"] >= 1.0
    config = json.loads((run / "draft" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["dflash_config"]["selector_top_k"] == 4
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    decoder = SpeculativeDecoder.from_model(model, proposer="dflash2", draft=str(run / "draft"))
    assert decoder.generate_ids([2, 30, 3], max_new_tokens=10).token_ids == plain_greedy(model, [2, 30, 3], 10)
    result = CliRunner().invoke(main, args + ["--steps", "30", "--resume"])
    assert result.exit_code == 0, result.output
    resumed = json.loads((run / "trainer_state.json").read_text())
    assert resumed["step"] == 30 and [h["step"] for h in resumed["history"]] == [10, 20, 30]


def test_dflash2_drafts_train_only_as_dflash2_and_keep_their_shapes(tmp_path):
    from helpers import save_random_dflash2

    from specdec import SpecdecError
    from specdec_dflash.training import DFlashObjective

    target = TargetModel(tiny_model("llama", seed=3))
    v2 = save_random_dflash2(tmp_path / "v2", seed=1)
    with pytest.raises(SpecdecError, match="is a DFlash2 draft; train it with --proposer dflash2"):
        DFlashObjective(DFlashObjective.Config(), target, init=v2)
    with pytest.raises(SpecdecError, match="has selector_rank 6; --opt selector_rank=9 cannot change"):
        DFlash2Objective(DFlash2Objective.Config(selector_rank=9), target, init=v2)
    same = DFlash2Objective(DFlash2Objective.Config(selector_rank=6), target, init=v2)  # agreeing: fine
    assert same.draft.config.selector_rank == 6


@pytest.mark.parametrize("option", [{"target_layer_ids": [0, 1]}, {"mask_token_id": 7}])
def test_init_refuses_options_that_would_change_the_trained_draft(tmp_path, option):
    """Taps and the mask token are the trained draft's own: asked for others with --init, training would have
    gone on with the draft's (silently); now the option is refused, and an agreeing one is fine."""
    from specdec import SpecdecError
    from specdec_dflash.training import DFlashObjective

    target = TargetModel(tiny_model("llama", seed=3))
    folder = write_draft(tmp_path / "v1", seed=2)  # target_layer_ids [0, 2], mask_token_id 5
    (key, value), = option.items()
    have = getattr(load_draft(folder).config, key)
    with pytest.raises(SpecdecError, match=rf"has {key} .*; --opt {key}=.* cannot change a trained draft"):
        DFlashObjective(DFlashObjective.Config(**option), target, init=folder)
    same = DFlashObjective(DFlashObjective.Config(**{key: have}), target, init=folder)
    assert getattr(same.draft.config, key) == have
