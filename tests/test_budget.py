"""The adaptive draft budget (specdec.budget): acceptance by draft length read off verdicts, the choice of the
draft length from forward costs, and cutting drafts to a prefix."""

from __future__ import annotations

import pytest
import torch
from conftest import plain_greedy, tiny_model

from specdec import Draft, SpeculativeDecoder, tree
from specdec.budget import DraftBudget, trim
from specdec.target import TargetModel


class ProbedTarget:
    """A stand-in target for DraftBudget.probe: records each forward's width and advances the fake `clock` by
    cost(width, n), n the forward's 1-based index."""

    def __init__(self, cost=lambda width, n: 0.0, clock: list[float] | None = None):
        self.cost, self.clock, self.widths = cost, clock if clock is not None else [0.0], []

    def forward(self, feed):
        self.widths.append(feed.shape[1])
        self.clock[0] += self.cost(feed.shape[1], len(self.widths))

    def crop(self, lengths):
        pass


def test_acceptance_by_draft_length_counts_what_a_shorter_draft_would_have_kept():
    budget = DraftBudget()
    budget.record(4, [0, 1, 2])  # a chain of 4, three accepted
    budget.record(5, [0, 3])  # a tree: node 3 (under node 0) accepted after node 0
    assert budget.expected(0) == 1.0
    assert budget.expected(1) == 2.0  # both steps keep node 0
    assert budget.expected(3) == 1 + (3 + 1) / 2  # the tree's node 3 is not within its first 3 nodes
    assert budget.expected(4) == 1 + (3 + 2) / 2
    # node 4 is told only by the tree (the one draft of 5), which did not accept it: a cut to 5 keeps what a cut to
    # 4 keeps (averaged over the steps that drafted 5, as before the product-limit estimate, it read 1 + 2 / 1)
    assert budget.expected(5) == budget.expected(4)


def test_a_whole_draft_counts_for_every_longer_cut_and_a_cut_one_does_not():
    budget = DraftBudget()
    budget.record(2, [0, 1], whole=True)  # the proposer's whole draft: 2 tokens, both accepted
    budget.record(6, [0])  # cut by the budget to 6: what more tokens would have kept is unknown
    budget.record(3, [0, 1, 2])  # cut to 3
    assert budget.expected(2) == pytest.approx(1 + (2 + 1 + 2) / 3)
    # node 2: the cut 3 accepted it, the 6 did not
    assert budget.expected(3) == pytest.approx(budget.expected(2) + 1 / 3)
    # node 3 is told by the 6 (not accepted) and the whole 2 (nothing more); not by the cut 3, whose three
    # accepted tokens still count up to 3
    assert budget.expected(4) == budget.expected(3)
    assert budget.expected(6) == budget.expected(3)
    assert budget.measured()[5] == (2, pytest.approx(2.0))


def test_acceptance_never_falls_with_the_cut_and_rows_cut_short_keep_what_they_accepted():
    """Rows cut to 4 tokens that accept all 4, beside rows drafting 8 that accept 1: a cut to 5 keeps at least
    what a cut to 4 keeps. Averaged over the steps that reached 5 (the estimate before), E(5) read 2.0 against
    E(4)'s 3.5, and a budget that cut at 4 saw no reason ever to draft longer."""
    budget = DraftBudget()
    for _ in range(50):
        budget.record(4, [0, 1, 2, 3])  # cut by the budget to 4: all accepted
        budget.record(8, [0])  # cut to 8 (an exploration step): one accepted
    assert budget.expected(4) == pytest.approx(1 + (4 + 1) / 2)
    assert budget.expected(5) == pytest.approx(budget.expected(4))  # node 4: told only by the 8s, not accepted
    values = [budget.expected(m) for m in range(9)]
    assert values == sorted(values)


