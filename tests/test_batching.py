"""Batched decoding: every row's output is what its prompt gives alone, whatever the proposer, the batch size,
the prompt lengths and when each row stops; bad input is refused before any row is decoded."""

from __future__ import annotations

import pytest
import torch
from conftest import plain_greedy, tiny_model
from helpers import EmptyProposer, MaxProposer, RandomProposer, RandomTreeProposer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_lossless import dflash_dirs, draft_dir, eagle_dirs, registered_cases  # noqa: F401 (fixtures)

from specdec import DecodeState, Draft, Proposer, ProposerConfig, SpeculativeDecoder, TargetModel
from specdec.errors import SpecdecError
from specdec.sampling import SamplingParams

MODELS: dict = {}


def model_for(kind: str, seed: int, eos: int | None = None):
    key = (kind, seed)
    if key not in MODELS:
        MODELS[key] = tiny_model(kind, seed=seed)
    model = MODELS[key]
    model.generation_config.eos_token_id = eos
    model.config.eos_token_id = eos
    return model


class RowOracle(Proposer):
    """Drafts each row's true greedy continuation (looked up by its prompt), cut at a per-row number of tokens,
    so that rows accept long drafts and finish at different steps."""

    name = "test-row-oracle"

    class Config(ProposerConfig):
        num_tokens: int = 5

    references: dict[tuple[int, ...], list[int]] = {}

    def propose(self, state: DecodeState) -> Draft:
        prompt = tuple(state.tokens[0, : state.prompt_length].tolist())
        done = state.length - state.prompt_length
        k = min(self.config.num_tokens - len(prompt) % 3, state.max_draft_tokens)
        return Draft(tokens=torch.tensor([self.references[prompt][done: done + k]], dtype=torch.long))


class HistoryProposer(Proposer):
    """A one-row third-party proposer with per-sequence state: it remembers what it saw and fails loudly if the
    engine ever shows it another row's tokens."""

    name = "test-history"

    def reset(self) -> None:
        self.seen: list[int] | None = None

    def prefill(self, state, target_output) -> None:
        assert target_output.logits.shape[0] == 1
        self.seen = state.tokens[0].tolist()

    def observe(self, state, verdict, target_output) -> None:
        tokens = state.tokens[0].tolist()
        assert self.seen is not None and tokens[: len(self.seen)] == self.seen, "another row's tokens"
        self.seen = tokens

    def propose(self, state: DecodeState) -> Draft:
        assert self.seen == state.tokens[0].tolist(), "another row's state"
        k = min(3, state.max_draft_tokens)
        return Draft(tokens=state.tokens[:, -k:] if k else state.tokens.new_empty(1, 0))


TEST_PROPOSERS = [(RandomProposer, {"num_tokens": 4}), (RandomProposer, {"num_tokens": 9, "seed": 3}),
                  (EmptyProposer, {}), (MaxProposer, {}), (RandomTreeProposer, {}), (HistoryProposer, {}),
                  (RowOracle, {})]

prompt_lists = st.lists(st.lists(st.integers(0, 127), min_size=1, max_size=14), min_size=1, max_size=8)


def expected_outputs(model, prompts, max_new, eos):
    return [plain_greedy(model, p, max_new, eos=eos) for p in prompts]


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["llama", "qwen3"]), seed=st.integers(0, 2), prompts=prompt_lists,
       max_new=st.integers(1, 20), batch_size=st.integers(1, 5), eos=st.one_of(st.none(), st.integers(0, 127)),
       case=st.integers(0, 100))
def test_registered_proposers_batched_match_each_prompt_alone(draft_dir, dflash_dirs, eagle_dirs, kind, seed,  # noqa: F811
                                                             prompts, max_new, batch_size, eos, case):
    model = model_for(kind, seed, eos)
    cases = registered_cases(draft_dir, dflash_dirs, eagle_dirs)
    name, options = cases[case % len(cases)]
    if name in ("dflash", "dflash2") and kind != "llama":
        name, options = "ngram", {"candidates": 3}
    decoder = SpeculativeDecoder.from_model(model, proposer=name, **options)
    outs = decoder.generate_ids(prompts, max_new_tokens=max_new, batch_size=batch_size)
    if len(prompts) == 1 and not isinstance(outs, list):
        outs = [outs]
    assert [o.token_ids for o in outs] == expected_outputs(model, prompts, max_new, eos), (name, options)


