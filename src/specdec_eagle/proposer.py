"""The `eagle3` proposer: a one-layer draft fed the target's hidden states guesses token by token, as a
chain or as a dynamic tree (EAGLE-2's expansion)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import torch
from pydantic import Field

from specdec import DecodeState, Draft, tree
from specdec.hidden_state import HiddenStateProposer, holds_draft
from specdec.limits import MAX_VERIFY_TOKENS, VERIFY_WHY, at_most, check_draft_sizes
from specdec.prepacked import route_through_packed
from specdec.sampling import SamplingParams, logits_to_probs

from .checkpoint import check_against_target, load_draft, read_config_for
from .model import Eagle3Cache, Eagle3Config

#: the EAGLE-3 draft this project trained for the embedded default target, shipped inside the package
SHIPPED_DRAFT = Path(__file__).parent / "drafts" / "smollm2-135m-instruct"


def shipped_draft_available() -> bool:
    return holds_draft(SHIPPED_DRAFT)


class Eagle3Proposer(HiddenStateProposer):
    name = "eagle3"
    description = "EAGLE-3: a one-layer draft fed three target layers' hidden states drafts token by token"
    chain_hint = "--opt tree_size=0"
    shipped_draft = SHIPPED_DRAFT
    check_against_target = staticmethod(check_against_target)

    class Config(HiddenStateProposer.Config):
        draft: str | None = Field(None, description="EAGLE-3 checkpoint folder (default: the shipped SmolLM2 "
                                  "draft, when this package ships one)")
        # each at most MAX_VERIFY_TOKENS: a chain or tree deeper than one verification forward holds, a tree of
        # more nodes, or a tree_width beyond it (at most tree_size nodes of one depth, or children of one node,
        # are verified) cannot be verified
        num_tokens: Annotated[int, at_most(MAX_VERIFY_TOKENS, VERIFY_WHY)] = Field(
            6, ge=1, description="draft forwards per step: the chain's length, the tree's depth")
        tree_size: Annotated[int, at_most(MAX_VERIFY_TOKENS, VERIFY_WHY)] = Field(
            16, ge=0, description="N >= 1: verify the N likeliest draft tokens as a tree (EAGLE-2's dynamic tree; "
            "greedy decoding, or drafting=greedy); 0 = a chain")
        tree_width: Annotated[int, at_most(MAX_VERIFY_TOKENS, VERIFY_WHY)] = Field(
            4, ge=1, description="tree: nodes expanded per depth and children kept per node")
        drafting: Literal["sample", "greedy"] = Field(
            "sample", description="at temperature > 0: draft the chain from the draft's own distribution and "
            "pass it to the verifier (sample), or draft argmax tokens as point masses, a tree when tree_size > 0 "
            "(greedy)")

    def check_sizes(self, max_context: int) -> None:
        config = self.config
        check_draft_sizes(self.name, max_context, num_tokens=config.num_tokens, tree_size=config.tree_size,
                          tree_width=config.tree_width)

    def read_draft_config(self, folder: Path) -> Eagle3Config:
        return read_config_for(folder, self.target.num_layers)  # taps the checkpoint leaves out: the target's

    def load(self, folder: Path, draft_config: Eagle3Config) -> None:
        target = self.target
        self.model = load_draft(folder, dtype=target.dtype, device=target.device, num_target_layers=target.num_layers)
        self.vocab_ids = self.model.target_ids(torch.arange(draft_config.draft_vocab_size, device=target.device))
        self.prepacked = route_through_packed([self.model])  # few-row products, laid out once (bf16 CPU)

    def new_cache(self) -> Eagle3Cache:
        return Eagle3Cache()

    def _read_context(self, state: DecodeState) -> torch.Tensor:
        """Feed the pending target features (positions p..T-2, each with token p+1..T-1) into the draft's
        cache; returns the draft's output at position T-2, the feature of its first guess [B, 1, H]."""
        context = self.take_pending(state)
        assert self.cache.length() == context.start, "draft cache out of sync"
        tokens = state.tokens[:, context.start + 1:]
        out = self.model(self.target.embed_tokens(tokens), self.model.fuse(context.states),
                         context.positions.expand(tokens.shape[0], -1), self.cache)
        return out[:, -1:]

    def drafts_trees(self, sampling: SamplingParams) -> bool:
        return bool(self.config.tree_size) and (sampling.greedy or self.config.drafting == "greedy")

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> Draft:
        k = min(self.config.num_tokens, state.max_draft_tokens)
        sampling = state.sampling
        sampled = sampling is not None and not sampling.greedy and self.config.drafting == "sample"
        feature = self._read_context(state)
        committed = self.cache.length()
        try:
            if self.config.tree_size and state.batch_size == 1 and not sampled:
                return self._tree(feature, state.length, k)
            return self._chain(feature, state, k, sampled)
        finally:
            self.cache.crop(committed)  # the guesses' keys go; the next step reads the target's features

    def _chain(self, feature: torch.Tensor, state: DecodeState, k: int, sampled: bool) -> Draft:
        tokens, probs = [], []
        for j in range(k):
            logits = self.model.logits(feature)[:, -1]  # [B, V']
            if sampled:
                q = logits_to_probs(logits, state.sampling)
                pick = torch.multinomial(q, 1, generator=state.generator)
                full = q.new_zeros(q.shape[0], self.target.vocab_size)
                probs.append(full.index_copy_(-1, self.vocab_ids, q))
            else:  # max(...).indices is argmax (first index on ties), faster on bf16 CPU tensors
                pick = logits.max(dim=-1, keepdim=True).indices
            token = self.vocab_ids[pick]  # [B, 1]
            tokens.append(token)
            if j + 1 < k:  # the guess at position T + j becomes the next input, the output the next feature
                position = torch.full_like(token, state.length - 1 + j)
                feature = self.model(self.target.embed_tokens(token), feature, position, self.cache)
        return Draft(tokens=torch.cat(tokens, dim=1), probs=torch.stack(probs, dim=1) if sampled else None)

    def _tree(self, feature: torch.Tensor, length: int, depth: int) -> Draft:
        """EAGLE-2's dynamic tree: at each depth the `tree_width` likeliest nodes (by the product of draft
        probabilities along their path) are read by the draft in one forward, each keeping its
        `tree_width` likeliest children; finally the `tree_size` likeliest nodes of all are verified.
        A node's estimate never exceeds its parent's, so the chosen nodes form a tree. Each depth keeps only
        its likeliest `_kept_per_depth` nodes, which changes nothing (see `best_children`) and keeps a wide
        tree's work per depth at tree_width^2 numbers rather than as many Python paths."""
        width = min(self.config.tree_width, self.vocab_ids.numel())
        committed = self.cache.length()
        # nodes: (log estimate, path of target ids from the root)
        logq = self.model.logits(feature)[0, -1].float().log_softmax(-1)
        top = logq.topk(width)
        frontier = [(value, [token]) for value, token in zip(top.values.tolist(),
                                                             self.vocab_ids[top.indices].tolist(), strict=True)]
        nodes = list(frontier)
        slots: dict[tuple[int, ...], int] = {}  # path -> index of its key among the guesses in the cache
        features = {(): feature[0, -1]}
        for d in range(1, depth):
            frontier.sort(key=lambda node: -node[0])
            expand = frontier[:width]
            # each expanded node sees the committed context, its ancestors' keys and its own (one scatter)
            n, fed = len(expand), len(slots)
            rows = [row for row, (_, path) in enumerate(expand) for _ in range(len(path) - 1)] + list(range(n))
            cols = [committed + slots[tuple(path[:cut])] for _, path in expand for cut in range(1, len(path))]
            cols += [committed + fed + row for row in range(n)]
            mask = torch.zeros(n, committed + fed + n, dtype=torch.bool)
            mask[:, :committed] = True
            mask[rows, cols] = True
            tokens = torch.tensor([[path[-1] for _, path in expand]], device=feature.device)
            parent_features = torch.stack([features[tuple(path[:-1])] for _, path in expand]).unsqueeze(0)
            positions = torch.full_like(tokens, length - 2 + d)
            out = self.model(self.target.embed_tokens(tokens), parent_features, positions, self.cache,
                             mask.to(feature.device))  # [1, n, H]
            for row, (_, path) in enumerate(expand):
                slots[tuple(path)] = len(slots)
                features[tuple(path)] = out[0, row]
            logq = self.model.logits(out)[0].float().log_softmax(-1)  # [n, V']
            top = logq.topk(width, dim=-1)
            frontier = best_children(expand, top.values, self.vocab_ids[top.indices], self._kept_per_depth(width))
            nodes.extend(frontier)
        nodes.sort(key=lambda node: (-node[0], len(node[1])))  # a parent before its children, even on ties
        tokens, parents = tree.from_paths([path for _, path in nodes[: self.config.tree_size]])
        return Draft(tokens=torch.tensor([tokens], device=feature.device), parents=parents)

    def _kept_per_depth(self, width: int) -> int:
        """How many nodes of one depth `_tree` keeps: the `tree_size` that can be verified, and at least the
        `width` that are expanded."""
        return max(self.config.tree_size, width)


