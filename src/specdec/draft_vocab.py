"""A reduced draft vocabulary: a draft scores only the tokens the target emits most often.

The idea is FR-Spec's and EAGLE-3's (its `d2t` table): a draft's LM head over the target's whole
vocabulary is the largest matmul of a draft step and of a training step, yet almost all accepted tokens
come from a few thousand frequent ones. Verification stays with the target's full head, so output is
unchanged; a token outside the subset can only be produced by the target, never drafted. How a draft
stores its subset is the plugin's business (DFlash: `draft_vocab.json`; EAGLE-3: `d2t` in its weights).
"""

from __future__ import annotations

import torch

from .errors import SpecdecError


def most_frequent(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ids of the `size` largest counts (ties to the lower id), ascending."""
    if not 1 <= size <= counts.numel():
        raise SpecdecError(f"A draft vocabulary of {size} tokens is impossible for a vocabulary of {counts.numel()}; "
                           f"choose 1..{counts.numel()}.")
    # a stable sort on -counts keeps lower ids first among equal counts
    order = torch.sort(-counts.long(), stable=True).indices
    return order[:size].sort().values


def head_rows(head: torch.nn.Module, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The frozen LM head's weight (and bias) rows for the draft vocabulary, gathered once, contiguous: a
    gathered view would be a slow matmul operand on every call."""
    bias = getattr(head, "bias", None)
    return (head.weight.detach()[token_ids].contiguous(),
            None if bias is None else bias.detach()[token_ids].contiguous())


def head_rows_linear(head: torch.nn.Module, token_ids: torch.Tensor) -> torch.nn.Linear:
    """`head_rows` as a frozen nn.Linear (what the proposer scores the draft vocabulary with)."""
    weight, bias = head_rows(head, token_ids)
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = torch.nn.Parameter(bias, requires_grad=False)
    return linear


def label_map(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] long: target token id -> index in the draft vocabulary, -1 for tokens outside it."""
    mapping = torch.full((vocab_size,), -1, dtype=torch.long, device=token_ids.device)
    mapping[token_ids] = torch.arange(token_ids.numel(), device=token_ids.device)
    return mapping
