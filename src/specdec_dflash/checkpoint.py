"""DFlash checkpoints in z-lab's layout: `config.json` + safetensors. Never pickle, never remote code."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from specdec.errors import SpecdecError
from specdec.hidden_state import (
    check_config_fields,
    check_taps_fit,
    check_vocabulary_fits,
    parse_config,
    read_config_json,
    write_checkpoint,
)
from specdec.weights import check_tensors, read_safetensors

from .dflash2_model import DFlash2Config, DFlash2DraftModel
from .model import DFlashConfig, DFlashDraftModel

#: how messages name the checkpoint
KIND = "DFlash draft"

#: tensors some checkpoints carry but a DFlash draft takes from the target instead
TARGET_OWNED = ("embed_tokens.weight", "lm_head.weight", "model.embed_tokens.weight")


#: What a DFlash config.json may hold besides DFlashConfig's own fields and specdec.hidden_state.INERT_FIELDS:
#: the layout's own keys (read by DFlashConfig.from_checkpoint_json); `tie_word_embeddings` (inert: the draft has
#: no embeddings or head of its own, it uses the target's); `use_sliding_window` and `max_window_layers` (read:
#: which layers are windowed, as transformers' Qwen3Config derives them).
LAYOUT_FIELDS = frozenset({"dflash_config", "tie_word_embeddings", "use_sliding_window", "max_window_layers"})

#: the architecture that marks a DFlash2 draft (the rest of the config is DFlash's plus its own keys)
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"

#: the selector's codebooks: stored bare by z-lab's checkpoints, with `.weight` by a transformers save of its
#: nn.Embedding version; both read
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def is_dflash2(raw: dict) -> bool:
    return DFLASH2_ARCHITECTURE in [str(a) for a in raw.get("architectures") or []]


def read_config(path: str | os.PathLike) -> DFlashConfig:
    """The draft's config (a DFlash2Config for a DFlash2DraftModel); a field it does not honour is refused,
    before any weights load."""
    folder = Path(path)
    raw = read_config_json(folder, KIND)
    architectures = [str(a) for a in raw.get("architectures") or []]
    if "eagle_config" in raw or any("Eagle" in a for a in architectures):
        raise SpecdecError(f"{folder} holds an EAGLE draft, not a DFlash one; use --proposer eagle3.")
    config_class = DFlash2Config if is_dflash2(raw) else DFlashConfig
    config_file = folder / "config.json"
    read = set(config_class.model_fields) | LAYOUT_FIELDS
    check_config_fields(config_file, KIND, raw, read,
                        nested={"dflash_config": (frozenset(config_class.DFLASH_KEYS) | {"is_causal"}, {})})
    config = parse_config(config_file, raw, config_class.from_checkpoint_json)
    inner = (raw.get("dflash_config") or {}).get("is_causal")
    if inner is not None:
        # z-lab's code reads is_causal at the top level only (else: causal in sliding_attention layers); some
        # ports read dflash_config's. Where the two readings differ, which one the draft was trained with is
        # unknowable: refused.
        layers = [config.causal_of(i) for i in range(config.num_hidden_layers)]
        if not isinstance(inner, bool) or any(causal != inner for causal in layers):
            causal = [i for i, c in enumerate(layers) if c]
            reading = ("every layer bidirectional" if not causal else "every layer causal" if len(causal) == len(layers)
                       else f"layers {causal} causal and the rest bidirectional")
            raise SpecdecError(f"{config_file} sets dflash_config.is_causal to {json.dumps(inner)}, but z-lab's code "
                               f"reads is_causal at the top level only and makes {reading} inside the block here; "
                               "move it to the top level (or delete it).")
    return config


def check_against_target(config: DFlashConfig, target_hidden: int, target_layers: int, vocab_size: int,
                         where: str) -> None:
    """Every way a draft can fail to fit its target, each as one sentence, before any work starts."""
    check_taps_fit(KIND, config, target_hidden, target_layers, where)
    if not 0 <= config.mask_token_id < vocab_size:
        raise SpecdecError(f"The DFlash draft {where} uses mask token {config.mask_token_id}, outside the target's "
                           f"vocabulary of {vocab_size}; use a draft trained for this target.")
    check_vocabulary_fits(KIND, config.vocab_size, vocab_size, where)


def load_weights(model: DFlashDraftModel, folder: Path) -> None:
    tensors = read_safetensors(folder, KIND)
    tensors = {k.removeprefix("model."): v for k, v in tensors.items() if k not in TARGET_OWNED}
    for name in CODEBOOKS:
        if name in tensors and f"{name}.weight" in tensors:
            raise SpecdecError(f"{folder} holds both {name} and {name}.weight; keep one of them.")
    tensors = {(k.removesuffix(".weight") if k.removesuffix(".weight") in CODEBOOKS else k): v
               for k, v in tensors.items()}
    check_tensors(model.state_dict(), tensors, folder, KIND)
    model.load_state_dict(tensors, strict=True)


def load_draft(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> DFlashDraftModel:
    folder = Path(path)
    config = read_config(folder)
    model = DFlash2DraftModel(config) if isinstance(config, DFlash2Config) else DFlashDraftModel(config)
    load_weights(model, folder)
    return model.to(device=device, dtype=dtype).eval()


def checkpoint_contents(model: DFlashDraftModel, dtype: torch.dtype = torch.bfloat16,
                        extra_config: dict | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """The config.json (z-lab's layout) and the tensors of `model`'s checkpoint, weights in `dtype`."""
    config = model.config.to_checkpoint_json() | {"torch_dtype": str(dtype).removeprefix("torch.")}
    config.update(extra_config or {})
    tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in model.state_dict().items()}
    return config, tensors


def save_draft(model: DFlashDraftModel, path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
               extra_config: dict | None = None) -> Path:
    """Write config.json + model.safetensors in z-lab's layout (loadable by z-lab's code, vLLM and SGLang)."""
    config, tensors = checkpoint_contents(model, dtype, extra_config)
    return write_checkpoint(Path(path), config, tensors)
