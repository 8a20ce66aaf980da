"""Reading JSONL files of records, with errors that name the file and the line."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from .errors import SpecdecError


def read_jsonl(path: str | os.PathLike, what: str = "JSONL file") -> Iterator[tuple[str, dict]]:
    """Yields (where, record) for every non-blank line; `where` is "FILE, line N" for the caller's errors."""
    file = Path(path)
    if not file.is_file():
        raise SpecdecError(f"{what} {file} does not exist; check the path.")
    with file.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{file}, line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SpecdecError(f"{where} is not valid JSON ({exc.msg}); fix or remove that line.") from None
            if not isinstance(record, dict):
                raise SpecdecError(f"{where} is a JSON {type(record).__name__}, not an object; write one object "
                                   "per line.")
            yield where, record
