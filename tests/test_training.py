"""DFlash training: anchors and the packed attention mask against brute force, loss weights, label alignment,
a tiny end-to-end run with resume, and bad input."""

from __future__ import annotations

import json
import math

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
    # resume continues from step 20, not from scratch; the longer schedule is said, not silently taken
    result = CliRunner().invoke(main, args + ["--steps", "30", "--resume"])
    assert result.exit_code == 0, result.output
    assert "note: steps is 30 now against 20 before; the run follows 30 from here." in result.output
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
    # a piece of a run under torchrun: every rank stops after the same step (rank 0's clock decides for all)
    paused = tmp_path / "ddp-paused"
    command = proc.args[:proc.args.index("--out") + 1] + [str(paused)] + proc.args[proc.args.index("--out") + 2:]
    proc = subprocess.run(command + ["--pause-at-minutes", "1e-8"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0 and "paused after" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.loads((paused / "trainer_state.json").read_text())["step"] == 1


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


# -- issue 25: the learning-rate schedule, data ids, settings, output folders, atomic checkpoints -----------

def test_the_learning_rate_never_exceeds_the_peak():
    """Brute force over many run lengths, warm-up shares, floors and time budgets: never above `lr`, always
    never negative, rising through the warm-up and falling after it. (A 2-step run used to start at 12.5x the peak.)"""
    from specdec.training.trainer import TrainSettings, lr_at

    peak = 6e-4
    assert lr_at(0, TrainSettings(steps=2, lr=peak)) <= peak
    # long runs keep the schedule they had: linear warm-up over 4% of the steps
    assert lr_at(10, TrainSettings(steps=1000, lr=peak)) == pytest.approx(peak * 10 / 40)
    for steps in range(1, 161):
        for warmup in (0.0, 0.01, 0.04, 0.1, 0.3, 1.0):
            for floor in (0.0, 0.1, 0.5):
                for minutes, elapsed in ((None, 0.0), (1.0, 0.0), (1.0, 6.0), (1.0, 90.0)):
                    settings = TrainSettings(steps=steps, lr=peak, warmup_ratio=warmup, min_lr_ratio=floor,
                                             max_minutes=minutes)
                    lrs = [lr_at(step, settings, elapsed) for step in range(steps)]
                    assert max(lrs) <= peak and min(lrs) >= 0, (steps, warmup, floor, minutes, elapsed)
                    top = lrs.index(max(lrs))
                    assert lrs[: top + 1] == sorted(lrs[: top + 1]), (steps, warmup, floor)
                    assert lrs[top:] == sorted(lrs[top:], reverse=True), (steps, warmup, floor)


def _generating_model():
    model = tiny_model("llama", seed=5, dtype=torch.float32)
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 1
    return model


def test_data_ids_are_prompt_hashes_so_same_named_files_do_not_collide(tmp_path):
    from specdec.training.data import ID_SCHEME, generate_data, prompt_key

    model, tokenizer = _generating_model(), tiny_tokenizer()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "good.jsonl").write_text('{"prompt": "w10 w11"}\n{"prompt": "w12 w13"}\n')
    # the same stem and line numbers as a/good.jsonl, other prompts, and one prompt a/ has too
    (tmp_path / "b" / "good.jsonl").write_text('{"prompt": "w20 w21"}\n{"prompt": "w22 w23"}\n'
                                               '{"id": "x", "prompt": "w10 w11"}\n')
    out = tmp_path / "data"
    generate_data(model, tokenizer, "tiny", [str(tmp_path / "a" / "good.jsonl")], out, max_new_tokens=4,
                  batch_size=2, progress=False)
    index = generate_data(model, tokenizer, "tiny", [str(tmp_path / "b" / "good.jsonl")], out, max_new_tokens=4,
                          batch_size=2, progress=False)
    ids = [i for shard in index["shards"] for i in shard["ids"]]
    texts = ["w10 w11", "w12 w13", "w20 w21", "w22 w23"]
    assert sorted(ids) == sorted(prompt_key(t) for t in texts)  # b's new prompts were not skipped, none twice
    assert index["format"] == 2 and index["id_scheme"] == ID_SCHEME
    assert index["generation"]["prompt_files"] == [str(tmp_path / "a" / "good.jsonl"),
                                                   str(tmp_path / "b" / "good.jsonl")]
    assert prompt_key("w10 w11") != prompt_key("w10 w11 ") and prompt_key("\ud800").startswith("sha256:")


def test_a_resume_over_a_format_1_index_keeps_its_ids(tmp_path):
    """Old data directories (ids `<stem>:<line>`) resume with old ids: nothing repeated, nothing skipped, and
    the sequences are the ones a new directory gets."""
    from specdec.training.data import generate_data, read_prompts

    model, tokenizer = _generating_model(), tiny_tokenizer()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"w{10 + i} w{20 + i}"}) + "\n" for i in range(5)))
    kwargs = dict(max_new_tokens=5, batch_size=2, progress=False)
    generate_data(model, tokenizer, "tiny", [str(prompts)], tmp_path / "new", **kwargs)
    old = tmp_path / "old"
    generate_data(model, tokenizer, "tiny", [str(prompts)], old, limit=2, **kwargs)
    # rewrite it as specdec wrote format 1: old ids, no id scheme, no owner marker, no per-shard settings
    legacy = {r.key: r.id for r in read_prompts(prompts)}
    index = json.loads((old / "index.json").read_text())
    index = {"format": 1, "target": index["target"],
             "generation": {"max_new_tokens": 5, "max_prompt_tokens": 512, "temperature": 0.0,
                            "prompt_files": [str(prompts)], "shuffle_seed": 0},
             "shards": [{k: v for k, v in s.items() if k != "generation"} | {"ids": [legacy[i] for i in s["ids"]]}
                        for s in index["shards"]]}
    (old / "index.json").write_text(json.dumps(index))
    for extra in (".specdec-owner", ".specdec-lock"):
        (old / extra).unlink()
    resumed = generate_data(model, tokenizer, "tiny", [str(prompts)], old, **kwargs)
    ids = [i for shard in resumed["shards"] for i in shard["ids"]]
    assert sorted(ids) == sorted(legacy.values()) and resumed["format"] == 1
    by_text = {legacy[k]: k for k in legacy}
    new_index = DataDir(tmp_path / "new").read_index()
    new = dict(zip([i for s in new_index["shards"] for i in s["ids"]],
                   [t.tolist() for t, _ in DataDir(tmp_path / "new").sequences()], strict=True))
    assert {by_text[i]: t.tolist() for i, (t, _) in zip(ids, DataDir(old).sequences(), strict=True)} == new


