"""The public contracts between the engine and its plugins: proposers, verifiers, caches.

Every tensor is batch-shaped ([B, ...]) even where the engine only runs B = 1 today.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from .sampling import SamplingParams
    from .target import TargetModel, TargetOutput


class ProposerConfig(BaseModel):
    """Options of a proposer; `--opt key=value` on the CLI is validated against the subclass."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass
class Draft:
    """Tokens a proposer suggests after the last committed token.

    tokens: LongTensor [B, k], on any device (the engine moves tokens and probs to the target's).
    probs: optional [B, k, V], the distribution each token was drawn from;
    without it the draft is a point mass (the verifier accepts iff the target would have produced it).
    parents: optional, a tree instead of a chain (see `specdec.tree`): k ints, the index of each token's
    parent in `tokens` or -1 for a child of the last committed token, parents before children, the same
    for every row. Tree drafts are point masses (no probs); the verifier follows the target's own choices
    through the tree, so several candidates cost one target forward.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    parents: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[-1])

    @property
    def is_tree(self) -> bool:
        return self.parents is not None


@dataclass
class DecodeState:
    """What a proposer sees at each step.

    tokens: LongTensor [B, T], every committed token (prompt + generated).
    max_draft_tokens: the most tokens a draft may hold now (bounded by max_new_tokens and the context window).
    """

    tokens: torch.Tensor
    max_draft_tokens: int
    prompt_length: int
    sampling: SamplingParams | None = None
    generator: torch.Generator | None = None

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def length(self) -> int:
        return int(self.tokens.shape[1])


@dataclass
class Verdict:
    """The verifier's decision for one step.

    num_accepted: LongTensor [B], how many draft tokens were accepted.
    emitted: LongTensor [B, k+1], the accepted draft tokens then the target's own token, padded with -1.
    path: for a tree draft, LongTensor [B, k]: the indices of the accepted draft tokens, padded with -1;
    None for a chain, where they are the first num_accepted.
    """

    num_accepted: torch.Tensor
    emitted: torch.Tensor
    path: torch.Tensor | None = None


class Proposer:
    """Base class of every proposer. Subclasses set `name`, optionally a nested `Config`, and `propose`."""

    name: ClassVar[str] = ""
    Config: ClassVar[type[ProposerConfig]] = ProposerConfig
    #: Short description shown by `specdec plugins`.
    description: ClassVar[str] = ""

    def __init__(self, config: ProposerConfig, target: TargetModel) -> None:
        self.config = config
        self.target = target

    @classmethod
    def default_for(cls, model: str | None) -> bool:
        """True when this proposer needs no options for `model` (None: the embedded default) and should be
        picked when the user names no proposer. The first such proposer in DEFAULT_PROPOSER_ORDER wins."""
        return False

    def propose(self, state: DecodeState) -> Draft:  # pragma: no cover - interface
        raise NotImplementedError

    def prefill(self, state: DecodeState, target_output: TargetOutput) -> None:
        """Called once after the target has read the prompt (its taps cover every prompt position)."""

    def observe(self, state: DecodeState, verdict: Verdict, target_output: TargetOutput) -> None:
        """Called after each verification; `state.tokens` already holds the newly committed tokens."""

    def reset(self) -> None:
        """Forget all per-sequence state before a new generation."""


class Verifier:
    """Decides which draft tokens to keep. A pure function of the target's logits and the draft."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    #: whether `verify` accepts tree drafts (Draft.parents) and returns Verdict.path for them
    supports_trees: ClassVar[bool] = False

    def verify(
        self,
        target_logits: torch.Tensor,
        draft: Draft,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Verdict:  # pragma: no cover - interface
        """target_logits: [B, k+1, V] raw logits at the last committed token and each draft token."""
        raise NotImplementedError


class KVCache:
    """The target's key/value cache. `crop(length)` rolls it back to the first `length` positions."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""

    def __init__(self, model: Any) -> None:
        self.model = model

    @property
    def hf_cache(self) -> Any:  # pragma: no cover - interface
        """The object passed to the transformers model as its cache."""
        raise NotImplementedError

    def length(self) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def crop(self, length: int) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    @property
    def can_retain(self) -> bool:
        """Whether `retain` works for this model's layers; tree drafts need it."""
        return False

    def retain(self, length: int, indices: torch.Tensor) -> None:
        """After a tree draft: keep the first `length` positions, then those at `length + indices` (the
        accepted tree nodes, in order), and drop the rest. Caches that cannot only take chain drafts."""
        raise NotImplementedError(f"The {type(self).name!r} cache cannot keep a tree draft's accepted path.")


@dataclass
class Registry:
    """Every proposer, verifier and cache class, with the distribution each came from."""

    proposers: dict[str, type[Proposer]] = field(default_factory=dict)
    verifiers: dict[str, type[Verifier]] = field(default_factory=dict)
    caches: dict[str, type[KVCache]] = field(default_factory=dict)
    objectives: dict[str, type] = field(default_factory=dict)
    origins: dict[tuple[str, str], str] = field(default_factory=dict)