def test_long_drafts_that_only_lookup_hits_reach_do_not_set_the_length_for_a_batch():
    """Trees are long when prompt lookup found a continuation, and then accept well; a batch whose rows mostly
    draft 16 tokens and accept 1 must not verify 17 or more on the strength of those (it did, before whole
    drafts counted for longer cuts)."""
    budget = DraftBudget()
    budget.costs[16] = [(1, 0.040), (2, 0.046), (3, 0.051), (5, 0.062), (9, 0.076), (17, 0.144)]
    for step in range(400):
        if step % 10:
            budget.record(16, [0], whole=True)  # no lookup hit: 16 nodes, one accepted
        else:
            budget.record(24, list(range(8)), whole=True)  # a lookup hit: 24 nodes, 8 accepted
    budget.draft_seconds[16], budget.plain_seconds[16] = 0.0005, 0.0002
    assert budget.expected(24) == pytest.approx(1 + (0.9 * 1 + 0.1 * 8))
    assert budget.choose(16, 24)[0] <= 2  # counting only the drafts 17 or more long, it chose 17


def _measured(costs: list[tuple[int, float]], accepted_per_step: int) -> DraftBudget:
    budget = DraftBudget()
    budget.costs[8] = costs
    for _ in range(400):
        budget.record(8, list(range(accepted_per_step)))
    budget.draft_seconds[8], budget.plain_seconds[8] = 0.001, 0.0005
    return budget


def test_cheap_wide_forwards_verify_long_drafts_and_dear_ones_none():
    flat = [(1, 0.030), (2, 0.030), (3, 0.031), (5, 0.032), (9, 0.034), (17, 0.060)]
    steep = [(1, 0.030), (2, 0.090), (3, 0.150), (5, 0.270), (9, 0.510), (17, 0.990)]  # each token: 2x a step
    assert _measured(flat, 6).choose(8, 8) == [6] * 8  # the 6 that are accepted, not the 2 that never are
    assert _measured(steep, 6).choose(8, 8) == [0] * 8
    assert _measured(flat, 0).choose(8, 8) == [0] * 8  # nothing is ever accepted: no drafting
    assert _measured(flat, 6).choose(1, 8) == [None]  # one row alone is its own bucket, not probed yet: whole draft


def test_a_moment_of_slowness_during_the_probe_does_not_set_one_widths_cost(monkeypatch):
    """Widths take turns within each probe round and each keeps its least time, so two slow forwards in a row
    (another process taking the CPU) inflate one try of two widths, not every try of one."""
    import specdec.budget as budget_module

    true_cost = {w: 0.030 + 0.001 * w for w in budget_module._WIDTHS}
    clock = [0.0]

    # the 3rd and 4th forwards of the probe crawl
    target = ProbedTarget(lambda width, n: true_cost[width] * (10 if n in (3, 4) else 1), clock)
    monkeypatch.setattr(budget_module.time, "perf_counter", lambda: clock[0])
    budget = DraftBudget()
    budget.probe(target, 4, torch.zeros(4, 1, dtype=torch.long), [5] * 4)
    assert [w for w, _ in budget.costs[4]] == list(budget_module._WIDTHS)
    assert [s for _, s in budget.costs[4]] == pytest.approx([true_cost[w] for w in budget_module._WIDTHS])


