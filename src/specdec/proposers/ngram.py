"""Prompt lookup decoding (Saxena 2023): copy what followed the latest earlier occurrence of the suffix."""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import Field, model_validator

from .. import tree
from ..contracts import DecodeState, Draft, Proposer, ProposerConfig


def find_continuations(tokens: np.ndarray, min_n: int, max_n: int, num_tokens: int, limit: int = 1,
                       latest: bool = True) -> list[np.ndarray]:
    """Up to `limit` distinct continuations of earlier matches of the context's suffix: the longest suffix
    n-gram (max_n down to min_n) first, and within one n the most recent match first (latest=True) or the
    first one, as transformers' prompt lookup does (latest=False). Shorter n-grams are tried only while
    fewer than `limit` continuations were found."""
    length = tokens.shape[0]
    found: list[np.ndarray] = []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # windows starting at 0 .. length-n-1: every earlier n-gram, never the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        for hit in (hits[::-1] if latest else hits):
            start = int(hit) + n
            continuation = tokens[start: start + num_tokens]
            if continuation.size and not any(np.array_equal(continuation, f) for f in found):
                found.append(continuation)
                if len(found) == limit:
                    return found
    return found


def find_continuation(tokens: np.ndarray, min_n: int, max_n: int, num_tokens: int,
                      latest: bool = True) -> np.ndarray:
    """The first of `find_continuations`, or an empty array."""
    found = find_continuations(tokens, min_n, max_n, num_tokens, 1, latest)
    return found[0] if found else tokens[:0]


class NgramProposer(Proposer):
    name = "ngram"
    description = "prompt lookup: continues the longest suffix n-gram found earlier in prompt + output"

    class Config(ProposerConfig):
        num_tokens: int = Field(10, ge=1, description="most tokens proposed per step")
        min_n: int = Field(1, ge=1, description="shortest suffix n-gram to match")
        max_n: int = Field(3, ge=1, description="longest suffix n-gram to match")
        prefer: Literal["latest", "earliest"] = Field("latest", description="which earlier match to copy from")
        candidates: int = Field(1, ge=1, description="distinct continuations verified at once, as a tree "
                                "(1 = a chain)")

        @model_validator(mode="after")
        def _ordered(self):
            if self.min_n > self.max_n:
                raise ValueError(f"min_n ({self.min_n}) must not exceed max_n ({self.max_n})")
            return self

    def propose(self, state: DecodeState) -> Draft:
        limit = min(self.config.num_tokens, state.max_draft_tokens)
        latest = self.config.prefer == "latest"
        if self.config.candidates > 1 and state.batch_size == 1:
            found = find_continuations(state.tokens[0].cpu().numpy(), self.config.min_n, self.config.max_n, limit,
                                       self.config.candidates, latest)
            tokens, parents = tree.from_paths([c.tolist() for c in found])
            return Draft(tokens=torch.tensor([tokens], dtype=torch.long, device=state.tokens.device),
                         parents=parents)
        rows = []
        for row in state.tokens.cpu().numpy():
            rows.append(find_continuation(row, self.config.min_n, self.config.max_n, limit, latest=latest))
        width = min(len(r) for r in rows)  # one k for the batch: trim to the shortest row
        tokens = torch.from_numpy(np.stack([r[:width] for r in rows])).to(state.tokens.device)
        return Draft(tokens=tokens)
