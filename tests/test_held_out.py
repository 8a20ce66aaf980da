"""The trainer's held-out split: chosen by id hash, so data that grows by appended shards keeps its held-out
sequences (and the prompts an acceptance curve is measured on) in front; the run records which ones they were."""

from __future__ import annotations

import json

from click.testing import CliRunner
from conftest import tiny_tokenizer, tiny_train_args, write_data

from specdec.cli import main
from specdec.training.data import DataDir
from specdec.training.trainer import split_sequences


def _first_token(sequence_id: str) -> int:
    return int(sequence_id.split(":")[1], 16) % 50 + 5


def _write(data: DataDir, index: dict, first: int, count: int) -> None:
    """Append a shard of `count` sequences whose first token is read off their id (to check the pairing)."""
    ids = [f"sha256:{n:032x}" for n in range(first, first + count)]
    data.append_shard(index, ids, [([_first_token(i), 7, 8, 9], [0, 1, 1, 1]) for i in ids])


def _new_index() -> dict:
    return {"format": 2, "target": {"name_or_path": "tiny", "tokenizer_sha256": "x"}, "shards": []}


def test_growing_data_keeps_its_held_out_sequences_in_front(tmp_path):
    data, index = DataDir(tmp_path), _new_index()
    _write(data, index, 0, 300)
    train, held, held_ids = split_sequences(data, 0.05, 64)
    assert len(held) == len(held_ids) > 3 and len(train) + len(held) == 300
    assert [int(tokens[0]) for tokens, _ in held] == [_first_token(i) for i in held_ids]
    _write(data, index, 300, 300)
    _, grown_held, grown_ids = split_sequences(data, 0.05, 64)
    assert grown_ids[: len(held_ids)] == held_ids and len(grown_ids) > len(held_ids)
    assert [int(tokens[0]) for tokens, _ in grown_held] == [_first_token(i) for i in grown_ids]


def test_a_tiny_data_set_still_holds_one_out_and_names_it(tmp_path):
    data, index = DataDir(tmp_path), _new_index()
    _write(data, index, 0, 3)
    train, held, held_ids = split_sequences(data, 1e-9, 64)  # no id hashes below this fraction
    assert len(train) == 2 and held_ids == [f"sha256:{2:032x}"] and int(held[0][0][0]) == _first_token(held_ids[0])


def test_the_run_records_the_prompts_its_curve_is_measured_on(tiny_setup):
    root, model_dir, data_dir = tiny_setup
    run = root / "run-ids"
    args = tiny_train_args(model_dir, data_dir, save_every=2) + [
        "--proposer", "dflash", "--out", str(run), "--opt", "num_layers=1", "--opt", "mask_token_id=4"]
    result = CliRunner().invoke(main, args + ["--steps", "2"])
    assert result.exit_code == 0, result.output
    _, _, held_ids = split_sequences(DataDir(data_dir), 0.01, 2048)
    state = json.loads((run / "trainer_state.json").read_text())
    assert state["eval_ids"] == held_ids[:2] and state["eval_ids"]
    result = CliRunner().invoke(main, args + ["--steps", "4", "--resume"])
    assert result.exit_code == 0 and "held-out prompts differ" not in result.output
    # resumed on other data, the curve is measured on other prompts from here: said, and recorded
    other = write_data(root / "data-other", tiny_tokenizer(), [([2, 20, 3, 21, 22, 23], [0, 0, 0, 1, 1, 1])] * 5)
    other_ids = split_sequences(DataDir(other), 0.01, 2048)[2]
    assert other_ids != held_ids
    other_args = [other if arg == data_dir else arg for arg in args]
    result = CliRunner().invoke(main, other_args + ["--steps", "6", "--resume"])
    assert result.exit_code == 0 and "held-out prompts differ" in result.output
    assert json.loads((run / "trainer_state.json").read_text())["eval_ids"] == other_ids[:2]