def test_the_steps_real_forwards_correct_the_probed_costs():
    """A width that steps ran (3 times or more) takes the moving average of its real times; the others, their probed
    times scaled by the real times' ratio to the probed ones: so a probe that underrates what steps cost (tree
    masks, longer contexts) stops deciding the draft length once steps have run."""
    budget = DraftBudget()
    budget.costs[4] = [(1, 0.030), (2, 0.032), (3, 0.034), (5, 0.036), (9, 0.040), (17, 0.080)]
    assert budget.forward_seconds(4, 9) == pytest.approx(0.040)
    assert budget.forward_seconds(3, 9) == pytest.approx(0.030)  # 3 rows of the bucket of 4
    for _ in range(60):
        budget.record_forward(4, 9, 0.048)  # real steps of width 9: 20% dearer than probed
    assert budget.forward_seconds(4, 9) == pytest.approx(0.048)
    assert budget.forward_seconds(4, 13) == pytest.approx(0.060 * 1.2, rel=1e-3)  # interpolated, corrected
    budget.record_forward(4, 5, 0.0432)  # once: the probe (corrected) holds
    ratio = budget.observed_ratio[4]
    assert budget.forward_seconds(4, 5) == pytest.approx(0.036 * ratio)
    budget.record_forward(4, 5, 0.0432)
    budget.record_forward(4, 5, 0.0432)
    assert budget.forward_seconds(4, 5) == pytest.approx(0.0432)  # seen 3 times: its own average
    for _ in range(3):  # 3 rows of the bucket of 4: their own times, which say nothing of 4 rows'
        budget.record_forward(3, 9, 0.045)
    assert budget.forward_seconds(3, 9) == pytest.approx(0.045)
    assert budget.forward_seconds(4, 9) == pytest.approx(0.048)
    assert budget.forward_seconds(3, 13) == pytest.approx(0.060 * 3 / 4 * budget.observed_ratio[3])
    budget.record_forward(16, 5, 1.0)  # a bucket not probed yet: nothing to correct
    assert 16 not in budget.observed
    budget.costs[2] = budget.costs[4]
    budget.record_forward(1, 9, 0.5)  # one row alone: no sample of the bucket of 2
    assert 1 not in budget.observed and 1 not in budget.observed_ratio


def test_a_width_not_seen_lately_reads_its_probe_at_the_current_ratio():
    """A width's own average stands only while the width was seen in the rows' last _OBSERVED_FRESH forwards: one
    measured in a slow spell of the machine and then not chosen must not keep its slow time while the widths chosen
    instead run fast (the batch would go on drafting, priced against a plain step it no longer takes)."""
    import specdec.budget as budget_module

    budget = DraftBudget()
    budget.costs[16] = [(1, 0.130), (2, 0.200), (3, 0.270), (5, 0.420), (9, 0.700), (17, 1.350)]
    for _ in range(20):
        budget.record_forward(16, 1, 0.217)  # a slow spell, at plain steps
    assert budget.forward_seconds(16, 1) == pytest.approx(0.217, rel=1e-3)
    for _ in range(budget_module._OBSERVED_FRESH - 1):
        budget.record_forward(16, 2, 0.200)  # the machine fast again, at drafting steps of width 2
    assert budget.forward_seconds(16, 1) == pytest.approx(0.217, rel=1e-3)  # still fresh
    budget.record_forward(16, 2, 0.200)
    assert budget.forward_seconds(16, 1) == pytest.approx(0.130 * budget.observed_ratio[16])
    assert budget.forward_seconds(16, 1) < 0.150
    assert budget.forward_seconds(16, 2) == pytest.approx(0.200, rel=1e-3)


def test_a_width_seen_dearer_than_probed_is_chosen_less():
    budget = DraftBudget()
    budget.costs[4] = [(1, 0.030), (2, 0.032), (3, 0.034), (5, 0.036), (9, 0.040), (17, 0.080)]
    for _ in range(400):
        budget.record(16, list(range(16)))  # every draft token accepted
    budget.draft_seconds[4] = budget.plain_seconds[4] = 0.0
    assert budget.choose(4, 16) == [8] * 4  # probed: 9 tokens per row in 40 ms beat 17 in 80
    for _ in range(60):
        budget.record_forward(4, 9, 0.060)  # but real steps of 9 take 60 ms, of 17 the 80 probed
        budget.record_forward(4, 17, 0.080)
    assert budget.choose(4, 16) == [16] * 4


