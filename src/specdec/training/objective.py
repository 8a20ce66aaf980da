"""What a plugin supplies to make its drafts trainable by the shared trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from ..target import TargetModel
from .data import DataDir


class ObjectiveConfig(BaseModel):
    """Options of a training objective (`specdec train --opt key=value`)."""

    model_config = ConfigDict(extra="forbid")

    def for_resume(self) -> ObjectiveConfig:
        """These options as a resumed run applies them (`--resume`); options that act only when a run
        begins (e.g. counting something from the data) override this to switch themselves off."""
        return self


class TrainingObjective:
    """The per-proposer part of training: the draft being trained and its loss on one sequence."""

    name: ClassVar[str] = ""
    Config: ClassVar[type[ObjectiveConfig]] = ObjectiveConfig

    def __init__(self, config: ObjectiveConfig, target: TargetModel, init: str | Path | None = None) -> None:
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

    def use_data(self, data: DataDir) -> None:
        """Called once before the first step with the training data (e.g. for token statistics)."""

    def save_draft(self, folder: str | Path) -> Path:  # pragma: no cover - interface
        """Write a checkpoint the proposer loads with its `draft` option."""
        raise NotImplementedError

    def proposer_options(self, folder: str | Path) -> dict[str, Any]:
        """Options that make the proposer use the draft saved in `folder` (for evaluation)."""
        return {"draft": str(folder)}



def rope_theta_of(config: Any) -> float:
    """A transformers config's RoPE base, wherever this transformers version keeps it (a draft copies it)."""
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        theta = params.get("rope_theta", 10000.0)
    return float(theta)


def target_shaped_fields(target: TargetModel, intermediate_size: int | None = None) -> dict[str, Any]:
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
