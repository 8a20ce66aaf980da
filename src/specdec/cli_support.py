"""Helpers shared by the `specdec` commands (specdec.cli, specdec.bench.cli, specdec.training.cli):
SpecdecError as one sentence and exit code 2, and `--opt key=value` pairs."""

from __future__ import annotations

import functools
import sys
from typing import Any

import click

from .errors import SpecdecError


def user_errors(func):
    """Turn SpecdecError into `error: ...` on stderr and exit code 2."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except SpecdecError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)

    return wrapper


def parse_options(pairs: tuple[str, ...]) -> dict[str, str]:
    options: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise SpecdecError(f"--opt {pair!r} is not of the form key=value; write e.g. --opt num_tokens=8.")
        options[key.strip()] = value
    return options