def test_drafting_time_is_kept_per_batch_bucket_and_measured_afresh():
    """A drafting time measured at another batch size (e.g. the last rows of a call, alone) does not decide this
    one's; a bucket that stopped drafting drafts again after a while, so a stale time cannot keep it off."""
    flat = [(1, 0.030), (2, 0.030), (3, 0.031), (5, 0.032), (9, 0.034), (17, 0.060)]
    budget = _measured(flat, 6)
    budget.record_step_time(1, True, 0.5)  # one row alone drafting slowly: its own bucket, not bucket 8's
    budget.record_step_time(2, True, 2 * 0.5)  # nor does a batch of 2
    assert budget.choose(8, 8) == [6] * 8
    budget.costs[4] = flat
    # bucket 4 has not drafted yet: it drafts once at its best length (drafting priced as bucket 8's), not in full
    assert budget.choose(4, 8) == [6] * 4
    budget.record_step_time(4, True, 4 * 0.2)  # then very dear drafting there
    budget.plain_seconds[4] = 0.0005
    assert budget.choose(4, 8) == [0] * 4
    for _ in range(32):
        budget.record_step_time(4, False, 4 * 0.0005)
    assert budget.choose(4, 8)[0] >= 1  # 32 plain steps later: draft once to measure again
    budget.record_step_time(4, True, 4 * 0.0001)  # cheap now
    assert budget.choose(4, 8) == [6] * 4


def test_no_refresh_where_no_draft_length_would_pay_were_drafting_free():
    """Re-measuring the drafting time cannot change the choice where even free drafting loses to plain decoding
    (a forward's cost growing faster than the acceptance): that bucket stays plain, where it used to draft once
    every _REFRESH_STEPS steps; a bucket it could pay in still refreshes."""
    import specdec.budget as budget_module

    steep = [(w, 0.030 * w ** 1.5) for w in budget_module._WIDTHS]
    budget = _measured(steep, 1)  # E(m) <= 2 plus its margin, a forward of 2 tokens costing 2.8 of one
    budget.costs[16] = steep
    budget.plain_seconds[16] = 0.0005
    budget.record_step_time(16, True, 16 * 0.002)
    for _ in range(budget_module._REFRESH_STEPS + 5):
        budget.record_step_time(16, False, 16 * 0.0005)
        assert budget.choose(16, 8) == [0] * 16
    budget.costs[32] = steep
    assert budget.choose(32, 8) == [0] * 32  # never drafted there: nothing it could measure would pay
    flat = [(1, 0.030), (2, 0.030), (3, 0.031), (5, 0.032), (9, 0.034), (17, 0.060)]
    budget.costs[16] = flat
    budget.record_step_time(16, True, 16 * 0.2)  # drafting measured very dear once
    for _ in range(budget_module._REFRESH_STEPS):
        budget.record_step_time(16, False, 16 * 0.0005)
    assert budget.choose(16, 8)[0] >= 1  # free drafting would pay here: it re-measures


def test_a_cut_tree_is_a_tree_of_its_first_nodes():
    tokens, parents = tree.from_paths([[5, 6, 7], [5, 9], [8]])
    draft = Draft(tokens=torch.tensor([tokens]), parents=parents)
    cut = trim(draft, 3)
    assert cut.tokens.tolist() == [tokens[:3]] and cut.parents == parents[:3]
    assert tree.check_parents(cut.parents) is None
    probs = torch.rand(1, 4, 10)
    chain = trim(Draft(tokens=torch.tensor([[1, 2, 3, 4]]), probs=probs), 2)
    assert chain.tokens.tolist() == [[1, 2]] and torch.equal(chain.probs, probs[:, :2])


def test_a_pinned_budget_of_zero_is_plain_decoding_and_one_row_keeps_its_draft():
    model = tiny_model("llama", seed=0)
    prompts = [[7, 8, 9, 7, 8, 9, 7, 8], [1, 2, 3]]
    decoder = SpeculativeDecoder.from_model(model, proposer="ngram")
    outs = decoder.generate_ids(prompts, max_new_tokens=12, batch_size=2, draft_budget=0)
    assert [o.token_ids for o in outs] == [plain_greedy(model, p, 12) for p in prompts]
    assert all(set(o.stats.acceptance_lengths) == {1} for o in outs)
    alone = decoder.generate_ids(prompts[0], max_new_tokens=12)  # adaptive, and too short to leave its warm-up
    assert max(alone.stats.acceptance_lengths) > 1


