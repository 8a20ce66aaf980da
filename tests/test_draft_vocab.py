"""The reduced draft vocabulary: choosing it, reading it back, training with it and drafting from it."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import plain_greedy, tiny_model, tiny_tokenizer, write_data

from specdec import DecodeState, SpecdecError, SpeculativeDecoder, TargetModel
from specdec.training.data import DataDir
from specdec_dflash.checkpoint import save_draft
from specdec_dflash.model import DFlashConfig, DFlashDraftModel
from specdec_dflash.proposer import DFlashProposer
from specdec_dflash.training import DFlashObjective
from specdec_dflash.vocab import VOCAB_FILE, label_map, load_vocab, most_frequent, save_vocab


def test_most_frequent_takes_the_largest_counts_and_breaks_ties_by_lower_id():
    counts = torch.tensor([5, 0, 9, 5, 1, 5])
    assert most_frequent(counts, 2).tolist() == [0, 2]
    assert most_frequent(counts, 4).tolist() == [0, 2, 3, 5]
    with pytest.raises(SpecdecError, match="impossible for a vocabulary of 6"):
        most_frequent(counts, 7)


def test_label_map_inverts_the_subset():
    mapping = label_map(torch.tensor([1, 4, 6]), 8)
    assert mapping.tolist() == [-1, 0, -1, -1, 1, -1, 2, -1]


@pytest.mark.parametrize("content,message", [
    ("[1, 2]", "is not a draft vocabulary"),
    ('{"token_ids": []}', "non-empty list of integers"),
    ('{"token_ids": [1, 1]}', "repeated or outside the target's vocabulary of 128"),
    ('{"token_ids": [3, 128]}', "repeated or outside the target's vocabulary of 128"),
])
def test_bad_vocabulary_files_fail_with_one_sentence(tmp_path, content, message):
    (tmp_path / VOCAB_FILE).write_text(content)
    with pytest.raises(SpecdecError, match=message):
        load_vocab(tmp_path, 128)


def test_no_file_means_the_whole_vocabulary(tmp_path):
    assert load_vocab(tmp_path, 128) is None
    save_vocab(torch.tensor([9, 2, 40]), tmp_path)
    assert load_vocab(tmp_path, 128).tolist() == [2, 9, 40]


def random_draft(folder, vocab_ids=None):
    torch.manual_seed(1)
    config = DFlashConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, intermediate_size=48, block_size=6, mask_token_id=5, target_layer_ids=[0, 2],
                          num_target_layers=4, vocab_size=128, rope_theta=10000.0)
    model = DFlashDraftModel(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    save_draft(model, folder, dtype=torch.float64)
    if vocab_ids is not None:
        save_vocab(torch.tensor(vocab_ids), folder)
    return str(folder)


def test_drafts_come_from_the_subset_and_output_is_unchanged(tmp_path):
    model = tiny_model("llama", seed=3)
    subset = list(range(0, 128, 4))
    folder = random_draft(tmp_path, subset)
    target = TargetModel(model)
    chain = {"tree_size": 0, "lookup": 0}  # the draft's own argmax chain, to compare slot by slot
    proposer = DFlashProposer(DFlashProposer.Config(draft=folder, **chain), target)
    full = DFlashProposer(DFlashProposer.Config(draft=folder, vocab="full", **chain), TargetModel(model))
    assert proposer.vocab_ids.tolist() == subset and full.vocab_ids is None
    prompt = torch.tensor([[9, 10, 11, 12]])
    for p in (proposer, full):
        p.reset()
        p.target.reset()
        p.prefill(DecodeState(tokens=prompt, max_draft_tokens=5, prompt_length=3), p.target.prefill(prompt[:, :-1]))
    drafted = proposer.propose(DecodeState(tokens=prompt, max_draft_tokens=5, prompt_length=3)).tokens
    assert all(t % 4 == 0 for t in drafted.flatten().tolist())
    # the subset's argmax is the full argmax wherever the full argmax lies inside the subset
    reference = full.propose(DecodeState(tokens=prompt, max_draft_tokens=5, prompt_length=3)).tokens
    inside = reference % 4 == 0
    assert torch.equal(drafted[inside], reference[inside])
    for prompt in ([1, 2, 3], [7, 8, 9, 10, 7, 8, 9, 10], [100]):
        out = SpeculativeDecoder.from_model(model, proposer="dflash", draft=folder).generate_ids(prompt, 25)
        assert out.token_ids == plain_greedy(model, prompt, 25)


def test_training_with_a_draft_vocabulary_saves_and_keeps_it(tmp_path):
    tokenizer = tiny_tokenizer()
    target = TargetModel(tiny_model("llama", seed=4, dtype=torch.float32), tokenizer)
    frequent = [20, 21, 22, 23]
    sequences = [([2, 3] + frequent * 3 + [40 + i], [0, 0] + [1] * 13) for i in range(4)]
    data = DataDir(write_data(tmp_path / "data", tokenizer, sequences))
    objective = DFlashObjective(DFlashObjective.Config(num_layers=1, block_size=4, mask_token_id=4,
                                                       draft_vocab_size=5, num_anchors=4), target)
    objective.use_data(data)
    assert objective.vocab_ids.tolist() == [20, 21, 22, 23, 40]  # 4 x 3 each, then the lowest of the singletons
    tokens, mask = next(iter(data.sequences()))
    loss, info = objective.loss(tokens, mask, torch.Generator().manual_seed(0))
    loss.backward()
    assert torch.isfinite(loss) and loss > 0
    # labels outside the subset are ignored, inside ones map to subset indices
    labels = torch.tensor([[20, 41, -100], [40, 23, 7]])
    assert objective.draft_labels(labels).tolist() == [[0, -100, -100], [4, 3, -100]]
    objective.save_draft(tmp_path / "draft")
    saved = json.loads((tmp_path / "draft" / VOCAB_FILE).read_text())
    assert saved["token_ids"] == [20, 21, 22, 23, 40] and "most frequent" in saved["source"]
    # --init (and so --resume) keeps the saved subset rather than recounting data that may have grown
    again = DFlashObjective(DFlashObjective.Config(draft_vocab_size=5), target, init=tmp_path / "draft")
    grown = [([2, 3, 60, 61, 62, 63, 64], [0] * 2 + [1] * 5)]
    again.use_data(DataDir(write_data(tmp_path / "other", tokenizer, grown)))
    assert again.vocab_ids.tolist() == [20, 21, 22, 23, 40]
    # and names where the tokens were counted, through any number of continuations (a resume is one)
    again.save_draft(tmp_path / "continued")
    assert json.loads((tmp_path / "continued" / VOCAB_FILE).read_text())["source"] == saved["source"]
    (tmp_path / "draft" / VOCAB_FILE).write_text(json.dumps({"token_ids": saved["token_ids"]}))  # none recorded
    unnamed = DFlashObjective(DFlashObjective.Config(draft_vocab_size=5), target, init=tmp_path / "draft")
    assert unnamed.vocab_source == f"inherited from {tmp_path / 'draft'}"
    # unless told to count afresh: the head rows are the target's, so only the choice of tokens changes
    recounted = DFlashObjective(DFlashObjective.Config(vocab_from_data=True), target, init=tmp_path / "draft")
    recounted.use_data(DataDir(write_data(tmp_path / "third", tokenizer, grown)))
    assert recounted.vocab_ids.tolist() == [60, 61, 62, 63, 64]
    assert torch.equal(recounted.head_weight, target.lm_head.weight[60:65].to(recounted.head_weight.dtype))
    # counted once, when a run begins: a resumed run keeps it (the trainer applies Config.for_resume)
    assert recounted.config.for_resume().vocab_from_data is False
    nothing = DFlashObjective(DFlashObjective.Config(num_layers=1, block_size=4, mask_token_id=4,
                                                     vocab_from_data=True), target)
    with pytest.raises(SpecdecError, match="vocab_from_data has no vocabulary to recount"):
        nothing.use_data(data)
