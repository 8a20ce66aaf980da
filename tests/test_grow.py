"""Growing a trained DFlash/DFlash2 draft: the deeper or wider draft drafts exactly what the smaller one drafted,
the trainer honours `--opt num_layers` and `--opt intermediate_size` with --init, and what was added learns."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import drafted_chains, tiny_model, tiny_train_args, train_one_layer_dflash
from safetensors.torch import load_file
from test_dflash import write_draft

from specdec import SpecdecError
from specdec.cli import main
from specdec_dflash.checkpoint import load_draft, save_draft
from specdec_dflash.dflash2_training import upgrade_to_dflash2
from specdec_dflash.grow import deepen, widen


def shallow_draft(tmp_path, kind: str):
    """A 2-layer draft of `kind` whose every part (convolutions and selector included) is not at its start."""
    folder = write_draft(tmp_path / "v1", seed=9)
    if kind == "dflash":
        return folder
    v2 = upgrade_to_dflash2(load_draft(folder, dtype=torch.float64), 2, 8, 4, 5)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in v2.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return save_draft(v2, tmp_path / "v2", dtype=torch.float64)


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_a_deepened_draft_drafts_what_the_shallow_one_drafted(tmp_path, kind):
    target = tiny_model("llama", seed=3)
    shallow_folder = shallow_draft(tmp_path, kind)
    shallow = load_draft(shallow_folder, dtype=torch.float64)
    with torch.no_grad():  # weights no float32 can hold: deepening must not round them
        for p in shallow.parameters():
            p.add_(torch.randn_like(p) * 1e-9)
    shallow_folder = save_draft(shallow, tmp_path / "shallow64", dtype=torch.float64)
    deeper = deepen(shallow, 4)
    assert len(deeper.layers) == 4 and deeper.config.num_hidden_layers == 4
    last = {k: v for k, v in shallow.layers[1].state_dict().items()}
    for layer in deeper.layers[2:]:  # copies of the last layer, their residual outputs zero
        for key, value in layer.state_dict().items():
            if key in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
                assert not value.any(), key
            else:
                assert torch.equal(value, last[key]), key
    blocks = torch.randn(1, 6, 32, dtype=torch.float64)  # [B, n, H]
    taps = torch.randn(1, 5, 64, dtype=torch.float64)  # [B, c, 2 taps x H]
    positions = torch.arange(11).unsqueeze(0)
    with torch.no_grad():  # the same bits: every new layer adds exact zeros to the residual stream
        assert torch.equal(shallow(blocks, taps, positions[:, :5], positions[:, 5:]),
                           deeper(blocks, taps, positions[:, :5], positions[:, 5:]))
    deeper_folder = save_draft(deeper, tmp_path / "deeper", dtype=torch.float64)
    assert json.loads((deeper_folder / "config.json").read_text())["num_hidden_layers"] == 4
    chains = drafted_chains(target, kind, shallow_folder)
    assert any(len(c) > 0 for c in chains)
    assert drafted_chains(target, kind, deeper_folder) == chains


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_a_widened_draft_drafts_what_the_narrow_one_drafted(tmp_path, kind):
    target = tiny_model("llama", seed=3)
    narrow = load_draft(shallow_draft(tmp_path, kind), dtype=torch.float64)
    with torch.no_grad():  # weights no float32 can hold: widening must not round them
        for p in narrow.parameters():
            p.add_(torch.randn_like(p) * 1e-9)
    narrow_folder = save_draft(narrow, tmp_path / "narrow64", dtype=torch.float64)
    units = narrow.config.intermediate_size
    wider = widen(narrow, units + 24)
    assert wider.config.intermediate_size == units + 24 and type(wider) is type(narrow)
    old = narrow.state_dict()
    for key, value in wider.state_dict().items():
        if key.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):  # [I, H]: trained rows, then fresh ones
            assert torch.equal(value[:units], old[key]) and value[units:].abs().min() > 0, key
            assert 0.5 < value[units:].std() / old[key].std() < 2, key
        elif key.endswith("mlp.down_proj.weight"):  # [H, I]: the new units write nothing
            assert torch.equal(value[:, :units], old[key]) and not value[:, units:].any(), key
        else:
            assert torch.equal(value, old[key]), key
    blocks = torch.randn(1, 6, 32, dtype=torch.float64)  # [B, n, H]
    taps = torch.randn(1, 5, 64, dtype=torch.float64)  # [B, c, 2 taps x H]
    positions = torch.arange(11).unsqueeze(0)
    with torch.no_grad():
        narrow_out = narrow(blocks, taps, positions[:, :5], positions[:, 5:])
        wider_out = wider(blocks, taps, positions[:, :5], positions[:, 5:])
    # the new units' zero columns add exact zeros, though a longer product may sum in another order
    torch.testing.assert_close(wider_out, narrow_out, rtol=1e-12, atol=1e-12)
    wider_folder = save_draft(wider, tmp_path / "wider", dtype=torch.float64)
    assert json.loads((wider_folder / "config.json").read_text())["intermediate_size"] == units + 24
    chains = drafted_chains(target, kind, narrow_folder)
    assert any(len(c) > 0 for c in chains)
    assert drafted_chains(target, kind, wider_folder) == chains
    assert widen(narrow, units) is narrow
    with pytest.raises(SpecdecError, match=f"smaller than the {units} MLP units.*intermediate_size={units} or more"):
        widen(narrow, units - 1)


def test_a_draft_is_not_cut(tmp_path):
    shallow = load_draft(write_draft(tmp_path / "v1"), dtype=torch.float64)
    assert deepen(shallow, 2) is shallow
    with pytest.raises(SpecdecError, match="fewer than the 2 layers.*num_layers=2 or more"):
        deepen(shallow, 1)


def test_training_honours_num_layers_and_intermediate_size_with_init_and_what_is_added_learns(tiny_setup):
    root, model_dir, data_dir = tiny_setup
    base = tiny_train_args(model_dir, data_dir, save_every=5)
    one = train_one_layer_dflash(root, model_dir, data_dir, steps=5, name="one")
    result = CliRunner().invoke(main, base + ["--proposer", "dflash", "--out", str(root / "two"), "--steps", "5",
                                              "--init", str(one), "--opt", "num_layers=2"])
    assert result.exit_code == 0, result.output
    config = json.loads((root / "two" / "draft" / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    weights = load_file(root / "two" / "draft" / "model.safetensors")
    assert weights["layers.1.self_attn.o_proj.weight"].float().abs().sum() > 0  # trained away from zero
    two = base + ["--proposer", "dflash", "--out", str(root / "two"), "--init", str(one), "--resume"]
    result = CliRunner().invoke(main, two + ["--steps", "10", "--opt", "num_layers=3"])
    assert result.exit_code == 2 and "resume with the --opt values the run was started with" in result.output
    result = CliRunner().invoke(main, two + ["--steps", "10", "--opt", "num_layers=2"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, base + ["--proposer", "dflash", "--out", str(root / "cut"), "--steps", "5",
                                              "--init", str(root / "two" / "draft"), "--opt", "num_layers=1"])
    assert result.exit_code == 2 and "can be deepened, not cut" in result.output
    assert not (root / "cut" / "draft").exists()
    units = json.loads((one / "config.json").read_text())["intermediate_size"]
    result = CliRunner().invoke(main, base + ["--proposer", "dflash", "--out", str(root / "wide"), "--steps", "5",
                                              "--init", str(one), "--opt", f"intermediate_size={2 * units}"])
    assert result.exit_code == 0, result.output
    assert json.loads((root / "wide" / "draft" / "config.json").read_text())["intermediate_size"] == 2 * units
    weights = load_file(root / "wide" / "draft" / "model.safetensors")
    assert weights["layers.0.mlp.down_proj.weight"][:, units:].float().abs().sum() > 0  # the new units learned
    result = CliRunner().invoke(main, base + ["--proposer", "dflash", "--out", str(root / "narrow"), "--steps", "5",
                                              "--init", str(one), "--opt", f"intermediate_size={units - 1}"])
    assert result.exit_code == 2 and "can be widened, not cut" in result.output
    assert not (root / "narrow" / "draft").exists()
