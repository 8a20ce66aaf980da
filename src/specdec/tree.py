"""Token trees: several candidate continuations verified in one target forward.

A tree draft is a flat list of k tokens plus `parents` [k]: the index of each token's parent in the
list, or -1 for a child of the root (the last committed token). Parents come before their children, so
a chain is parents = [-1, 0, 1, ..., k-2]. The target reads [root, token_0, ..., token_{k-1}] with an
attention mask that lets each token see the committed context, the root, its ancestors and itself, at
the position its depth gives (SpecInfer, Miao et al. 2023; Medusa and EAGLE-2 verify trees the same way).
Verification walks from the root: at each node the target picks its token (argmax, or a sample), and the
walk moves to the first child holding that token. Every emitted token is the target's own choice given
exactly the tokens before it, so the output is the same as without the tree, greedy or sampled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def check_parents(parents: Sequence[int]) -> str | None:
    """None when `parents` describes a tree (each entry -1 or an earlier index); else what is wrong."""
    for j, parent in enumerate(parents):
        if not -1 <= parent < j:
            return (f"parents[{j}] is {parent}; each token's parent must be -1 (the last committed token) or "
                    f"the index of an earlier draft token (0..{j - 1})")
    return None


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each draft token: 1 for children of the root."""
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def is_chain(parents: Sequence[int]) -> bool:
    return all(parent == j - 1 for j, parent in enumerate(parents))


def visibility(parents: Sequence[int]) -> torch.Tensor:
    """Bool [k+1, k+1] over the feed [root, draft...]: True where a node may attend (itself and its ancestors)."""
    k = len(parents)
    sees = torch.zeros(k + 1, k + 1, dtype=torch.bool)
    sees[0, 0] = True
    for j, parent in enumerate(parents):
        sees[j + 1] = sees[parent + 1]  # the root is row 0, draft token j is row j + 1
        sees[j + 1, j + 1] = True
    return sees


def bool_mask(parents: Sequence[int], past_length: int, device: torch.device) -> torch.Tensor:
    """Bool [k+1, past_length + k+1] for the feed [root, draft...] after `past_length` cached positions: True
    where a query may look. Only the [k+1, k+1] tree block crosses to the device; the rest is made there."""
    k = len(parents)
    mask = torch.ones(k + 1, past_length + k + 1, dtype=torch.bool, device=device)
    mask[:, past_length:] = visibility(parents).to(device)
    return mask


