"""`specdec bench`: dataset lookup, validation before loading, an end-to-end run, results schema, plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import plain_greedy, save_tiny_model

from specdec import bench
from specdec.cli import main


def words(*ids: int) -> str:
    return " ".join(f"w{i}" for i in ids)


SHARED = Path(__file__).resolve().parents[2] / "shared" / "datasets"
RECORDS = [
    {"id": "rep", "turns": [words(5, 6, 7, 5, 6, 7, 5)]},
    {"id": "dflash", "turns": [words(9, 10, 11)], "turns_dflash": [words(9, 10, 11, 9, 10)]},
    {"id": "chat", "turns": [words(20, 21, 22), words(23, 20, 21)]},
]


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-models")
    target = save_tiny_model(root / "target", seed=1)
    stop_early_on_first_record(target)
    draft = save_tiny_model(root / "draft", layers=1, hidden=16, heads=2, kv_heads=1, seed=9)
    data = root / "data"
    data.mkdir()
    write_jsonl(data / "tiny.jsonl", RECORDS)
    return {"target": target, "draft": draft, "data": str(data)}


def stop_early_on_first_record(folder: str) -> None:
    """Make the 5th greedy token of the first record the model's EOS, so EOS stops are exercised."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.check import encode_messages

    model = AutoModelForCausalLM.from_pretrained(folder)
    messages = [{"role": "user", "content": RECORDS[0]["turns"][0]}]
    ids = encode_messages(AutoTokenizer.from_pretrained(folder), messages)
    model.generation_config.eos_token_id = plain_greedy(model, ids, 5)[4]
    model.generation_config.save_pretrained(folder)


@pytest.fixture
def no_loading(monkeypatch):
    import specdec.loading

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was validated")

    monkeypatch.setattr(specdec.loading, "load_model", refuse)