def test_settings_are_recorded_per_shard_and_a_resume_with_others_is_refused(tmp_path):
    from specdec.training.data import generate_data

    model, tokenizer = _generating_model(), tiny_tokenizer()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"w{10 + i} w{20 + i}"}) + "\n" for i in range(5)))
    out = tmp_path / "data"
    index = generate_data(model, tokenizer, "tiny", [str(prompts)], out, max_new_tokens=6, batch_size=2,
                          flush_seconds=0, limit=3, progress=False)
    assert len(index["shards"]) == 2  # --flush-seconds 0: a shard after every batch
    assert all(s["generation"] == {"max_new_tokens": 6, "max_prompt_tokens": 512, "temperature": 0.0,
                                   "target": "tiny"} for s in index["shards"])
    for change, message in ((dict(max_new_tokens=7), "--max-new-tokens 6, not 7"),
                            (dict(temperature=0.5), "--temperature 0.0, not 0.5"),
                            (dict(max_prompt_tokens=64), "--max-prompt-tokens 512, not 64")):
        with pytest.raises(SpecdecError, match=message):
            generate_data(model, tokenizer, "tiny", [str(prompts)], out, **{"max_new_tokens": 6, **change})
    with pytest.raises(SpecdecError, match="--model tiny, not other"):
        generate_data(model, tokenizer, "other", [str(prompts)], out, max_new_tokens=6)
    # the CLI refuses before it loads a model (there is no model called `tiny` to load)
    result = CliRunner().invoke(main, ["data", "generate", "--prompts", str(prompts), "--out", str(out),
                                       "--model", "tiny", "--max-new-tokens", "9"])
    assert result.exit_code == 2 and "generated with --max-new-tokens 6, not 9" in result.output
    assert len(DataDir(out).read_index()["shards"]) == 2
    bad = CliRunner().invoke(main, ["data", "generate", "--prompts", str(prompts), "--out", str(out),
                                    "--flush-seconds", "-1"])
    assert bad.exit_code == 2 and "--flush-seconds" in bad.output


