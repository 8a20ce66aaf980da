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

from pathlib import Path

import torch
from pydantic import Field

from specdec import Draft, tree
from specdec.errors import SpecdecError

from .checkpoint import read_config
from .dflash2_model import CandidateSelector, DFlash2Config
from .proposer import TREE_RUNNER_UPS, DFlashProposer, _Job, best_first_expand, ordered_paths

#: the DFlash2 draft this project trained for the embedded default target, shipped inside the package
SHIPPED_DRAFT = Path(__file__).parent / "drafts" / "smollm2-135m-instruct-dflash2"



class DFlash2Proposer(DFlashProposer):
    name = "dflash2"
    description = ("DFlash2: DFlash with dynamic convolutions in every layer and a candidate selector that "
                   "rescores each slot's top-k by the token before it (z-lab, 2026-08)")
    # below dflash: the shipped DFlash2 draft (1 layer, 120 one-core + 50 two-core minutes) is level with the
    # shipped DFlash one on 20 prompts of GSM8K and MT-Bench; the default changes only on a larger measurement
    default_priority = 90
    shipped_draft = SHIPPED_DRAFT

    class Config(DFlashProposer.Config):
        draft: str | None = Field(None, description="DFlash2 checkpoint folder, z-lab's layout (default: the "
                                  "shipped SmolLM2 DFlash2 draft)")

    def read_draft_config(self, folder: Path) -> DFlash2Config:
        if self.target.dtype == torch.float16:
            # z-lab's DFlash2 drafts are bf16-trained; in float16 the residual stream and the convolution's
            # kernels overflow (vLLM's ports saw NaN and no acceptance)
            raise SpecdecError("DFlash2 drafts overflow in float16; run the target in bfloat16 or float32 "
                               "(--dtype bfloat16).")
        config = read_config(folder)
        if not isinstance(config, DFlash2Config):
            raise SpecdecError(f"{folder} holds a DFlash draft (DFlashDraftModel), not a DFlash2 one; use "
                               "--proposer dflash.")
        return config

    @property
    def selector(self) -> CandidateSelector:
        return self.model.candidate_selector

    def _finish(self, job: _Job, logits: torch.Tensor, hidden: torch.Tensor) -> Draft:
        """logits [1, k, V'] (transformed), hidden [1, k, H] at slots 1..k -> the draft."""
        width = min(self.selector.top_k, logits.shape[-1])
        unary, picks = logits[0].float().topk(width, dim=-1)  # [k, width]
        candidates = self._to_target_ids(picks)  # [k, width] target token ids
        factors = self.selector.edge_factors(hidden[0], candidates)  # [k, width, r]
        anchor = job.block[0, :1]  # [1]: the last committed token precedes slot 1
        if job.use_tree:
            return self._tree2(unary, candidates, factors, anchor, job)
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

    def _tree2(self, unary: torch.Tensor, candidates: torch.Tensor, factors: torch.Tensor, anchor: torch.Tensor,
               job: _Job) -> Draft:
        """The `tree_size` nodes likeliest to be accepted, a node's estimate being the product of the
        selector's probabilities (softmax of the scores given the node's own path) along its path."""
        slots = candidates.shape[0]
        width = min(1 + TREE_RUNNER_UPS, candidates.shape[1])
        if self.config.expansion == "best_first":
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
        else:
            paths, chain = self._chain_paths2(unary, candidates, factors, anchor, width)
        lookup = job.found
        if self.config.lookup_after and job.lookup:
            lookup = lookup + self._lookups_after(chain, job.state.max_draft_tokens)
        tokens, parents = tree.from_paths(ordered_paths([c.tolist() for c in lookup], paths))
        return Draft(tokens=torch.tensor([tokens], device=unary.device), parents=parents)

    @staticmethod
    def _greedy_path(children, slots: int) -> list[int]:
        path: list[int] = []
        for _ in range(slots):
            path.append(children(path)[1][0])
        return path

    def _chain_paths2(self, unary: torch.Tensor, candidates: torch.Tensor, factors: torch.Tensor,
                      anchor: torch.Tensor, width: int) -> tuple[list[list[int]], list[int]]:
        """The `tree_size` likeliest of: the walk's prefixes, and a runner-up at one slot (scored given the
        walk before it) followed by prefixes of the walk from that runner-up on. All branches walk together,
        one batched scoring per slot. Returns (paths, the walk)."""
        slots = candidates.shape[0]
        # the walk itself, and each slot's runner-ups given the walk's token before it
        previous, chain, chain_logq, branch_tokens, branch_logq = anchor, [], [], [], []
        for slot in range(slots):
            logq = self.selector.scores(unary[slot], factors[slot], previous)[0].log_softmax(-1)
            top = logq.topk(width)
            previous = candidates[slot][top.indices[:1]]
            chain.append(previous)
            chain_logq.append(top.values[0])
            branch_tokens.append(candidates[slot][top.indices[1:]])
            branch_logq.append(top.values[1:])
        # branch (j, r) starts at slot j; walk every branch on to the last slot, one scoring per slot
        start = torch.cat([torch.full_like(t, j) for j, t in enumerate(branch_tokens)])  # [M]
        previous = torch.cat(branch_tokens)  # [M]
        estimate = torch.stack(chain_logq).cumsum(0)
        before = torch.cat([estimate.new_zeros(1), estimate[:-1]])  # the walk's estimate before slot j
        walked, walked_logq = [previous], [before[start] + torch.cat(branch_logq)]
        for slot in range(1, slots):
            logq = self.selector.scores(unary[slot], factors[slot], previous).log_softmax(-1)  # [M, width]
            best = logq.max(-1)
            previous = torch.where(start < slot, candidates[slot][best.indices], previous)
            walked.append(previous)
            walked_logq.append(walked_logq[-1] + torch.where(start < slot, best.values, 0.0))
        tokens = torch.stack(walked, 1).tolist()  # [M, slots]: branch tokens from its start on (and filler before)
        logqs = torch.stack(walked_logq, 1).tolist()
        chain_ids = torch.cat(chain).tolist()
        found: list[tuple[float, list[int]]] = [(value, chain_ids[: d + 1])
                                                 for d, value in enumerate(estimate.tolist())]
        for m, j in enumerate(start.tolist()):
            for d in range(j, slots):  # the branch's prefixes: runner-up at j, then the walk from it to d
                found.append((logqs[m][d], chain_ids[:j] + tokens[m][j: d + 1]))
        found.sort(key=lambda c: (-c[0], len(c[1])))  # a parent before its children, even on ties
        return [path for _, path in found[: self.config.tree_size]], chain_ids