def attention_mask(parents: Sequence[int], past_length: int, dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    """`bool_mask` as the additive [1, 1, k+1, past_length + k+1] that eager and SDPA attention add: 0 where a
    query may look, the dtype's minimum elsewhere."""
    sees = bool_mask(parents, past_length, device)
    return torch.zeros(sees.shape, dtype=dtype, device=device).masked_fill_(~sees, torch.finfo(dtype).min)[None, None]


def walk(choose: Callable[[int], int], tokens: Sequence[int], parents: Sequence[int]) -> tuple[list[int], int]:
    """(indices of the accepted draft tokens, root first; the target's token after the last of them).
    `choose(i)` is the target's token after feed position i (0: the root, j + 1: draft token j), asked only
    for the nodes the walk reaches; the walk follows the first child holding that token."""
    children: dict[int, list[int]] = {}
    for j, parent in enumerate(parents):
        children.setdefault(parent, []).append(j)
    path: list[int] = []
    node = -1
    while True:
        wanted = choose(node + 1)
        node = next((c for c in children.get(node, ()) if tokens[c] == wanted), None)
        if node is None:
            return path, wanted
        path.append(node)


def verify_tree(choose: Callable[[int, int], int], draft_tokens: torch.Tensor,
                parents: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk each row's tree: `choose(b, i)` is the target's token for row b after feed position i.
    draft_tokens [B, k] -> (num_accepted [B], emitted [B, k+1], path [B, k]); emitted holds the accepted
    tokens, then the target's token after the last of them, padded with -1; path the accepted draft
    indices, padded with -1."""
    batch, k = draft_tokens.shape
    emitted = torch.full((batch, k + 1), -1, dtype=torch.long)
    path_out = torch.full((batch, k), -1, dtype=torch.long)
    counts = torch.zeros(batch, dtype=torch.long)
    drafted = draft_tokens.tolist()  # one host transfer for the whole walk
    for b in range(batch):
        path, final = walk(lambda i, b=b: choose(b, i), drafted[b], parents)
        n = len(path)
        counts[b] = n
        if n:
            path_out[b, :n] = torch.tensor(path)
            emitted[b, :n] = torch.tensor([drafted[b][j] for j in path])
        emitted[b, n] = final
    device = draft_tokens.device
    return counts.to(device), emitted.to(device), path_out.to(device)


def parents_tensor(parents: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor, batch: int, k: int,
                   device: torch.device) -> torch.Tensor:
    """Per-row parents as a LongTensor [B, k]. `parents` is one list for every row, one list per row (row b's
    tree has len(parents[b]) <= k nodes; draft_tokens[b, len(parents[b]):] are padding), or a tensor [B, k]
    whose entries below -1 mark padding. Padding belongs to no tree: it is never any node's child.
    Raises ValueError naming the row and node where an entry is not -1 or an earlier index."""
    if isinstance(parents, torch.Tensor):
        table = parents.to(device=device, dtype=torch.long)
    elif len(parents) == 0 or not isinstance(parents[0], Sequence):  # one tree shared by every row
        table = torch.tensor(list(parents), dtype=torch.long, device=device).view(1, -1).expand(batch, -1)
    else:
        if len(parents) != batch:
            raise ValueError(f"{len(parents)} parents lists for {batch} rows")
        longest = max((len(row) for row in parents), default=0)
        if longest > k:
            raise ValueError(f"a row's tree has {longest} nodes but draft_tokens holds {k} per row")
        table = torch.tensor([list(row) + [-2] * (k - len(row)) for row in parents], dtype=torch.long,
                             device=device)
    if tuple(table.shape) != (batch, k):
        raise ValueError(f"parents must describe [B, k] = {(batch, k)} nodes, got {tuple(table.shape)}")
    index = torch.arange(k, device=device)
    node = table >= -1
    # a node's parent is -1 or an earlier node (not padding) of the same row
    bad = node & ((table >= index) | (table >= 0) & ~node.gather(1, table.clamp_min(0)))
    if bool(bad.any()):
        b, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"row {b}: parents[{j}] is {int(table[b, j])}; each node's parent must be -1 (the last "
                         f"committed token) or the index of an earlier node of the row (0..{j - 1}), not padding")
    return table


def verify_tree_batched(
    chosen: torch.Tensor | Callable[[torch.Tensor], torch.Tensor],
    draft_tokens: torch.Tensor,
    parents: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor,
    *,
    levels: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`verify_tree` for every row at once, with tensor operations: one step per tree level, none per token.

    draft_tokens [B, k]; parents as `parents_tensor` takes them (shared, per row, or [B, k] with padding).
    `chosen` is the target's token after each feed position: a LongTensor [B, k+1] (greedy: the argmax at
    each node; column 0 is the root, column j + 1 draft token j), or a callable that takes the walk's current
    node of every row (LongTensor [B], -1 for the root) and returns the target's token after it (LongTensor
    [B]); it is called once per level for all rows, finished rows included (their answer is ignored), so it
    may draw its tokens lazily (`sampled_chooser`). At each level every unfinished row moves to the first
    child (lowest index) of its node holding the wanted token, or stops and emits it.

    Returns exactly what `verify_tree` returns for the same choices (a padding node never matches):
    num_accepted [B], emitted [B, k+1] (accepted tokens, then the target's token, -1 after), path [B, k]
    (accepted node indices, -1 after), on draft_tokens' device. Runs while any row is unfinished (one host
    read per level, at most depth + 1 levels); `levels` runs exactly that many levels without reading
    anything back (it must be at least the deepest row's depth + 1)."""
    batch, k = draft_tokens.shape
    device = draft_tokens.device
    table = parents_tensor(parents, batch, k, device)
    tokens = draft_tokens.to(torch.long)
    if callable(chosen):
        choose = chosen
    else:
        if tuple(chosen.shape) != (batch, k + 1):
            raise ValueError(f"chosen must be [B, k+1] = {(batch, k + 1)}, got {tuple(chosen.shape)}")
        table_chosen = chosen.to(device=device, dtype=torch.long)

        def choose(nodes: torch.Tensor) -> torch.Tensor:
            return table_chosen.gather(1, (nodes + 1).unsqueeze(1)).squeeze(1)

    rows = torch.arange(batch, device=device)
    columns = torch.arange(k, device=device)
    emitted = torch.full((batch, k + 1), -1, dtype=torch.long, device=device)
    path = torch.full((batch, k), -1, dtype=torch.long, device=device)
    counts = torch.zeros(batch, dtype=torch.long, device=device)
    node = torch.full((batch,), -1, dtype=torch.long, device=device)
    active = torch.ones(batch, dtype=torch.bool, device=device)
    level = 0
    while (level < levels) if levels is not None else bool(active.any()):
        level += 1
        wanted = choose(node).to(device=device, dtype=torch.long)
        holds = (table == node.unsqueeze(1)) & (tokens == wanted.unsqueeze(1))  # children of node holding it
        child = torch.where(holds, columns, k).min(dim=1).values if k else torch.zeros_like(node)
        found = active & (child < k)
        child = child.clamp(max=max(k - 1, 0))
        token = tokens.gather(1, child.unsqueeze(1)).squeeze(1) if k else wanted
        slot = counts.clamp(max=k)
        emitted[rows, slot] = torch.where(found, token, torch.where(active, wanted, emitted[rows, slot]))
        if k:
            at = counts.clamp(max=k - 1)
            path[rows, at] = torch.where(found, child, path[rows, at])
        counts += found.to(torch.long)
        node = torch.where(found, child, node)
        active = found
    return counts, emitted, path


def sampled_chooser(probs: torch.Tensor,
                    generator: torch.Generator | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A `chosen` callable for `verify_tree_batched` that samples: probs [B, k+1, V] (the target's processed
    distribution at each feed position); each call draws, for every row, one token from probs[b, node + 1] by
    the exponential race of `verifiers.sample` (argmax(p / E), E ~ Exp(1) on [B, V], fresh at every level),
    so every node a walk reaches gets its own independent draw, as `RejectionSamplingVerifier` does for
    trees. For B = 1 the draws, and so the result, are bit-identical to that verifier's with the same
    generator (it draws [V] at each node reached, in the same order)."""
    rows = torch.arange(probs.shape[0], device=probs.device)

    def choose(nodes: torch.Tensor) -> torch.Tensor:
        p = probs[rows, nodes + 1]
        exponentials = torch.empty(p.shape, dtype=torch.float64, device=p.device)
        exponentials.exponential_(generator=generator).clamp_min_(torch.finfo(torch.float64).tiny)
        return (p.double() / exponentials).argmax(dim=-1)

    return choose


def from_paths(paths: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Merge candidate continuations into a trie: (tokens, parents), shared prefixes stored once, candidates
    in the order given (so the first candidate's tokens come first among siblings)."""
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for path in paths:
        node = -1
        for token in path:
            key = (node, int(token))
            if key not in index:
                index[key] = len(tokens)
                tokens.append(int(token))
                parents.append(node)
            node = index[key]
    return tokens, parents