def test_output_folders_holding_other_files_are_refused(tiny_setup, tmp_path):
    root, model_dir, data_dir = tiny_setup
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w10 w11"}\n')
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    absent = str(tmp_path / "no-model")  # reaching the model load means the folder was accepted
    gen = ["data", "generate", "--prompts", str(prompts), "--out", str(mine), "--model", absent]
    train = ["train", "--proposer", "dflash", "--data", data_dir, "--out", str(mine), "--model", absent,
             "--opt", "mask_token_id=4", "--steps", "1"]
    for args in (gen, train):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and "holds files specdec did not write" in result.output
        assert "--overwrite" in result.output and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    result = CliRunner().invoke(main, train + ["--resume"])
    assert result.exit_code == 2 and "Nothing to resume" in result.output
    for args in (gen, train):
        result = CliRunner().invoke(main, args + ["--overwrite"])
        assert result.exit_code == 2 and "Model folder" in result.output, result.output
    assert (mine / "notes.txt").read_text() == "keep me"
    result = CliRunner().invoke(main, train[:-4] + ["--warmup-ratio", "1.5"])
    assert result.exit_code == 2 and "--warmup-ratio 1.5" in result.output
    # a damaged index in a specdec data folder is a sentence, not a traceback
    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged" / ".specdec-owner").write_text("written by specdec data generate\n")
    (tmp_path / "damaged" / "index.json").write_text('{"format": 2, "shar')
    result = CliRunner().invoke(main, gen[:5] + [str(tmp_path / "damaged"), "--model", absent])
    assert result.exit_code == 2 and "index.json is not valid JSON" in result.output


def test_a_second_writer_is_refused(tmp_path):
    from specdec.training.data import generate_data
    from specdec.training.interrupts import folder_lock

    model, tokenizer = _generating_model(), tiny_tokenizer()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w10 w11"}\n')
    out = tmp_path / "data"
    generate_data(model, tokenizer, "tiny", [str(prompts)], out, max_new_tokens=3, progress=False)
    with folder_lock(out, "data generate"):
        with pytest.raises(SpecdecError, match="Another `specdec data generate` is writing into"):
            generate_data(model, tokenizer, "tiny", [str(prompts)], out, max_new_tokens=3, progress=False)
    index = generate_data(model, tokenizer, "tiny", [str(prompts)], out, max_new_tokens=3, progress=False)
    assert len(index["shards"]) == 1


def test_a_checkpoint_killed_mid_swap_is_repaired(tmp_path):
    """A kill between the two renames of the draft swap leaves no draft/; opening the run puts the previous
    draft back (it matches the trainer state) and removes staging folders and temporary files."""
    from specdec.training.checkpoint import prepare_run_dir

    run = tmp_path / "run"
    (run / ".draft-old").mkdir(parents=True)
    (run / ".draft-old" / "config.json").write_text("{}")
    (run / ".draft-k3j2").mkdir()
    (run / ".trainer_state.safetensors.abc.tmp").write_text("half")
    (run / "trainer_state.json").write_text("{}")
    (run / "trainer_state.safetensors").write_text("")
    prepare_run_dir(run, resume=True)
    assert sorted(p.name for p in run.iterdir()) == [".specdec-owner", "draft", "trainer_state.json",
                                                     "trainer_state.safetensors"]
    assert (run / "draft" / "config.json").is_file()
    with pytest.raises(SpecdecError, match="already holds a training run; pass --resume"):
        prepare_run_dir(run, resume=False, overwrite=True)


