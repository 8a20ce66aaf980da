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
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, Protocol, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .contracts import DecodeState, Proposer, ProposerConfig, Target, TargetOutput, Verdict
from .errors import SpecdecError
from .files import atomic_save_file, atomic_write_json
from .jsonl import read_json
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


class DraftLayerConfig(BaseModel):
    """The shape of a Llama/Qwen-style draft decoder layer, named as checkpoints' config.json names it: the
    fields every hidden-state draft shares. A plugin's config subclasses it with its own fields (and its own
    `rope_theta` default, which differs between the layouts)."""

    model_config = ConfigDict(extra="ignore")  # the plugin's checkpoint reader refuses what it does not honour

    hidden_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768

    def layer_fields(self) -> dict[str, Any]:
        """These fields under their config.json names, for a plugin's `to_checkpoint_json`."""
        return {name: getattr(self, name) for name in DraftLayerConfig.model_fields}

    @model_validator(mode="after")
    def _heads_share_key_values(self) -> DraftLayerConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        return self


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
    return read_json(config_file, f"The {kind}'s config")


class Setting(NamedTuple):
    """A config.json field that changes the draft's numbers, of which the draft implements some values."""

    accepts: Callable[[Any], bool]  # whether the draft computes what this value asks for (None: never asked)
    implemented: str  # the value(s) it implements, in words ("'silu'")
    newer: bool = False  # a field of newer drafts of this kind, which this specdec does not implement


#: Fields a Hugging Face config.json may hold that never change what a draft computes at inference: bookkeeping
#: (`architectures` is checked by each plugin for the kind of draft it names; the dtype is specdec's --dtype);
#: special token ids (the target's tokenizer decides); `use_cache` (specdec keeps its own caches);
#: `initializer_range` and `attention_dropout` (training only: dropout is off at inference); `pretraining_tp`
#: (Llama: splits a matmul into slices whose sum is the same product); `auto_map` (names remote code, which
#: specdec never runs).
INERT_FIELDS = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range", "attention_dropout",
    "pretraining_tp", "auto_map",
})


def _plain_rope(value: Any) -> bool:
    return isinstance(value, dict) and value.get("rope_type", value.get("type", "default")) == "default" and \
        set(value) <= {"rope_type", "type", "rope_theta"}


#: Fields that change the numbers of every draft specdec implements (a Llama/Qwen decoder layer with plain
#: RoPE, SiLU MLP and no biases): values it does not implement are refused.
SETTINGS = {
    "hidden_act": Setting(lambda v: v in ("silu", "swish"), "'silu'"),
    "attention_bias": Setting(lambda v: v is False, "false"),
    "mlp_bias": Setting(lambda v: v is False, "false"),
    "rope_scaling": Setting(_plain_rope, "plain RoPE (rope_type 'default', no scaling)"),
    "rope_parameters": Setting(_plain_rope, "plain RoPE (rope_type 'default', no scaling)"),
}


def _shown(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list, bool)) or value is None else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_config_fields(config_file: Path, kind: str, raw: Mapping[str, Any], read: Collection[str],
                        settings: Mapping[str, Setting] | None = None,
                        nested: Mapping[str, tuple[Collection[str], Mapping[str, Setting]]] | None = None,
                        prefix: str = "") -> None:
    """Every field of a draft's config.json (`raw`) is honoured or refused, never ignored: read by the draft's
    config (`read`), known to be inert (INERT_FIELDS), or a setting (SETTINGS and the plugin's `settings`) whose
    value the draft implements; anything else is refused with one sentence naming the field and its value,
    before any weights load. `nested` holds the fields of a sub-object ("dflash_config": (read, settings))."""
    known = {**SETTINGS, **(settings or {})}
    for key, value in raw.items():
        name = prefix + key
        if key in (nested or {}) and isinstance(value, dict):
            inner_read, inner_settings = nested[key]
            check_config_fields(config_file, kind, value, inner_read, {**(settings or {}), **inner_settings},
                                prefix=f"{name}.")
        elif key in known:
            setting = known[key]
            if value is not None and not setting.accepts(value):
                if setting.newer:
                    raise SpecdecError(f"{config_file} sets {name} to {_shown(value)}, a setting of newer "
                                       f"{kind}s that this specdec does not implement (only {setting.implemented}); "
                                       "use a draft without it.")
                raise SpecdecError(f"{config_file} sets {name} to {_shown(value)}, but specdec's {kind} implements "
                                   f"only {setting.implemented}; use a draft trained with that.")
        elif key not in read and key not in INERT_FIELDS:
            raise SpecdecError(f"{config_file} sets {name} to {_shown(value)}, a field specdec's {kind} neither "
                               "reads nor knows to leave the draft's numbers alone; use a draft without it (or "
                               "delete the field if you know it is inert).")


def sliding_window_of(raw: Mapping[str, Any]) -> int | None:
    """The sliding window a Qwen-style config.json asks for: `sliding_window`, unless `use_sliding_window` is
    false (transformers' Qwen configs then set no window)."""
    return None if raw.get("use_sliding_window") is False else raw.get("sliding_window")


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
    """model.safetensors, then config.json, in `folder`, each written atomically (specdec.files): an
    interrupted save never leaves a truncated file, and config.json, which makes the folder a draft, comes last."""
    atomic_save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    atomic_write_json(folder / "config.json", config)
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
        self.check_sizes(target.max_context)
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

    def check_sizes(self, max_context: int) -> None:
        """Refuse, before anything loads, a size-like option whose draft would not fit one verification forward
        of a target with this context window (specdec.limits.check_draft_sizes); the Config's static bounds
        were checked when the options were parsed."""

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
