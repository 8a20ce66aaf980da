"""`specdec check` / check_lossless: pass on built-in proposers, fail (position named) on broken ones."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import save_tiny_model, tiny_model, tiny_tokenizer
from helpers import RandomProposer

from specdec import DecodeState, Draft, Proposer, SpeculativeDecoder, Verdict, Verifier
from specdec.check import (
    NearTieJudge,
    Prompt,
    TurnResult,
    check_lossless,
    first_divergence,
    read_prompts_jsonl,
)
from specdec.cli import main
from specdec.plugins import get_registry


def words(*ids: int) -> str:
    return " ".join(f"w{i}" for i in ids)


PROMPTS = [words(5, 6, 7, 5, 6, 7, 5), [3, 4, 5, 3, 4],
           Prompt(id="two-turn", turns=[words(9, 10), words(11, 12, 9)])]


class AcceptAllVerifier(Verifier):
    """Broken on purpose: accepts every draft token, then appends the target's token after the last one."""

    name = "greedy"

    def verify(self, target_logits, draft, sampling, generator):
        bonus = target_logits[:, -1].argmax(dim=-1, keepdim=True)
        emitted = torch.cat([draft.tokens.to(bonus.dtype), bonus], dim=1)
        return Verdict(num_accepted=torch.full((draft.tokens.shape[0],), draft.num_tokens), emitted=emitted)