Node = tuple[float, list[int]]  # (log estimate: the sum of draft log-probabilities along the path, target ids)


def best_children(expand: list[Node], values: torch.Tensor, ids: torch.Tensor, keep: int) -> list[Node]:
    """The children of the nodes `expand` (child log-probabilities `values` and target ids `ids`, [n, w]), in
    row-major order, keeping only the `keep` likeliest (among equal estimates, the earlier).

    Dropping the others changes no tree: a dropped child has `keep` >= tree_size siblings-or-cousins of its
    depth ranked before it (by estimate, then order, as the final selection ranks them), so it is never among
    the tree_size nodes verified; its descendants' estimates are no larger, so neither are they; and the next
    depth expands the `width` <= keep likeliest. The sums are float64, as Python's were."""
    n, w = values.shape
    if n * w <= keep:  # nothing to drop (the default tree): plain Python is faster for a few nodes
        return [(value + child_value, path + [child])
                for (value, path), child_values, child_ids in zip(expand, values.tolist(), ids.tolist(), strict=True)
                for child_value, child in zip(child_values, child_ids, strict=True)]
    parents = torch.tensor([value for value, _ in expand], dtype=torch.float64)
    estimates = (parents.unsqueeze(1) + values.detach().double().cpu()).flatten()  # [n * w], row-major
    chosen = torch.sort(-estimates, stable=True).indices[:keep].sort().values  # back in row-major order
    flat_ids = ids.flatten().cpu()
    return [(estimate, expand[index // w][1] + [child])
            for estimate, index, child in zip(estimates[chosen].tolist(), chosen.tolist(), flat_ids[chosen].tolist(),
                                              strict=True)]
