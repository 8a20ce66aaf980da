"""Reading the JSON and JSONL files a user gives specdec, with errors that name the file and the line.

Every file is decoded as strict UTF-8 (a JSONL file may start with a byte-order mark): a byte that is not
UTF-8, a line that is not JSON, or a string holding an unpaired surrogate (a `\\udcff` escape, which no
tokenizer can encode) is one sentence naming the file, never a traceback later.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import SpecdecError

_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def json_type(value: Any) -> str:
    """The JSON name of a decoded value's type ("array", not "list")."""
    return _JSON_TYPES.get(type(value), type(value).__name__)


def decode_utf8(data: bytes, where: str) -> str:
    """`data` as text; a byte that is not UTF-8 is one sentence naming `where` and the offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecdecError(f"{where} is not valid UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                           "save it with UTF-8 encoding.") from None


def check_unicode(value: Any, where: str) -> None:
    """Every string in a decoded JSON value can be encoded as UTF-8 (no unpaired surrogate escapes)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise SpecdecError(f"{where} holds an unpaired surrogate ({value[exc.start]!r}), which is not text "
                               "any tokenizer can encode; fix that string.") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key, where)
            check_unicode(item, where)
    elif isinstance(value, list):
        for item in value:
            check_unicode(item, where)


def _read_bytes(file: Path, what: str) -> bytes:
    if not file.is_file():
        raise SpecdecError(f"{what} {file} does not exist; check the path.")
    try:
        return file.read_bytes()
    except OSError as exc:
        raise SpecdecError(f"{what} {file} cannot be read ({exc.strerror or exc}); check the file and its "
                           "permissions.") from None


def read_json(path: str | os.PathLike, what: str = "JSON file", expect_object: bool = True) -> Any:
    """A JSON file (config.json, index.json, ...), read as strict UTF-8; one object unless `expect_object`
    is false."""
    file = Path(path)
    text = decode_utf8(_read_bytes(file, what), f"{what} {file}")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecdecError(f"{what} {file} is not valid JSON ({exc.msg} at line {exc.lineno}, column "
                           f"{exc.colno}); fix the file or replace it with an intact copy.") from None
    if expect_object and not isinstance(value, dict):
        raise SpecdecError(f"{what} {file} holds a JSON {json_type(value)}, not an object; fix the file or replace "
                           "it with an intact copy.")
    return value


def read_jsonl(path: str | os.PathLike, what: str = "JSONL file") -> Iterator[tuple[str, dict]]:
    """Yields (where, record) for every non-blank line; `where` is "FILE, line N" for the caller's errors."""
    file = Path(path)
    data = _read_bytes(file, what)
    if data.startswith(b"\xef\xbb\xbf"):  # a byte-order mark, as some editors write: not part of line 1
        data = data[3:]
    for number, raw in enumerate(data.split(b"\n"), start=1):
        where = f"{file}, line {number}"
        line = decode_utf8(raw, where)
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SpecdecError(f"{where} is not valid JSON ({exc.msg}); fix or remove that line.") from None
        if not isinstance(record, dict):
            raise SpecdecError(f"{where} is a JSON {json_type(record)}, not an object; write one object per line.")
        check_unicode(record, where)
        yield where, record
