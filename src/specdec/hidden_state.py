"""What every proposer whose draft reads the target's hidden states shares (DFlash, EAGLE-3).

Such a draft is conditioned on the target's hidden states at a few decoder layers, its *taps*. The
proposer asks the target for them once; keeps the taps of newly committed positions until the draft's
next forward reads them into its KV cache; and before any work starts finds its checkpoint folder (the
user's, or the one its plugin ships for the embedded target), reads its config.json and checks it
against the target, every failure as one sentence. What the draft computes, and how it drafts from it,
stays in its plugin: each architecture reads top to bottom in its own model file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, Protocol, TypeVar

import torch
from pydantic import Field, ValidationError
from safetensors.torch import save_file

from .contracts import DecodeState, Proposer, ProposerConfig, Target, TargetOutput, Verdict
from .errors import SpecdecError
from .loading import EMBEDDED_NAME

ConfigT = TypeVar("ConfigT")


class TapsConfig(Protocol):
    """The fields of a draft's config that say which target it reads."""

    @property
    def hidden_size(self) -> int: ...

    @property
    def target_layer_ids(self) -> Sequence[int]: ...

    @property
    def num_target_layers(self) -> int: ...


def holds_draft(folder: Path | None) -> bool:
    """Whether `folder` holds a draft checkpoint: config.json and safetensors weights."""
    return folder is not None and (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def read_config_json(folder: Path, kind: str) -> dict[str, Any]:
    """A draft folder's config.json, as JSON. `kind` names the checkpoint in messages ("DFlash draft")."""
    config_file = folder / "config.json"
    if not folder.is_dir():
        raise SpecdecError(f"{kind} folder {folder} does not exist; pass --draft PATH to a checkpoint folder.")
    if not config_file.is_file():
        article = "an" if kind[:1] in "AEIOU" else "a"
        raise SpecdecError(f"{folder} has no config.json; {article} {kind} folder holds config.json and "
                           "safetensors.")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise SpecdecError(f"{config_file} is not valid JSON ({exc.msg} at line {exc.lineno}).") from None


def parse_config(config_file: Path, raw: dict[str, Any], parse: Callable[[dict[str, Any]], ConfigT]) -> ConfigT:
    """`parse(raw)`, the config a draft's config.json describes; a field it rejects, or a setting the
    draft does not implement (a ValueError), as one sentence naming the file."""
    try:
        return parse(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "config"
        raise SpecdecError(f"{config_file}: {key}: {err['msg']}; fix the draft's config.json.") from None
    except SpecdecError:
        raise
    except ValueError as exc:
        raise SpecdecError(f"{config_file}: {exc}; use a draft without it.") from None


def check_taps_fit(kind: str, config: TapsConfig, target_hidden: int, target_layers: int, where: str) -> None:
    """The draft at `where` reads states as wide as the target's, from layers the target has."""
    if config.hidden_size != target_hidden:
        raise SpecdecError(f"The {kind} {where} has hidden size {config.hidden_size} but the target has "
                           f"{target_hidden}; use a draft trained for this target.")
    bad = [i for i in config.target_layer_ids if not 0 <= i < target_layers]
    if bad:
        raise SpecdecError(f"The {kind} {where} taps target layers {bad} but the target has only "
                           f"{target_layers} layers (ids 0..{target_layers - 1}); use a draft trained for this target.")
    if config.num_target_layers != target_layers:
        raise SpecdecError(f"The {kind} {where} was trained for a target with {config.num_target_layers} "
                           f"layers but this target has {target_layers}; use a draft trained for this target.")


def check_vocabulary_fits(kind: str, draft_vocab: int | None, target_vocab: int, where: str) -> None:
    """The draft at `where` was trained for the target's vocabulary (None: its config does not say)."""
    if draft_vocab is not None and draft_vocab != target_vocab:
        raise SpecdecError(f"The {kind} {where} was trained for a vocabulary of {draft_vocab} tokens but "
                           f"the target has {target_vocab}; use a draft trained for this target.")


def write_checkpoint(folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """config.json + model.safetensors in `folder`; the weights go through a temporary file, so an
    interrupted save never leaves a truncated model.safetensors."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


class PendingTaps(NamedTuple):
    """Tapped target states the draft has not read yet, of positions start..T-2 (T committed tokens)."""

    states: torch.Tensor  # [B, n, len(layer_ids) * H]
    start: int
    positions: torch.Tensor  # [1, n]: start, ..., T - 2


class HiddenStateProposer(Proposer):
    """Base of a proposer whose draft reads target taps. A subclass names its `shipped_draft` and fills
    in `check_against_target` and the hooks `read_draft_config`, `load` and `new_cache`. Construction finds
    the draft's folder, reads and checks its config, sets `layer_ids` from it, calls `load`, requests the
    taps and resets. Per sequence: `cache` is a fresh `new_cache()`; `prefill` and `observe` collect the
    taps of committed positions, and `take_pending` hands them to the draft's next forward."""

    #: the draft this package ships for the embedded default target (None: none), used without --draft
    shipped_draft: ClassVar[Path | None] = None
    #: the plugin's check that a draft config fits the target: (draft config, target hidden size, number of
    #: target layers, target vocabulary size, where the draft is) -> a SpecdecError naming where, or None
    check_against_target: ClassVar[Callable[[Any, int, int, int, str], None]]

    class Config(ProposerConfig):
        draft: str | None = Field(None, description="draft checkpoint folder (default: the shipped draft)")

    config: Config
    layer_ids: list[int]
    cache: Any

    def __init__(self, config: Config, target: Target) -> None:
        super().__init__(config, target)
        if config.draft is None and not self.has_shipped_draft():
            raise SpecdecError(f"Proposer '{self.name}' needs a draft checkpoint; pass --draft PATH (or --opt "
                               "draft=PATH).")
        folder = Path(config.draft) if config.draft is not None else self.shipped_draft
        draft_config = self.read_draft_config(folder)
        try:
            self.check_against_target(draft_config, target.hidden_size, target.num_layers, target.vocab_size,
                                      str(folder))
        except SpecdecError:
            if config.draft is not None:
                raise
            raise SpecdecError(f"Proposer '{self.name}' needs a draft checkpoint for this target (the shipped draft "
                               f"is for the embedded {EMBEDDED_NAME}); pass --draft PATH.") from None
        self.layer_ids = list(draft_config.target_layer_ids)
        self.load(folder, draft_config)
        target.request_taps(self.layer_ids)
        self.reset()

    @classmethod
    def has_shipped_draft(cls) -> bool:
        return holds_draft(cls.shipped_draft)

    def read_draft_config(self, folder: Path) -> TapsConfig:  # pragma: no cover - interface
        """The config in `folder`, each problem with it as one sentence."""
        raise NotImplementedError

    def load(self, folder: Path, draft_config: Any) -> None:  # pragma: no cover - interface
        """Load the draft (and whatever drafting needs beside it) from `folder`, whose config fits the target."""
        raise NotImplementedError

    def new_cache(self) -> Any:  # pragma: no cover - interface
        """An empty draft KV cache, for a new sequence."""
        raise NotImplementedError

    def reset(self) -> None:
        self.cache = self.new_cache()
        self._pending: torch.Tensor | None = None  # tapped target states the draft has not read yet
        self._pending_start = 0  # position of the first of them

    def prefill(self, state: DecodeState, target_output: TargetOutput) -> None:
        self._pending = target_output.tapped(self.layer_ids)  # every prompt position
        self._pending_start = 0

    def observe(self, state: DecodeState, verdict: Verdict, target_output: TargetOutput) -> None:
        # The verification forward read [last committed, draft...]; the first accepted + 1 are committed now,
        # so their hidden states become the draft's context, and no extra target pass is needed.
        accepted = int(verdict.num_accepted[0]) + 1
        new = target_output.tapped(self.layer_ids)[:, :accepted]
        if self._pending is None:
            self._pending, self._pending_start = new, state.length - accepted - 1
        else:
            self._pending = torch.cat([self._pending, new], dim=1)

    def take_pending(self, state: DecodeState) -> PendingTaps:
        """The taps the draft has not read yet, which reach up to the last committed token's predecessor;
        handed over once, for the forward that reads them into the draft's cache."""
        pending, start, length = self._pending, self._pending_start, state.length
        assert pending is not None and start + pending.shape[1] == length - 1, "context out of sync"
        self._pending, self._pending_start = None, length - 1
        positions = torch.arange(start, length - 1, device=state.tokens.device).unsqueeze(0)
        return PendingTaps(pending, start, positions)