def test_a_row_cut_to_m_tokens_asks_its_proposer_for_m(monkeypatch):
    """A cut row's proposer is asked for the cut (state.max_draft_tokens), so that it drafts no slot the step will
    not verify; a budget above what a row may still verify asks for what it may verify."""
    from specdec.proposers.ngram import NgramProposer

    model = tiny_model("llama", seed=0)
    prompts = [[7, 8, 9, 7, 8, 9, 7, 8], [1, 2, 3, 1, 2, 3]]
    decoder = SpeculativeDecoder.from_model(model, proposer="ngram")
    asked: list[tuple[int, int]] = []  # (max_draft_tokens, tokens still wanted after this step's own)
    original = NgramProposer.propose

    def propose(self, state):
        asked.append((state.max_draft_tokens, 12 - (state.length - state.prompt_length) - 1))
        return original(self, state)

    monkeypatch.setattr(NgramProposer, "propose", propose)
    for budget in (2, 50):
        asked.clear()
        outs = decoder.generate_ids(prompts, max_new_tokens=12, batch_size=2, draft_budget=budget)
        assert [o.token_ids for o in outs] == [plain_greedy(model, p, 12) for p in prompts]
        assert asked and all(ask == min(budget, left) for ask, left in asked), asked


def test_one_row_alone_takes_the_budget_from_its_own_probe(monkeypatch):
    """A lone row is a batch of one: where a forward's cost grows steeply with its width (a CPU without bf16
    matrix units verifying in bf16), it verifies only the draft tokens that pay, and none when none do; where
    the cost is flat it verifies what is accepted. ONE_ROW off: its whole draft, as before stop 34."""
    import specdec.budget as budget_module

    flat = [(1, 0.030), (2, 0.030), (3, 0.031), (5, 0.032), (9, 0.034), (17, 0.060), (33, 0.120)]
    steep = [(1, 0.030), (2, 0.090), (3, 0.150), (5, 0.270), (9, 0.510), (17, 0.990), (33, 1.950)]
    bent = [(1, 0.033), (2, 0.045), (3, 0.056), (5, 0.066), (9, 0.088), (17, 0.128), (33, 0.211)]
    # a draft never accepted, at a drafting time like a DFlash draft's (5 ms): not worth its optimism margin
    for costs, accepted, drafting, chosen in ((flat, 6, 0.001, [6]), (steep, 6, 0.001, [0]), (flat, 0, 0.005, [0])):
        budget = _measured(flat, accepted)
        budget.costs[1], budget.draft_seconds[1], budget.plain_seconds[1] = costs, drafting, 0.0005
        assert budget.choose(1, 8) == chosen
    budget = DraftBudget()  # a 16-token tree whose node k is accepted with probability 0.9 ** (k + 1)
    for _ in range(400):
        budget.record(16, [k for k in range(16) if (_ * 7919 % 1000) / 1000 < 0.9 ** (k + 1)], whole=True)
    budget.costs[1], budget.draft_seconds[1], budget.plain_seconds[1] = bent, 0.006, 0.0005
    cut = budget.choose(1, 16)[0]
    assert 1 <= cut < 16  # the tree's tail costs more than it brings on this cost curve
    rate = [budget.expected(m) / (budget.forward_seconds(1, 1 + m) + 0.006) for m in (cut, 16)]
    assert rate[0] > rate[1]
    monkeypatch.setattr(budget_module, "ONE_ROW", False)
    assert budget.choose(1, 16) == [None]