def test_bench_end_to_end(folders, tmp_path):
    out = tmp_path / "out"
    args = ["bench", "--dataset", "tiny", "--data-dir", folders["data"], "--model", folders["target"],
            "--proposers", "ngram,draft,ngram:one", "--draft", folders["draft"], "--opt", "draft.num_tokens=2",
            "--opt", "ngram:one.num_tokens=1", "--cache", "ngram:one=dynamic",
            "--baselines", "hf-greedy,hf-pld,hf-assisted", "--draft-model", folders["draft"],
            "--max-new-tokens", "10", "--dtype", "float32", "--out", str(out), "--no-progress"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output + result.stderr
    results = json.loads((out / "results.json").read_text())

    assert results["schema_version"] == bench.SCHEMA_VERSION
    meta = results["meta"]
    for key in ("command", "dataset", "limit", "max_new_tokens", "dtype", "model", "versions", "timestamp"):
        assert key in meta
    assert meta["dataset"]["num_prompts"] == 3 and meta["dataset"]["num_turns"] == 4
    assert meta["dtype"] == "float32" and meta["max_new_tokens"] == 10 and not meta["interrupted"]
    assert {"torch", "transformers"} <= set(meta["versions"])

    runners = results["proposers"]
    assert list(runners) == ["autoregressive", "ngram", "draft", "ngram:one", "hf-greedy", "hf-pld", "hf-assisted"]
    for name, r in runners.items():
        for key in ("mean_acceptance_length", "tokens_per_second", "speedup", "exact_match_rate",
                    "acceptance_rate_per_position", "peak_rss_mb", "time_split_seconds"):
            assert key in r, (name, key)
        assert r["num_prompts"] == 3 and r["tokens_per_second"]["median"] > 0
        # lossless: the same tokens as autoregressive, stopping at the tokenizer's EOS (w1) or at 10 a turn
        assert r["num_generated_tokens"] == runners["autoregressive"]["num_generated_tokens"] <= 4 * 10
        s = r["speedup"]["vs_autoregressive"]
        assert s["q25"] <= s["median"] <= s["q75"] and r["speedup"]["vs_hf_greedy"]["median"] > 0
        pld = r["speedup"]["vs_hf_pld"]  # paired against transformers' prompt lookup, which ran here
        assert pld["q25"] <= pld["median"] <= pld["q75"]
        assert r["exact_match_rate"] == 1.0, (name, r["divergences"])  # float32: lossless, HF agrees too
    assert runners["autoregressive"]["mean_acceptance_length"] == 1.0
    assert runners["autoregressive"]["speedup"]["vs_autoregressive"]["median"] == 1.0
    assert runners["ngram"]["mean_acceptance_length"] > 1.0
    assert len(runners["draft"]["acceptance_rate_per_position"]) == 2
    assert len(runners["ngram:one"]["acceptance_rate_per_position"]) == 1  # a second ngram, with its own options
    assert results["meta"]["proposer_options"]["ngram:one"]["num_tokens"] == 1
    # the tiny Llama runs through specdec's native forward unless a runner asks for transformers'
    assert results["meta"]["caches"] == {"autoregressive": "native", "ngram": "native", "draft": "native",
                                         "ngram:one": "dynamic"}
    assert runners["ngram:one"]["cache"] == "dynamic" and runners["hf-greedy"]["cache"] is None
    assert runners["hf-greedy"]["mean_acceptance_length"] is None
    assert runners["hf-greedy"]["time_split_seconds"] is None
    assert set(runners["ngram"]["time_split_seconds"]) == {"prefill", "propose", "verify", "other"}
    assert [p["id"] for p in results["per_prompt"]] == ["rep", "dflash", "chat"]
    stopped = {name: run["tokens"] for name, run in results["per_prompt"][0]["runs"].items()}
    assert set(stopped.values()) <= {1, 2, 3, 4, 5} and len(set(stopped.values())) == 1  # all stop at the EOS

    markdown = (out / "results.md").read_text()
    assert "| runner | mean acceptance length" in markdown and "| ngram |" in markdown
    assert "KV cache: autoregressive native, ngram native, draft native, ngram:one dynamic" in markdown
    assert "| speedup vs hf-pld |" in markdown and "| hf-pld | n/a |" in markdown
    lines = markdown.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("| runner |"))
    header, rule, first = lines[top: top + 3]
    assert header.count("|") == rule.count("|") == first.count("|")  # the optional column lines up
    # the time split per verification step: steps from the histogram, milliseconds from the seconds
    split_at = lines.index("## Time split (seconds, summed over prompts)")
    split = next(line for line in lines[split_at:] if line.startswith("| ngram |"))
    cells = [c.strip() for c in split.strip("|").split("|")]
    steps = sum(runners["ngram"]["acceptance_length_histogram"].values())
    assert int(cells[6]) == steps
    assert float(cells[7]) == pytest.approx(1e3 * runners["ngram"]["time_split_seconds"]["propose"] / steps, abs=0.006)
    for png in ("acceptance_lengths.png", "acceptance_per_position.png", "speedup.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_by_batch_size(folders, tmp_path):
    out = tmp_path / "batched"
    args = ["bench", "--dataset", "tiny", "--data-dir", folders["data"], "--model", folders["target"],
            "--proposers", "ngram,draft", "--draft", folders["draft"], "--batch-size", "1,2,3", "--rounds", "2",
            "--max-new-tokens", "8", "--dtype", "float32", "--out", str(out), "--no-progress"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output + result.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["batch_sizes"] == [1, 2, 3] and results["meta"]["dataset"]["num_prompts"] == 3
    assert results["meta"]["rounds"] == 2
    assert list(results["batched"]) == ["1", "2", "3"]
    tokens = set()
    for batch, runners in results["batched"].items():
        assert list(runners) == ["autoregressive", "ngram", "draft", "hf-greedy"]
        for name, r in runners.items():
            assert r["tokens_per_second"] > 0 and r["speedup_vs_hf_greedy"] > 0, (batch, name)
            assert len(r["tokens_per_second_rounds"]) == 2  # the median of two passes
            if name != "hf-greedy":
                assert r["exact_match_rate"] == 1.0, (batch, name)  # float32: every row as alone
                tokens.add(r["num_tokens"])
        assert runners["autoregressive"]["speedup_vs_autoregressive"] == 1.0
        assert runners["hf-greedy"]["mean_acceptance_length"] is None
    assert len(tokens) == 1  # every runner at every batch size generated the same tokens (the first record stops)
    markdown = (out / "results.md").read_text()
    assert "## Batched decoding" in markdown and "| 3 | draft |" in markdown
    for png in ("throughput_by_batch.png", "speedup_by_batch.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_interrupt_writes_finished_prompts(folders, tmp_path, monkeypatch):
    """Ctrl-C during prompt 2: prompt 1 (done by every runner) is summarised and written."""
    import specdec.loading

    plan = bench.plan_bench("tiny", "ngram", baselines="hf-greedy", data_dir=folders["data"],
                            max_new_tokens=6, dtype="float32", out=tmp_path / "partial")
    model, tokenizer = specdec.loading.load_model(folders["target"], specdec.loading.DTYPES["float32"],
                                                  specdec.loading.resolve_device("cpu"))
    calls = {"n": 0}
    real = bench.HFRunner.generate

    def interrupting(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # warm-up, prompt 1, then Ctrl-C in prompt 2
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(bench.HFRunner, "generate", interrupting)
    results = bench.run_bench(plan, model, tokenizer, show_progress=False)
    assert results["meta"]["interrupted"] and results["meta"]["dataset"]["num_prompts"] == 1
    assert all(r["num_prompts"] == 1 for r in results["proposers"].values())
    paths = bench.write_results(results, plan.out)
    assert json.loads(paths[0].read_text())["meta"]["interrupted"] is True
    assert all(r["speedup"]["vs_hf_pld"] is None for r in results["proposers"].values())  # hf-pld did not run
    assert "hf-pld" not in bench.render_markdown(results)


def test_bench_pins_the_draft_budget_for_every_specdec_runner(folders, tmp_path):
    """--draft-budget N reaches every specdec runner, per prompt and in batches: 0 is plain decoding for all."""
    for extra in ([], ["--batch-size", "2"]):
        out = tmp_path / f"pinned{len(extra)}"
        args = ["bench", "--dataset", "tiny", "--data-dir", folders["data"], "--model", folders["target"],
                "--proposers", "ngram,draft", "--draft", folders["draft"], "--baselines", "none",
                "--max-new-tokens", "8", "--dtype", "float32", "--draft-budget", "0", "--out", str(out),
                "--no-progress", *extra]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output + result.stderr
        results = json.loads((out / "results.json").read_text())
        assert results["meta"]["draft_budget"] == 0
        runners = results["batched"]["2"] if extra else results["proposers"]
        assert {name: r["mean_acceptance_length"] for name, r in runners.items()} == dict.fromkeys(runners, 1.0)
        assert "Draft budget: pinned at 0 draft tokens" in (out / "results.md").read_text()


def test_bench_bad_input(folders, tmp_path, no_loading):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps(RECORDS[1]) + "\n{not json\n")
    no_turns = write_jsonl(tmp_path / "noturns.jsonl", [{"id": "x", "question": "w5"}])
    base = ["bench", "--model", folders["target"], "--data-dir", folders["data"],
            "--out", str(tmp_path / "o")]
    cases = [
        (["-d", "no-such-set"], ["Unknown dataset 'no-such-set'", "tiny", folders["data"]]),
        (["-d", str(bad)], [f"{bad}, line 3", "not valid JSON"]),
        (["-d", str(no_turns)], [f"{no_turns}, line 1", "turns"]),
        (["-d", str(tmp_path / "missing.jsonl")], ["does not exist"]),
        (["-d", "tiny", "--limit", "0"], ["--limit must be at least 1"]),
        (["-d", "tiny", "-p", "ngram,nope"], ["Unknown proposer 'nope'", "autoregressive", "ngram"]),
        (["-d", "tiny", "-p", "hf-greedy"], ["--baselines"]),
        (["-d", "tiny", "-p", "ngram:"], ["empty label", "NAME:LABEL"]),
        (["-d", "tiny", "-p", "nope:x"], ["Unknown proposer 'nope'"]),
        (["-d", "tiny", "--baselines", "hf-magic"], ["Unknown baseline 'hf-magic'"]),
        (["-d", "tiny", "--baselines", "hf-assisted"], ["--draft-model"]),
        (["-d", "tiny", "-p", "ngram", "--opt", "ngram.num_tokens=0"], ["num_tokens"]),
        (["-d", "tiny", "-p", "ngram", "--opt", "draft.num_tokens=2"], ["not in --proposers"]),
        (["-d", "tiny", "-n", "0"], ["--max-new-tokens"]),
        (["-d", "tiny", "-p", "ngram", "--cache", "ngram=static"], ["unknown cache 'static'", "native"]),
        (["-d", "tiny", "-p", "ngram", "--cache", "draft=dynamic"], ["names runner 'draft'"]),
        (["-d", "tiny", "-p", "ngram", "--cache", "ngram"], ["RUNNER=CACHE"]),
        (["-d", "tiny", "--batch-size", "0,4"], ["'0' is not a whole number from 1 to"]),
        (["-d", "tiny", "--batch-size", "4", "--baselines", "hf-pld"], ["no batched form", "hf-greedy"]),
        (["-d", "tiny", "--rounds", "3"], ["--rounds", "--batch-size"]),
        (["-d", "tiny", "--batch-size", "4", "--rounds", "0"], ["--rounds"]),
        (["-d", "tiny", "--draft-budget", "-1"], ["--draft-budget"]),
        (["-d", "tiny", "--draft-budget", "lots"], ["--draft-budget must be auto or a whole number"]),
    ]
    for args, needles in cases:
        result = CliRunner().invoke(main, base + args)
        assert result.exit_code == 2, (args, result.output, result.stderr)
        assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
        assert "Traceback" not in result.stderr
        for needle in needles:
            assert needle in result.stderr, (needle, result.stderr)


def test_dataset_search_path(tmp_path, monkeypatch):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    write_jsonl(second / "only_b.jsonl", RECORDS[:1])
    write_jsonl(first / "both.jsonl", RECORDS[:1])
    write_jsonl(second / "both.jsonl", RECORDS)
    monkeypatch.setenv(bench.ENV_DATA_DIR, str(second))
    assert bench.resolve_dataset("only_b") == second / "only_b.jsonl"
    assert bench.resolve_dataset("both", data_dir=first) == first / "both.jsonl"  # --data-dir first
    path, prompts = bench.load_dataset("both", limit=2)
    assert path == second / "both.jsonl" and [p.id for p in prompts] == ["rep", "dflash"]
    assert prompts[1].turns == [words(9, 10, 11, 9, 10)]  # turns_dflash preferred


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/datasets is not present")
def test_shared_datasets_parse():
    _, gsm8k = bench.load_dataset(str(SHARED / "gsm8k.jsonl"), limit=2)
    assert len(gsm8k) == 2 and "\\boxed{}" in gsm8k[0].turns[0]  # the DFlash paper's wording
    _, mt_bench = bench.load_dataset(str(SHARED / "mt_bench.jsonl"))
    assert len(mt_bench) == 80 and all(len(p.turns) == 2 for p in mt_bench)


def test_plots_render_headless(tmp_path):
    stats = {"mean_acceptance_length": 2.0, "acceptance_length_histogram": {"1": 2, "3": 2},
             "acceptance_rate_per_position": [0.5, 0.5], "speedup": {
                 "vs_autoregressive": {"median": 1.5, "q25": 1.2, "q75": 1.7}, "vs_hf_greedy": None}}
    paths = bench.write_plots({"proposers": {"x": stats}}, tmp_path)
    assert [p.name for p in paths] == ["acceptance_lengths.png", "acceptance_per_position.png", "speedup.png"]
    assert all(p.stat().st_size > 1000 for p in paths)
