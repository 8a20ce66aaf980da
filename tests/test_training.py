"""DFlash training: anchors and the packed attention mask against brute force, loss weights, label alignment,
a tiny end-to-end run with resume, and bad input."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import save_tiny_model, tiny_model, tiny_tokenizer

from specdec import SpecdecError, TargetModel
from specdec.cli import main
from specdec.training.data import DataDir, read_prompts
from specdec_dflash.training import (
    DFlashObjective,
    block_inputs,
    loss_weights,
    packed_attention_mask,
    sample_anchors,
)


def brute_force_mask(anchors: list[int], context_length: int, block_size: int) -> torch.Tensor:
    """Which query may see which key, spelled out one pair at a time."""
    queries = len(anchors) * block_size
    mask = torch.zeros(queries, context_length + queries, dtype=torch.bool)
    for q in range(queries):
        a = q // block_size
        for j in range(context_length):
            mask[q, j] = j < anchors[a]  # context strictly before the anchor
        for kq in range(queries):
            mask[q, context_length + kq] = kq // block_size == a  # own block, both directions
    return mask


@pytest.mark.parametrize("anchors,length,block", [([0], 1, 4), ([0, 3, 5], 7, 4), ([2, 9], 10, 16), ([5], 6, 2)])
def test_packed_mask_matches_brute_force(anchors, length, block):
    got = packed_attention_mask(torch.tensor(anchors), length, block)
    assert torch.equal(got, brute_force_mask(anchors, length, block))


def test_anchors_are_response_positions_with_a_successor():
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1], dtype=torch.bool)
    gen = torch.Generator().manual_seed(0)
    anchors = sample_anchors(mask, 100, gen)
    assert anchors.tolist() == [3, 4, 5, 6]  # 7 is last: nothing after it to predict
    few = sample_anchors(mask, 2, gen)
    assert len(few) == 2 and set(few.tolist()) <= {3, 4, 5, 6} and few.tolist() == sorted(few.tolist())
    assert sample_anchors(torch.tensor([0, 0, 1], dtype=torch.bool), 5, gen).numel() == 0
    counts = torch.zeros(8)
    for _ in range(400):
        counts[sample_anchors(mask, 1, gen)] += 1
    assert (counts[3:7] > 60).all()  # uniform over the four candidates, resampled each call


def test_labels_are_aligned_and_clipped_at_the_end():
    tokens = torch.arange(100, 110)  # token at position p is 100 + p
    ids, positions, labels, valid = block_inputs(tokens, torch.tensor([2, 7]), block_size=5, mask_token_id=1)
    assert ids.tolist() == [102, 1, 1, 1, 1, 107, 1, 1, 1, 1]
    assert positions.tolist() == [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    # slot k of the block anchored at p predicts token p + k
    assert labels[0].tolist() == [103, 104, 105, 106]
    assert labels[1].tolist() == [108, 109, -100, -100] and valid[1].tolist() == [True, True, False, False]


def test_taps_only_forward_matches_prefill_and_skips_the_rest():
    model = tiny_model("llama", layers=4, seed=5)
    target = TargetModel(model)
    target.request_taps([0, 2])
    tokens = torch.randint(0, 128, (1, 11), generator=torch.Generator().manual_seed(0))
    full = target.prefill(tokens)
    calls = []
    hook = model.model.layers[3].register_forward_hook(lambda *_: calls.append(1))
    try:
        only = target.tap_hidden_states(tokens)
    finally:
        hook.remove()
    assert calls == []  # layer 3 (after the deepest tap) and the LM head never ran
    assert only.logits.numel() == 0 and target.cache_length == 11  # the prefill's cache is untouched
    assert torch.equal(only.tapped([0, 2]), full.tapped([0, 2]))
    step = target.forward(tokens[:, -1:])  # ordinary forwards run every layer again
    assert step.logits.shape == (1, 1, 128) and target.cache_length == 12


def test_loss_weights():
    w = loss_weights(16)
    assert w.shape == (15,) and w[0] == 1.0
    assert torch.allclose(w, torch.exp(-torch.arange(15.0) / 7))
    assert torch.allclose(loss_weights(10), torch.exp(-torch.arange(9.0) / 5))
    assert torch.allclose(loss_weights(8), torch.exp(-torch.arange(7.0) / 4))


def test_tiny_run_lowers_loss_writes_a_loadable_draft_and_resumes(tiny_setup):
    root, model_dir, data_dir = tiny_setup
    run = root / "run"
    args = ["train", "--proposer", "dflash", "--model", model_dir, "--data", data_dir, "--out", str(run),
            "--dtype", "float32", "--opt", "num_layers=1", "--opt", "block_size=4", "--opt", "num_anchors=8",
            "--opt", "mask_token_id=4", "--lr", "3e-3", "--save-every", "10", "--eval-prompts", "2",
            "--no-progress"]
    result = CliRunner().invoke(main, args + ["--steps", "20"])
    assert result.exit_code == 0, result.output
    state = json.loads((run / "trainer_state.json").read_text())
    history = state["history"]
    assert state["step"] == 20 and history[-1]["loss"] < history[0]["loss"]
    assert history[-1]["acceptance"] >= 1.0
    # the draft loads in the real proposer and decodes losslessly
    from transformers import AutoModelForCausalLM

    from specdec import SpeculativeDecoder

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    decoder = SpeculativeDecoder.from_model(model, proposer="dflash", draft=str(run / "draft"))
    assert decoder.generate_ids([2, 30, 3], max_new_tokens=10).stats.num_generated_tokens == 10
    # resume continues from step 20, not from scratch
    result = CliRunner().invoke(main, args + ["--steps", "30", "--resume"])
    assert result.exit_code == 0, result.output
    resumed = json.loads((run / "trainer_state.json").read_text())
    assert resumed["step"] == 30 and [h["step"] for h in resumed["history"]] == [10, 20, 30]
    # a second fresh run into the same folder is refused
    result = CliRunner().invoke(main, args + ["--steps", "5"])
    assert result.exit_code == 2 and "--resume" in result.output


def test_block_size_larger_than_the_init_draft(tiny_setup):
    root, model_dir, data_dir = tiny_setup
    target = TargetModel(tiny_model("llama", seed=4), tiny_tokenizer())
    small = DFlashObjective(DFlashObjective.Config(num_layers=1, block_size=4, mask_token_id=4), target)
    small.save_draft(root / "small")
    with pytest.raises(SpecdecError, match="block_size 8 is larger than the 4"):
        DFlashObjective(DFlashObjective.Config(block_size=8), target, init=root / "small")


def test_init_keeps_or_shortens_the_block(tiny_setup, tmp_path):
    root, model_dir, data_dir = tiny_setup
    target = TargetModel(tiny_model("llama", seed=4), tiny_tokenizer())
    DFlashObjective(DFlashObjective.Config(num_layers=1, block_size=4, mask_token_id=4), target).save_draft(
        tmp_path / "four")
    assert DFlashObjective(DFlashObjective.Config(), target, init=tmp_path / "four").block_size == 4
    shorter = DFlashObjective(DFlashObjective.Config(block_size=3), target, init=tmp_path / "four")
    assert shorter.block_size == 3 and shorter.weights.shape == (2,)
    shorter.save_draft(tmp_path / "three")  # the proposer's default block follows the fine-tuned one
    assert json.loads((tmp_path / "three" / "config.json").read_text())["block_size"] == 3


def test_data_made_for_another_target(tiny_setup, tmp_path):
    root, model_dir, data_dir = tiny_setup
    other = save_tiny_model(tmp_path / "other", vocab=100, seed=1)
    result = CliRunner().invoke(main, ["train", "--proposer", "dflash", "--model", other, "--data", data_dir,
                                       "--out", str(tmp_path / "run"), "--opt", "mask_token_id=4", "--steps", "1"])
    assert result.exit_code == 2 and "another target's tokenizer" in result.output


def test_prompt_files_missing_or_malformed(tmp_path):
    with pytest.raises(SpecdecError, match="does not exist"):
        read_prompts(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": \n')
    with pytest.raises(SpecdecError, match="line 2 is not valid JSON"):
        read_prompts(bad)
    bad.write_text('{"prompt": "fine"}\n\n{"text": "no prompt field"}\n')
    with pytest.raises(SpecdecError, match="line 3 has no non-empty `prompt`"):
        read_prompts(bad)
    good = tmp_path / "good.jsonl"
    good.write_text('{"id": "a", "prompt": "hi"}\n{"id": "b", "turns": ["one", "two"]}\n')
    assert [(r.id, r.text) for r in read_prompts(good)] == [("good:a", "hi"), ("good:b", "one")]
    result = CliRunner().invoke(main, ["data", "generate", "--prompts", str(bad), "--out", str(tmp_path / "d")])
    assert result.exit_code == 2 and "line 3" in result.output


def test_generate_data_end_to_end_and_resume(tmp_path):
    from specdec.training.data import generate_data

    model = tiny_model("llama", seed=5, dtype=torch.float32)
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 1
    tokenizer = tiny_tokenizer()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"w{10 + i} w{20 + i}"}) + "\n" for i in range(5)))
    out = tmp_path / "data"
    index = generate_data(model, tokenizer, "tiny", [str(prompts)], out, max_new_tokens=6, batch_size=2, limit=3,
                          sequences_per_shard=2, progress=False)
    assert sum(len(s["ids"]) for s in index["shards"]) == 3
    index = generate_data(model, tokenizer, "tiny", [str(prompts)], out, max_new_tokens=6, batch_size=2,
                          sequences_per_shard=2, progress=False)
    sequences = list(DataDir(out).sequences())
    assert len(sequences) == 5 and len({i for s in index["shards"] for i in s["ids"]}) == 5
    for tokens, mask in sequences:
        prompt_len = int((~mask).sum())
        assert tokens[:prompt_len].tolist()[0] == 2 and 1 <= int(mask.sum()) <= 6
        assert mask[prompt_len:].all()  # the response is one run at the end


@pytest.mark.slow
def test_torchrun_ddp_two_processes(tiny_setup, tmp_path):
    """The same command under torchrun (gloo on CPU): both ranks step together, rank 0 writes the run."""
    import os
    import shutil
    import subprocess
    import sys

    root, model_dir, data_dir = tiny_setup
    torchrun = shutil.which("torchrun")
    assert torchrun, "torchrun ships with torch"
    run = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "specdec", "train", "--proposer", "dflash",
         "--model", model_dir, "--data", data_dir, "--out", str(run), "--dtype", "float32", "--opt", "num_layers=1",
         "--opt", "block_size=4", "--opt", "num_anchors=4", "--opt", "mask_token_id=4", "--steps", "4",
         "--opt", "draft_vocab_size=40", "--save-every", "2", "--eval-prompts", "1", "--no-progress"],
        capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    state = json.loads((run / "trainer_state.json").read_text())
    assert state["step"] == 4 and [h["step"] for h in state["history"]] == [2, 4]
    assert (run / "draft" / "model.safetensors").is_file()
    assert len(json.loads((run / "draft" / "draft_vocab.json").read_text())["token_ids"]) == 40  # broadcast subset
    assert sys.executable


def test_unknown_cache_is_refused_before_the_model_loads(tiny_setup, tmp_path):
    root, model_dir, data_dir = tiny_setup
    result = CliRunner().invoke(main, ["train", "--proposer", "dflash", "--model", str(tmp_path / "absent"),
                                       "--data", data_dir, "--out", str(tmp_path / "run"), "--cache", "paged"])
    assert result.exit_code == 2 and "Unknown cache 'paged'" in result.output


def test_packed_batch_loss_equals_the_mean_of_single_sequence_losses():
    """Several sequences in one padded forward: the same anchors, loss and gradients as one at a time,
    including a sequence shorter than a block and one with no anchor at all."""
    target = TargetModel(tiny_model("llama", seed=4), tiny_tokenizer())  # float64: autocast leaves it alone
    objective = DFlashObjective(DFlashObjective.Config(num_layers=2, block_size=4, num_anchors=5, mask_token_id=4),
                                target)
    objective.draft.double()
    sequences = [([2, 30, 3] + list(range(31, 41)), 3), ([2, 7, 3, 8, 9, 10], 3), ([2, 5, 3], 3),
                 ([2, 11, 3] + list(range(12, 30)), 3), ([9, 9], 1)]
    batch = [(torch.tensor(t), torch.tensor([0] * p + [1] * (len(t) - p), dtype=torch.bool)) for t, p in sequences]

    def run(packed: bool):
        objective.draft.zero_grad(set_to_none=True)
        gen = torch.Generator().manual_seed(0)
        if packed:
            loss, info = objective.batch_loss(batch, gen)
        else:
            results = [objective.loss(tokens, mask, gen) for tokens, mask in batch]
            loss = torch.stack([r[0] for r in results]).mean()
            info = {"accuracy": sum(r[1]["accuracy"] for r in results) / len(results)}
        loss.backward()
        return loss.detach(), info, {n: p.grad.clone() for n, p in objective.draft.named_parameters()}

    loss_one, info_one, grads_one = run(packed=False)
    loss_all, info_all, grads_all = run(packed=True)
    assert loss_one > 0
    # the logits are cast to float32 before the cross-entropy, so sums agree to float32 rounding
    assert torch.allclose(loss_all.double(), loss_one.double(), rtol=1e-6, atol=0)
    assert info_all["accuracy"] == pytest.approx(info_one["accuracy"])
    for name, grad in grads_one.items():
        assert torch.allclose(grads_all[name], grad, rtol=1e-5, atol=1e-9), name


def test_training_with_packed_forwards(tiny_setup, tmp_path):
    root, model_dir, data_dir = tiny_setup
    args = ["train", "--proposer", "dflash", "--model", model_dir, "--data", data_dir, "--out", str(tmp_path / "run"),
            "--dtype", "float32", "--opt", "num_layers=1", "--opt", "block_size=4", "--opt", "num_anchors=8",
            "--opt", "mask_token_id=4", "--lr", "3e-3", "--save-every", "4", "--eval-prompts", "1", "--steps", "8",
            "--sequences-per-step", "4", "--sequences-per-forward", "3", "--no-progress"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    history = json.loads((tmp_path / "run" / "trainer_state.json").read_text())["history"]
    assert [h["step"] for h in history] == [4, 8] and history[-1]["loss"] < history[0]["loss"]
    bad = CliRunner().invoke(main, args[:-2] + ["0", "--no-progress"])
    assert bad.exit_code == 2 and "--sequences-per-forward" in bad.output


def test_a_draft_with_sliding_window_layers_is_refused(tmp_path):
    from specdec_dflash.checkpoint import save_draft
    from specdec_dflash.model import DFlashConfig, DFlashDraftModel

    target = TargetModel(tiny_model("llama", seed=4), tiny_tokenizer())
    config = DFlashConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, intermediate_size=48, block_size=4, mask_token_id=4, target_layer_ids=[0, 2],
                          num_target_layers=4, vocab_size=128, rope_theta=10000.0, sliding_window=16)
    save_draft(DFlashDraftModel(config), tmp_path / "windowed")
    with pytest.raises(SpecdecError, match="sliding-window layers"):
        DFlashObjective(DFlashObjective.Config(), target, init=tmp_path / "windowed")