def test_a_bucket_is_probed_only_once_the_budget_would_read_it(monkeypatch):
    """Not during the warm-up steps (a short generation never pays a probe), not for a proposer that has never
    drafted (plain decoding), and for one row alone in fewer rounds over widths up to 33."""
    import specdec.budget as budget_module

    budget = DraftBudget()
    for _ in range(budget_module._WARMUP_STEPS):
        assert not budget.needs_probe(1) and not budget.needs_probe(4)
        budget.record(0, [])  # plain decoding: nothing drafted
    assert not budget.needs_probe(1) and not budget.needs_probe(4)
    budget.record(4, [0, 1])
    assert budget.needs_probe(1) and budget.needs_probe(4)
    monkeypatch.setattr(budget_module, "ONE_ROW", False)
    assert not budget.needs_probe(1) and budget.needs_probe(4)

    target = ProbedTarget()
    budget.probe(target, 1, torch.zeros(1, 1, dtype=torch.long), [5])
    assert target.widths == list(budget_module._ONE_ROW_WIDTHS) * budget_module._ONE_ROW_PROBE_ROUNDS
    assert [w for w, _ in budget.costs[1]] == list(budget_module._ONE_ROW_WIDTHS)
    assert not budget.needs_probe(1)


def test_a_lone_row_whose_drafts_never_pay_falls_to_plain_decoding_and_stays_exact(monkeypatch):
    """Through the engine: a lone row drafting random tokens on a target whose forward cost rises steeply with
    its width stops asking its proposer once the budget has measured that, and its output is still plain
    greedy decoding's; with the budget pinned it keeps drafting."""
    from helpers import RandomProposer

    import specdec.budget as budget_module

    steep = [(w, 0.030 * w) for w in budget_module._ONE_ROW_WIDTHS]

    def probe(self, target, rows, feed_row, lengths):
        self.costs[budget_module.bucket(rows)] = steep

    monkeypatch.setattr(budget_module.DraftBudget, "probe", probe)
    monkeypatch.setattr(budget_module, "OBSERVED_COSTS", False)  # the tiny model's real forwards are flat
    model = tiny_model("llama", seed=1)
    prompt = [5, 6, 7, 8, 9]
    calls = []
    target = TargetModel(model)
    proposer = RandomProposer(RandomProposer.Config(num_tokens=6, seed=3), target)
    decoder = SpeculativeDecoder(target, proposer)
    original = proposer.propose
    monkeypatch.setattr(proposer, "propose", lambda state: calls.append(1) or original(state))
    out = decoder.generate_ids(prompt, max_new_tokens=60)
    assert out.token_ids == plain_greedy(model, prompt, 60)
    assert budget_module._WARMUP_STEPS <= len(calls) < 20  # after the warm-up it drafts only to re-measure
    calls.clear()
    pinned = decoder.generate_ids(prompt, max_new_tokens=60, draft_budget=6)
    assert pinned.token_ids == out.token_ids and len(calls) >= 50


def test_a_probe_skips_the_widths_that_cannot_pay_on_a_steep_cost_curve():
    """Once a forward costs more than the most a step could commit (on what was measured) times a one-token
    forward, no wider one can pay: the probe stops timing them (after one try with a wider margin in its first
    round, on its least try so far in the later ones), so a batch's last rows do not spend seconds per bucket
    probing; on a flat curve every width is timed. The skipped widths read at least as dear as the widest probed.
    Past the second round only widths whose tries disagree are timed again (these stand-ins cost the same each
    time)."""
    import specdec.budget as budget_module

    def measured() -> DraftBudget:
        budget = DraftBudget()
        for _ in range(200):
            budget.record(8, [0])  # one draft token in eight accepted: E(m) <= 2 plus its margin
        return budget

    clock = [0.0]
    steep = ProbedTarget(lambda w, n: 0.030 * w, clock)
    flat = ProbedTarget(lambda w, n: 0.030 + 0.0001 * w, clock)
    budget, other = measured(), measured()  # one per target: a budget belongs to one engine's target
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(budget_module.time, "perf_counter", lambda: clock[0])
        budget.probe(steep, 4, torch.zeros(4, 1, dtype=torch.long), [5] * 4)
        other.probe(flat, 8, torch.zeros(8, 1, dtype=torch.long), [5] * 8)
        fresh = DraftBudget()  # nothing drafted yet: nothing to judge by, every width
        fresh.probe(steep, 16, torch.zeros(16, 1, dtype=torch.long), [5] * 16)
    # ceiling ~2.2 tokens: width 5 costs 5 one-token forwards, past 2 x 2.2 in the first round; 3 past 1.25 x 2.2 in
    # the second, on its first try (a width already timed too dear is not timed again)
    assert steep.widths[:6] == [1, 2, 3, 5] + [1, 2]  # against 4 x 6 widths, the widest 17 tokens
    assert [w for w, _ in budget.costs[4]] == [1, 2, 3, 5]
    assert budget.forward_seconds(4, 17) >= budget.forward_seconds(4, 5)
    assert flat.widths == list(budget_module._WIDTHS) * 2
    assert steep.widths[6:] == list(budget_module._WIDTHS) * 2  # the fresh budget's


