"""Prompt lookup decoding (Saxena 2023): copy what followed the latest earlier occurrence of the suffix."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from pydantic import Field, model_validator

from .. import tree
from ..contracts import DecodeState, Draft, Proposer, ProposerConfig
from ..lookup import NgramIndex

if TYPE_CHECKING:
    from ..target import TargetModel


class NgramProposer(Proposer):
    name = "ngram"
    description = "prompt lookup: continues the longest suffix n-gram found earlier in prompt + output"
    default_priority = 10  # needs nothing but the tokens: the default wherever no trained draft fits

    @classmethod
    def default_for(cls, model: str | None) -> bool:
        return True

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

    def __init__(self, config: Config, target: TargetModel) -> None:
        super().__init__(config, target)
        self.reset()

    def reset(self) -> None:
        self._indices: list[NgramIndex] = []  # one per batch row, kept up to date as tokens are committed

    def propose(self, state: DecodeState) -> Draft:
        limit = min(self.config.num_tokens, state.max_draft_tokens)
        latest = self.config.prefer == "latest"
        while len(self._indices) < state.batch_size:
            self._indices.append(NgramIndex(self.config.min_n, self.config.max_n))
        for row in range(state.batch_size):
            self._indices[row].sync(state.tokens, row)
        if self.config.candidates > 1 and state.batch_size == 1:
            found = self._indices[0].continuations(limit, self.config.candidates, latest)
            tokens, parents = tree.from_paths([c.tolist() for c in found])
            return Draft(tokens=torch.tensor([tokens], dtype=torch.long, device=state.tokens.device),
                         parents=parents)
        rows = []
        for index in self._indices[: state.batch_size]:
            found = index.continuations(limit, 1, latest)
            rows.append(found[0] if found else np.empty(0, dtype=np.int64))
        width = min(len(r) for r in rows)  # one k for the batch: trim to the shortest row
        tokens = torch.from_numpy(np.stack([r[:width] for r in rows])).to(state.tokens.device)
        return Draft(tokens=tokens)
