"""A reduced draft vocabulary: the draft scores only the tokens the target emits most often.

The idea is FR-Spec's and EAGLE-3's (its `d2t` table): a draft's LM head over the target's whole
vocabulary is the largest matmul of a draft step and of a training step, yet almost all accepted tokens
come from a few thousand frequent ones (on SmolLM2's own answers to the training prompts, the 8,192 most
frequent tokens cover 98.5% of the response tokens). Verification stays with the target's full head, so
output is unchanged; a token outside the subset can only be produced by the target, never drafted.

On disk: ``draft_vocab.json`` beside the weights, ``{"token_ids": [...ascending...], "source": ...}``.
Checkpoints without it draft over the whole vocabulary (z-lab's layout has no such file, and engines that
ignore it stay lossless, only slower).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from specdec.draft_vocab import head_rows, head_rows_linear, label_map, most_frequent
from specdec.errors import SpecdecError
from specdec.files import atomic_write_json

__all__ = ["VOCAB_FILE", "head_rows", "head_rows_linear", "inherited_source", "label_map", "load_vocab",
           "most_frequent", "save_vocab"]

VOCAB_FILE = "draft_vocab.json"


def save_vocab(token_ids: torch.Tensor, folder: str | os.PathLike, source: str = "") -> None:
    """Write draft_vocab.json in `folder`, atomically (specdec.files)."""
    atomic_write_json(Path(folder) / VOCAB_FILE, {"token_ids": token_ids.tolist(), "source": source}, indent=None)


def inherited_source(folder: str | os.PathLike) -> str:
    """The `source` a draft trained from `folder` records: the origin `folder`'s vocabulary recorded (its count),
    so a resumed run, or a draft continued from a continued one, keeps naming where the tokens were counted;
    `inherited from <folder>` only where `folder` recorded nothing."""
    try:
        recorded = json.loads((Path(folder) / VOCAB_FILE).read_text()).get("source", "")
    except (OSError, json.JSONDecodeError, AttributeError):
        recorded = ""
    return recorded if isinstance(recorded, str) and recorded else f"inherited from {folder}"


def load_vocab(folder: str | os.PathLike, vocab_size: int) -> torch.Tensor | None:
    """The draft vocabulary saved in `folder`, checked against the target's vocabulary; None if there is none."""
    path = Path(folder) / VOCAB_FILE
    if not path.is_file():
        return None
    try:
        ids = json.loads(path.read_text())["token_ids"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise SpecdecError(f"{path} is not a draft vocabulary (JSON with a `token_ids` list); delete it to draft "
                           "over the whole vocabulary.") from None
    if not ids or not all(isinstance(i, int) for i in ids):
        raise SpecdecError(f"{path}: `token_ids` must be a non-empty list of integers; delete the file to draft "
                           "over the whole vocabulary.")
    tensor = torch.tensor(ids, dtype=torch.long)
    if tensor.min() < 0 or tensor.max() >= vocab_size or tensor.unique().numel() != tensor.numel():
        raise SpecdecError(f"{path} lists token ids that are repeated or outside the target's vocabulary of "
                           f"{vocab_size}; use a draft trained for this target.")
    return tensor.sort().values