@settings(max_examples=14, deadline=None)
@given(kind=st.sampled_from(["llama", "qwen3"]), prompts=prompt_lists, max_new=st.integers(1, 24),
       batch_size=st.integers(1, 8), eos=st.one_of(st.none(), st.integers(0, 127)),
       which=st.integers(0, len(TEST_PROPOSERS) - 1))
def test_random_and_adversarial_proposers_batched(kind, prompts, max_new, batch_size, eos, which):
    model = model_for(kind, 1, eos)
    expected = expected_outputs(model, prompts, max_new, eos)
    cls, options = TEST_PROPOSERS[which]
    RowOracle.references = {tuple(p): plain_greedy(model, p, max_new + 12) for p in prompts}
    target = TargetModel(model)
    decoder = SpeculativeDecoder(target, cls(cls.Config(**options), target))
    outs = decoder.generate_ids([torch.tensor(p) for p in prompts], max_new_tokens=max_new, batch_size=batch_size)
    outs = outs if isinstance(outs, list) else [outs]
    assert [o.token_ids for o in outs] == expected
    for out, tokens in zip(outs, expected, strict=True):
        assert out.stats.num_generated_tokens == len(tokens)
        assert out.stop_reason == ("eos" if eos is not None and eos in tokens else "max_new_tokens")


def test_rows_finish_at_different_steps_and_waiting_prompts_join():
    model = model_for("llama", 0, None)
    prompts = [[1, 2, 3], [4] * 9, [5, 6], [7, 8, 9, 10, 11], [12], [13, 14, 15, 16]]
    RowOracle.references = {tuple(p): plain_greedy(model, p, 40) for p in prompts}
    target = TargetModel(model)
    decoder = SpeculativeDecoder(target, RowOracle(RowOracle.Config(num_tokens=6), target))
    outs = decoder.generate_ids(prompts, max_new_tokens=25, batch_size=2)
    assert [o.token_ids for o in outs] == [plain_greedy(model, p, 25) for p in prompts]
    steps = [o.stats.num_target_forwards for o in outs]
    assert len(set(steps)) > 1  # rows accepted different amounts, so they left at different steps
    assert len(decoder.engine._forks) == 1  # two slots: the decoder's proposer and one fork, reused


@settings(max_examples=8, deadline=None)
@given(prompts=prompt_lists, batch_size=st.integers(1, 8), seed=st.integers(0, 2**31),
       which=st.sampled_from(["autoregressive", "ngram", "ngram-tree"]), temperature=st.sampled_from([0.7, 1.0]))
def test_sampled_rows_equal_each_prompt_alone_with_the_same_seed(prompts, batch_size, seed, which, temperature):
    """A row draws from its own generator, seeded like the prompt alone: its output is that prompt's sampled
    output exactly (whose distribution test_sampling proves to be the target's). Proposers that draw only from
    the row's generator (or not at all) make the same drafts either way, given the same draft budget (the
    adaptive one cuts drafts by batch size: then the distribution is the same, test_sampling checks it)."""
    model = model_for("llama", 2, None)
    options = {"candidates": 3} if which == "ngram-tree" else {}
    decoder = SpeculativeDecoder.from_model(model, proposer=which.removesuffix("-tree"), **options)
    alone = [decoder.generate_ids(p, max_new_tokens=10, temperature=temperature, seed=seed, draft_budget=3).token_ids
             for p in prompts]
    together = decoder.generate_ids([torch.tensor(p) for p in prompts], max_new_tokens=10, temperature=temperature,
                                    seed=seed, batch_size=batch_size, draft_budget=3)
    together = together if isinstance(together, list) else [together]
    assert [o.token_ids for o in together] == alone


