"""The `dflash` proposer: one draft forward per step proposes up to block_size - 1 tokens."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from itertools import count
from pathlib import Path
from typing import Annotated, Literal, NamedTuple

import numpy as np
import torch
from pydantic import Field
from torch import nn

from specdec import DecodeState, Draft, Proposer, tree
from specdec.errors import SpecdecError
from specdec.hidden_state import HiddenStateProposer, PendingTaps
from specdec.limits import (
    MAX_NGRAM,
    MAX_VERIFY_TOKENS,
    NGRAM_WHY,
    VERIFY_WHY,
    at_most,
    check_at_most,
    check_draft_sizes,
    verify_capacity,
)
from specdec.lookup import NgramIndex
from specdec.prepacked import route_through_packed
from specdec.sampling import SamplingParams, logits_to_probs

from .checkpoint import check_against_target, load_draft, read_config
from .dflash2_model import DFlash2Config
from .model import DFlashConfig, DraftCache
from .vocab import head_rows_linear, load_vocab

#: runner-up tokens per slot a tree may branch to (`tree_size`); more rarely pays: their estimates fall fast
TREE_RUNNER_UPS = 4

#: prompt-lookup continuations (distinct earlier matches) a tree verifies beside the draft's candidates
LOOKUP_CANDIDATES = 3

#: the most tokens a prompt-lookup continuation proposes (beyond the draft's block when that is shorter)
LOOKUP_TOKENS = 10

#: which nodes come first in a tree draft, and so which a batch's draft budget keeps when it cuts the tree to
#: its first m nodes (specdec.budget.trim): "lookup_first" (the prompt-lookup continuations' nodes, then the
#: draft's by estimate) or "draft_first" (the draft's nodes by estimate, then the continuations'). A tree the
#: budget does not cut is verified whole either way, and the order of its nodes changes nothing in its verdict.
NODE_ORDER = "lookup_first"


def ordered_paths(lookup: list[list[int]], paths: list[list[int]]) -> list[list[int]]:
    """Prompt-lookup continuations and the draft's paths (best first) in NODE_ORDER, for tree.from_paths."""
    return lookup + paths if NODE_ORDER == "lookup_first" else paths + lookup


#: continuations looked up after each argmax-chain prefix (`lookup_after`)
SEEDED_LOOKUP_CANDIDATES = 2

#: draft tokens one `lookup_after` prefix may add to a tree: its continuations, each up to LOOKUP_TOKENS long
SEEDED_LOOKUP_TOKENS = SEEDED_LOOKUP_CANDIDATES * LOOKUP_TOKENS


def block_why(limit: int) -> str:
    """Why a block is at most `limit` + 1 positions (completes specdec.limits.too_large)."""
    return f"as a block drafts block_size - 1 tokens and one verification forward may hold at most {limit}"


def lookup_after_why(limit: int) -> str:
    """Why lookup_after is at most limit // SEEDED_LOOKUP_TOKENS."""
    return (f"as each seeded prefix adds up to {SEEDED_LOOKUP_TOKENS} draft tokens ({SEEDED_LOOKUP_CANDIDATES} "
            f"continuations of {LOOKUP_TOKENS}) and one verification forward may hold at most {limit}")


#: the draft this project trained for the embedded default target, shipped inside the package
SHIPPED_DRAFT = Path(__file__).parent / "drafts" / "smollm2-135m-instruct"


class _Job(NamedTuple):
    """One row's step that needs the draft forward (DFlashProposer._plan), finished by _finish."""

    state: DecodeState
    k: int  # draft slots used: block positions 1..k
    sampled: bool
    use_tree: bool
    lookup: bool
    found: list[np.ndarray]  # prompt-lookup continuations joining a tree
    block: torch.Tensor  # [1, block_size]: the last committed token, then mask tokens
    block_positions: torch.Tensor  # [1, block_size]
    context: PendingTaps