def test_a_probe_times_again_only_the_widths_whose_tries_disagree(monkeypatch):
    """Two tries of a width within _PROBE_SETTLED of each other settle its time; a width whose second try was
    far off the first (a moment of slowness) is timed in the later rounds, and keeps its least time."""
    import specdec.budget as budget_module

    clock = [0.0]
    # the 8th forward (width 2, second round) crawls: only width 2 is timed past the second round, once (its third
    # try agrees with its first)
    target = ProbedTarget(lambda w, n: (0.030 + 0.001 * w) * (5 if n == 8 else 1), clock)
    monkeypatch.setattr(budget_module.time, "perf_counter", lambda: clock[0])
    budget = DraftBudget()
    budget.probe(target, 4, torch.zeros(4, 1, dtype=torch.long), [5] * 4)
    assert target.widths == list(budget_module._WIDTHS) * 2 + [2]
    assert dict(budget.costs[4])[2] == pytest.approx(0.032)


def test_a_draining_batch_reads_the_token_counts_probed_before_and_times_only_the_rest(monkeypatch):
    """A forward's time follows its token count (rows x width): a bucket whose widths' token counts lie inside
    the range an earlier probe timed reads them off that probe by tokens, and times on its live batch only the
    widths outside it (a batch draining from 16 rows times only 8 rows of one token, not six widths four times
    over). Switched off (SHARED_CURVE), every bucket times every width."""
    import specdec.budget as budget_module

    def cost(tokens: int) -> float:
        return 0.030 + 0.002 * tokens

    clock = [0.0]
    monkeypatch.setattr(budget_module.time, "perf_counter", lambda: clock[0])
    budget = DraftBudget()
    wide = ProbedTarget(lambda w, n: cost(16 * w), clock)
    budget.probe(wide, 16, torch.zeros(16, 1, dtype=torch.long), [5] * 16)  # tokens 16 .. 272
    draining = ProbedTarget(lambda w, n: cost(8 * w), clock)
    budget.probe(draining, 8, torch.zeros(8, 1, dtype=torch.long), [5] * 8)
    assert set(draining.widths) == {1}  # 8 tokens: below what was timed
    assert [w for w, _ in budget.costs[8]] == list(budget_module._WIDTHS)
    for width in budget_module._WIDTHS:  # inside the range: linear between probed token counts, exact here
        assert budget.forward_seconds(8, width) == pytest.approx(cost(8 * width))
    alone = ProbedTarget(lambda w, n: cost(w), clock)
    budget.probe(alone, 1, torch.zeros(1, 1, dtype=torch.long), [5])  # tokens 1 .. 33: 1, 2, 3 and 5 timed
    assert set(alone.widths) == {1, 2, 3, 5}
    assert budget.forward_seconds(1, 33) == pytest.approx(cost(33))

    monkeypatch.setattr(budget_module, "SHARED_CURVE", False)
    again = ProbedTarget(lambda w, n: cost(8 * w), clock)
    budget.probe(again, 8, torch.zeros(8, 1, dtype=torch.long), [5] * 8)
    assert set(again.widths) == set(budget_module._WIDTHS)
