"""The `dflash2` proposer: DFlash's block drafting, then the candidate selector's walk along the block.

Everything before the draft's logits is DFlash's (the block, the context, batching, prompt lookup, the
budget); what differs is how the logits become a draft. Each slot's `selector_top_k` likeliest tokens are
rescored by the token before them (specdec_dflash.dflash2_model.CandidateSelector), so the tokens of a draft
depend on each other:

- chain (greedy, or `drafting=greedy`): the walk takes each slot's best-scored candidate;
- sampled (temperature > 0, `drafting=sample`): each slot's token is drawn from softmax(score / T) over its
  candidates, the walk going on from the token drawn, and the verifier gets that sparse distribution as q
  (z-lab's reference applies no top-k/top-p to the draft);
- tree (`tree_size` > 0, greedy): runner-up candidates scored given the tokens before them, each followed by
  the selector's walk from it (`expansion=chain`), or any path expanded best first with each node's children
  scored given its own token (`expansion=best_first`); prompt-lookup continuations join as for dflash.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from pydantic import Field

from specdec import Draft
from specdec.errors import SpecdecError

from .checkpoint import read_config
from .dflash2_model import CandidateSelector, DFlash2Config
from .proposer import TREE_RUNNER_UPS, DFlashProposer, _Job, best_first_expand

#: the DFlash2 draft this project trained for the embedded default target, shipped inside the package
SHIPPED_DRAFT = Path(__file__).parent / "drafts" / "smollm2-135m-instruct-dflash2"



class DFlash2Proposer(DFlashProposer):
    name = "dflash2"
    description = ("DFlash2: DFlash with dynamic convolutions in every layer and a candidate selector that "
                   "rescores each slot's top-k by the token before it (z-lab, 2026-08)")
    # above dflash: with the shipped drafts, level or ahead at batch 1 (GSM8K 40: 2.28x against 2.26x; MT-Bench
    # 40: 2.01x against 1.99x) and ahead in batches, where its one-layer draft's cheaper forward counts every
    # step (docs/benchmarks.md, "Stop 30")
    default_priority = 110
    shipped_draft = SHIPPED_DRAFT

    class Config(DFlashProposer.Config):
        draft: str | None = Field(None, description="DFlash2 checkpoint folder, z-lab's layout (default: the "
                                  "shipped SmolLM2 DFlash2 draft)")

    @staticmethod
    def _draft_dtype(target_dtype: torch.dtype) -> torch.dtype:
        # DFlash2 drafts are bf16-trained; in float16 the residual stream and the convolution's kernels overflow
        # (vLLM's ports saw NaN and no acceptance), so under a float16 target the draft computes in float32
        return torch.float32 if target_dtype == torch.float16 else target_dtype

    def read_draft_config(self, folder: Path) -> DFlash2Config:
        config = read_config(folder)
        if not isinstance(config, DFlash2Config):
            raise SpecdecError(f"{folder} holds a DFlash draft (DFlashDraftModel), not a DFlash2 one; use "
                               "--proposer dflash.")
        return config

    @property
    def selector(self) -> CandidateSelector:
        return self.model.candidate_selector

    def _candidates(self, logits: torch.Tensor, hidden: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """logits [R, k, V'] (transformed), hidden [R, k, H] at slots 1..k -> each slot's unary scores and
        candidate target ids [R, k, width], and the selector's edge factors [R, k, width, r]."""
        width = min(self.selector.top_k, logits.shape[-1])
        unary, picks = logits.float().topk(width, dim=-1)  # [R, k, width]
        candidates = self._to_target_ids(picks)
        return unary, candidates, self.selector.edge_factors(hidden, candidates)

    def _finish_rows(self, rows: Sequence[tuple[DFlashProposer, _Job]], logits: torch.Tensor,
                     hidden: torch.Tensor) -> list[Draft]:
        """As DFlash's, but greedy trees expanded along the walk (the default) are scored for all rows of one
        draft length at once: one row's selector walk is some twenty small products, and at 16 rows doing
        them row by row cost ~10% of a step on this project's CPU."""
        drafts, together = self._rows_apart(rows, logits, hidden,
                                            lambda job: job.use_tree and self.config.expansion == "chain")
        for k, members in together.items():
            index = torch.tensor(members, device=logits.device)
            unary, candidates, factors = self._candidates(logits[index, 1: 1 + k], hidden[index, 1: 1 + k])
            anchors = torch.cat([rows[r][1].block[:, :1] for r in members])  # [R', 1]: the last committed tokens
            width = min(1 + TREE_RUNNER_UPS, candidates.shape[-1])
            for r, (paths, chain) in zip(members, self._chain_paths2(unary, candidates, factors, anchors, width),
                                         strict=True):
                proposer, job = rows[r]
                drafts[r] = proposer._tree_draft(job, paths, chain, logits.device)
        return drafts  # type: ignore[return-value]

    def _finish(self, job: _Job, logits: torch.Tensor, hidden: torch.Tensor) -> Draft:
        """logits [1, k, V'] (transformed), hidden [1, k, H] at slots 1..k -> the draft."""
        unary, candidates, factors = (t[0] for t in self._candidates(logits, hidden))  # [k, width], [k, width, r]
        anchor = job.block[0, :1]  # [1]: the last committed token precedes slot 1
        if job.use_tree:  # only best-first trees reach here (_finish_rows)
            return self._best_first_tree(unary, candidates, factors, anchor, job)
        sampling = job.state.sampling
        temperature = sampling.temperature if job.sampled else 0.0
        tokens, q = self._walk(unary, candidates, factors, anchor, temperature, job.state.generator)
        if not job.sampled:
            return Draft(tokens=tokens.unsqueeze(0))
        probs = q.new_zeros(1, job.k, self.target.vocab_size)
        probs[0].scatter_(-1, candidates, q)  # q is the selector's over each slot's candidates, 0 elsewhere
        return Draft(tokens=tokens.unsqueeze(0), probs=probs)

    def _walk(self, unary: torch.Tensor, candidates: torch.Tensor, factors: torch.Tensor, anchor: torch.Tensor,
              temperature: float, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The selector's walk: tokens [k] and each slot's distribution over its candidates [k, width] (the
        scores' softmax at `temperature`; at 0 the tokens are the best-scored and the rows are unused)."""
        previous, tokens, rows = anchor, [], []
        for slot in range(candidates.shape[0]):
            scores = self.selector.scores(unary[slot], factors[slot], previous)[0]  # [width]
            if temperature > 0:
                q = (scores / temperature).softmax(-1)
                index = torch.multinomial(q, 1, generator=generator)
                rows.append(q)
            else:
                index = scores.max(-1, keepdim=True).indices  # argmax, first on ties
            previous = candidates[slot].gather(0, index)
            tokens.append(previous)
        q = torch.stack(rows) if rows else unary.new_zeros(0)
        return torch.cat(tokens), q

    def _best_first_tree(self, unary: torch.Tensor, candidates: torch.Tensor, factors: torch.Tensor,
                         anchor: torch.Tensor, job: _Job) -> Draft:
        """expansion=best_first: the `tree_size` nodes likeliest to be accepted, a node's estimate being the
        product of the selector's probabilities (softmax of the scores given the node's own path) along its
        path. (Trees expanded along the walk are built for all rows at once, in _finish_rows.)"""
        slots = candidates.shape[0]
        width = min(1 + TREE_RUNNER_UPS, candidates.shape[1])
        cache: dict[tuple[int, ...], tuple[list[float], list[int]]] = {}

        def children(path: list[int]) -> tuple[list[float], list[int]]:
            key = tuple(path)
            if key not in cache:
                previous = anchor if not path else torch.tensor(path[-1:], device=anchor.device)
                slot = len(path)
                logq = self.selector.scores(unary[slot], factors[slot], previous)[0].log_softmax(-1)
                top = logq.topk(width)
                cache[key] = (top.values.tolist(), candidates[slot][top.indices].tolist())
            return cache[key]

        paths = best_first_expand(children, slots, self.config.tree_size)
        chain = self._greedy_path(children, slots) if self.config.lookup_after and job.lookup else []
        return self._tree_draft(job, paths, chain, unary.device)

    def _tree_draft(self, job: _Job, paths: list[list[int]], chain: list[int], device: torch.device) -> Draft:
        """The tree of `paths` and the row's prompt-lookup continuations (those seeded by `chain` as well)."""
        return self._paths_draft(paths, chain, job.found, self._seeded_depth(job), device)

    @staticmethod
    def _greedy_path(children, slots: int) -> list[int]:
        path: list[int] = []
        for _ in range(slots):
            path.append(children(path)[1][0])
        return path

    def _chain_paths2(self, unary: torch.Tensor, candidates: torch.Tensor, factors: torch.Tensor,
                      anchor: torch.Tensor, width: int) -> list[tuple[list[list[int]], list[int]]]:
        """For each of R rows (unary and candidates [R, k, w], factors [R, k, w, r], anchor [R, 1]): the
        `tree_size` likeliest of the walk's prefixes, and a runner-up at one slot (scored given the walk before
        it) followed by prefixes of the walk from that runner-up on. All rows' branches walk together, one
        batched scoring per slot. Returns each row's (paths, the walk)."""
        rows, slots = candidates.shape[:2]
        # the walk itself, and each slot's runner-ups given the walk's token before it
        previous, chain, chain_logq, branch_tokens, branch_logq = anchor, [], [], [], []
        for slot in range(slots):
            logq = self.selector.scores(unary[:, slot], factors[:, slot], previous)[:, 0].log_softmax(-1)  # [R, w]
            top = logq.topk(width)
            slot_ids = candidates[:, slot].gather(1, top.indices)  # [R, width], best first
            previous = slot_ids[:, :1]
            chain.append(previous)
            chain_logq.append(top.values[:, 0])
            branch_tokens.append(slot_ids[:, 1:])
            branch_logq.append(top.values[:, 1:])
        # branch (j, r) starts at slot j; walk every branch on to the last slot, one scoring per slot
        start = torch.cat([torch.full_like(t[0], j) for j, t in enumerate(branch_tokens)])  # [M]
        previous = torch.cat(branch_tokens, 1)  # [R, M]
        estimate = torch.stack(chain_logq, 1).cumsum(1)  # [R, slots]
        before = torch.cat([estimate.new_zeros(rows, 1), estimate[:, :-1]], 1)  # the walk's estimate before slot j
        walked, walked_logq = [previous], [before[:, start] + torch.cat(branch_logq, 1)]
        for slot in range(1, slots):
            logq = self.selector.scores(unary[:, slot], factors[:, slot], previous).log_softmax(-1)  # [R, M, w]
            best = logq.max(-1)
            previous = torch.where(start < slot, candidates[:, slot].gather(1, best.indices), previous)
            walked.append(previous)
            walked_logq.append(walked_logq[-1] + torch.where(start < slot, best.values, 0.0))
        tokens = torch.stack(walked, 2).tolist()  # [R, M, slots]: branch tokens from its start on (filler before)
        logqs = torch.stack(walked_logq, 2).tolist()
        chain_ids, estimates, starts = torch.cat(chain, 1).tolist(), estimate.tolist(), start.tolist()
        out = []
        for row in range(rows):
            found: list[tuple[float, list[int]]] = [(value, chain_ids[row][: d + 1])
                                                     for d, value in enumerate(estimates[row])]
            for m, j in enumerate(starts):
                for d in range(j, slots):  # the branch's prefixes: runner-up at j, then the walk from it to d
                    found.append((logqs[row][m][d], chain_ids[row][:j] + tokens[row][m][j: d + 1]))
            found.sort(key=lambda c: (-c[0], len(c[1])))  # a parent before its children, even on ties
            out.append(([path for _, path in found[: self.config.tree_size]], chain_ids[row]))
        return out
