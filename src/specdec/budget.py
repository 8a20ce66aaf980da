"""The adaptive draft budget: how many draft tokens each row of a batch may verify at this step.

A verification forward over B rows of 1 + m tokens each costs little more than one of 1 token while the target
is bound by reading its weights, and about linearly more once it is bound by arithmetic; a larger batch reaches
that point at a smaller m. At each step of a batch the engine picks the m that maximises the expected committed
tokens per second,

    rate(m) = B * E(m) / (t(B, 1 + m) + B * d(m > 0))

where t(B, w) is the measured time of a forward of B rows of w tokens: probed once per batch size bucket on the
live batch (then rolled back), and from then on corrected by the forwards the steps themselves run at B rows (a
width steps ran at least _OBSERVED_MIN times takes the moving average of its real times; any other, its probed
time scaled by the real times' moving ratio to the probed ones). The probe feeds each row's last token repeated;
real steps carry a tree mask per row over contexts that grow, and on this project's
CPU ran ~10% dearer than probed at the widths chosen most (9-10 tokens per row at batch 4), less at others. d is
the measured time per row of the rest of a step (drafting, verifying, the proposers' bookkeeping), kept per batch
size bucket (a batched draft forward is shared by the rows) and apart for steps that draft and steps that do not;
and E(m) = 1 + the mean number of draft tokens that would have been accepted had the draft been cut to its first
m tokens, read off every verdict (the accepted path of a chain or tree: parents come before children, so any
prefix of a draft is a draft). It is built up one draft position at a time, as a product-limit (Kaplan-Meier)
estimate is: E(m) = E(m - 1) + the share of steps whose node m - 1 was accepted, among the steps that tell
(drafts of at least m tokens, and whole drafts, not cut by the budget, of fewer: they accepted nothing more). A
draft the budget cut to fewer than m tokens tells nothing of node m - 1, and leaves only that share's
denominator. So E never falls as m grows, and a row cut to m whose draft accepted all of it still counts up to
m: averaging each cut over the steps that reached it (the rule before stop 28) dropped exactly those rows from
E(m + 1), and read longer cuts low, which kept the budget at the cut it had. At m = 0
the proposer is not asked at all: at large batches this is plain batched decoding. A bucket whose drafting time
is unknown (priced with the nearest bucket's drafting time, not drafting in full: a whole draft is up to ~47
tokens a row), or that has not drafted for _REFRESH_STEPS steps, drafts at its best m > 0 once, so that a drafting
time measured once under noise (or in another bucket) cannot keep drafting off. One row alone is a batch too (its
own bucket, ONE_ROW): where a forward's cost grows with its width (a CPU without bf16 matrix units verifying in
bf16 paid 33 ms for one token and 128 ms for 16), verifying a 16-token tree plus prompt-lookup continuations made
speculation slower than plain decoding, and the budget cuts the draft to what pays; where the cost is flat it
keeps nearly all of it. A bucket is probed only once the budget would read it (after the warm-up steps, and one
row alone in fewer rounds), so a short generation, or plain decoding, never pays a probe (`needs_probe`), and a
probe stops timing wider forwards once one costs more than any draft length could pay for (`_ceiling`). A probe
reads the widths whose token counts (rows x width) an earlier probe timed off that one, by tokens (SHARED_CURVE: a
forward's time follows its tokens far more than its rows), so a batch draining from 16 rows to 1 times only its
narrowest forwards in each bucket it passes through. vLLM and
SGLang turn speculation off under load for the same reason; here one rule covers every batch size and every
proposer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from itertools import accumulate

import torch

from .contracts import Draft
from .limits import MAX_VERIFY_TOKENS

#: batch sizes are probed in these buckets (a batch of 5 to 8 rows uses the probe at 8; one row alone, its own)
_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: forward widths (1 + draft tokens per row) probed per bucket; wider ones are extrapolated linearly
_WIDTHS = (1, 2, 3, 5, 9, 17)
#: one row alone also probes a 33-token forward: its drafts reach past 17 tokens (a 16-token tree plus prompt-lookup
#: continuations), where extrapolating from 9 and 17 read the cost low on a CPU whose cost curve bends there
_ONE_ROW_WIDTHS = (*_WIDTHS, 33)
#: tries of each width in a probe (the least counts), the widths taking turns
_PROBE_ROUNDS = 4
#: a probe stops timing wider forwards once one costs this many times the most a step could commit (`_ceiling`)
#: times a one-token forward: a round after the first already has the least of two tries; the first round, one
#: try, so a wider margin (a forward seen 20% dear by chance must not rule out the widths past it). On a CPU whose
#: forward's cost grows steeply with its width (bf16 without bf16 units) this skips most of a probe of many rows,
#: which took seconds per bucket as a batch's last rows passed through buckets 8, 4, 2 and 1
_PROBE_CUT_FIRST = 2.0
_PROBE_CUT = 1.25
#: past the second round, a width whose two least tries agree within this share is not timed again: at 16 rows a
#: round of every width took ~4 s on a CPU without bf16 units, and a moment of slowness shows as two tries apart
_PROBE_SETTLED = 0.05
#: whether a bucket reads the widths whose token counts (rows x width) an earlier probe timed off that probe, by
#: tokens, and times only the others on its live batch: a batch draining from 16 rows passes through buckets 8, 4,
#: 2 and 1, and probing each in full took ~14 s on such a CPU (4.4 s for bucket 4 alone), paid at every run's tail.
#: A forward's time follows its token count far more than its rows (16 rows of 1 token and 1 row of 17 cost within
#: ~20% there); the steps' real forwards then correct each row count's level (`record_forward`)
SHARED_CURVE = True
#: one row alone probes in fewer rounds: its probe is paid inside one generation, often a short one (two rounds of
#: seven widths cost ~0.6 s on this project's CPU), and its own real forwards correct the widths it then verifies
_ONE_ROW_PROBE_ROUNDS = 2
#: rows' steps seen before the estimates are trusted
_WARMUP_STEPS = 8
#: the upper-confidence margin on E(m) after n steps is min(1, _EXPLORATION / sqrt(1 + n)) tokens. 2.0 until stop 36:
#: where drafting only breaks even (one bf16 row on a CPU without bf16 units: a 3-token forward cost ~1.75 one-token
#: ones) its margin, still 0.15 tokens after 170 steps, kept a lone row drafting 2 tokens at E(2) = 1.87 and 4% below
#: plain decoding; at 0.5 that row decodes plainly, level with it, and where drafting pays (float32, one row and
#: batch 4) the speed is unchanged (docs/benchmarks.md, "Stop 36")
_EXPLORATION = 0.5
#: steps without drafting after which a batch bucket drafts once more, to measure its drafting time afresh (unless no
#: draft length would pay even were drafting free)
_REFRESH_STEPS = 32
#: weight of the newest measurement in the budget's moving averages (step times, real forwards)
_NEWEST_WEIGHT = 0.1
#: real forwards of one width seen before their average replaces that width's probed time (one slow forward, the
#: OS or another process, must not make a width look dear for good: a width not chosen is not measured again)
_OBSERVED_MIN = 3
#: a width's own average stands only while it was seen within this many of the rows' last forwards; after, its probed
#: time scaled by the real times' recent ratio to the probed ones. A machine's speed drifts (a virtual machine's
#: neighbours): a width measured in a slow spell and then not chosen kept its slow average while the widths chosen
#: instead ran fast, and a batch of 16 drafted for ~90 steps on a one-token forward's 217 ms where it was taking ~140
_OBSERVED_FRESH = 16
#: whether the steps' real forwards correct the probed costs (a switch for measuring what that changes)
OBSERVED_COSTS = True
#: whether a whole draft counts for longer cuts (`record`; a switch for measuring what that changes)
WHOLE_DRAFTS = True
#: a pinned draft budget above any draft's length (`draft_budget=UNCUT`): every draft verified whole, so that a
#: draft's own acceptance is measured, not what this machine's forward costs make the adaptive budget keep of it
UNCUT = MAX_VERIFY_TOKENS
#: whether one row alone takes the budget too (False: it verifies its proposer's whole draft, as before stop 34; a
#: switch for measuring what that changes)
ONE_ROW = True


def _moving(average: float | None, value: float) -> float:
    """The moving average `average` (None: nothing measured yet) after one more measurement."""
    return value if average is None else (1 - _NEWEST_WEIGHT) * average + _NEWEST_WEIGHT * value


def _interpolate(curve: list[tuple[int, float]], x: int) -> float:
    """The time at x (a forward's tokens, or its width) on a sorted [(x, seconds)] table, linearly between the two
    entries around it (x at most the largest entry's)."""
    for (x0, t0), (x1, t1) in zip(curve, curve[1:], strict=False):
        if x <= x1:
            return t0 + (t1 - t0) * (x - x0) / (x1 - x0)
    return curve[-1][1]  # x == the largest entry's (or a table of one entry)


def _settled(tries: list[float]) -> bool:
    """Whether a width's two least tries agree within _PROBE_SETTLED (a third would not move its least time)."""
    if len(tries) < 2:  # timed once (a width cut as too dear before its second try)
        return False
    low, second = sorted(tries)[:2]
    return second <= low * (1 + _PROBE_SETTLED)


def bucket(batch: int) -> int:
    return next((b for b in _BUCKETS if b >= batch), _BUCKETS[-1])


class DraftBudget:
    """Per engine: forward costs by batch bucket, acceptance by draft length, drafting time per row."""

    def __init__(self) -> None:
        self.costs: dict[int, list[tuple[int, float]]] = {}  # bucket -> [(width, seconds)]
        self.tokens_seconds: dict[int, float] = {}  # tokens in a probed forward (rows x width) -> its least time
        self.drafted: list[int] = [0]  # [d]: steps whose verified draft held exactly d tokens
        self.node_accepted: list[int] = [0]  # [m >= 1]: steps whose node m - 1 was accepted
        # [m]: steps whose whole draft (not cut) held m - 1 tokens: a cut to m or more would have left them whole,
        # so they tell about every m' >= m too
        self.whole_steps: list[int] = []
        self.steps = 0  # rows' steps recorded
        # by batch bucket: moving averages of one row's share of a step's time outside the target forward, with
        # and without drafts, and the steps since the bucket last drafted
        self.draft_seconds: dict[int, float] = {}
        # by the exact number of rows: moving averages of the steps' real forward times by width, and of their
        # ratio to the probed time of that width (a forward's time is far from proportional to its rows: 16 rows
        # of one token took 47 ms where 10 took ~40, so a time scaled from other row counts would mislead)
        # rows -> width -> (forwards, average, the rows' forward count when it was last seen)
        self.observed: dict[int, dict[int, tuple[int, float, int]]] = {}
        self.observed_ratio: dict[int, float] = {}
        self.forwards: dict[int, int] = {}  # rows -> real forwards recorded
        self.plain_seconds: dict[int, float] = {}
        self.plain_streak: dict[int, int] = {}

    # -- measuring -----------------------------------------------------------------------------------------
    def record(self, drafted: int, path: Sequence[int], whole: bool = False) -> None:
        """One row's step: `drafted` tokens verified, `path` the accepted ones' indices into the draft (a
        chain's are 0 .. n - 1); `whole`: those tokens were the proposer's whole draft (not cut by the budget).

        A whole draft counts for every longer cut as well, with what it accepted: without it, E(m) for an m
        longer than most drafts was read off the few drafts that long, which are not a fair sample (a tree
        with prompt-lookup continuations is long exactly when the lookup found something, and then accepts
        well), and a batch cut every row to a length that only such drafts had earned."""
        self.steps += 1
        while len(self.drafted) <= drafted:
            self.drafted.append(0)
            self.node_accepted.append(0)
        self.drafted[drafted] += 1
        for node in path:  # a path's nodes are draft indices below `drafted`
            self.node_accepted[node + 1] += 1
        if whole and WHOLE_DRAFTS:
            while len(self.whole_steps) <= drafted + 1:
                self.whole_steps.append(0)
            self.whole_steps[drafted + 1] += 1

    def record_step_time(self, rows: int, drafted: bool, seconds: float) -> None:
        """A step's time outside the target's forward (drafting, verifying, committing, the proposers' observe),
        per row: kept apart for steps that drafted and steps that did not."""
        per_row, b = seconds / rows, bucket(rows)
        averages = self.draft_seconds if drafted else self.plain_seconds
        stale = drafted and self.plain_streak.get(b, 0) >= _REFRESH_STEPS  # a refresh step replaces the old time
        averages[b] = _moving(None if stale else averages.get(b), per_row)
        self.plain_streak[b] = 0 if drafted else self.plain_streak.get(b, 0) + 1

    def record_forward(self, rows: int, width: int, seconds: float) -> None:
        """A step's target forward: `rows` rows of `width` tokens took `seconds`. Corrects the probed costs of
        the rows' bucket (one row alone is a bucket of its own: its forward is not twice as cheap as one of two
        rows, so scaling it to the bucket of 2 would make that bucket look dear)."""
        b = bucket(rows)
        if not OBSERVED_COSTS or b not in self.costs:
            return
        widths = self.observed.setdefault(rows, {})
        count, average, _ = widths.get(width, (0, None, 0))
        self.forwards[rows] = self.forwards.get(rows, 0) + 1
        widths[width] = (count + 1, _moving(average, seconds), self.forwards[rows])
        ratio = seconds / (self._probed(b, width) * rows / b)
        self.observed_ratio[rows] = _moving(self.observed_ratio.get(rows), ratio)

    def measured(self) -> list[tuple[int, float]]:
        """For each cut m = 0 .. the longest draft seen: (steps that tell what a draft cut to m accepts: drafts at
        least m long and whole drafts shorter than m, the draft tokens a step cut to m is expected to accept)."""
        at_least = list(accumulate(reversed(self.drafted)))[::-1]  # [m]: steps whose draft held >= m tokens
        totals, whole, mean = [], 0, 0.0
        for m in range(len(self.drafted)):
            whole += self.whole_steps[m] if m < len(self.whole_steps) else 0
            steps = at_least[m] + whole
            mean += self.node_accepted[m] / steps if m and steps else 0.0  # node m - 1's share (the docstring)
            totals.append((steps, mean))
        return totals

    def expected(self, m: int, measured: list[tuple[int, float]] | None = None) -> float:
        """Expected tokens committed by one row's step with a draft cut to m tokens (the target's own included);
        `measured`: this budget's `measured()`, when the caller has it."""
        return 1.0 + (measured or self.measured())[min(m, len(self.drafted) - 1)][1]

    @torch.inference_mode()
    def probe(self, target: object, rows: int, feed_row: torch.Tensor, lengths: list[int]) -> None:
        """Time forwards of each width on the live batch (`feed_row` [B, 1]: each row's last token, repeated),
        rolling the cache back to `lengths` after each: nothing of it reaches any row. Each width's time is
        the least of _PROBE_ROUNDS, the widths taking turns within a round, so that a moment of slowness
        (another process, the OS) inflates one try of several widths, not every try of one: the probe is
        taken once per bucket and sets the draft length for every later step (a width timed 20% dear in
        one probe on this project's CPU kept a batch of 4 at 4 draft tokens per row where others chose 8).
        A width whose forward holds a number of tokens inside the range an earlier probe (of another bucket)
        timed is read off that probe's times by tokens instead (SHARED_CURVE), and past the second round only
        widths whose two least tries differ by more than _PROBE_SETTLED are timed again."""
        alone = rows == 1
        widths = list(_ONE_ROW_WIDTHS if alone else _WIDTHS)
        curve = sorted(self.tokens_seconds.items()) if SHARED_CURVE else []
        known = {w: _interpolate(curve, rows * w) for w in widths if curve and curve[0][0] <= rows * w <= curve[-1][0]}
        timed = [w for w in widths if w not in known]
        tries: dict[int, list[float]] = {width: [] for width in timed}
        feeds = {width: feed_row.expand(-1, width).contiguous() for width in timed}
        ceiling = self._ceiling()
        for round_ in range(_ONE_ROW_PROBE_ROUNDS if alone else _PROBE_ROUNDS):
            margin = _PROBE_CUT_FIRST if round_ == 0 else _PROBE_CUT
            for width in list(timed):
                if round_ >= 2 and _settled(tries[width]):
                    continue
                if not (round_ and self._beyond(tries, known, width, margin * ceiling)):  # already too dear
                    start = time.perf_counter()
                    target.forward(feeds[width])  # type: ignore[attr-defined]
                    if feed_row.device.type == "cuda":
                        torch.cuda.synchronize(feed_row.device)
                    tries[width].append(time.perf_counter() - start)
                    target.crop(lengths)  # type: ignore[attr-defined]
                if self._beyond(tries, known, width, margin * ceiling):
                    # no wider forward can pay (see _ceiling): later rounds, or the rest of this one, skip them
                    timed = timed[: timed.index(width) + 1]
                    known = {w: t for w, t in known.items() if w < width}
                    break
        best = {**known, **{width: min(times) for width, times in tries.items() if times}}
        for width, times in tries.items():
            if times:
                self.tokens_seconds[rows * width] = min(times)
        self.costs[bucket(rows)] = [(width, best[width] * bucket(rows) / rows)  # scaled to the bucket's rows
                                    for width in sorted(best)]

    @staticmethod
    def _beyond(tries: dict[int, list[float]], known: dict[int, float], width: int, bound: float) -> bool:
        """Whether `width` (wider than one token) has been timed at more than `bound` one-token forwards."""
        one = min(tries[1]) if tries.get(1) else known[1]
        return width > 1 and bool(tries[width]) and min(tries[width]) > bound * one

    def _ceiling(self) -> float:
        """The most a step of any draft length could commit per row on what has been measured (the upper
        confidence bound at its largest): a forward costing more than this many one-token forwards cannot pay at
        any width from there on, its time only growing with the width. Infinite before anything was drafted."""
        if len(self.drafted) < 2:
            return float("inf")
        measured = self.measured()
        return max(self.optimistic(m, measured) for m in range(len(self.drafted)))

    def forward_seconds(self, rows: int, width: int) -> float:
        """The expected time of a forward of `rows` rows of `width` tokens (see the module's docstring)."""
        count, average, last = self.observed.get(rows, {}).get(width, (0, 0.0, 0))
        if count >= _OBSERVED_MIN and self.forwards[rows] - last < _OBSERVED_FRESH:
            return average
        b = bucket(rows)  # the probe's time, scaled to these rows, times what these rows' real forwards ran over it
        return self._probed(b, width) * rows / b * self.observed_ratio.get(rows, 1.0)

    def _probed(self, b: int, width: int) -> float:
        """The probe's time for `width` in bucket b, interpolated between probed widths (linearly past the last)."""
        table = self.costs[b]
        if width <= table[-1][0]:
            return _interpolate(table, width)
        (w0, t0), (w1, t1) = table[-2], table[-1]
        return t1 + max(t1 - t0, 0.0) * (width - w1) / (w1 - w0)  # never cheaper than the widest probed

    # -- choosing ------------------------------------------------------------------------------------------
    def needs_probe(self, rows: int) -> bool:
        """Whether the forward's cost must be probed before this step's choice: only once `choose` would read
        the probe (past the warm-up steps, some draft token verified, one row alone only with ONE_ROW), so that
        a short generation, or a proposer that never drafts (plain decoding), never pays it."""
        if bucket(rows) in self.costs or self.steps < _WARMUP_STEPS or len(self.drafted) < 2:
            return False
        return rows > 1 or ONE_ROW

    def choose(self, rows: int, most: int) -> list[int | None]:
        """Draft tokens for each of `rows` rows whose drafts may hold up to `most` tokens; None: the row verifies
        its whole draft (too few steps measured yet, or one row alone with ONE_ROW off)."""
        b = bucket(rows)
        if (rows == 1 and not ONE_ROW) or self.steps < _WARMUP_STEPS or b not in self.costs:
            return [None] * rows
        # a bucket that has not drafted yet drafts once, at its best length on the drafting time per row of the
        # nearest bucket that has (a whole draft here verified up to ~47 tokens a row: at 8 rows in bf16 on a CPU
        # without bf16 units, seconds for one step)
        unmeasured = b not in self.draft_seconds
        refresh = unmeasured or self.plain_streak.get(b, 0) >= _REFRESH_STEPS
        drafting = self.draft_seconds.get(b, self._nearest_drafting_seconds(b))
        measured = self.measured()
        lengths = range(min(most, len(self.drafted) - 1) + 1)

        def rate(m: int, rest: float) -> float:  # expected committed tokens per second, `rest` per row besides
            return rows * self.optimistic(m, measured) / (self.forward_seconds(rows, 1 + m) + rows * rest)

        plain = rate(0, self.plain_seconds.get(b, 0.0))  # unmeasured plain: try it
        # drafting once to measure its time is pointless where no draft length would pay were drafting free (no
        # measured time could change the choice there; a batch of 16 in bf16 on a CPU without bf16 units still
        # drafted once every 32 plain steps, though the bench saw no speed difference from stopping it)
        if refresh and not any(rate(m, 0.0) > plain for m in lengths[1:]):
            refresh = False
        best, best_rate = 0, 0.0 if refresh else plain
        for m in lengths[1:]:
            if (candidate := rate(m, drafting)) > best_rate:
                best, best_rate = m, candidate
        return [best] * rows

    def _nearest_drafting_seconds(self, b: int) -> float:
        """The drafting time per row of the measured bucket nearest to b (0 when none has drafted yet)."""
        if not self.draft_seconds:
            return 0.0
        return self.draft_seconds[min(self.draft_seconds, key=lambda other: abs(other.bit_length() - b.bit_length()))]

    def optimistic(self, m: int, measured: list[tuple[int, float]] | None = None) -> float:
        """E(m) plus a margin that shrinks as draft length m is measured (an upper confidence bound): a length
        measured on few steps gets tried, and verifying it measures it, while one that cannot pay at this
        batch's forward costs is never tried. Acceptance by draft length does not depend on the batch, so every
        row's step in any batch adds to it."""
        measured = measured or self.measured()
        steps = measured[min(m, len(self.drafted) - 1)][0]
        return self.expected(m, measured) + (min(1.0, _EXPLORATION / (1 + steps) ** 0.5) if m else 0.0)


def trim(draft: Draft, m: int) -> Draft:
    """The draft's first m tokens (a tree's first m nodes: parents come before children, so they form a tree)."""
    if draft.num_tokens <= m:
        return draft
    return Draft(tokens=draft.tokens[:, :m], probs=None if draft.probs is None else draft.probs[:, :m],
                 parents=None if draft.parents is None else list(draft.parents[:m]))