class MutatingProposer(Proposer):
    """Broken on purpose: builds its draft in place in state.tokens, overwriting the last committed token."""

    name = "test-mutating"

    def propose(self, state: DecodeState) -> Draft:
        tokens = state.tokens  # a view of the engine's buffer, not a copy
        tokens[:, -1] = (tokens[:, -1] + 1) % self.target.vocab_size
        return Draft(tokens=tokens[:, -1:].clone())


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=1)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Target and draft saved as transformers folders (with the tokenizer), for --model/--draft."""
    root = tmp_path_factory.mktemp("check-models")
    return {"target": save_tiny_model(root / "target", seed=1),
            "draft": save_tiny_model(root / "draft", layers=1, hidden=16, heads=2, kv_heads=1, seed=9)}


@pytest.mark.parametrize("proposer,options", [("autoregressive", {}), ("ngram", {}),
                                              ("ngram", {"num_tokens": 2, "min_n": 1, "max_n": 1}),
                                              ("draft", {"num_tokens": 3})])
def test_builtin_proposers_pass(model, tokenizer, folders, proposer, options):
    if proposer == "draft":
        options = {**options, "draft": folders["draft"]}
    decoder = SpeculativeDecoder.from_model(model, tokenizer, proposer=proposer, **options)
    report = check_lossless(decoder, PROMPTS, max_new_tokens=16)
    assert report.passed, [report.describe(r, tokenizer) for r in report.failures]
    assert [r.status for r in report.results] == ["exact"] * len(PROMPTS)
    assert len(report.results[2].candidate) == 2  # both turns ran, turn 2 after the decoder's own answer
    assert report.to_dict()["passed"] is True
    proposed = sum(n for r in report.results for t in r.candidate for n in t.stats.proposed_per_position)
    assert (proposed > 0) == (proposer != "autoregressive")  # it really proposed (a random draft rarely hits)
    if proposer == "ngram":
        assert report.mean_acceptance_length > 1.0


def test_accept_all_verifier_fails_with_position(model, tokenizer):
    decoder = SpeculativeDecoder.from_model(model, tokenizer, proposer="autoregressive")
    decoder = SpeculativeDecoder(decoder.target, RandomProposer(RandomProposer.Config(), decoder.target))
    decoder.engine.greedy_verifier = AcceptAllVerifier()
    report = check_lossless(decoder, PROMPTS[:2], max_new_tokens=12)
    assert not report.passed
    failure = report.failures[0]
    d = failure.divergence
    assert d.position >= 1 and d.expected != d.got and not d.certified
    assert failure.reference[0].token_ids[: d.position] == failure.candidate[0].token_ids[: d.position]
    line = report.describe(failure, tokenizer)
    assert line.startswith("FAIL") and f"generated token {d.position}" in line and "float32" in line


def test_in_place_mutating_proposer_fails(model, tokenizer):
    base = SpeculativeDecoder.from_model(model, tokenizer, proposer="autoregressive")
    decoder = SpeculativeDecoder(base.target, MutatingProposer(MutatingProposer.Config(), base.target))
    report = check_lossless(decoder, PROMPTS[:1], max_new_tokens=12)
    assert not report.passed and report.failures[0].divergence.position >= 1


def test_near_tie_rule(model):
    """float32/float64: nothing is certified; bf16: certified only when the float32 gap is below epsilon."""
    prompt, expected = [5, 6, 7], [8, 9, 10]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + expected[:1]])).logits[0, -1].float()
    runner_up = int(torch.topk(logits, 2).indices[1])
    reference = [TurnResult(prompt_ids=prompt, token_ids=expected)]
    candidate = [TurnResult(prompt_ids=prompt, token_ids=[8, runner_up, 11])]
    assert first_divergence(reference, reference) is None
    assert NearTieJudge(model, epsilon=1e9).compare(reference, candidate).certified is False  # float64: exact
    bf16 = tiny_model("llama", seed=1, dtype=torch.bfloat16)
    loose = NearTieJudge(bf16, epsilon=1e9).compare(reference, candidate)
    assert (loose.turn, loose.position, loose.expected, loose.got) == (0, 1, 9, runner_up)
    assert loose.certified and loose.gap is not None and loose.top2_gap is not None
    assert NearTieJudge(bf16, epsilon=1e-9).compare(reference, candidate).certified is False
    shorter = [TurnResult(prompt_ids=prompt, token_ids=[8, 9])]
    ended = NearTieJudge(bf16, epsilon=1e9).compare(reference, shorter)
    assert ended.position == 2 and ended.got is None and not ended.certified


def test_cli_check_passes(folders, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": words(5, 6, 7, 5, 6)}) + "\n\n"
                       + json.dumps({"turns": [words(9, 10), words(11, 12)]}) + "\n")
    result = CliRunner().invoke(main, ["check", "--proposer", "ngram", "--model", folders["target"],
                                       "--prompts", str(prompts), "--max-new-tokens", "10",
                                       "--opt", "num_tokens=3"])
    assert result.exit_code == 0, result.output + result.stderr
    assert result.stdout.count("ok ") == 2
    assert "2/2 prompts lossless" in result.stderr


def test_cli_check_fails_on_broken_plugin(folders, monkeypatch):
    """A test plugin (random drafts) registered next to a broken greedy verifier: exit 1, position named."""
    registry = get_registry()
    monkeypatch.setitem(registry.proposers, "test-random", RandomProposer)
    monkeypatch.setitem(registry.origins, ("proposers", "test-random"), "tests")
    monkeypatch.setitem(registry.verifiers, "greedy", AcceptAllVerifier)
    args = ["check", "-p", "test-random", "--model", folders["target"], "-n", "12"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output + result.stderr
    assert "NOT LOSSLESS" in result.stderr and "first divergence at generated token" in result.stderr
    assert "Traceback" not in result.output + result.stderr


def test_cli_check_bad_input(folders, tmp_path, monkeypatch):
    import specdec.loading

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was validated")

    monkeypatch.setattr(specdec.loading, "load_model", no_loading)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "w5"}) + "\n" + '{"prompt": \n')
    empty_turns = tmp_path / "empty.jsonl"
    empty_turns.write_text(json.dumps({"turns": []}) + "\n")
    cases = [
        (["-p", "no-such-proposer"], "Unknown proposer 'no-such-proposer'"),
        (["-p", "ngram", "--prompts", str(bad)], f"{bad}, line 2"),
        (["-p", "ngram", "--prompts", str(empty_turns)], f"{empty_turns}, line 1"),
        (["-p", "ngram", "--prompts", str(tmp_path / "missing.jsonl")], "does not exist"),
        (["-p", "ngram", "--opt", "num_tokens=zero"], "num_tokens"),
        (["-p", "ngram", "-n", "0"], "--max-new-tokens"),
    ]
    for args, needle in cases:
        result = CliRunner().invoke(main, ["check", "--model", folders["target"], *args])
        assert result.exit_code == 2, (args, result.output, result.stderr)
        assert needle in result.stderr and "Traceback" not in result.stderr
        assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1


def test_read_prompts_jsonl_prefers_dflash_wording(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "a", "turns": ["plain"], "turns_dflash": ["paper wording"]}) + "\n")
    assert read_prompts_jsonl(path)[0].turns == ["paper wording"]
    assert read_prompts_jsonl(path, paper_turns=False)[0].turns == ["plain"]