# ---------------------------------------------------------------------------------------------------------
# Distillation from the target's distribution (issue 24).
# ---------------------------------------------------------------------------------------------------------
def test_distillation_targets_and_loss_are_their_brute_force_definition():
    """Top-k of the target's logits, softmax at the temperature over those k only; the draft's cross-entropy
    against them with the targets outside the draft vocabulary dropped and the rest renormalised."""
    from specdec_dflash.distillation import distillation_ce, soft_targets

    gen = torch.Generator().manual_seed(1)
    teacher = torch.randn(2, 3, 20, generator=gen) * 2
    probs, ids = soft_targets(teacher, 4, 0.5)
    for i in range(2):
        for j in range(3):
            row = teacher[i, j].tolist()
            best = sorted(range(20), key=lambda t: -row[t])[:4]
            assert ids[i, j].tolist() == best
            norm = sum(math.exp(row[t] / 0.5) for t in best)
            assert probs[i, j].tolist() == pytest.approx([math.exp(row[t] / 0.5) / norm for t in best], rel=1e-5)
    logits = torch.randn(2, 3, 12, generator=gen)
    draft_ids = torch.randint(0, 12, (2, 3, 4), generator=gen)
    draft_ids[0, 1, 2] = -100  # one target outside the draft vocabulary
    draft_ids[1, 2] = -100  # none inside: no loss
    loss, inside = distillation_ce(logits, probs, draft_ids)
    for i in range(2):
        for j in range(3):
            kept = [(float(probs[i, j, t]), int(draft_ids[i, j, t])) for t in range(4) if draft_ids[i, j, t] >= 0]
            assert bool(inside[i, j]) == bool(kept)
            if not kept:
                assert float(loss[i, j]) == 0
                continue
            mass = sum(p for p, _ in kept)
            log_norm = math.log(sum(math.exp(v) for v in logits[i, j].tolist()))
            expected = -sum(p / mass * (float(logits[i, j, t]) - log_norm) for p, t in kept)
            assert float(loss[i, j]) == pytest.approx(expected, rel=1e-5)


def test_distilling_the_top_token_of_a_target_on_its_own_greedy_text_is_hard_label_training():
    """On data the target wrote greedily, its top-1 token at the position before each slot's label is that
    label: distill_top_k=1 gives the hard-label loss exactly (the teacher is read at the right positions)."""
    from conftest import plain_greedy

    model = tiny_model("llama", seed=4)
    target = TargetModel(model, tiny_tokenizer())
    batch = []
    for prompt in ([2, 30, 3], [2, 7, 3, 8], [5, 6]):
        tokens = prompt + plain_greedy(model, prompt, 14)
        batch.append((torch.tensor(tokens), torch.tensor([0] * len(prompt) + [1] * 14, dtype=torch.bool)))
    losses = []
    for k in (0, 1):
        torch.manual_seed(0)
        objective = DFlashObjective(DFlashObjective.Config(num_layers=1, block_size=4, num_anchors=6, mask_token_id=4,
                                                           distill_top_k=k, distill_temperature=0.3), target)
        objective.draft.double()
        losses.append(objective.batch_loss(batch, torch.Generator().manual_seed(0))[0])
    assert losses[0] > 0 and torch.allclose(losses[1].double(), losses[0].double(), rtol=1e-6, atol=0)
    # and with several tokens it is another loss
    torch.manual_seed(0)
    objective = DFlashObjective(DFlashObjective.Config(num_layers=1, block_size=4, num_anchors=6, mask_token_id=4,
                                                       distill_top_k=5), target)
    objective.draft.double()
    assert not torch.allclose(objective.batch_loss(batch, torch.Generator().manual_seed(0))[0], losses[0])


