"""docs/plugins.md's code, run as the third-party plugin it describes: a proposer, a verifier and a command."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import install_fake_dist, plain_greedy, save_tiny_model, tiny_model

from specdec import SpeculativeDecoder
from specdec.api import default_proposer
from specdec.cli import main
from specdec.plugins import get_registry

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "plugins.md"


def guide_module() -> str:
    """The guide's Python blocks, in order: one plugin module."""
    return "\n\n".join(re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, max_positions=64)


@pytest.fixture
def guide_plugin(tmp_path, monkeypatch):
    install_fake_dist(tmp_path, "specdec-guide", "specdec_guide_plugin", guide_module(), "guide")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SPECDEC_LOAD_PLUGINS", "dflash,guide")
    get_registry.cache_clear()
    yield
    get_registry.cache_clear()


def run_cli(*args):
    return CliRunner().invoke(main, list(args))


def test_the_guide_holds_a_proposer_a_verifier_and_a_command():
    source = guide_module()
    assert "class RepeatLast(specdec.Proposer)" in source and "class FirstMismatch(specdec.Verifier)" in source
    assert "def register_commands(cli)" in source


def test_the_plugin_is_listed_with_what_each_part_declares(guide_plugin):
    rows = {(row["kind"], row["name"]): row for row in json.loads(run_cli("plugins", "--json").output)}
    assert rows[("proposer", "repeat-last")]["distribution"] == "specdec-guide 0.1"
    assert rows[("verifier", "first-mismatch")]["supports"] == ["greedy"]
    assert rows[("verifier", "rejection")]["supports"] == ["sampling", "trees"]
    assert rows[("command", "repeat-stats")]["distribution"] == "specdec-guide 0.1"
    assert rows[("command", "export")]["distribution"].startswith("specdec ")  # the dflash plugin's command
    assert rows[("proposer", "dflash2")]["default"] and rows[("proposer", "dflash2")]["default_priority"] == 110
    assert not rows[("proposer", "dflash")]["default"] and rows[("proposer", "dflash")]["default_priority"] == 100
    # which proposers draft a batch's rows in one call (propose_batch overridden) and which row by row
    assert {name: rows[("proposer", name)]["drafts_rows"] for name in ("dflash", "ngram", "repeat-last")} \
        == {"dflash": "together", "ngram": "one by one", "repeat-last": "one by one"}


def test_the_guide_proposer_and_verifier_are_lossless_together(guide_plugin, model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    decoder = SpeculativeDecoder.from_model(model, proposer="repeat-last", verifier="first-mismatch", num_tokens=3)
    assert type(decoder.engine.greedy_verifier).name == "first-mismatch"
    calls = []
    verify = decoder.engine.greedy_verifier.verify
    decoder.engine.greedy_verifier.verify = lambda *args: calls.append(1) or verify(*args)
    prompt = [2, 4, 4, 4, 3]
    out = decoder.generate_ids(prompt, max_new_tokens=12)
    assert out.token_ids == plain_greedy(model, prompt, 12)
    assert len(calls) == out.stats.num_target_forwards  # every step, the prefill's included, went through it


def test_specdec_check_runs_against_a_third_party_verifier(guide_plugin, model_dir):
    result = run_cli("check", "--proposer", "repeat-last", "--verifier", "first-mismatch", "--model", model_dir,
                     "-n", "8", "--opt", "num_tokens=2")
    assert result.exit_code == 0, result.output
    assert "5/5 prompts lossless" in result.output


def test_a_verifier_is_refused_for_what_it_does_not_support(guide_plugin, model_dir):
    for args, fragment in [
        (("--verifier", "first-mismatch", "-t", "0.7"), "'first-mismatch' is not exact for sampling"),
        (("--verifier", "rejection"), "'rejection' is not exact for greedy decoding"),
        (("--verifier", "nope"), "Unknown verifier 'nope'"),
    ]:
        result = run_cli("run", "--model", model_dir, "-p", "ngram", *args, "hi")
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], result.output


def test_the_guide_command_runs_and_refuses_bad_input(guide_plugin):
    assert run_cli("repeat-stats", "a a b").output.strip() == "1/2 words repeat the one before"
    result = run_cli("repeat-stats", "a")
    assert result.exit_code == 2 and result.output.startswith("error: TEXT needs at least two words")
    assert "repeat-stats" in run_cli("--help").output


def test_a_plugin_command_cannot_shadow_a_builtin_and_clashes_name_both(tmp_path, monkeypatch):
    command = ("import click\nimport specdec\n\n@click.command('{name}')\ndef cmd():\n    click.echo('{who}')\n\n"
               "@specdec.hookimpl\ndef register_commands(cli):\n    cli.add_command(cmd)\n")
    install_fake_dist(tmp_path, "specdec-one", "specdec_one", command.format(name="run", who="one"), "one")
    install_fake_dist(tmp_path, "specdec-two", "specdec_two", command.format(name="hello", who="two"), "two")
    install_fake_dist(tmp_path, "specdec-three", "specdec_three", command.format(name="hello", who="three"),
                      "three")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SPECDEC_LOAD_PLUGINS", "one,two")
    get_registry.cache_clear()
    try:
        assert run_cli("run", "--help").exit_code == 0 and "PROMPT" in run_cli("run", "--help").output
        lines = run_cli("hello").output.strip().splitlines()
        assert lines[-1] == "two"
        assert any("specdec-one 0.1 adds a command 'run'" in line and "hides" in line for line in lines[:-1])
        monkeypatch.setenv("SPECDEC_LOAD_PLUGINS", "two,three")
        get_registry.cache_clear()
        result = run_cli("hello")
        assert result.exit_code == 2 and "Two plugins add the command 'hello'" in result.output
    finally:
        get_registry.cache_clear()


def test_the_default_proposer_is_the_highest_priority_that_needs_no_options(monkeypatch):
    monkeypatch.setenv("SPECDEC_LOAD_PLUGINS", "dflash")
    get_registry.cache_clear()
    try:
        assert default_proposer(None) == "dflash2"  # the shipped drafts fit the embedded target
        assert default_proposer("some/other-model") == "ngram"
        monkeypatch.setenv("SPECDEC_LOAD_PLUGINS", "")
        get_registry.cache_clear()
        assert default_proposer(None) == "ngram"
    finally:
        get_registry.cache_clear()


def test_a_named_verifier_reaches_the_engine_through_from_model():
    decoder = SpeculativeDecoder.from_model(tiny_model("llama", seed=0), proposer="ngram", verifier="greedy")
    assert decoder.engine.greedy_verifier is decoder.engine.sampling_verifier
    with pytest.raises(Exception, match="not exact for sampling"):
        decoder.generate_ids([2, 4, 4], max_new_tokens=4, temperature=0.5)
