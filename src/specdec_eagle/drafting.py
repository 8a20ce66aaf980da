"""One row's EAGLE-3 drafting as steps, so that the rows of a batch draft in lockstep: at each step every row
names the positions it wants the draft to read (`inputs`), one draft forward reads all rows' positions
(`Eagle3DraftModel.forward_rows`), and each row takes its outputs and logits back (`absorb`). A chain reads
one position per step; EAGLE-2's dynamic tree reads its `tree_width` best nodes of a depth."""

from __future__ import annotations

from typing import NamedTuple

import torch

from specdec import DecodeState, Draft, tree
from specdec.sampling import logits_to_probs

Node = tuple[float, list[int]]  # (log estimate: the sum of draft log-probabilities along the path, target ids)


class StepInputs(NamedTuple):
    """What one row has the draft read at a step: n positions."""

    tokens: torch.Tensor  # [n] target ids: the input token at each position
    features: torch.Tensor  # [n, H] each position's feature: the draft's output at its predecessor
    position: int  # every position of a step sits at the same depth, so at the same rotary position
    mask: torch.Tensor | None  # [n, c + n] bool over the row's cache and these positions; None: n == 1


class ChainDrafter:
    """The draft's argmax chain, or at temperature > 0 (drafting=sample) a chain drawn from its own
    distribution with that distribution q beside it, `k` tokens long."""

    def __init__(self, state: DecodeState, k: int, sampled: bool, vocab_ids: torch.Tensor, vocab_size: int):
        self.state, self.k, self.sampled = state, k, sampled
        self.vocab_ids, self.vocab_size = vocab_ids, vocab_size
        self.tokens: list[torch.Tensor] = []  # [1] target id per drafted token
        self.probs: list[torch.Tensor] = []  # [V] q over the whole vocabulary per drafted token (sampled)
        self.feature: torch.Tensor | None = None

    def absorb(self, outputs: torch.Tensor, logits: torch.Tensor) -> None:
        """The draft's output [1, H] and logits [1, V'] at the last position read: the next token."""
        if self.sampled:
            q = logits_to_probs(logits, self.state.sampling)  # [1, V']
            pick = torch.multinomial(q, 1, generator=self.state.generator)[0]
            self.probs.append(q.new_zeros(self.vocab_size).index_copy_(-1, self.vocab_ids, q[0]))
        else:  # max(...).indices is argmax (first index on ties), faster on bf16 CPU tensors
            pick = logits.max(dim=-1).indices
        self.tokens.append(self.vocab_ids[pick])
        self.feature = outputs

    def inputs(self) -> StepInputs | None:
        """The last guess, fed back with the draft's output before it as its feature; None when done."""
        if len(self.tokens) >= self.k:
            return None
        # the guess at position T + j - 1 (T committed) is read at rotary position T - 1 + j - 1
        return StepInputs(self.tokens[-1], self.feature, self.state.length - 2 + len(self.tokens), None)

    def draft(self) -> Draft:
        tokens = torch.cat(self.tokens).unsqueeze(0)  # [1, k]
        return Draft(tokens=tokens, probs=torch.stack(self.probs).unsqueeze(0) if self.sampled else None)


class TreeDrafter:
    """EAGLE-2's dynamic tree: at each depth the `width` likeliest nodes (by the product of draft probabilities
    along their path) are read by the draft in one forward, each keeping its `width` likeliest children;
    finally the `size` likeliest nodes of all are verified. A node's estimate never exceeds its parent's, so
    the chosen nodes form a tree. Each depth keeps only its likeliest `kept` nodes, which changes nothing (see
    `best_children`) and keeps a wide tree's work per depth at width^2 numbers rather than as many paths."""

    def __init__(self, state: DecodeState, depth: int, width: int, size: int, kept: int, vocab_ids: torch.Tensor,
                 committed: int):
        self.length, self.depth, self.width, self.size, self.kept = state.length, depth, width, size, kept
        self.vocab_ids, self.committed = vocab_ids, committed  # committed: the row's draft cache length
        self.nodes: list[Node] = []
        self.frontier: list[Node] = []
        self.expand: list[Node] = []
        self.slots: dict[tuple[int, ...], int] = {}  # path -> index of its key among the guesses in the cache
        self.features: dict[tuple[int, ...], torch.Tensor] = {}  # path -> the draft's output there [H]
        self.level = 0  # depths drafted

    def absorb(self, outputs: torch.Tensor, logits: torch.Tensor) -> None:
        """Outputs [n, H] and logits [n, V'] of the positions last read (the root's context output first)."""
        logq = logits.float().log_softmax(-1)
        top = logq.topk(self.width, dim=-1)
        ids = self.vocab_ids[top.indices]
        if self.level == 0:
            self.features[()] = outputs[-1]
            self.frontier = [(value, [token]) for value, token in
                             zip(top.values[-1].tolist(), ids[-1].tolist(), strict=True)]
        else:
            for row, (_, path) in enumerate(self.expand):
                self.slots[tuple(path)] = len(self.slots)
                self.features[tuple(path)] = outputs[row]
            self.frontier = best_children(self.expand, top.values, ids, self.kept)
        self.nodes.extend(self.frontier)
        self.level += 1

    def inputs(self) -> StepInputs | None:
        """The depth's `width` best nodes, each seeing the committed context, its ancestors' keys and its own."""
        if self.level >= self.depth:
            return None
        self.frontier.sort(key=lambda node: -node[0])
        expand = self.expand = self.frontier[: self.width]
        n, fed, committed = len(expand), len(self.slots), self.committed
        rows = [row for row, (_, path) in enumerate(expand) for _ in range(len(path) - 1)] + list(range(n))
        cols = [committed + self.slots[tuple(path[:cut])] for _, path in expand for cut in range(1, len(path))]
        cols += [committed + fed + row for row in range(n)]
        mask = torch.zeros(n, committed + fed + n, dtype=torch.bool)
        mask[:, :committed] = True
        mask[rows, cols] = True
        features = torch.stack([self.features[tuple(path[:-1])] for _, path in expand])
        tokens = torch.tensor([path[-1] for _, path in expand], device=self.vocab_ids.device)
        return StepInputs(tokens, features, self.length - 2 + self.level, mask)

    def draft(self) -> Draft:
        self.nodes.sort(key=lambda node: (-node[0], len(node[1])))  # a parent before its children, even on ties
        tokens, parents = tree.from_paths([path for _, path in self.nodes[: self.size]])
        return Draft(tokens=torch.tensor([tokens], device=self.vocab_ids.device), parents=parents)


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
