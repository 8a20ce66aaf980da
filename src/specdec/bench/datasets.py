"""Datasets for `specdec bench`: where a dataset NAME is looked up, and loading its prompts (JSONL)."""

from __future__ import annotations

import os
from pathlib import Path

from ..check import Prompt, read_prompts_jsonl
from ..errors import SpecdecError

ENV_DATA_DIR = "SPECDEC_DATA_DIR"
DEFAULT_DATA_DIR = Path("..") / "shared" / "datasets"


def dataset_search_path(data_dir: str | os.PathLike | None = None) -> list[Path]:
    """Where a dataset NAME is looked up, in order: --data-dir, $SPECDEC_DATA_DIR, ../shared/datasets."""
    path = [Path(p) for p in (data_dir, os.environ.get(ENV_DATA_DIR)) if p]
    return path + [DEFAULT_DATA_DIR]


def known_datasets(data_dir: str | os.PathLike | None = None) -> list[str]:
    names: set[str] = set()
    for folder in dataset_search_path(data_dir):
        if folder.is_dir():
            names.update(p.stem for p in folder.glob("*.jsonl"))
    return sorted(names)


def resolve_dataset(name_or_path: str, data_dir: str | os.PathLike | None = None) -> Path:
    """A JSONL path as given, or NAME -> NAME.jsonl in the first folder of the search path that has it."""
    if not name_or_path or not name_or_path.strip():
        raise SpecdecError("--dataset is empty; give a dataset name (e.g. gsm8k) or a JSONL path.")
    as_path = Path(name_or_path)
    if as_path.suffix == ".jsonl" or os.sep in name_or_path or as_path.is_file():
        if not as_path.is_file():
            raise SpecdecError(f"Dataset file {name_or_path} does not exist; check the path.")
        return as_path
    for folder in dataset_search_path(data_dir):
        candidate = folder / f"{name_or_path}.jsonl"
        if candidate.is_file():
            return candidate
    known = ", ".join(known_datasets(data_dir)) or "none"
    where = ", ".join(str(p) for p in dataset_search_path(data_dir))
    raise SpecdecError(f"Unknown dataset {name_or_path!r}; known datasets: {known} (searched {where}; "
                       f"set --data-dir or ${ENV_DATA_DIR}, or pass a JSONL path).")


def load_dataset(name_or_path: str, data_dir: str | os.PathLike | None = None,
                 limit: int | None = None) -> tuple[Path, list[Prompt]]:
    """(path, prompts): every line is validated; the first `limit` prompts are kept."""
    if limit is not None and limit < 1:
        raise SpecdecError(f"--limit must be at least 1, got {limit}; leave it out to run every prompt.")
    path = resolve_dataset(name_or_path, data_dir)
    prompts = read_prompts_jsonl(path, paper_turns=True)
    return path, prompts[:limit] if limit is not None else prompts
