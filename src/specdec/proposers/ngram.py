"""Prompt lookup decoding (Saxena 2023): copy what followed the latest earlier occurrence of the suffix."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

import numpy as np
import torch
from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from .. import tree
from ..contracts import DecodeState, Draft, Proposer, ProposerConfig
from ..errors import SpecdecError
from ..limits import (
    MAX_NGRAM,
    MAX_VERIFY_TOKENS,
    NGRAM_WHY,
    VERIFY_WHY,
    at_most,
    capacity_why,
    check_draft_sizes,
    verify_capacity,
)
from ..lookup import NgramIndex

if TYPE_CHECKING:
    from ..sampling import SamplingParams
    from ..target import TargetModel


class NgramProposer(Proposer):
    name = "ngram"
    description = "prompt lookup: continues the longest suffix n-gram found earlier in prompt + output"
    chain_hint = "--opt candidates=1"
    default_priority = 10  # needs nothing but the tokens: the default wherever no trained draft fits

    @classmethod
    def default_for(cls, model: str | None) -> bool:
        return True

    class Config(ProposerConfig):
        num_tokens: Annotated[int, at_most(MAX_VERIFY_TOKENS, VERIFY_WHY)] = Field(
            10, ge=1, description=f"most tokens proposed per step (at most {MAX_VERIFY_TOKENS})")
        min_n: Annotated[int, at_most(MAX_NGRAM, NGRAM_WHY)] = Field(
            1, ge=1, description="shortest suffix n-gram to match")
        max_n: Annotated[int, at_most(MAX_NGRAM, NGRAM_WHY)] = Field(
            3, ge=1, description=f"longest suffix n-gram to match (at most {MAX_NGRAM})")
        prefer: Literal["latest", "earliest"] = Field("latest", description="which earlier match to copy from")
        candidates: int = Field(1, ge=1, description="distinct continuations verified at once, as a tree "
                                f"(1 = a chain; candidates x num_tokens at most {MAX_VERIFY_TOKENS})")

        @field_validator("candidates")
        @classmethod
        def _fits_one_forward(cls, candidates: int, info: ValidationInfo) -> int:
            num_tokens = info.data.get("num_tokens")  # absent when num_tokens itself was refused
            problem = None if num_tokens is None else candidates_problem(candidates, num_tokens, MAX_VERIFY_TOKENS,
                                                                         VERIFY_WHY)
            if problem is not None:
                raise PydanticCustomError("too_large", "{text}", {"text": problem})
            return candidates

        @model_validator(mode="after")
        def _ordered(self):
            if self.min_n > self.max_n:
                raise ValueError(f"min_n ({self.min_n}) must not exceed max_n ({self.max_n})")
            return self

    def __init__(self, config: Config, target: TargetModel) -> None:
        super().__init__(config, target)
        # the static bounds above, again for a target whose context window leaves less room
        check_draft_sizes(self.name, target.max_context, num_tokens=config.num_tokens)
        problem = candidates_problem(config.candidates, config.num_tokens, verify_capacity(target.max_context),
                                     capacity_why(target.max_context))
        if problem is not None:
            raise SpecdecError(f"Invalid option 'candidates' for proposer {self.name!r}: {problem}.")
        self.reset()

    def reset(self) -> None:
        self._indices: list[NgramIndex] = []  # one per batch row, kept up to date as tokens are committed

    def drafts_trees(self, sampling: SamplingParams) -> bool:
        return self.config.candidates > 1

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



def candidates_problem(candidates: int, num_tokens: int, limit: int, why: str) -> str | None:
    """Why `candidates` continuations of up to `num_tokens` tokens each do not fit one verification forward of
    `limit` draft tokens, or None when they do."""
    total = candidates * num_tokens
    if total <= limit:
        return None
    return (f"{candidates} continuations of up to {num_tokens} tokens (num_tokens) are up to {total} draft tokens, "
            f"more than {limit}, {why}; choose candidates at most {max(1, limit // num_tokens)} or a smaller "
            "num_tokens")
