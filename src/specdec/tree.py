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
