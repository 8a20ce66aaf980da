"""The decoding loop over a batch of rows (DESIGN.md, data path): prompts join as rows, each row's proposer
drafts, one target forward verifies every row's draft, each row commits what its verifier accepted, the cache
rolls each row back to what it holds, and finished rows leave so that waiting prompts can join (continuous
batching within one call, as vLLM's scheduler does across requests)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

import torch

from . import tree
from .budget import DraftBudget, trim
from .contracts import Draft, Proposer, TargetOutput, Verdict, Verifier
from .draft_checks import chains_only, check_draft, on_device
from .errors import PluginError, SpecdecError
from .generation import EngineResult, GenerationStats, Row, StopChecker
from .sampling import SamplingParams
from .target import TargetModel

__all__ = ["DEFAULT_BATCH_SIZE", "Engine", "EngineResult", "GenerationStats", "StopChecker"]

#: rows decoded together when the caller names no batch size (and the target's cache can hold several)
DEFAULT_BATCH_SIZE = 16

#: on_tokens(row index among the prompts, newly committed token ids)
TokensCallback = Callable[[int, list[int]], None]


class Engine:
    """Runs a proposer and a verifier against a target, losslessly, over one or many prompts.

    Each row of a batch is drafted by a proposer of its own (the engine's proposer for the first slot, its
    `fork()`s for the others), so per-sequence draft state never mixes between rows; the target reads every row
    in one forward, rows of different lengths side by side (the native cache keeps a length per row)."""

    def __init__(self, target: TargetModel, proposer: Proposer, greedy_verifier: Verifier,
                 sampling_verifier: Verifier) -> None:
        self.target = target
        self.proposer = proposer
        self.greedy_verifier = greedy_verifier
        self.sampling_verifier = sampling_verifier
        self._forks: list[Proposer] = []  # proposers for batch slots after the first, made once and kept
        self.budget = DraftBudget()  # forward costs and acceptance by draft length, kept across calls
        self.draft_budget: int | None = None  # draft tokens per row for the call in progress (None: adaptive)

    def verifier_for(self, sampling: SamplingParams) -> Verifier:
        """The verifier for this kind of decoding; one sentence, before any work, if it is not exact for it or
        cannot take the trees the proposer will draft."""
        verifier = self.greedy_verifier if sampling.greedy else self.sampling_verifier
        problem = type(verifier).inexact_for(sampling.greedy)
        if problem is not None:
            raise SpecdecError(problem)
        if not verifier.supports_trees and self.proposer.drafts_trees(sampling):
            raise SpecdecError(chains_only(verifier, self.proposer))
        return verifier

    # -- front doors -----------------------------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: torch.Tensor,
        max_new_tokens: int,
        sampling: SamplingParams,
        seed: int | None = None,
        stop_strings: list[str] | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
        draft_budget: int | None = None,
    ) -> EngineResult:
        """Generate after one prompt `prompt_ids` [1, T]; returns the generated ids (the stop token included)."""
        if prompt_ids.dim() != 2 or prompt_ids.shape[1] < 1:
            raise SpecdecError("The prompt is empty; give at least one token of text.")
        if prompt_ids.shape[0] != 1:
            raise SpecdecError(f"generate() takes one prompt [1, T], not {prompt_ids.shape[0]} rows; give several "
                               "prompts to generate_batch().")
        callback = None if on_tokens is None else (lambda _row, tokens: on_tokens(tokens))
        return self.generate_batch([prompt_ids[0]], max_new_tokens, sampling, seeds=[seed],
                                   stop_strings=stop_strings, batch_size=1, on_tokens=callback,
                                   draft_budget=draft_budget)[0]

    def generate_batch(
        self,
        prompts: Sequence[torch.Tensor],
        max_new_tokens: int,
        sampling: SamplingParams,
        seeds: Sequence[int | None] | None = None,
        stop_strings: list[str] | None = None,
        batch_size: int | None = None,
        on_tokens: TokensCallback | None = None,
        draft_budget: int | None = None,
    ) -> list[EngineResult]:
        """Generate after each prompt (1-D token ids); one result per prompt, in order. At most `batch_size`
        rows decode together (None: up to DEFAULT_BATCH_SIZE where the cache can hold rows of different
        lengths, else one); the others wait and join as rows finish. Row i samples with its own generator,
        seeded with `seeds[i]`, so a prompt's output does not depend on the prompts beside it.

        `draft_budget`: the most draft tokens a row verifies per step (its proposer is asked for a draft that
        deep, and a tree is cut to its first nodes; 0 = plain decoding); None: chosen at each step from the
        measured forward costs and acceptance (specdec.budget), for one row alone as for several, except a lone
        row that samples (it verifies its whole draft, so that its seed reproduces its output).

        Every prompt is checked before any work (an invalid one is named by its index), and the call holds the
        target's lock (one per model object) from its first prefill to its last step: the KV cache, the
        proposers' draft state and the model's tap hooks belong to the rows in progress.
        """
        self.verifier_for(sampling)  # a verifier that cannot serve this decoding is named before the prompts
        rows = self._rows(prompts, max_new_tokens, sampling, seeds, stop_strings)
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise SpecdecError(f"The batch size must be a whole number of at least 1, got {batch_size!r}.")
        if draft_budget is not None and (isinstance(draft_budget, bool) or not isinstance(draft_budget, int)
                                         or draft_budget < 0):
            raise SpecdecError(f"The draft budget must be a whole number of at least 0 (0 = plain decoding), got "
                               f"{draft_budget!r}.")
        with self.target.lock.hold():
            self.draft_budget = draft_budget
            self.target.reset()  # may hand the model to transformers' forward (see TargetModel._recheck_backend)
            if batch_size is None:
                batch_size = DEFAULT_BATCH_SIZE if self.target.can_batch else 1
            elif batch_size > 1 and not self.target.can_batch:
                raise SpecdecError(f"Batch size {batch_size} needs a cache that keeps rows of different lengths; "
                                   f"this target runs on the {self.target.cache_name!r} cache, which does not "
                                   "(the native cache does, for Llama, Qwen2 and Qwen3 targets): use batch size 1.")
            return self._run(rows, min(batch_size, len(rows)), on_tokens)

    def _rows(self, prompts: Sequence[torch.Tensor], max_new_tokens: int, sampling: SamplingParams,
              seeds: Sequence[int | None] | None, stop_strings: list[str] | None) -> list[Row]:
        """One Row per prompt, every prompt checked first (one sentence naming the first bad one)."""
        if isinstance(prompts, torch.Tensor) or not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise SpecdecError("No prompts were given; pass a list of at least one prompt.")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise SpecdecError(f"max_new_tokens must be at least 1, got {max_new_tokens!r}.")
        seeds = [None] * len(prompts) if seeds is None else list(seeds)
        if len(seeds) != len(prompts):
            raise SpecdecError(f"{len(seeds)} seeds were given for {len(prompts)} prompts; give one per prompt.")
        context, device = self.target.max_context, self.target.device
        which = (lambda i: f"Prompt {i}") if len(prompts) > 1 else (lambda i: "The prompt")
        ids = []
        for i, prompt in enumerate(prompts):
            prompt = torch.as_tensor(prompt, dtype=torch.long).reshape(-1)
            if prompt.numel() == 0:
                raise SpecdecError(f"{which(i)} is empty; give at least one token of text.")
            if prompt.numel() >= context:
                raise SpecdecError(f"{which(i)} has {prompt.numel()} tokens but the model's context window is "
                                   f"{context}; shorten it.")
            ids.append(prompt.to(device))
        stops = StopChecker(self.target.eos_token_ids, stop_strings or [], self.target.tokenizer)
        return [self.make_row(i, prompt, max_new_tokens, sampling, seed, stops)
                for i, (prompt, seed) in enumerate(zip(ids, seeds, strict=True))]

    def make_row(self, index: int, prompt: torch.Tensor, max_new_tokens: int, sampling: SamplingParams,
                 seed: int | None, stops: StopChecker) -> Row:
        """A row for a checked prompt (1-D ids on the target's device, shorter than the context window): its
        own generator (seeded with `seed`, else at random), its verifier (`verifier_for`), at most the new
        tokens the context window leaves."""
        generator = torch.Generator(device=self.target.device)
        generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
        budget = min(max_new_tokens, self.target.max_context - prompt.numel())
        row = Row(index, prompt, budget, sampling, generator, stops)
        row.verifier = self.verifier_for(sampling)
        return row

    # -- the loop --------------------------------------------------------------------------------------------
    def _run(self, rows: list[Row], batch_size: int, on_tokens: TokensCallback | None) -> list[EngineResult]:
        waiting, active = deque(rows), []
        idle = self.proposers(batch_size)
        while waiting or active:
            if waiting and len(active) < batch_size:
                joining = [waiting.popleft() for _ in range(min(batch_size - len(active), len(waiting)))]
                self.admit(joining, active, idle, on_tokens)
            else:
                for row, tokens in zip(active, self.step(active), strict=True):
                    if on_tokens is not None and tokens:
                        on_tokens(row.index, tokens)
            self.retire(active, idle, last=not waiting)
        return [row.result(self.target.max_context) for row in rows]

    def proposers(self, slots: int) -> list[Proposer]:
        """One proposer per batch slot, the engine's own last (slots are taken with pop())."""
        while len(self._forks) < slots - 1:
            self._forks.append(self.proposer.fork())
        return [*self._forks[: slots - 1], self.proposer]

    def admit(self, joining: list[Row], active: list[Row], idle: list[Proposer],
              on_tokens: TokensCallback | None) -> None:
        """The target reads the joining prompts into new rows; each prompt's last logits give its first token
        (a step with an empty draft), and its proposer reads the prompt."""
        start = time.perf_counter()
        if self.target.can_batch:
            out = self.target.add_rows([row.prompt_ids for row in joining])  # logits [k, 1, V], taps [k, T_max, H]
        else:  # one row at a time (the batch size is 1): a fresh cache per prompt
            out = self.target.prefill(joining[0].prompt_ids.unsqueeze(0))
        for j, row in enumerate(joining):
            row.joined_at = start
            row.proposer = idle.pop()
            row.proposer.reset()
            logits = out.logits[j: j + 1]
            verdict = row.verifier.verify(logits, Draft(tokens=row.buffer.new_empty(1, 0)), row.sampling,
                                          row.generator)
            tokens = row.commit(verdict.emitted[0, :1])
            row.stats.num_target_forwards += 1
            if not row.finished:
                taps = {i: t[j: j + 1, : row.prompt_length] for i, t in out.taps.items()}
                row.proposer.prefill(row.state(0), TargetOutput(logits=logits, taps=taps))
            active.append(row)
            if on_tokens is not None:
                on_tokens(row.index, tokens)
        elapsed = time.perf_counter() - start  # the proposers' resets and prefills included
        for row in joining:
            row.stats.prefill_seconds = elapsed

    def step(self, rows: list[Row]) -> list[list[int]]:
        """One speculative step for every row: each row's proposer drafts; one target forward reads each row's
        [last committed token, draft], right-padded to the widest; each row is verified on its own logits
        with its own generator (rows of one verifier and sampling in one `verify_rows` call); the cache keeps
        what each row accepted. Returns each row's committed tokens."""
        cuts = self._budget_for(rows)  # may probe the forward's cost first
        start = time.perf_counter()
        drafts, whole = self._propose(rows, cuts)
        drafted = time.perf_counter()
        width = 1 + max(draft.num_tokens for draft in drafts)
        feed = torch.zeros(len(rows), width, dtype=torch.long, device=self.target.device)  # [B, 1 + k_max]
        for b, (row, draft) in enumerate(zip(rows, drafts, strict=True)):
            feed[b, 0] = row.buffer[0, row.length - 1]
            feed[b, 1: 1 + draft.num_tokens] = draft.tokens[0]
        trees = [None if d.parents is None or tree.is_chain(d.parents) else d.parents for d in drafts]
        parents: list[int] | list[list[int]] | None = None
        if any(t is not None for t in trees):  # one tree for one row, else a tree per row (chains as trees)
            parents = trees[0] if len(rows) == 1 else [padded_parents(d, width - 1) for d in drafts]
        forward_start = time.perf_counter()
        out = self.target.forward(feed, tree_parents=parents)  # logits [B, 1 + k_max, V]
        forward_seconds = time.perf_counter() - forward_start
        verdicts = verify_groups(rows, out.logits, drafts)
        accepted = torch.cat([v.num_accepted.reshape(1) for v in verdicts]).tolist()  # one host read per step
        lengths = [row.length for row in rows]  # committed before this step; the cache held one fewer
        if parents is None:
            self.target.crop([length + n for length, n in zip(lengths, accepted, strict=True)])
        else:  # keep each row's accepted path (a chain row's is its first n tokens)
            self.target.retain(lengths, accepted_paths(verdicts, trees, accepted, self.target.device))
        verified = time.perf_counter()
        committed = []
        for b, (row, draft, verdict, n) in enumerate(zip(rows, drafts, verdicts, accepted, strict=True)):
            row_tree = trees[b]
            if self.draft_budget is None:
                path = range(n) if row_tree is None else verdict.path[0, :n].tolist()  # type: ignore[union-attr]
                self.budget.record(draft.num_tokens, path, whole[b])
            row.stats.record_step(n, draft.num_tokens if row_tree is None else max(tree.depths(row_tree)))
            row.stats.verify_seconds += verified - drafted
            committed.append(row.commit(verdict.emitted[0, : n + 1]))
            if not row.finished:
                observed = time.perf_counter()
                assert row.proposer is not None
                row.proposer.observe(row.state(0), verdict, row_output(out, b, draft, verdict, n, row_tree))
                row.stats.propose_seconds += time.perf_counter() - observed
        if self.draft_budget is None:
            self.budget.record_forward(len(rows), width, forward_seconds)
            self.budget.record_step_time(len(rows), width > 1, time.perf_counter() - start - forward_seconds)
        return committed

    def _budget_for(self, rows: list[Row]) -> list[int | None]:
        """Draft tokens each row may verify at this step (None: all it drafts); see specdec.budget."""
        if self.draft_budget is not None:
            return [self.draft_budget] * len(rows)
        if len(rows) == 1 and not rows[0].sampling.greedy:
            # a lone sampling row verifies its whole draft, so that its seed reproduces its output: a cut chosen
            # from timed forwards would make the sample depend on the machine's load (greedy output does not)
            return [None]
        if self.budget.needs_probe(len(rows)):
            last = torch.stack([row.buffer[0, row.length - 1] for row in rows]).unsqueeze(1)  # [B, 1]
            self.budget.probe(self.target, len(rows), last, self.target.cache_lengths)
        return self.budget.choose(len(rows), max(row.draft_budget for row in rows))

    def _propose(self, rows: list[Row], cuts: list[int | None]) -> tuple[list[Draft], list[bool]]:
        """Each row's draft, cut to its first `cuts[b]` tokens (0: its proposer is not asked), and whether it is
        the proposer's whole draft. Several rows draft in one `propose_batch` call, so a proposer may share one
        forward among them."""
        drafts = [Draft(tokens=row.buffer.new_empty(1, 0)) for row in rows]
        whole = [False] * len(rows)
        asked = [b for b, (row, cut) in enumerate(zip(rows, cuts, strict=True)) if row.draft_budget > 0 and cut != 0]
        if not asked:
            return drafts, whole
        start = time.perf_counter()
        # a row cut to m tokens asks its proposer for m, not for a whole draft to cut: DFlash's head and trees
        # then cover m slots, not its block's seven (at 16 rows cut to 1-3 tokens, scoring and walking all seven
        # was ~6% of a generation's time on a 2-core CPU, spent on slots no row would verify)
        asks = [rows[b].draft_budget if (cut := cuts[b]) is None else min(cut, rows[b].draft_budget) for b in asked]
        states = [rows[b].state(ask) for b, ask in zip(asked, asks, strict=True)]
        proposers = [rows[b].proposer for b in asked]
        if len(asked) == 1:
            made = [proposers[0].propose(states[0])]  # type: ignore[union-attr]
        else:
            made = type(self.proposer).propose_batch(proposers, states)  # type: ignore[arg-type]
        if not isinstance(made, list) or len(made) != len(asked):
            raise PluginError(f"Proposer {type(self.proposer).name!r} ({type(self.proposer).__module__}) returned "
                              f"{len(made) if isinstance(made, list) else type(made).__name__} drafts from "
                              f"propose_batch for {len(asked)} rows; expected a list of one draft per row.")
        share = (time.perf_counter() - start) / len(asked)
        for b, ask, state, draft in zip(asked, asks, states, made, strict=True):
            check_draft(rows[b].proposer, self.target, draft, state, rows[b].verifier)  # type: ignore[arg-type]
            rows[b].stats.propose_seconds += share
            draft = on_device(draft, rows[b].buffer.device)
            # whole: the proposer's own draft, not cut (a row asked for fewer tokens than it may verify cannot tell)
            whole[b] = ask == rows[b].draft_budget and (cuts[b] is None or draft.num_tokens <= cuts[b])  # type: ignore[operator]
            drafts[b] = draft if cuts[b] is None else trim(draft, cuts[b])  # type: ignore[arg-type]
        return drafts, whole

    def retire(self, active: list[Row], idle: list[Proposer], last: bool) -> None:
        """Finished rows leave the batch (and the cache); their proposers wait for the next prompt. When the
        last rows finish the cache is left as the last step made it (the next generation resets it)."""
        done = [b for b, row in enumerate(active) if row.finished]
        if not done:
            return
        if self.target.can_batch and not (last and len(done) == len(active)):
            self.target.drop_rows(done)
        now = time.perf_counter()
        for b in reversed(done):
            row = active.pop(b)
            row.stats.wall_seconds = now - row.joined_at
            assert row.proposer is not None
            idle.append(row.proposer)
            row.proposer = None


def verify_groups(rows: list[Row], logits: torch.Tensor, drafts: list[Draft]) -> list[Verdict]:
    """Each row's verdict from its own verifier: rows that share a verifier and sampling parameters in one
    `verify_rows` call (all rows, without a copy, in the common case of one kind of decoding)."""
    groups: dict[tuple[int, SamplingParams], list[int]] = {}
    for b, row in enumerate(rows):
        groups.setdefault((id(row.verifier), row.sampling), []).append(b)
    verdicts: list[Verdict | None] = [None] * len(rows)
    for members in groups.values():
        verifier = rows[members[0]].verifier
        part = logits if len(members) == len(rows) else logits[members]
        got = verifier.verify_rows(part, [drafts[b] for b in members], rows[members[0]].sampling,
                                   [rows[b].generator for b in members])
        if not isinstance(got, list) or len(got) != len(members):
            raise PluginError(f"Verifier {type(verifier).name!r} ({type(verifier).__module__}) returned "
                              f"{len(got) if isinstance(got, list) else type(got).__name__} verdicts from "
                              f"verify_rows for {len(members)} rows; expected a list of one per row.")
        for b, verdict in zip(members, got, strict=True):
            verdicts[b] = verdict
    return verdicts  # type: ignore[return-value]


def padded_parents(draft: Draft, size: int) -> list[int]:
    """A row's draft as a tree of `size` nodes for a forward where other rows draft more: a chain keeps its
    parents (each token under the one before); the padding nodes hang under the root, so no real node sees
    them, and the cache drops them."""
    k = draft.num_tokens
    parents = list(draft.parents) if draft.parents is not None else list(range(-1, k - 1))
    return parents + [-1] * (size - k)


def accepted_paths(verdicts: list[Verdict], trees: list[list[int] | None], accepted: list[int],
                   device: torch.device) -> torch.Tensor:
    """Each row's accepted draft nodes [B, max accepted], -1 padded (KVCache.retain's indices)."""
    paths = torch.full((len(verdicts), max(accepted)), -1, dtype=torch.long, device=device)
    for b, (verdict, row_tree, n) in enumerate(zip(verdicts, trees, accepted, strict=True)):
        if n == 0:
            continue
        if row_tree is None:
            paths[b, :n] = torch.arange(n, device=device)
        else:
            assert verdict.path is not None, "tree verifiers return the accepted path"
            paths[b, :n] = verdict.path[0, :n].to(device)
    return paths


def row_output(out: TargetOutput, b: int, draft: Draft, verdict: Verdict, accepted: int,
               row_tree: list[int] | None) -> TargetOutput:
    """Row b's part of the verification forward, as a one-row proposer sees it: logits and taps at the last
    committed token and its draft; for a tree, at the accepted path, seen as the chain it became."""
    width = draft.num_tokens + 1
    row = TargetOutput(logits=out.logits[b: b + 1, :width], taps={i: t[b: b + 1, :width] for i, t in out.taps.items()})
    if row_tree is None:
        return row
    assert verdict.path is not None, "tree verifiers return the accepted path"
    path = verdict.path[0, :accepted].to(out.logits.device)
    return row.select(torch.cat([path.new_zeros(1), path + 1]))