def best_first_paths(values: list[list[float]], ids: list[list[int]], size: int) -> list[list[int]]:
    """The `size` likeliest nodes of the tree whose children at depth d are slot d's candidate tokens
    (`ids[d]`, with log-probabilities `values[d]`), a node's estimate being the sum along its path; as root
    paths, best first."""
    return best_first_expand(lambda path: (values[len(path)], ids[len(path)]), len(ids), size)


def best_first_expand(children: Callable[[list[int]], tuple[list[float], list[int]]], depth: int,
                      size: int) -> list[list[int]]:
    """The `size` likeliest nodes of a tree at most `depth` deep whose node `path` has the children
    `children(path)` (log-probabilities, token ids), a node's estimate being the sum along its path; as root
    paths, best first. Estimates only shrink along a path, so a parent always comes before its children."""
    order = count()  # ties pop in push order: a parent before any child it pushes
    values, ids = children([])
    heap = [(-value, next(order), [token]) for value, token in zip(values, ids, strict=True)]
    heapq.heapify(heap)
    paths: list[list[int]] = []
    while heap and len(paths) < size:
        negative, _, path = heapq.heappop(heap)
        paths.append(path)
        if len(path) < depth:
            values, ids = children(path)
            for token, value in zip(ids, values, strict=True):
                heapq.heappush(heap, (negative - value, next(order), path + [token]))
    return paths


