"""The CLI: JSON contract, plugins listing, third-party plugins, and every kind of bad input."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner
from conftest import install_fake_dist, plain_greedy, save_tiny_model, tiny_model

from specdec.cli import main
from specdec.plugins import get_registry


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, max_positions=64)


def run_cli(*args):
    return CliRunner().invoke(main, list(args))


def assert_clean_error(result, *fragments):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    message = result.output.strip().splitlines()
    assert len(message) == 1 and message[0].startswith("error: "), result.output
    for fragment in fragments:
        assert fragment in message[0], message[0]


def test_run_json_contract_and_lossless(model_dir):
    result = run_cli("run", "--model", model_dir, "--proposer", "ngram", "--dtype", "float32", "--json",
                     "-n", "12", "w5 w6 w7 w5 w6")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert set(out) == {"text", "token_ids", "stats", "stop_reason"}  # stop_reason: issue 25 item 7
    assert set(out["stats"]) == {"num_generated_tokens", "num_target_forwards", "mean_acceptance_length",
                                 "acceptance_lengths", "tokens_per_second", "wall_seconds"}
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompt = [2, 5, 6, 7, 5, 6, 3]  # the chat template wraps the user message in w2 ... w3
    assert out["token_ids"] == plain_greedy(model, prompt, 12)
    assert out["stats"]["num_generated_tokens"] == 12


def test_raw_skips_the_chat_template(model_dir):
    result = run_cli("run", "--model", model_dir, "-p", "autoregressive", "--raw", "--json", "-n", "5", "w9 w8")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert json.loads(result.output)["token_ids"] == plain_greedy(model, [9, 8], 5)


def test_unknown_proposer_lists_known(model_dir):
    assert_clean_error(run_cli("run", "--model", model_dir, "-p", "nope", "hi"), "Unknown proposer 'nope'",
                       "ngram", "autoregressive")


def test_unknown_cache_lists_known(model_dir):
    assert_clean_error(run_cli("run", "--model", model_dir, "--cache", "paged", "hi"), "Unknown cache 'paged'",
                       "dynamic", "native")


def test_both_caches_give_the_same_tokens(model_dir):
    ids = [json.loads(run_cli("run", "--model", model_dir, "-p", "ngram", "--cache", cache, "--json", "-n", "12",
                              "w5 w6 w7 w5 w6").output)["token_ids"] for cache in ("native", "dynamic")]
    assert ids[0] == ids[1] and len(ids[0]) == 12


def test_unknown_option(model_dir):
    assert_clean_error(run_cli("run", "--model", model_dir, "-p", "ngram", "--opt", "speed=9", "hi"),
                       "Unknown option 'speed'", "num_tokens")


def test_invalid_option_value(model_dir):
    assert_clean_error(run_cli("run", "--model", model_dir, "-p", "ngram", "--opt", "num_tokens=0", "hi"),
                       "Invalid option 'num_tokens'", "greater than or equal to 1")


def test_malformed_option(model_dir):
    assert_clean_error(run_cli("run", "--model", model_dir, "-p", "ngram", "--opt", "num_tokens", "hi"),
                       "key=value")


def test_empty_prompt(model_dir):
    assert_clean_error(run_cli("run", "--model", model_dir, "  "), "prompt is empty")


def test_max_new_tokens_below_one(model_dir):
    assert_clean_error(run_cli("run", "--model", model_dir, "-n", "0", "hi"), "--max-new-tokens must be at least 1")


def test_prompt_past_the_context_window(model_dir):
    prompt = " ".join(f"w{i % 100 + 5}" for i in range(80))
    assert_clean_error(run_cli("run", "--model", model_dir, "-p", "ngram", prompt), "context window is 64")


def test_missing_model_folder():
    assert_clean_error(run_cli("run", "--model", "./no/such/folder", "hi"), "does not exist")


def test_draft_with_another_vocabulary(model_dir, tmp_path):
    other = save_tiny_model(tmp_path / "other", vocab=64, with_tokenizer=False, layers=1)
    assert_clean_error(run_cli("run", "--model", model_dir, "-p", "draft", "--draft", other, "hi"),
                       "vocabulary of 64 tokens but the target has 128")


def test_dflash_without_a_draft_for_a_custom_target(model_dir):
    result = run_cli("run", "--model", model_dir, "-p", "dflash", "hi")
    assert_clean_error(result, "needs a draft checkpoint")


def test_eagle3_without_a_draft_for_a_custom_target(model_dir):
    assert_clean_error(run_cli("run", "--model", model_dir, "-p", "eagle3", "hi"), "needs a draft checkpoint")


def test_a_draft_of_the_other_kind_is_named(model_dir, tmp_path):
    from specdec_dflash.checkpoint import save_draft as save_dflash
    from specdec_dflash.model import DFlashConfig, DFlashDraftModel
    from specdec_eagle.checkpoint import save_draft as save_eagle
    from specdec_eagle.model import Eagle3Config, Eagle3DraftModel

    dflash = DFlashConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, intermediate_size=48, mask_token_id=5, target_layer_ids=[1],
                          num_target_layers=4, vocab_size=128)
    save_dflash(DFlashDraftModel(dflash), tmp_path / "dflash")
    eagle = Eagle3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         intermediate_size=48, vocab_size=128, draft_vocab_size=128, target_layer_ids=[0, 1, 3],
                         num_target_layers=4)
    save_eagle(Eagle3DraftModel(eagle), tmp_path / "eagle")
    assert_clean_error(run_cli("run", "--model", model_dir, "-p", "eagle3", "--draft", str(tmp_path / "dflash"),
                               "hi"), "holds a DFlash draft, not an EAGLE-3 one; use --proposer dflash")
    assert_clean_error(run_cli("run", "--model", model_dir, "-p", "dflash", "--draft", str(tmp_path / "eagle"),
                               "hi"), "holds an EAGLE draft, not a DFlash one; use --proposer eagle3")


# -- third-party plugins through the entry-point group ------------------------------------------------------
PLUGIN = textwrap.dedent('''
    import torch
    import specdec

    class Echo(specdec.Proposer):
        """Proposes the last token again: a legitimate (if weak) proposer."""
        name = "echo"
        description = "repeats the last token"
        class Config(specdec.ProposerConfig):
            num_tokens: int = 2
        def propose(self, state):
            k = min(self.config.num_tokens, state.max_draft_tokens)
            return specdec.Draft(tokens=state.tokens[:, -1:].repeat(1, k))

    class WrongShape(specdec.Proposer):
        name = "bad-shape"
        def propose(self, state):
            return specdec.Draft(tokens=torch.zeros(3, dtype=torch.long))

    class OutOfRange(specdec.Proposer):
        name = "bad-ids"
        def propose(self, state):
            return specdec.Draft(tokens=torch.full((1, 1), 10**6, dtype=torch.long))

    class TooMany(specdec.Proposer):
        name = "bad-count"
        def propose(self, state):
            return specdec.Draft(tokens=torch.zeros(1, state.max_draft_tokens + 1, dtype=torch.long))

    @specdec.hookimpl
    def register_proposers(register):
        for cls in (Echo, WrongShape, OutOfRange, TooMany):
            register(cls)
''')


@pytest.fixture
def plugin_path(tmp_path, monkeypatch):
    install_fake_dist(tmp_path, "specdec-echo", "specdec_echo_plugin", PLUGIN, "echo")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SPECDEC_LOAD_PLUGINS", "dflash,echo")
    get_registry.cache_clear()
    yield tmp_path
    get_registry.cache_clear()


def test_third_party_plugin_is_listed_and_works(plugin_path, model_dir):
    listing = json.loads(run_cli("plugins", "--json").output)
    echo = next(row for row in listing if row["name"] == "echo")
    assert echo["distribution"] == "specdec-echo 0.1" and echo["options"]["num_tokens"]["default"] == 2
    assert {"ngram", "autoregressive", "draft", "dflash"} <= {row["name"] for row in listing}
    assert "eagle3" not in {row["name"] for row in listing}  # not in SPECDEC_LOAD_PLUGINS
    result = run_cli("run", "--model", model_dir, "-p", "echo", "--json", "-n", "10", "w4 w4 w4")
    assert result.exit_code == 0, result.output
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert json.loads(result.output)["token_ids"] == plain_greedy(model, [2, 4, 4, 4, 3], 10)


@pytest.mark.parametrize("name,fragment", [
    ("bad-shape", "returned draft tokens of shape (3,)"),
    ("bad-ids", "outside the vocabulary [0, 128)"),
    ("bad-count", "were allowed"),
])
def test_broken_proposers_are_named(plugin_path, model_dir, name, fragment):
    result = run_cli("run", "--model", model_dir, "-p", name, "-n", "6", "w4 w5")
    assert_clean_error(result, f"Proposer '{name}'", fragment)


def test_allowlist_keeps_tests_hermetic(plugin_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_LOAD_PLUGINS", "")
    get_registry.cache_clear()
    assert "echo" not in get_registry().proposers and "dflash" not in get_registry().proposers
    assert "ngram" in get_registry().proposers  # built-ins always load


def test_duplicate_names_name_both_distributions(plugin_path, monkeypatch):
    source = PLUGIN.replace('name = "echo"', 'name = "ngram"')
    install_fake_dist(plugin_path, "specdec-clash", "specdec_clash_plugin", source, "clash")
    monkeypatch.setenv("SPECDEC_LOAD_PLUGINS", "clash")
    get_registry.cache_clear()
    from specdec.errors import PluginError

    with pytest.raises(PluginError, match=r"'ngram': specdec \(built-in\) and specdec-clash 0.1"):
        get_registry()


def test_plugin_that_fails_to_import_warns_and_others_work(plugin_path, monkeypatch):
    install_fake_dist(plugin_path, "specdec-broken", "specdec_broken_plugin", "raise ImportError('no numpy 9')\n",
                      "broken")
    monkeypatch.setenv("SPECDEC_LOAD_PLUGINS", "broken,echo")
    get_registry.cache_clear()
    with pytest.warns(UserWarning, match="'broken' .*specdec-broken 0.1.*no numpy 9"):
        registry = get_registry()
    assert "echo" in registry.proposers and "ngram" in registry.proposers


def test_console_script_exit_code_and_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "run", "-p", "nope", "hi"], capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: Unknown proposer 'nope'")


def test_python_api_engine_names_plugin():
    from specdec import PluginError, SpeculativeDecoder, TargetModel

    class Bad(__import__("specdec").Proposer):
        name = "inline-bad"

        def propose(self, state):
            import torch

            return __import__("specdec").Draft(tokens=torch.zeros(1, 2, 1, dtype=torch.long))

    target = TargetModel(tiny_model("llama", seed=0))
    decoder = SpeculativeDecoder(target, Bad(Bad.Config(), target))
    with pytest.raises(PluginError, match="Proposer 'inline-bad'"):
        decoder.generate_ids([1, 2], max_new_tokens=4)


# -- issue 25: one sentence for every bad input, the top level, stop_reason, the Python API's smaller cases ----

def test_json_carries_stop_reason(model_dir):
    result = run_cli("run", "--model", model_dir, "-p", "ngram", "--json", "-n", "3", "w5 w6")
    out = json.loads(result.output)
    assert out["stop_reason"] == "max_new_tokens" and len(out["token_ids"]) == 3
    long_prompt = " ".join(f"w{i % 5 + 5}" for i in range(60))  # 60 of the 64 positions (one token a word)
    out = json.loads(run_cli("run", "--model", model_dir, "-p", "ngram", "--json", "--raw", "-n", "20",
                             long_prompt).output)
    assert out["stop_reason"] == "context" and len(out["token_ids"]) == 4


def test_stop_given_as_one_string_is_one_stop_string(model_dir):
    from specdec import SpeculativeDecoder

    decoder = SpeculativeDecoder.from_pretrained(model_dir, proposer="ngram", dtype="float32", device="cpu")
    free = decoder.generate("w5 w6", max_new_tokens=6)
    second = free.text.split()[1]  # e.g. "w68": as characters, "w" would stop at the first token
    out = decoder.generate("w5 w6", max_new_tokens=6, stop=second)
    assert out.token_ids == free.token_ids[:2] and out.stop_reason == "stop_string"
    ids = decoder.encode_prompt("w5 w6")[0].tolist()
    assert decoder.generate_ids(ids, max_new_tokens=6, stop=second).token_ids == free.token_ids[:2]


def test_generate_a_list_of_prompts_gives_one_output_each(model_dir):
    from specdec import SpecdecError, SpeculativeDecoder

    decoder = SpeculativeDecoder.from_pretrained(model_dir, proposer="ngram", dtype="float32", device="cpu")
    outs = decoder.generate(["w5", "w6 w7"], max_new_tokens=4)
    assert [o.token_ids for o in outs] == [decoder.generate(p, max_new_tokens=4).token_ids for p in ["w5", "w6 w7"]]
    with pytest.raises(SpecdecError, match="Prompt 1 is not valid UTF-8"):
        decoder.generate(["w5", "w5 \udcff"])
    with pytest.raises(SpecdecError, match="The prompt is not valid UTF-8"):
        decoder.generate("w5 \udcff")


def test_temperature_must_be_finite(model_dir):
    from specdec import SpecdecError
    from specdec.sampling import SamplingParams

    for bad in (float("inf"), float("nan"), -1.0):
        with pytest.raises(SpecdecError, match="temperature must be a finite number >= 0"):
            SamplingParams(temperature=bad)
    for value in ("inf", "nan", "-inf", "-0.5"):
        assert_clean_error(run_cli("run", "--model", model_dir, "--temperature", value, "hi"), "--temperature")


@pytest.mark.parametrize("option,value,fragment", [
    ("--top-k", "-1", "--top-k must be at least 0"),
    ("--top-k", str(2**40), "--top-k must be at most"),
    ("--top-p", "0", "--top-p must be in (0, 1]"),
    ("--top-p", "1.5", "--top-p must be in (0, 1]"),
    ("--top-p", "nan", "--top-p must be in (0, 1]"),
    ("--seed", "-1", "--seed must be between 0 and"),
    ("--seed", str(2**64), "--seed must be between 0 and"),
    ("-n", str(10**30), "--max-new-tokens must be at most"),
    ("-n", "-3", "--max-new-tokens must be at least 1"),
    ("-n", "many", "'many' is not a valid integer"),
])
def test_numeric_options_at_their_extremes(model_dir, option, value, fragment):
    assert_clean_error(run_cli("run", "--model", model_dir, option, value, "hi"), fragment)


def test_devices_that_are_not_there(model_dir):
    import torch

    bad = ["tpu", "gpu", "cuda:-1", "meta"]
    bad += [f"cuda:{torch.cuda.device_count()}"] if torch.cuda.is_available() else ["cuda", "cuda:7"]
    for device in bad:
        assert_clean_error(run_cli("run", "--model", model_dir, "--device", device, "hi"), f"Device '{device}'")
        assert_clean_error(run_cli("check", "-p", "ngram", "--model", model_dir, "--device", device),
                           f"Device '{device}'")


def test_prompt_that_is_not_utf8(model_dir):
    # a command-line byte that is not UTF-8 reaches Python as a lone surrogate (surrogateescape)
    assert_clean_error(run_cli("run", "--model", model_dir, "w5 \udcff w6"), "prompt is not valid UTF-8", "0xff")


def _copy_model(model_dir, tmp_path):
    import shutil

    return shutil.copytree(model_dir, tmp_path / "copy")


def test_target_with_remote_code_is_refused_unrun(model_dir, tmp_path):
    folder = _copy_model(model_dir, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    assert_clean_error(run_cli("run", "--model", str(folder), "hi"), "auto_map", "never runs remote code")
    assert not (tmp_path / "ran").exists()


def test_target_with_only_a_pickle_is_refused_unopened(model_dir, tmp_path, monkeypatch):
    import torch

    folder = _copy_model(model_dir, tmp_path)
    from safetensors.torch import load_file

    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")  # a benign pickle
    (folder / "model.safetensors").unlink()

    def refuse(*args, **kwargs):
        raise AssertionError("torch.load was called")

    monkeypatch.setattr(torch, "load", refuse)
    assert_clean_error(run_cli("run", "--model", str(folder), "hi"), "only pickle weights (pytorch_model.bin)",
                       "convert them to safetensors")


@pytest.mark.parametrize("damage,fragment", [
    ("truncated", "is truncated or corrupt"),
    ("config-not-utf8", "config.json is not valid UTF-8 (byte 0xff"),
    ("config-not-json", "config.json is not valid JSON"),
    ("tokenizer-not-json", "tokenizer.json is not valid JSON"),
])
def test_damaged_target_folder(model_dir, tmp_path, damage, fragment):
    folder = _copy_model(model_dir, tmp_path)
    if damage == "truncated":
        weights = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(weights[: len(weights) // 3])
    elif damage == "config-not-utf8":
        (folder / "config.json").write_bytes(b"{\xff}")
    elif damage == "config-not-json":
        (folder / "config.json").write_text('{"model_type": "llama",')
    else:
        (folder / "tokenizer.json").write_text("{")
    assert_clean_error(run_cli("run", "--model", str(folder), "hi"), fragment)


def test_truncated_draft_weights(model_dir, tmp_path):
    from specdec_dflash.checkpoint import save_draft
    from specdec_dflash.model import DFlashConfig, DFlashDraftModel

    config = DFlashConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, intermediate_size=48, mask_token_id=5, target_layer_ids=[1],
                          num_target_layers=4, vocab_size=128)
    save_draft(DFlashDraftModel(config), tmp_path / "draft")
    weights = (tmp_path / "draft" / "model.safetensors").read_bytes()
    (tmp_path / "draft" / "model.safetensors").write_bytes(weights[:-100])
    assert_clean_error(run_cli("run", "--model", model_dir, "-p", "dflash", "--draft", str(tmp_path / "draft"), "hi"),
                       "DFlash draft weights file", "truncated or corrupt")


def test_prompts_file_that_is_not_utf8(model_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b'{"prompt": "w5"}\n{"prompt": "w6 \xe9"}\n')
    assert_clean_error(run_cli("check", "-p", "ngram", "--model", model_dir, "--prompts", str(prompts)),
                       f"{prompts}, line 2 is not valid UTF-8 (byte 0xe9")


def test_usage_errors_are_one_line():
    assert_clean_error(run_cli("run", "--no-such-option", "hi"), "No such option", "`specdec run --help`")
    assert_clean_error(run_cli("--no-such-option"), "No such option", "`specdec --help`")
    assert_clean_error(run_cli("plugins", "surplus"), "unexpected extra argument")


def _failing_from_pretrained(exc):
    def fail(*args, **kwargs):
        raise exc

    return fail


def test_internal_error_is_one_sentence_asking_for_a_report(model_dir, monkeypatch):
    from specdec import api

    monkeypatch.setattr(api.SpeculativeDecoder, "from_pretrained", _failing_from_pretrained(RuntimeError("boom\nx")))
    result = run_cli("run", "--model", model_dir, "hi")
    assert result.exit_code == 1 and "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: internal error in `specdec run` (RuntimeError: boom x)")
    assert "bug in specdec" in lines[0] and "specdec --debug run" in lines[0]
    debug = run_cli("--debug", "run", "--model", model_dir, "hi")
    assert debug.exit_code == 1 and "Traceback (most recent call last)" in debug.output
    assert debug.output.strip().splitlines()[-1].startswith("error: internal error in `specdec run`")


def test_specdec_error_traceback_only_under_debug(model_dir):
    plain = run_cli("run", "--model", model_dir, "-p", "nope", "hi")
    assert_clean_error(plain, "Unknown proposer 'nope'")
    debug = run_cli("--debug", "run", "--model", model_dir, "-p", "nope", "hi")
    assert debug.exit_code == 2 and "Traceback (most recent call last)" in debug.output
    assert debug.output.strip().splitlines()[-1].startswith("error: Unknown proposer 'nope'")


def test_keyboard_interrupt_is_one_line(model_dir, monkeypatch):
    from specdec import api

    monkeypatch.setattr(api.SpeculativeDecoder, "from_pretrained", _failing_from_pretrained(KeyboardInterrupt()))
    result = run_cli("run", "--model", model_dir, "hi")
    assert result.exit_code == 130
    assert result.output.strip().splitlines() == ["interrupted: `specdec run` stopped (Ctrl-C)."]


def test_plugin_commands_get_the_same_top_level(monkeypatch):
    import click

    from specdec.errors import SpecdecError

    @click.command()
    def sentence():
        raise SpecdecError("The widget is missing; pass --widget.")

    @click.group()
    def tools():
        pass

    @tools.command()
    def crash():
        raise ValueError("bad state")

    commands = get_registry().commands
    monkeypatch.setitem(commands, "sentence", sentence)
    monkeypatch.setitem(commands, "tools", tools)
    assert_clean_error(run_cli("sentence"), "The widget is missing; pass --widget.")
    result = run_cli("tools", "crash")
    assert result.exit_code == 1 and result.output.strip().splitlines() == [
        "error: internal error in `specdec tools crash` (ValueError: bad state); this is a bug in specdec, please "
        "report it with the command line and the output of `specdec --debug tools crash ...`."]


def _bench_args(model_dir, tmp_path, out, *extra):
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "tiny.jsonl").write_text(json.dumps({"id": "a", "turns": ["w5 w6 w5 w6"]}) + "\n")
    return ["bench", "-d", "tiny", "--data-dir", str(data), "--model", model_dir, "-p", "ngram", "--baselines",
            "none", "-n", "3", "--no-progress", "--out", str(out), *extra]


def test_bench_out_refuses_another_runs_results_and_foreign_files(model_dir, tmp_path):
    out = tmp_path / "out"
    first = run_cli(*_bench_args(model_dir, tmp_path, out))
    assert first.exit_code == 0, first.output
    before = (out / "results.json").read_bytes()
    assert_clean_error(run_cli(*_bench_args(model_dir, tmp_path, out)), "already holds results.json", "--overwrite")
    assert (out / "results.json").read_bytes() == before
    again = run_cli(*_bench_args(model_dir, tmp_path, out, "--overwrite"))
    assert again.exit_code == 0, again.output
    assert json.loads((out / "results.json").read_text())["meta"]["timestamp"]
    assert not [p.name for p in out.iterdir() if p.name.startswith(".") and p.name != ".specdec-owner"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert_clean_error(run_cli(*_bench_args(model_dir, tmp_path, mine)), "already holds files specdec did not write")
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
