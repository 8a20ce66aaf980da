"""specdec's tap_norm (issue 24): each tapped hidden state RMS-normalised before the fusion layer. Drafted as
the full-recompute reference says, trained from the objective option, kept out of layouts that cannot hold it."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import tiny_model
from safetensors.torch import load_file
from test_dflash import chain_matches_reference, reference_logits, write_draft

from specdec import SpecdecError
from specdec.cli import main
from specdec_dflash.checkpoint import load_draft, read_config
from specdec_dflash.export import export_draft


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=3)


def test_tap_norm_drafts_as_the_reference_and_changes_the_numbers(tmp_path, target):
    folder = write_draft(tmp_path / "normed", seed=4, block_size=5, tap_norm=True)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["dflash_config"]["tap_norm"] is True  # saved where z-lab's other keys are
    assert read_config(folder).tap_norm
    weights = {k: v.double() for k, v in load_file(folder / "model.safetensors").items()}
    assert {f"tap_norms.{i}.weight" for i in range(2)} <= set(weights)
    _, seen, _ = chain_matches_reference(target, folder, cfg, weights)
    # the same weights read without the norm give other logits: the reference would catch a norm left out
    plain = {**cfg, "dflash_config": {**cfg["dflash_config"], "tap_norm": False}}
    committed = seen[0][0]
    assert not torch.allclose(reference_logits(weights, cfg, target, committed, 4),
                              reference_logits(weights, plain, target, committed, 4))


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_a_tap_normed_draft_is_not_exported_where_readers_would_skip_the_norm(tmp_path, fmt):
    folder = write_draft(tmp_path / "normed", tap_norm=True)
    with pytest.raises(SpecdecError, match="tap_norm"):
        export_draft(folder, tmp_path / "out", fmt)
    assert not (tmp_path / "out").exists()
    out = export_draft(folder, tmp_path / "zlab", "zlab")
    assert read_config(out).tap_norm and load_draft(out).tap_norms is not None


def test_normalize_taps_trains_a_draft_that_loads_and_is_refused_against_an_init_without_it(tiny_setup):
    root, model_dir, data_dir = tiny_setup
    tmp_path = root / "tap_norm"
    args = ["train", "--proposer", "dflash", "--model", model_dir, "--data", data_dir, "--dtype", "float32",
            "--steps", "2", "--eval-prompts", "1", "--no-progress", "--opt", "num_layers=1", "--opt", "block_size=4",
            "--opt", "mask_token_id=4"]
    result = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "normed"), "--opt", "normalize_taps=true"])
    assert result.exit_code == 0, result.output
    draft = load_draft(tmp_path / "normed" / "draft")
    assert draft.config.tap_norm and draft.tap_norms is not None
    result = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "plain")])
    assert result.exit_code == 0, result.output
    assert not load_draft(tmp_path / "plain" / "draft").config.tap_norm
    result = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "again"), "--init",
                                       str(tmp_path / "plain" / "draft"), "--opt", "normalize_taps=true"])
    assert result.exit_code == 2 and "normalize_taps=true" in result.output and "Traceback" not in result.output
