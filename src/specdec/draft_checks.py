"""What the engine checks of every draft before the target reads it: a proposer may suggest anything, but only
in the shape the contract allows (one sentence naming the proposer otherwise)."""

from __future__ import annotations

from dataclasses import replace

import torch

from . import tree
from .contracts import DecodeState, Draft, Proposer, Target, Verifier
from .errors import PluginError, SpecdecError


def check_draft(proposer: Proposer, target: Target, draft: Draft, state: DecodeState, verifier: Verifier) -> None:
    """A proposer may suggest anything, but only in the shape the contract allows."""
    name = f"Proposer {type(proposer).name!r} ({type(proposer).__module__})"
    tokens = draft.tokens
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.shape[0] != state.batch_size:
        shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise PluginError(f"{name} returned draft tokens of shape {shape}; expected a LongTensor "
                          f"[{state.batch_size}, k].")
    if tokens.dtype not in (torch.int64, torch.int32):
        raise PluginError(f"{name} returned draft tokens of dtype {tokens.dtype}; expected torch.long.")
    if draft.parents is not None:
        _check_tree(proposer, target, name, draft, state, verifier)
    elif tokens.shape[1] > state.max_draft_tokens:
        raise PluginError(f"{name} proposed {tokens.shape[1]} tokens but at most {state.max_draft_tokens} "
                          "were allowed (state.max_draft_tokens).")
    vocab = target.vocab_size
    if tokens.numel() and bool(((tokens < 0) | (tokens >= vocab)).any()):
        raise PluginError(f"{name} proposed token ids outside the vocabulary [0, {vocab}).")
    if draft.probs is not None and tuple(draft.probs.shape) != (state.batch_size, tokens.shape[1], vocab):
        raise PluginError(f"{name} returned draft probs of shape {tuple(draft.probs.shape)}; expected "
                          f"[{state.batch_size}, {tokens.shape[1]}, {vocab}].")


def _check_tree(proposer: Proposer, target: Target, name: str, draft: Draft, state: DecodeState,
                verifier: Verifier) -> None:
    parents = draft.parents
    if not isinstance(parents, list) or len(parents) != draft.num_tokens:
        raise PluginError(f"{name} returned a tree draft whose parents are not a list of {draft.num_tokens} "
                          "ints, one per draft token.")
    problem = tree.check_parents(parents)
    if problem is not None:
        raise PluginError(f"{name} returned a malformed tree draft: {problem}.")
    if draft.probs is not None:
        raise PluginError(f"{name} returned a tree draft with probs; tree drafts must be point masses "
                          "(leave Draft.probs None).")
    depth = max(tree.depths(parents), default=0)
    if depth > state.max_draft_tokens:
        raise PluginError(f"{name} proposed a tree {depth} tokens deep but at most {state.max_draft_tokens} "
                          "were allowed (state.max_draft_tokens).")
    if not getattr(target, "can_retain", False):
        raise SpecdecError(f"{name} returned a tree draft, but the target's KV cache cannot keep a "
                           "tree's accepted path for this model (sliding-window attention); use a chain draft"
                           f"{chain_hint(proposer)}.")
    if not verifier.supports_trees:  # a proposer that says so in drafts_trees() is refused before any work
        raise PluginError(f"{name} returned a tree draft but the verifier {type(verifier).name!r} takes "
                          "chains only, and the proposer's drafts_trees() did not say it would draft trees.")


def chain_hint(proposer: Proposer) -> str:
    hint = type(proposer).chain_hint
    return f" ({hint})" if hint else ""


def chains_only(verifier: Verifier, proposer: Proposer) -> str:
    return (f"The verifier {type(verifier).name!r} takes chains only but the proposer {type(proposer).name!r} "
            f"drafts trees; choose a verifier that takes trees, or a chain draft{chain_hint(proposer)}.")


def on_device(draft: Draft, device: torch.device) -> Draft:
    """The draft on the target's device: a proposer may well draft on the host (n-gram tables, a CPU draft)."""
    if draft.tokens.device == device and (draft.probs is None or draft.probs.device == device):
        return draft
    return replace(draft, tokens=draft.tokens.to(device),
                   probs=None if draft.probs is None else draft.probs.to(device))
