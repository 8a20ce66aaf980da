"""The public contracts between the engine and its plugins: proposers, verifiers, caches, training objectives,
draft exporters, and the target as plugins see it.

Every tensor is batch-shaped ([B, ...]) even where the engine only runs B = 1 today. This module imports
nothing concrete of specdec: implementations import it, never the other way round.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

if TYPE_CHECKING:
    from .sampling import SamplingParams


@dataclass
class TargetOutput:
    """logits: [B, n, V] (prefill keeps only the last position); taps: layer id -> [B, n_tokens, H]."""

    logits: torch.Tensor
    taps: dict[int, torch.Tensor] = field(default_factory=dict)

    def tapped(self, layer_ids: list[int] | tuple[int, ...]) -> torch.Tensor:
        """The requested taps concatenated on the feature axis: [B, n_tokens, len(layer_ids) * H]."""
        return torch.cat([self.taps[i] for i in layer_ids], dim=-1)

    def select(self, positions: torch.Tensor) -> TargetOutput:
        """The logits and taps at these positions [n] of the forward, in this order (a tree's accepted path
        seen as the chain it became)."""
        logits = self.logits[:, positions.to(self.logits.device)]
        taps = {i: t[:, positions.to(t.device)] for i, t in self.taps.items()}
        return TargetOutput(logits=logits, taps=taps)


class Target(Protocol):
    """The target model as proposers and training objectives see it (`specdec.TargetModel` implements it)."""

    model: nn.Module
    tokenizer: Any
    config: Any

    @property
    def vocab_size(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def max_context(self) -> int: ...
    @property
    def embed_tokens(self) -> nn.Module: ...
    @property
    def lm_head(self) -> nn.Module: ...
    @property
    def eos_token_ids(self) -> set[int]: ...

    def request_taps(self, layer_ids: Sequence[int]) -> None:
        """Capture these decoder layers' outputs in every later forward (TargetOutput.taps)."""

    def tap_hidden_states(self, input_ids: torch.Tensor) -> TargetOutput:
        """Taps only, for every position of [B, T], from a cache-free forward (training)."""


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

    tokens: LongTensor [B, T], every committed token (prompt + generated); row b holds `lengths[b]` of them,
    left-aligned (positions past a row's length are padding).
    lengths: committed tokens per row (default: T for every row).
    max_draft_tokens: the most tokens a draft may hold now (bounded by max_new_tokens and the context window).
    """

    tokens: torch.Tensor
    max_draft_tokens: int
    prompt_length: int
    sampling: SamplingParams | None = None
    generator: torch.Generator | None = None
    lengths: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.lengths:
            self.lengths = [int(self.tokens.shape[1])] * int(self.tokens.shape[0])

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def length(self) -> int:
        """The committed length shared by every row (proposers written for one length per batch use it)."""
        first = self.lengths[0]
        if any(n != first for n in self.lengths):
            raise ValueError(f"The rows hold different lengths {self.lengths}; read state.lengths per row.")
        return first


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
    #: When no proposer is named, the highest-priority proposer whose `default_for(model)` is true is used.
    default_priority: ClassVar[int] = 0
    #: How to make this proposer draft chains, for messages (e.g. "--opt tree_size=0"); "" if it only does.
    chain_hint: ClassVar[str] = ""

    def __init__(self, config: ProposerConfig, target: Target) -> None:
        self.config = config
        self.target = target

    @classmethod
    def default_for(cls, model: str | None) -> bool:
        """True when this proposer needs no options for `model` (None: the embedded default) and may be picked
        when the user names no proposer; among those, the highest `default_priority` wins."""
        return False

    def propose(self, state: DecodeState) -> Draft:  # pragma: no cover - interface
        raise NotImplementedError

    @classmethod
    def propose_batch(cls, proposers: Sequence[Proposer], states: Sequence[DecodeState]) -> list[Draft]:
        """Drafts for several rows at once: `proposers[i]` (a fork of one proposer of this class per row) drafts
        for `states[i]` (one row each). The default asks each in turn; a proposer whose drafting can share one
        forward across rows overrides it (dflash runs every row's block in one draft forward)."""
        return [proposer.propose(state) for proposer, state in zip(proposers, states, strict=True)]

    def drafts_trees(self, sampling: SamplingParams) -> bool:
        """Whether, with its options, this proposer may return tree drafts for this kind of decoding (the
        engine then refuses a chains-only verifier before any work)."""
        return False

    def prefill(self, state: DecodeState, target_output: TargetOutput) -> None:
        """Called once after the target has read the prompt (its taps cover every prompt position)."""

    def observe(self, state: DecodeState, verdict: Verdict, target_output: TargetOutput) -> None:
        """Called after each verification; `state.tokens` already holds the newly committed tokens."""

    def reset(self) -> None:
        """Forget all per-sequence state before a new generation."""

    def fork(self) -> Proposer:
        """A proposer with the same options and weights and per-sequence state of its own: the engine drafts
        each row of a batch with its own proposer (the first row with this one). The default copies the object
        shallowly and calls reset(), so reset() must assign fresh per-sequence state rather than clear shared
        containers in place; a proposer that keeps per-row state elsewhere (the draft-model proposer's rows
        share one ragged draft cache) overrides it."""
        clone = copy.copy(self)
        clone.reset()
        return clone


class Verifier:
    """Decides which draft tokens to keep. A pure function of the target's logits and the draft."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    #: which decoding it is exact for: greedy (temperature 0) and/or sampled (temperature > 0); the engine
    #: refuses to run a verifier for the other kind, before any work starts
    supports_greedy: ClassVar[bool] = True
    supports_sampling: ClassVar[bool] = False
    #: whether `verify` accepts tree drafts (Draft.parents) and returns Verdict.path for them
    supports_trees: ClassVar[bool] = False

    @classmethod
    def inexact_for(cls, greedy: bool) -> str | None:
        """The sentence refusing this verifier for greedy (or sampled) decoding, or None when it is exact."""
        if greedy and not cls.supports_greedy:
            return (f"The verifier {cls.name!r} is not exact for greedy decoding; use it with --temperature > 0, "
                    "or choose another verifier (specdec plugins).")
        if not greedy and not cls.supports_sampling:
            return (f"The verifier {cls.name!r} is not exact for sampling; use it with --temperature 0, or choose "
                    "another verifier (specdec plugins).")
        return None

    def verify(
        self,
        target_logits: torch.Tensor,
        draft: Draft,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Verdict:  # pragma: no cover - interface
        """target_logits: [B, k+1, V] raw logits at the last committed token and each draft token."""
        raise NotImplementedError

    def verify_rows(self, target_logits: torch.Tensor, drafts: Sequence[Draft], sampling: SamplingParams,
                    generators: Sequence[torch.Generator | None]) -> list[Verdict]:
        """One verdict per row of a batch: row b's draft ([1, k_b]) judged on target_logits[b, :k_b + 1]
        (target_logits [B, 1 + max k_b, V], right-padded) with row b's generator. The default calls `verify`
        row by row; a verifier with a batched kernel overrides it, with the same result per row."""
        return [self.verify(target_logits[b: b + 1, : draft.num_tokens + 1], draft, sampling, generator)
                for b, (draft, generator) in enumerate(zip(drafts, generators, strict=True))]


class KVCache:
    """The target's key/value cache, per row. `crop(lengths)` rolls row b back to its first `lengths[b]`
    positions.

    A cache read by transformers' forward also has `hf_cache`, the object passed to the model as its cache
    (see `specdec.caches.DynamicKVCache`); the native cache is read by specdec's own forward instead.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""

    def __init__(self, model: Any) -> None:
        self.model = model

    def lengths(self) -> list[int]:  # pragma: no cover - interface
        """Positions held per row; [] before the first forward."""
        raise NotImplementedError

    def crop(self, lengths: Sequence[int]) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    @property
    def can_retain(self) -> bool:
        """Whether `retain` works for this model's layers; tree drafts need it."""
        return False

    def retain(self, lengths: Sequence[int], indices: torch.Tensor) -> None:
        """After a tree draft: keep row b's first `lengths[b]` positions, then those at `lengths[b] +
        indices[b]` (indices: [B, n], the accepted tree nodes, in order; a row keeping fewer pads on the right
        with -1, as Verdict.path does), and drop the rest. Caches that cannot only take chain drafts."""
        raise NotImplementedError(f"The {type(self).name!r} cache cannot keep a tree draft's accepted path.")


def cache_api_problem(cls: type) -> str | None:
    """Why a KVCache class is written for the single-length API of specdec before per-row lengths, or None."""
    import inspect

    if cls.lengths is KVCache.lengths or ("length" in vars(cls) and "lengths" not in vars(cls)):
        return (f"The cache {cls.__name__} implements length() but not lengths(); caches now keep a length per "
                "row: implement lengths() -> list[int], crop(lengths) and retain(lengths, indices [B, n]).")
    for method in ("crop", "retain"):
        if "length" in inspect.signature(getattr(cls, method)).parameters:
            return (f"The cache {cls.__name__}.{method} takes one `length`; caches now keep a length per row: "
                    f"take `lengths` (one per row) instead.")
    return None


def same_length(lengths: Sequence[int], what: str) -> int:
    """The one length shared by every row, for caches that keep rows of equal length."""
    if not lengths:
        raise ValueError(f"{what} needs one length per row, got none.")
    first = int(lengths[0])
    if any(int(n) != first for n in lengths):
        raise NotImplementedError(f"{what} keeps rows of one length; got per-row lengths {list(lengths)}.")
    return first


class ObjectiveConfig(BaseModel):
    """Options of a training objective (`specdec train --opt key=value`)."""

    model_config = ConfigDict(extra="forbid")

    def for_resume(self) -> ObjectiveConfig:
        """These options as a resumed run applies them (`--resume`); options that act only when a run
        begins (e.g. counting something from the data) override this to switch themselves off."""
        return self


class TrainingObjective:
    """The per-proposer part of training: the draft being trained and its loss on one sequence. Registered
    with `register_objectives`; the shared trainer (`specdec.training`) owns the loop."""

    name: ClassVar[str] = ""
    Config: ClassVar[type[ObjectiveConfig]] = ObjectiveConfig

    #: whether this objective reads the target's taps through `target_taps`, so that `--tap-cache` can keep them
    keeps_taps: ClassVar[bool] = False
    #: where the trainer keeps the target's taps of each sequence (`--tap-cache`; a
    #: specdec.training.tap_store.TapStore), or None: a target forward every step
    tap_store: Any = None

    def __init__(self, config: ObjectiveConfig, target: Target, init: str | Path | None = None) -> None:
        self.config = config
        self.target = target

    @property
    def module(self) -> nn.Module:  # pragma: no cover - interface
        """The trainable draft (everything else stays frozen)."""
        raise NotImplementedError

    def loss(self, tokens: torch.Tensor, loss_mask: torch.Tensor,
             generator: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:  # pragma: no cover
        """tokens, loss_mask: [T] for one sequence -> (scalar loss, metrics for the progress bar)."""
        raise NotImplementedError

    def batch_loss(self, sequences: list[tuple[torch.Tensor, torch.Tensor]],
                   generator: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        """The mean of `loss` over several sequences, in as few forwards as the objective can manage.

        This default runs them one by one; an objective that can pack them into one batch overrides it
        (on a GPU, small per-sequence forwards leave the card idle between kernel launches).
        """
        losses, metrics = zip(*(self.loss(tokens, mask, generator) for tokens, mask in sequences), strict=True)
        mean = {key: sum(m[key] for m in metrics) / len(metrics) for key in metrics[0]}
        return torch.stack(list(losses)).mean(), mean

    def target_taps(self, tokens: torch.Tensor, lengths: Sequence[int], layer_ids: Sequence[int]) -> torch.Tensor:
        """The target's states at `layer_ids` for a right-padded batch of sequences [N, L] (row n real up to
        lengths[n]), concatenated: [N, L, len(layer_ids) * H]. From the tap store where the trainer keeps one
        (each sequence's taps computed once, then read), else from a target forward."""
        if self.tap_store is None:
            return self.target.tap_hidden_states(tokens).tapped(list(layer_ids))
        return self.tap_store.tapped(self.target, tokens, lengths, layer_ids)

    def use_data(self, data: Any) -> None:
        """Called once before the first step with the training data (a `specdec.training.DataDir`), e.g. for
        token statistics."""

    def save_draft(self, folder: str | Path) -> Path:  # pragma: no cover - interface
        """Write a checkpoint the proposer loads with its `draft` option."""
        raise NotImplementedError

    def proposer_options(self, folder: str | Path) -> dict[str, Any]:
        """Options that make the proposer use the draft saved in `folder` (for evaluation)."""
        return {"draft": str(folder)}


@dataclass
class ExportedDraft:
    """What `specdec export` writes for a draft: config.json's object, model.safetensors' tensors, and other
    JSON files beside them (file name -> JSON value)."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    files: dict[str, Any] = field(default_factory=dict)


class DraftExporter:
    """Writes a plugin's drafts in the layouts serving engines read (`specdec export --format`). Registered with
    `register_exporters`; the command owns the output folder (what it refuses, replaces and writes atomically),
    the exporter only says what goes in it."""

    name: ClassVar[str] = ""
    #: config.json `architectures` of the drafts this exporter writes
    architectures: ClassVar[tuple[str, ...]] = ()
    #: the layouts it writes, as `--format` names them
    formats: ClassVar[tuple[str, ...]] = ()
    description: ClassVar[str] = ""

    def contents(self, draft: Path, fmt: str, verifier: str | None = None) -> ExportedDraft:  # pragma: no cover
        """The export of the draft in `draft` in layout `fmt` (one of `formats`); a draft that cannot be read is
        refused with a SpecdecError, before anything is written. `verifier`: the target's name or path, for
        layouts that record it."""
        raise NotImplementedError


@dataclass
class Registry:
    """Every proposer, verifier, cache, objective and exporter class, with the distribution each came from."""

    proposers: dict[str, type[Proposer]] = field(default_factory=dict)
    verifiers: dict[str, type[Verifier]] = field(default_factory=dict)
    caches: dict[str, type[KVCache]] = field(default_factory=dict)
    objectives: dict[str, type[TrainingObjective]] = field(default_factory=dict)
    exporters: dict[str, type[DraftExporter]] = field(default_factory=dict)
    #: CLI commands plugins add (`register_commands`), by name: click.Command objects
    commands: dict[str, Any] = field(default_factory=dict)
    origins: dict[tuple[str, str], str] = field(default_factory=dict)
