"""What a plugin supplies to make its drafts trainable by the shared trainer: the objective's contract (defined
with the other plugin contracts in `specdec.contracts`) and helpers that shape a new draft after its target."""

from __future__ import annotations

from typing import Any

import torch

from ..contracts import ObjectiveConfig, Target, TrainingObjective
from ..errors import SpecdecError

__all__ = ["ObjectiveConfig", "TrainingObjective", "master_dtype", "refuse_reshaping", "rope_theta_of",
           "target_shaped_fields"]


def master_dtype(target: Target) -> torch.dtype:
    """The dtype a draft trains in beside `target`: float32 master weights (the forward runs under bf16
    autocast), or float64 beside a float64 target, which autocast leaves alone (exact tests)."""
    return torch.float64 if target.dtype == torch.float64 else torch.float32


def refuse_reshaping(config: ObjectiveConfig, draft_config: Any, init: object, keys: tuple[str, ...]) -> None:
    """With --init, an option among `keys` that was given and differs from the trained draft's own value would
    train a draft other than the one asked for; refuse it rather than ignore it (a value equal to the draft's
    own is harmless)."""
    for key in sorted(set(config.model_fields_set) & set(keys)):
        wanted, have = getattr(config, key), getattr(draft_config, key)
        if wanted is not None and (list(have) if isinstance(wanted, list) else have) != wanted:
            raise SpecdecError(f"The draft {init} has {key} {have}; --opt {key}={wanted} cannot change a trained "
                               "draft. Drop it, or leave out --init to train a new draft.")


def rope_theta_of(config: Any) -> float:
    """A transformers config's RoPE base, wherever this transformers version keeps it (a draft copies it)."""
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        theta = params.get("rope_theta", 10000.0)
    return float(theta)


def target_shaped_fields(target: Target, intermediate_size: int | None = None) -> dict[str, Any]:
    """A new draft's layer shape copied from the target's config: width, heads, head size, MLP size (unless
    given), norm epsilon, RoPE base, context length, vocabulary."""
    tc = target.config
    heads = int(tc.num_attention_heads)
    return {
        "hidden_size": target.hidden_size,
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(tc, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(tc, "head_dim", None) or target.hidden_size // heads),
        "intermediate_size": intermediate_size or int(tc.intermediate_size),
        "rms_norm_eps": float(getattr(tc, "rms_norm_eps", 1e-6)),
        "rope_theta": rope_theta_of(tc),
        "max_position_embeddings": int(getattr(tc, "max_position_embeddings", 32768)),
        "vocab_size": target.vocab_size,
        "num_target_layers": target.num_layers,
    }