class DFlashProposer(HiddenStateProposer):
    name = "dflash"
    description = "DFlash block diffusion: a whole block drafted in one pass, conditioned on target hidden states"
    chain_hint = "--opt tree_size=0"
    default_priority = 100  # the shipped draft, where it fits the target, beats every default but dflash2
    shipped_draft = SHIPPED_DRAFT
    check_against_target = staticmethod(check_against_target)

    class Config(HiddenStateProposer.Config):
        draft: str | None = Field(None, description="DFlash checkpoint folder (default: the shipped SmolLM2 draft)")
        block_size: Annotated[int | None, at_most(MAX_VERIFY_TOKENS + 1, block_why(MAX_VERIFY_TOKENS))] = Field(
            None, ge=2, description=f"block size, at most the trained one (and {MAX_VERIFY_TOKENS + 1})")
        drafting: Literal["sample", "greedy"] = Field(
            "sample", description="at temperature > 0: draft the chain from the draft's own distribution and pass "
            "it to the verifier (sample), or draft argmax tokens as point masses, as z-lab's reference does, and "
            "as a tree when tree_size > 0 (greedy)")
        lookup: Annotated[int, at_most(MAX_NGRAM, NGRAM_WHY)] = Field(
            1, ge=0, description=f"0 = off; N >= 1 (at most {MAX_NGRAM}): when the last N to max(N, 3) tokens "
            "occurred earlier in prompt + output, also verify what followed them (prompt lookup, up to 3 "
            "continuations with a tree, else one instead of running the draft)")
        tree_size: Annotated[int, at_most(MAX_VERIFY_TOKENS, VERIFY_WHY)] = Field(
            16, ge=0, description=f"N >= 1 (at most {MAX_VERIFY_TOKENS}): verify the N draft tokens likeliest to be "
            "accepted as a tree: the chain and runner-ups at each slot followed by the rest of the chain (greedy "
            "decoding, or drafting=greedy); 0 = the draft's argmax chain, as the paper")
        expansion: Literal["chain", "best_first"] = Field(
            "chain", description="which paths a tree may hold: the chain, or a runner-up at one slot followed by "
            "the rest of the chain (chain); or any path through each slot's 5 likeliest tokens, expanded best "
            "first (best_first, EAGLE-2's expansion)")
        lookup_after: Annotated[int, at_most(MAX_VERIFY_TOKENS // SEEDED_LOOKUP_TOKENS,
                                             lookup_after_why(MAX_VERIFY_TOKENS))] = Field(
            0, ge=0, description=f"N >= 1 (at most {MAX_VERIFY_TOKENS // SEEDED_LOOKUP_TOKENS}), trees with lookup "
            "only: also look up what followed earlier occurrences of the context extended by the draft's first "
            "1..N argmax tokens (prompt lookup seeded by the draft); 0 = off")
        vocab: Literal["draft", "full"] = Field(
            "draft", description="score the draft's reduced vocabulary (draft_vocab.json, when the checkpoint has "
            "one) or the target's whole vocabulary (full)")

    @classmethod
    def default_for(cls, model: str | None) -> bool:
        return model is None and cls.has_shipped_draft()

    def read_draft_config(self, folder: Path) -> DFlashConfig:
        config = read_config(folder)
        if isinstance(config, DFlash2Config):
            raise SpecdecError(f"{folder} holds a DFlash2 draft (DFlash2DraftModel); use --proposer dflash2.")
        return config

    def check_sizes(self, max_context: int) -> None:
        config, limit = self.config, verify_capacity(max_context)
        check_draft_sizes(self.name, max_context, tree_size=config.tree_size)
        check_at_most(self.name, "block_size", config.block_size, limit + 1, block_why(limit))
        check_at_most(self.name, "lookup_after", config.lookup_after, limit // SEEDED_LOOKUP_TOKENS,
                      lookup_after_why(limit))

    def load(self, folder: Path, draft_config: DFlashConfig) -> None:
        config, target = self.config, self.target
        block_size = config.block_size or draft_config.block_size
        if block_size > draft_config.block_size:
            raise SpecdecError(f"block_size {block_size} is larger than the {draft_config.block_size} the draft "
                               f"{folder} was trained with; use --opt block_size={draft_config.block_size} or less.")
        limit = verify_capacity(target.max_context)
        if block_size > limit + 1:  # the trained block, where no option asks for less (the option was checked)
            raise SpecdecError(f"The DFlash draft {folder} was trained with block_size {block_size}, more than "
                               f"{limit + 1}, {block_why(limit)}; pass --opt block_size={limit + 1} or less.")
        self.draft_dtype = self._draft_dtype(target.dtype)
        self.model = load_draft(folder, dtype=self.draft_dtype, device=target.device)
        self.block_size = block_size
        vocab_ids = load_vocab(folder, target.vocab_size) if config.vocab == "draft" else None
        self.vocab_ids = None if vocab_ids is None else vocab_ids.to(target.device)
        self.head: nn.Linear | None = None  # the draft vocabulary's rows of the target's LM head
        if self.vocab_ids is not None:
            self.head = head_rows_linear(target.lm_head, self.vocab_ids)
        # the draft's few-row products, laid out once for oneDNN on a bf16 CPU (specdec.prepacked)
        self.prepacked = route_through_packed([self.model] + ([self.head] if self.head is not None else []))

    @staticmethod
    def _draft_dtype(target_dtype: torch.dtype) -> torch.dtype:
        """The dtype the draft computes in: the target's (its embeddings and taps enter as they are)."""
        return target_dtype

    def new_cache(self) -> DraftCache:
        return DraftCache(self.model.config.num_hidden_layers)

    def reset(self) -> None:
        super().reset()
        self._lookup_index = NgramIndex(max(self.config.lookup, 1), max(self.config.lookup, 3))

    def drafts_trees(self, sampling: SamplingParams) -> bool:
        return bool(self.config.tree_size) and (sampling.greedy or self.config.drafting == "greedy")

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> Draft:
        job = self._plan(state)
        return job if isinstance(job, Draft) else self._single(job)

    @classmethod
    @torch.inference_mode()
    def propose_batch(cls, proposers: Sequence[Proposer], states: Sequence[DecodeState]) -> list[Draft]:
        """Every row's block in one draft forward (each row with its own draft cache and context), and the head
        over every row in one product; rows answered by prompt lookup alone skip it."""
        drafts: list[Draft | None] = []
        jobs: list[tuple[int, DFlashProposer, _Job]] = []
        for proposer, state in zip(proposers, states, strict=True):
            assert isinstance(proposer, DFlashProposer)
            job = proposer._plan(state)
            drafts.append(job if isinstance(job, Draft) else None)
            if not isinstance(job, Draft):
                jobs.append((len(drafts) - 1, proposer, job))
        if len(jobs) == 1:
            index, proposer, job = jobs[0]
            drafts[index] = proposer._single(job)
        elif jobs:
            lead = jobs[0][1]
            assert all(p.model is lead.model for _, p, _ in jobs), "rows of one batch are forks of one proposer"
            blocks = torch.cat([job.block for _, _, job in jobs])  # [R, n]
            hidden = lead.model.forward_rows(
                lead._embed(blocks), [job.context.states.to(lead.draft_dtype) for _, _, job in jobs],
                [job.context.positions for _, _, job in jobs], torch.cat([job.block_positions for _, _, job in jobs]),
                [p.cache for _, p, _ in jobs])
            logits = lead._head_logits(hidden, max(job.k for _, _, job in jobs))  # [R, 1 + k_max, V']
            finished = lead._finish_rows([(proposer, job) for _, proposer, job in jobs], logits, hidden)
            for (index, _, _), draft in zip(jobs, finished, strict=True):
                drafts[index] = draft
        return [draft for draft in drafts if draft is not None]

    def _single(self, job: _Job) -> Draft:
        hidden = self.model(self._embed(job.block), job.context.states.to(self.draft_dtype), job.context.positions,
                            job.block_positions, cache=self.cache)
        return self._finish_rows([(self, job)], self._head_logits(hidden, job.k), hidden)[0]

    def _finish_rows(self, rows: Sequence[tuple[DFlashProposer, _Job]], logits: torch.Tensor,
                     hidden: torch.Tensor) -> list[Draft]:
        """Each row's draft from its block's logits [R, n, V'] and hidden states [R, n, H] (row r is rows[r],
        a fork of this proposer with its own lookup index). Trees rank the candidates of all rows of one draft
        length in one log-softmax and top-k: row by row, those small operations cost ~2% of a step at 16 rows
        on this project's CPU. What follows the ranking (paths, lookups) is each row's own."""
        drafts, together = self._rows_apart(rows, logits, hidden, lambda job: job.use_tree)
        for k, members in together.items():
            index = torch.tensor(members, device=logits.device)
            values, ids = self._top_candidates(logits[index, 1: 1 + k])
            for r, row_values, row_ids in zip(members, values, ids, strict=True):
                proposer, job = rows[r]
                drafts[r] = proposer._tree_from_top(row_values, row_ids, job.found, proposer._seeded_depth(job),
                                                    logits.device)
        return drafts  # type: ignore[return-value]

    @staticmethod
    def _rows_apart(rows: Sequence[tuple[DFlashProposer, _Job]], logits: torch.Tensor, hidden: torch.Tensor,
                    together_if: Callable[[_Job], bool]) -> tuple[list[Draft | None], dict[int, list[int]]]:
        """Rows finished one at a time (`_finish`, their drafts filled in) and the rows `together_if` keeps
        for the caller to finish together, by draft length k (their drafts left None)."""
        drafts: list[Draft | None] = [None] * len(rows)
        together: dict[int, list[int]] = {}
        for r, (proposer, job) in enumerate(rows):
            if together_if(job):
                together.setdefault(job.k, []).append(r)
            else:
                drafts[r] = proposer._finish(job, logits[r: r + 1, 1: 1 + job.k], hidden[r: r + 1, 1: 1 + job.k])
        return drafts, together

    def _plan(self, state: DecodeState) -> Draft | _Job:
        """What this step drafts: a prompt-lookup draft that needs no draft forward, or the block to run."""
        k = min(self.block_size - 1, state.max_draft_tokens)
        sampling = state.sampling
        sampled = sampling is not None and not sampling.greedy and self.config.drafting == "sample"
        # a tree is point masses: when sampling, drafting the chain from q measured faster (docs/benchmarks.md)
        use_tree = bool(self.config.tree_size) and state.batch_size == 1 and not sampled
        found: list[np.ndarray] = []
        lookup = bool(self.config.lookup) and state.batch_size == 1
        if lookup:
            limit = LOOKUP_CANDIDATES if use_tree else 1
            depth = min(max(k, LOOKUP_TOKENS), state.max_draft_tokens)  # copying may run past the block
            self._lookup_index.sync(state.tokens)
            found = self._lookup_index.continuations(depth, limit)
            if found and not use_tree:
                # the draft's context keeps accumulating in _pending and is read at its next forward
                return Draft(tokens=torch.from_numpy(found[0]).to(state.tokens.device).unsqueeze(0))
        length = state.length
        device = state.tokens.device
        block = torch.full((state.batch_size, self.block_size), self.model.config.mask_token_id, dtype=torch.long,
                           device=device)
        block[:, 0] = state.tokens[:, -1]
        block_positions = torch.arange(length - 1, length - 1 + self.block_size, device=device).unsqueeze(0)
        return _Job(state, k, sampled, use_tree, lookup, found, block, block_positions, self.take_pending(state))

    def _embed(self, block: torch.Tensor) -> torch.Tensor:
        """[R, n] token ids -> [R, n, H] the target's embeddings, in the draft's dtype."""
        return self.target.embed_tokens(block).to(self.draft_dtype)

    def _head_logits(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """hidden [R, n, H] -> logits [R, 1 + k, V'] at the block's first 1 + k positions (slots 0..k): a row
        asked for k < n - 1 tokens (the batch's draft budget) needs no more. The head reads a fresh copy of
        those positions: a bf16 matmul on a slice such as hidden[:, 1:] (offset storage) took ~8x longer on CPU
        than on a freshly allocated tensor."""
        if 1 + k < hidden.shape[1]:
            hidden = hidden[:, : 1 + k].contiguous()
        head = self.target.lm_head if self.vocab_ids is None else self.head
        logits = head(hidden.to(head.weight.dtype))  # [R, 1 + k, V or V']
        return self.model.transform_logits(logits)

    def _finish(self, job: _Job, logits: torch.Tensor, hidden: torch.Tensor) -> Draft:
        """The draft from the block's logits [B, k, V'] at slots 1..k (their hidden states [B, k, H] beside:
        DFlash2's selector reads them)."""
        state = job.state
        assert not job.use_tree, "trees are built in _finish_rows"
        if not job.sampled:
            # a point mass: the verifier needs no draft probs. max(...).indices is argmax (first index on ties)
            # and several times faster than argmax on bf16 CPU tensors.
            return Draft(tokens=self._to_target_ids(logits.max(dim=-1).indices))
        probs = logits_to_probs(logits, state.sampling)
        picks = torch.multinomial(probs.view(-1, probs.shape[-1]), 1, generator=state.generator).view(-1, job.k)
        if self.vocab_ids is not None:  # q over the whole vocabulary: zero outside the draft vocabulary
            full = probs.new_zeros(*probs.shape[:-1], self.target.vocab_size)
            probs = full.index_copy_(-1, self.vocab_ids, probs)
        return Draft(tokens=self._to_target_ids(picks), probs=probs)

    def _seeded_depth(self, job: _Job) -> int:
        """How deep prompt lookup seeded by the draft's chain may reach (`lookup_after`); 0 = not seeded."""
        return job.state.max_draft_tokens if self.config.lookup_after and job.lookup else 0

    def _top_candidates(self, logits: torch.Tensor) -> tuple[list[list[list[float]]], list[list[list[int]]]]:
        """logits [R, k, V'] -> each slot's 1 + TREE_RUNNER_UPS likeliest tokens, best first: log-probabilities
        and target ids, [R][k][width] as lists."""
        logq = logits.float().log_softmax(dim=-1)  # [R, k, V']
        top = logq.topk(min(1 + TREE_RUNNER_UPS, logq.shape[-1]), dim=-1)
        return top.values.tolist(), self._to_target_ids(top.indices).tolist()

    def _tree(self, logits: torch.Tensor, lookup: list[np.ndarray], seeded_depth: int = 0) -> Draft:
        """One row's tree from its slots' logits [k, V'] (_tree_from_top)."""
        values, ids = self._top_candidates(logits.unsqueeze(0))
        return self._tree_from_top(values[0], ids[0], lookup, seeded_depth, logits.device)

    def _tree_from_top(self, values: list[list[float]], ids: list[list[int]], lookup: list[np.ndarray],
                       seeded_depth: int, device: torch.device) -> Draft:
        """The `tree_size` draft tokens likeliest to be accepted, as a tree, plus the prompt-lookup
        continuations in `lookup`; `values` and `ids` are each slot's likeliest tokens (_top_candidates). A
        node's estimate is the product of the draft's probabilities along its path (EAGLE-2's expansion by
        confidence; a block drafter scores every slot at once, so the estimate treats slots as independent).
        Estimates only shrink along a path, so the best nodes form a tree. Which paths compete is
        `expansion`'s choice. With `seeded_depth` > 0, prompt lookup seeded by the chain (`_lookups_after`,
        paths up to that deep) joins `lookup`."""
        if self.config.expansion == "best_first":
            paths = best_first_paths(values, ids, self.config.tree_size)
        else:
            paths = self._chain_paths(values, ids)
        # the argmax chain is the top-1 column: no second pass over the logits
        return self._paths_draft(paths, [row[0] for row in ids], lookup, seeded_depth, device)

    def _paths_draft(self, paths: list[list[int]], chain: list[int], lookup: list[np.ndarray], seeded_depth: int,
                     device: torch.device) -> Draft:
        """The tree of the draft's `paths` and the prompt-lookup continuations `lookup`, joined (seeded_depth >
        0) by those seeded by the draft's `chain` (_lookups_after)."""
        if seeded_depth:
            lookup = lookup + self._lookups_after(chain, seeded_depth)
        tokens, parents = tree.from_paths(ordered_paths([c.tolist() for c in lookup], paths))
        return Draft(tokens=torch.tensor([tokens], device=device), parents=parents)

    def _chain_paths(self, values: list[list[float]], ids: list[list[int]]) -> list[list[int]]:
        """The `tree_size` likeliest of: the chain's prefixes, and a runner-up at one slot after the chain's
        prefix, followed by prefixes of the rest of the chain; parents before their children."""
        chain, best = [row[0] for row in ids], [row[0] for row in values]
        candidates: list[tuple[float, list[int]]] = []  # (log estimate, path from the root)
        for j in range(len(chain)):
            for r in range(0 if j == 0 else 1, len(ids[j])):  # rank 0 at slot 0 starts the chain itself
                estimate, path = sum(best[:j]) + values[j][r], chain[:j] + [ids[j][r]]
                candidates.append((estimate, path))
                for d in range(j + 1, len(chain)):  # then the rest of the chain
                    estimate, path = estimate + best[d], path + [chain[d]]
                    candidates.append((estimate, path))
        candidates.sort(key=lambda c: (-c[0], len(c[1])))  # a parent before its children, even on ties
        return [path for _, path in candidates[: self.config.tree_size]]

    def _lookups_after(self, chain: list[int], max_depth: int) -> list[np.ndarray]:
        """Prompt lookup seeded by the draft: for j = 1..lookup_after, the chain's first j tokens followed by
        what came after earlier occurrences of the committed tokens + those j tokens. Copying often resumes
        one or two tokens past the next one (a number, a name), which the unseeded lookup cannot reach."""
        paths = []
        for j in range(1, min(self.config.lookup_after, len(chain), max_depth - 1) + 1):
            seed = np.asarray(chain[:j], dtype=np.int64)
            budget = min(LOOKUP_TOKENS, max_depth - j)
            for continuation in self._lookup_index.continuations(budget, SEEDED_LOOKUP_CANDIDATES, extra=seed):
                paths.append(np.concatenate([seed, continuation]))
        return paths

    def _to_target_ids(self, indices: torch.Tensor) -> torch.Tensor:
        return indices if self.vocab_ids is None else self.vocab_ids[indices]
