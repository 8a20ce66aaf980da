"""Writing files safely: every file specdec writes lands whole or not at all, in a folder specdec owns.

- `atomic_write_bytes` / `atomic_write_text` / `atomic_save_file`: write to a temporary file in the same
  folder, flush and fsync it, then rename it over the destination (a rename within one file system is atomic
  on POSIX), so a reader or an interrupted run sees the old file or the new one, never half of one.
- `claim_output_dir`: an output folder is specdec's when it is new or empty, or when it holds the marker
  file a specdec command left there (`.specdec-owner`, naming the command). A folder holding anything else is
  the user's: refused with one sentence, unless `overwrite=True` (`--overwrite`), which lets specdec replace
  the files it writes there; nothing else in the folder is touched or deleted.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from .errors import SpecdecError

OWNER_MARKER = ".specdec-owner"


def _atomic(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """Call write(temporary path) and move the result to `path` in one rename."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(handle)
    try:
        write(tmp)
        with open(tmp, "rb") as written:  # the bytes reach the disk before the name points at them
            os.fsync(written.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return _atomic(path, lambda tmp: Path(tmp).write_bytes(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return _atomic(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def atomic_write_json(path: str | os.PathLike, value: object, indent: int | None = 2) -> Path:
    return atomic_write_text(path, json.dumps(value, indent=indent) + "\n")


def atomic_save_file(tensors: dict, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> Path:
    """safetensors' save_file, atomically."""
    from safetensors.torch import save_file

    return _atomic(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def claim_output_dir(path: str | os.PathLike, command: str, overwrite: bool = False,
                     option: str = "--out") -> Path:
    """Make `path` a folder `command` may write into, or refuse before any work starts.

    A new or empty folder is claimed (the marker is written); one already marked by specdec is reused (a
    resume, or another run of the command); one holding other files is refused unless `overwrite`. Returns
    the folder.
    """
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise SpecdecError(f"{option} {folder} is a file, not a folder; choose a folder path.")
    has_entries = folder.is_dir() and any(folder.iterdir())
    if has_entries and not (folder / OWNER_MARKER).is_file() and not overwrite:
        raise SpecdecError(f"{option} {folder} already holds files specdec did not write; choose a new or empty "
                           "folder, or pass --overwrite to let specdec replace the files it writes there.")
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / OWNER_MARKER).is_file():
        atomic_write_text(folder / OWNER_MARKER, f"written by specdec {command}\n")
    return folder


def same_path(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name the same folder or file (or one lies inside the other)."""
    ra, rb = Path(a).resolve(), Path(b).resolve()
    return ra == rb or ra in rb.parents or rb in ra.parents