def test_tiny_distilled_run(tiny_setup):
    root, model_dir, data_dir = tiny_setup
    run = root / "distilled"
    args = ["train", "--proposer", "dflash", "--model", model_dir, "--data", data_dir, "--out", str(run),
            "--dtype", "float32", "--opt", "num_layers=1", "--opt", "block_size=4", "--opt", "num_anchors=8",
            "--opt", "mask_token_id=4", "--opt", "distill_top_k=8", "--lr", "3e-3", "--save-every", "10",
            "--eval-prompts", "2", "--no-progress", "--steps", "20"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    history = json.loads((run / "trainer_state.json").read_text())["history"]
    assert history[-1]["loss"] < history[0]["loss"] and history[-1]["acceptance"] >= 1.0


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_draft_layers_initialised_from_target_layers(tmp_path, kind):
    """init_layers: draft layer i holds target layer init_layers[i]'s weights (and q/k norms where the target
    has them), and the draft saves, loads and drafts through the normal path, losslessly."""
    from conftest import plain_greedy

    from specdec import SpeculativeDecoder
    from specdec.backends import decoder_layers

    model = tiny_model(kind, seed=5)
    target = TargetModel(model, tiny_tokenizer())
    objective = DFlashObjective(DFlashObjective.Config(num_layers=2, block_size=4, mask_token_id=4,
                                                       init_layers=[2, 0]), target)
    layers = decoder_layers(model)
    for draft_layer, source in zip(objective.draft.layers, (2, 0), strict=True):
        theirs = layers[source].state_dict()
        for name, tensor in draft_layer.state_dict().items():
            if name in theirs:
                assert torch.equal(tensor, theirs[name].float()), (kind, name)
            elif name.endswith("_norm.weight"):  # a Llama target has no q/k norms: the draft's stay at one
                assert kind == "llama" and torch.equal(tensor, torch.ones_like(tensor))
    assert ("self_attn.q_norm.weight" in layers[0].state_dict()) == (kind == "qwen3")
    folder = objective.save_draft(tmp_path / "draft")
    decoder = SpeculativeDecoder.from_model(model, proposer="dflash", draft=str(folder), tree_size=0, lookup=0)
    assert decoder.generate_ids([2, 9, 3], max_new_tokens=12).token_ids == plain_greedy(model, [2, 9, 3], 12)


@pytest.mark.parametrize("layers,message", [([0], "names 1 target layers for a draft of 2"),
                                            ([0, 9], "names target layers \\[9\\], but the target has 4")])
def test_bad_init_layers_are_refused(layers, message):
    target = TargetModel(tiny_model("llama", seed=5), tiny_tokenizer())
    with pytest.raises(SpecdecError, match=message):
        DFlashObjective(DFlashObjective.Config(num_layers=2, block_size=4, mask_token_id=4, init_layers=layers),
                        target)


def test_a_run_resumed_elsewhere_from_its_folder_alone_repeats_the_uninterrupted_run(tiny_setup, tmp_path,
                                                                                   monkeypatch):
    """Issue 24's long runs in pieces: a run stopped mid-epoch, its folder moved (another machine), resumed
    from that folder and the data alone, ends with the loss curve and the weights of a run never stopped."""
    import os
    import shutil
    import signal

    from safetensors.torch import load_file

    root, model_dir, data_dir = tiny_setup
    common = ["train", "--proposer", "dflash", "--model", model_dir, "--data", data_dir, "--dtype", "float64",
              "--opt", "num_layers=1", "--opt", "block_size=4", "--opt", "num_anchors=8", "--opt", "mask_token_id=4",
              "--lr", "3e-3", "--save-every", "3", "--eval-prompts", "0", "--no-progress", "--steps", "14"]
    whole = tmp_path / "whole"
    assert CliRunner().invoke(main, common + ["--out", str(whole)]).exit_code == 0
    first = tmp_path / "first"
    calls, original = [], DFlashObjective.batch_loss

    def stopped_at_step_7(self, *args):  # SIGINT during step 7, as a machine's end would send it
        calls.append(1)
        if len(calls) == 7 * 2:  # two sequences a step
            os.kill(os.getpid(), signal.SIGINT)
        return original(self, *args)

    monkeypatch.setattr(DFlashObjective, "batch_loss", stopped_at_step_7)
    result = CliRunner().invoke(main, common + ["--out", str(first)])
    assert result.exit_code == 130, result.output
    monkeypatch.setattr(DFlashObjective, "batch_loss", original)
    state = json.loads((first / "trainer_state.json").read_text())
    assert state["step"] == 7 and 0 < state["position"]  # mid-epoch
    moved = tmp_path / "elsewhere" / "run"
    shutil.move(str(first), moved)
    result = CliRunner().invoke(main, common + ["--out", str(moved), "--resume"])
    assert result.exit_code == 0, result.output
    a = json.loads((whole / "trainer_state.json").read_text())["history"]
    b = json.loads((moved / "trainer_state.json").read_text())["history"]
    assert [(h["step"], h["loss"]) for h in a] == [(h["step"], h["loss"]) for h in b]
    assert [h["step"] for h in b] == [3, 6, 9, 12, 14]  # the stop's checkpoint adds no record
    wa, wb = load_file(whole / "draft" / "model.safetensors"), load_file(moved / "draft" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_init_layers_refuses_a_layer_with_parts_a_draft_layer_lacks():
    """A Qwen2 layer carries q/k/v biases: copying the rest would silently make another layer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).double().eval()
    target = TargetModel(model, tiny_tokenizer())
    with pytest.raises(SpecdecError, match="holds self_attn.k_proj.bias, which a DFlash draft layer has no place"):
        DFlashObjective(DFlashObjective.Config(num_layers=1, block_size=4, mask_token_id=4, init_layers=[1]), target)


def test_a_run_started_from_target_layers_resumes(tiny_setup, tmp_path):
    root, model_dir, data_dir = tiny_setup
    args = ["train", "--proposer", "dflash", "--model", model_dir, "--data", data_dir, "--out", str(tmp_path / "r"),
            "--dtype", "float32", "--opt", "num_layers=1", "--opt", "block_size=4", "--opt", "num_anchors=4",
            "--opt", "mask_token_id=4", "--opt", "init_layers=[2]", "--save-every", "2", "--eval-prompts", "1",
            "--no-progress"]
    assert CliRunner().invoke(main, args + ["--steps", "2"]).exit_code == 0
    result = CliRunner().invoke(main, args + ["--steps", "4", "--resume"])
    assert result.exit_code == 0, result.output


def test_a_run_paused_and_resumed_in_pieces_ends_as_the_run_never_paused(tiny_setup, tmp_path):
    """`--pause-at-minutes` ends one piece of a long run with a checkpoint; the schedule is the whole run's,
    so the pieces resumed one after the other end with the weights of the run trained in one go."""
    from safetensors.torch import load_file

    root, model_dir, data_dir = tiny_setup
    common = ["train", "--proposer", "dflash", "--model", model_dir, "--data", data_dir, "--dtype", "float64",
              "--opt", "num_layers=1", "--opt", "block_size=4", "--opt", "num_anchors=8", "--opt", "mask_token_id=4",
              "--lr", "3e-3", "--save-every", "4", "--eval-prompts", "0", "--no-progress", "--steps", "8"]
    whole, pieces = tmp_path / "whole", tmp_path / "pieces"
    assert CliRunner().invoke(main, common + ["--out", str(whole)]).exit_code == 0
    # a pause a microsecond in: the piece stops after its first step, saved, and says how to go on
    result = CliRunner().invoke(main, common + ["--out", str(pieces), "--pause-at-minutes", "1e-8"])
    assert result.exit_code == 0 and "paused after" in result.output and "--resume" in result.output
    assert json.loads((pieces / "trainer_state.json").read_text())["step"] == 1
    # a resume whose pause has already passed is refused before it trains
    result = CliRunner().invoke(main, common + ["--out", str(pieces), "--resume", "--pause-at-minutes", "1e-8"])
    assert result.exit_code == 2 and "already trained" in result.output and "later pause" in result.output
    assert json.loads((pieces / "trainer_state.json").read_text())["step"] == 1
    result = CliRunner().invoke(main, common + ["--out", str(pieces), "--resume"])
    assert result.exit_code == 0, result.output
    a = json.loads((whole / "trainer_state.json").read_text())["history"]
    b = json.loads((pieces / "trainer_state.json").read_text())["history"]
    assert [h["step"] for h in b] == [1, 4, 8]  # the pause's checkpoint is one more record
    assert [(h["step"], h["loss"], h["lr"]) for h in a] == [(h["step"], h["loss"], h["lr"]) for h in b[1:]]
    wa, wb = load_file(whole / "draft" / "model.safetensors"), load_file(pieces / "draft" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("extra, message", [
    (["--pause-at-minutes", "0"], "--pause-at-minutes 0.0 is not a finite number above 0"),
    (["--pause-at-minutes", "30", "--max-minutes", "30"], "is not before --max-minutes 30"),
])
def test_a_pause_that_cannot_happen_is_refused(tiny_setup, tmp_path, extra, message):
    root, model_dir, data_dir = tiny_setup
    result = CliRunner().invoke(main, ["train", "--proposer", "dflash", "--model", model_dir, "--data", data_dir,
                                       "--out", str(tmp_path / "r"), "--steps", "2"] + extra)
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("proposer,options", [
    ("dflash", ["--opt", "num_layers=1", "--opt", "block_size=4", "--opt", "num_anchors=8",
                "--opt", "mask_token_id=4"]),
    ("eagle3", ["--opt", "ttt_steps=2"]),
])
def test_a_run_reading_kept_taps_trains_as_the_run_computing_them(tiny_setup, tmp_path, monkeypatch, proposer,
                                                                  options):
    """--tap-cache: each training sequence's taps are computed once and read in later epochs; the run's losses
    and weights are the uncached run's (float64: a sequence's taps computed beside another sequence may round
    differently in the last bits, nothing more)."""
    from safetensors.torch import load_file

    root, model_dir, data_dir = tiny_setup
    common = ["train", "--proposer", proposer, "--model", model_dir, "--data", data_dir, "--dtype", "float64",
              *options, "--lr", "3e-3", "--save-every", "4", "--eval-prompts", "0", "--no-progress",
              "--steps", "16"]
    forwards = []
    original = TargetModel.tap_hidden_states
    monkeypatch.setattr(TargetModel, "tap_hidden_states",
                        lambda self, ids, *a, **k: forwards.append(ids.shape[0]) or original(self, ids, *a, **k))
    assert CliRunner().invoke(main, common + ["--out", str(tmp_path / "online")]).exit_code == 0
    online = sum(forwards)
    forwards.clear()
    cache = tmp_path / "taps"
    result = CliRunner().invoke(main, common + ["--out", str(tmp_path / "kept"), "--tap-cache", str(cache)])
    assert result.exit_code == 0, result.output
    stored = list(cache.glob("*/*.safetensors"))
    assert online == 32 and sum(forwards) == len(stored) < 16  # each sequence through the target once
    a = json.loads((tmp_path / "online" / "trainer_state.json").read_text())["history"]
    b = json.loads((tmp_path / "kept" / "trainer_state.json").read_text())["history"]
    assert [h["step"] for h in a] == [h["step"] for h in b]
    assert [h["loss"] for h in b] == pytest.approx([h["loss"] for h in a], rel=1e-9)
    wa = load_file(tmp_path / "online" / "draft" / "model.safetensors")
    wb = load_file(tmp_path / "kept" / "draft" / "model.safetensors")
    assert all(torch.allclose(wa[k], wb[k], rtol=0, atol=1e-9) for k in wa)
    # a second run over the same store reads every sequence's taps and runs no target forward for them
    forwards.clear()
    result = CliRunner().invoke(main, common + ["--out", str(tmp_path / "again"), "--tap-cache", str(cache)])
    assert result.exit_code == 0 and not forwards, result.output


def test_kept_taps_of_another_target_or_with_distillation_are_refused(tiny_setup, tmp_path):
    import shutil

    from transformers import AutoModelForCausalLM

    root, model_dir, data_dir = tiny_setup
    common = ["train", "--proposer", "dflash", "--data", data_dir, "--dtype", "float64", "--opt", "num_layers=1",
              "--opt", "block_size=4", "--opt", "num_anchors=4", "--opt", "mask_token_id=4", "--save-every", "2",
              "--eval-prompts", "0", "--no-progress", "--steps", "2", "--tap-cache", str(tmp_path / "taps")]
    assert CliRunner().invoke(main, common + ["--model", model_dir, "--out", str(tmp_path / "a")]).exit_code == 0
    # the same target loaded from elsewhere is the same target
    copy = tmp_path / "copy"
    shutil.copytree(model_dir, copy)
    result = CliRunner().invoke(main, common + ["--model", str(copy) + "/", "--out", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    # one deep weight changed, embeddings and config alike: another target
    model = AutoModelForCausalLM.from_pretrained(copy)
    with torch.no_grad():
        model.model.layers[-1].mlp.down_proj.weight[3, 5] += 0.5
    model.save_pretrained(tmp_path / "tuned")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (copy / name).exists():
            shutil.copy(copy / name, tmp_path / "tuned" / name)
    result = CliRunner().invoke(main, common + ["--model", str(tmp_path / "tuned"), "--out", str(tmp_path / "c")])
    assert result.exit_code == 2 and "holds taps of another target or layers (target differ)" in result.output, \
        result.output
    result = CliRunner().invoke(main, common + ["--model", model_dir, "--out", str(tmp_path / "d"), "--opt",
                                                "distill_top_k=4"])
    assert result.exit_code == 2 and "distillation (distill_top_k)" in result.output, result.output
    with pytest.MonkeyPatch.context() as patch:  # an objective that reads the target's taps its own way
        patch.setattr(DFlashObjective, "keeps_taps", False)
        result = CliRunner().invoke(main, common + ["--model", model_dir, "--out", str(tmp_path / "d")])
    assert result.exit_code == 2 and "reads the target's taps its own way" in result.output, result.output
    (tmp_path / "taps" / "meta.json").unlink()  # files whose target nobody can tell any more
    result = CliRunner().invoke(main, common + ["--model", model_dir, "--out", str(tmp_path / "e")])
    assert result.exit_code == 2 and "holds files but no meta.json" in result.output, result.output
    assert not any((tmp_path / run / "draft").exists() for run in "cde")


def test_the_tap_store_gives_the_targets_taps_in_the_order_asked(tmp_path):
    """Layers asked out of order, a batch mixing sequences kept earlier (computed beside other sequences) and
    new ones, an unreadable file computed again: the target's own taps, exactly where shapes allow."""
    from specdec.training.tap_store import TapStore

    target = TargetModel(tiny_model("llama", seed=2))
    target.request_taps([2, 0])
    store = TapStore(tmp_path / "taps", target, target.tap_ids)
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(5, 100, (n,), generator=gen) for n in (9, 4, 7)]

    def batch(chosen):
        width = max(rows[i].numel() for i in chosen)
        tokens = torch.zeros(len(chosen), width, dtype=torch.long)
        for j, i in enumerate(chosen):
            tokens[j, : rows[i].numel()] = rows[i]
        return tokens, [rows[i].numel() for i in chosen]

    tokens, lengths = batch([0, 1])
    first = store.tapped(target, tokens, lengths, [2, 0])
    expected = target.tap_hidden_states(tokens).tapped([2, 0])
    assert torch.equal(first[0], expected[0]) and torch.equal(first[1, :4], expected[1, :4])
    assert (first[1, 4:] == 0).all() and store.writes == 2 and store.reads == 0
    tokens, lengths = batch([2, 0, 1])  # sequence 2 is new; 0 and 1 are read back as they were computed
    mixed = store.tapped(target, tokens, lengths, [0, 2])
    new = target.tap_hidden_states(rows[2].unsqueeze(0)).tapped([0, 2])  # the forward over the missing row
    assert torch.equal(mixed[0, :7], new[0]) and (mixed[0, 7:] == 0).all()
    assert store.writes == 3 and store.reads == 2
    assert torch.equal(mixed[1, :9], torch.cat([first[0, :, 32:], first[0, :, :32]], dim=-1))
    alone = target.tap_hidden_states(tokens).tapped([0, 2])
    torch.testing.assert_close(mixed[2, :4], alone[2, :4], rtol=0, atol=1e-12)  # another batch: rounding only
    broken = next(store.folder.glob("*/*.safetensors"))
    broken.write_bytes(b"not a safetensors file")
    again = store.tapped(target, tokens, lengths, [0, 2])
    assert torch.equal(again, mixed) or torch.allclose(again, mixed, rtol=0, atol=1e-12)
    assert store.writes == 4 and not list(store.folder.glob("*/.*.tmp"))
    with pytest.raises(ValueError, match=r"holds layers \[0, 2\], not all of \[1\]"):
        store.tapped(target, tokens, lengths, [1])