def test_streaming_names_each_row():
    model = model_for("llama", 0, None)
    decoder = SpeculativeDecoder.from_model(model, proposer="ngram")
    seen: dict[int, list[int]] = {}
    decoder.engine.generate_batch([torch.tensor([1, 2]), torch.tensor([3, 4, 5])], 7, SamplingParams(),
                                  batch_size=2, on_tokens=lambda i, t: seen.setdefault(i, []).extend(t))
    assert seen == {0: plain_greedy(model, [1, 2], 7), 1: plain_greedy(model, [3, 4, 5], 7)}


class Counting(Proposer):
    name = "test-counting"
    calls = 0

    def propose(self, state: DecodeState) -> Draft:
        Counting.calls += 1
        return Draft(tokens=state.tokens.new_empty(1, 0))


@pytest.mark.parametrize(("prompts", "options", "message"), [
    ([], {}, "No prompts were given"),
    ([[1, 2], [], [3]], {}, "Prompt 1 is empty"),
    ([[1, 2], [3]], {"batch_size": 0}, "batch size must be a whole number of at least 1"),
    ([[1, 2], list(range(1, 100)) * 3], {}, "Prompt 1 has 297 tokens but the model's context window is 256"),
    ([[1, 2], [3]], {"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
])
def test_bad_input_is_refused_before_any_row_is_decoded(prompts, options, message):
    model = tiny_model("llama", seed=0, max_positions=256) if "context" in message else model_for("llama", 0, None)
    target = TargetModel(model)
    Counting.calls = 0
    decoder = SpeculativeDecoder(target, Counting(Counting.Config(), target))
    options = {"max_new_tokens": 5, **options}
    with pytest.raises(SpecdecError, match=message):
        decoder.generate_ids([torch.tensor(p, dtype=torch.long) for p in prompts] if prompts else [], **options)
    assert Counting.calls == 0 and target.cache_lengths == []


@pytest.mark.parametrize(("prompts", "message"), [
    ([], "The list of prompts is empty"),
    (["a b", "   ", "c"], "Prompt 1 is empty"),
    (["a b", 7], "Prompt 1 must be a string, got int"),
])
def test_text_prompts_are_checked_by_index(prompts, message):
    from specdec.api import validate_prompts

    with pytest.raises(SpecdecError, match=message):
        validate_prompts(prompts, 8)


def test_batching_needs_a_cache_with_ragged_rows():
    model = model_for("llama", 0, None)
    decoder = SpeculativeDecoder.from_model(model, proposer="ngram", cache="dynamic")
    with pytest.raises(SpecdecError, match="Batch size 2 needs a cache that keeps rows of different lengths"):
        decoder.generate_ids([[1, 2], [3]], max_new_tokens=4, batch_size=2)
    outs = decoder.generate_ids([[1, 2], [3]], max_new_tokens=6)  # no batch size: one row at a time
    assert [o.token_ids for o in outs] == [plain_greedy(model, [1, 2], 6), plain_greedy(model, [3], 6)]


@pytest.mark.parametrize("name,options", [("dflash", {"tree_size": 0, "lookup": 0}), ("dflash", {}),
                                          ("eagle3", {"tree_size": 0}), ("eagle3", {}),
                                          ("eagle3", {"tree_size": 9, "tree_width": 3, "num_tokens": 4}),
                                          ("draft", {"num_tokens": 4})],
                         ids=["dflash-chain", "dflash-defaults", "eagle3-chain", "eagle3-tree", "eagle3-tree-wide",
                              "draft-model"])
def test_one_draft_forward_for_every_row_drafts_as_each_row_alone(draft_dir, dflash_dirs, eagle_dirs, name,  # noqa: F811
                                                                  options, monkeypatch):
    """propose_batch (one draft forward for every row, each with its own cache and context length; for
    eagle3, one per depth for every row's chain or tree; for a draft model, one per drafted token over one
    ragged draft cache) drafts what propose does row by row: with the budget pinned, each row drafts the same
    tokens (and tree) after the same committed tokens, and accepts exactly as much at every step."""
    model = model_for("llama", 1, None)
    prompts = [[7, 8, 9, 10, 7, 8, 9], [1, 2], [3, 4, 5, 6, 3, 4], [11]]
    draft = {"dflash": dflash_dirs[1], "eagle3": eagle_dirs[1], "draft": draft_dir}[name]
    decoder = SpeculativeDecoder.from_model(model, proposer=name, draft=draft, **options)
    widths: list[int] = []
    if name == "draft":  # every forward of the rows' shared draft cache, with how many rows it read
        shared = decoder.proposer.rows.draft
        rows_forward = shared.forward_last
        monkeypatch.setattr(shared, "forward_last", lambda ids, *a, **k: widths.append(ids.shape[0]) or
                            rows_forward(ids, *a, **k))
    cls, seen = type(decoder.proposer), []
    original = cls.propose_batch.__func__

    def recording(klass, proposers, states):
        drafts = original(klass, proposers, states)
        seen.extend((tuple(s.tokens[0].tolist()), d.tokens.tolist(), d.parents)
                    for s, d in zip(states, drafts, strict=True))
        return drafts

    monkeypatch.setattr(cls, "propose", lambda self, state: recording(cls, [self], [state])[0])
    monkeypatch.setattr(cls, "propose_batch", classmethod(recording))
    together = decoder.generate_ids(prompts, max_new_tokens=20, batch_size=3, draft_budget=64)
    drafted_together, seen[:] = list(seen), []
    if name == "draft":
        assert max(widths) == 3  # the rows drafted in forwards over all three
    alone = [decoder.generate_ids(p, max_new_tokens=20, draft_budget=64) for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert [o.stats.acceptance_lengths for o in together] == [o.stats.acceptance_lengths for o in alone]
    assert sorted(drafted_together) == sorted(seen) and len(seen) > len(prompts)

@pytest.mark.parametrize("name,options", [("eagle3", {"drafting": "sample"}), ("eagle3", {"drafting": "greedy"}),
                                          ("draft", {"num_tokens": 3})],
                         ids=["eagle3-sample", "eagle3-greedy", "draft-model"])
def test_sampled_rows_drafted_together_equal_each_prompt_alone(draft_dir, eagle_dirs, name, options):  # noqa: F811
    """Sampled rows drafted in one forward per depth (eagle3) or per token (a draft model) draw from their own
    generators: each row's output is the prompt's sampled output alone, with the same seed and budget."""
    model = model_for("llama", 2, None)
    prompts = [[7, 8, 9, 10, 7, 8, 9], [1, 2], [3, 4, 5, 6, 3, 4], [11], [5, 5]]
    draft = eagle_dirs[0] if name == "eagle3" else draft_dir
    decoder = SpeculativeDecoder.from_model(model, proposer=name, draft=draft, **options)
    alone = [decoder.generate_ids(p, max_new_tokens=12, temperature=0.9, seed=5, draft_budget=4).token_ids
             for p in prompts]
    together = decoder.generate_ids(prompts, max_new_tokens=12, temperature=0.9, seed=5, batch_size=4,
                                    draft_budget=4)
    assert [o.token_ids for o in together] == alone


@settings(max_examples=30, deadline=None)
@given(counts=st.lists(st.integers(0, 5), min_size=2, max_size=6), seed=st.integers(0, 2**31),
       agree=st.lists(st.integers(0, 5), min_size=6, max_size=6))
def test_greedy_verify_rows_is_verify_row_by_row(counts, seed, agree):
    """The built-in greedy verifier's batched path (one ragged kernel call) gives each row what `verify` gives
    it alone, with drafts that agree with the target's argmax for a few tokens, then not."""
    from specdec.verifiers import GreedyVerifier

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(counts), 1 + max(counts), 40, generator=gen, dtype=torch.float64)
    choice = logits.argmax(-1)
    drafts = []
    for b, k in enumerate(counts):
        tokens = torch.randint(0, 40, (1, k), generator=gen)
        tokens[0, : agree[b]] = choice[b, : min(k, agree[b])]
        drafts.append(Draft(tokens=tokens))
    verifier = GreedyVerifier()
    rows = verifier.verify_rows(logits, drafts, SamplingParams(), [None] * len(counts))
    for b, draft in enumerate(drafts):
        alone = verifier.verify(logits[b: b + 1, : draft.num_tokens + 1], draft, SamplingParams(), None)
        assert torch.equal(rows[b].num_accepted, alone.num_accepted)
        assert torch.equal(rows[b].emitted, alone.emitted)


@settings(max_examples=30, deadline=None)
@given(counts=st.lists(st.integers(0, 5), min_size=2, max_size=6), seed=st.integers(0, 2**31),
       with_probs=st.booleans(), top_p=st.sampled_from([1.0, 0.9]))
def test_rejection_verify_rows_is_verify_row_by_row(counts, seed, with_probs, top_p):
    """The rejection verifier's batched path (one ragged call, each row drawing from its own generator) gives
    each row bit for bit what `verify` gives it alone with a generator in the same state."""
    from specdec.verifiers import RejectionSamplingVerifier

    gen = torch.Generator().manual_seed(seed)
    vocab = 30
    logits = torch.randn(len(counts), 1 + max(counts), vocab, generator=gen, dtype=torch.float64)
    drafts = []
    for k in counts:
        probs = torch.softmax(torch.randn(1, k, vocab, generator=gen, dtype=torch.float64), -1) if with_probs else None
        tokens = torch.randint(0, vocab, (1, k), generator=gen) if probs is None else \
            torch.multinomial(probs[0], 1, generator=gen).T if k else torch.zeros(1, 0, dtype=torch.long)
        drafts.append(Draft(tokens=tokens.reshape(1, k), probs=probs))
    sampling = SamplingParams(temperature=0.8, top_p=top_p)
    verifier = RejectionSamplingVerifier()
    rows = verifier.verify_rows(logits, drafts, sampling, [torch.Generator().manual_seed(seed + b)
                                                           for b in range(len(counts))])
    for b, draft in enumerate(drafts):
        alone = verifier.verify(logits[b: b + 1, : draft.num_tokens + 1], draft, sampling,
                                torch.Generator().manual_seed(seed + b))
        assert torch.equal(rows[b].num_accepted, alone.num_accepted)
        assert torch.equal(rows[b].emitted, alone.emitted)


def test_a_draft_model_that_cannot_batch_drafts_each_row_with_a_cache_of_its_own(tmp_path):
    """A draft model outside specdec's own forward (a GELU Llama here: transformers' forward, rows of one
    length) cannot share one ragged cache: each row drafts with its own, and every row's output is its own."""
    draft = tiny_model("llama", layers=1, hidden=16, heads=2, kv_heads=1, seed=9)
    draft.config.hidden_act = "gelu"  # read back as a GELU MLP, which specdec's own forward does not cover
    draft.save_pretrained(tmp_path / "gelu")
    model = model_for("llama", 0, None)
    prompts = [[7, 8, 9, 10, 7, 8, 9], [1, 2], [3, 4, 5, 6, 3, 4], [11]]
    decoder = SpeculativeDecoder.from_model(model, proposer="draft", draft=str(tmp_path / "gelu"), num_tokens=3)
    assert not decoder.proposer.draft.can_batch
    outs = decoder.generate_ids(prompts, max_new_tokens=12, batch_size=3, draft_budget=3)
    assert [o.token_ids for o in outs] == expected_outputs(model, prompts, 12, None)
    assert sum(sum(o.stats.proposed_per_position) for o in outs) > 0  # the rows did draft
    # each row drafted from its own context: it accepted at every step what the prompt alone accepts
    alone = [decoder.generate_ids(p, max_new_tokens=12, draft_budget=3) for p in prompts]
    assert [o.stats.acceptance_lengths for o in outs] == [o.stats.acceptance_lengths for o in alone]
