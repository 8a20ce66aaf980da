"""Helpers shared by the `specdec` commands (specdec.cli, specdec.bench.cli, specdec.training.cli):
SpecdecError as one sentence and exit code 2, the `--debug` switch, `--opt key=value` pairs, and the checks
of numeric options and devices that every command runs before any work starts."""

from __future__ import annotations

import functools
import math
import os
import sys
import traceback
from typing import Any

import click

from .errors import SpecdecError

#: the largest --seed (torch seeds its generators with a 64-bit integer; seed + prompt index must fit)
MAX_SEED = 2**63 - 1
#: the largest count-like option (--max-new-tokens, --top-k): generation is cut at the context window anyway,
#: so a larger value is a typing mistake, not a request
MAX_COUNT = 2**31 - 1
ENV_DEBUG = "SPECDEC_DEBUG"

_debug = False


def set_debug(on: bool) -> None:
    """`specdec --debug ...`: print the traceback of every error before its sentence."""
    global _debug
    _debug = bool(on)


def debug_enabled() -> bool:
    return _debug or os.environ.get(ENV_DEBUG, "") not in ("", "0")


def print_traceback() -> None:
    """The traceback of the exception being handled, on stderr, under --debug only."""
    if debug_enabled():
        click.echo(traceback.format_exc().rstrip(), err=True)


def user_errors(func):
    """Turn SpecdecError into `error: ...` on stderr and exit code 2."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except SpecdecError as exc:
            print_traceback()
            click.echo(f"error: {one_line(str(exc))}", err=True)
            sys.exit(2)

    return wrapper


def one_line(text: str) -> str:
    """A message as one line (a sentence that spans lines is joined with spaces)."""
    return " ".join(text.split())


def parse_options(pairs: tuple[str, ...]) -> dict[str, str]:
    options: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise SpecdecError(f"--opt {pair!r} is not of the form key=value; write e.g. --opt num_tokens=8.")
        options[key.strip()] = value
    return options


# -- numeric options -----------------------------------------------------------------------------------------

def check_count(option: str, value: int | None, minimum: int = 1, maximum: int = MAX_COUNT,
                off: str | None = None) -> None:
    """An integer option within [minimum, maximum]; `off` says what the minimum means (e.g. "0 turns it off")."""
    if value is None:
        return
    if value < minimum:
        meaning = f" ({off})" if off else ""
        raise SpecdecError(f"{option} must be at least {minimum}{meaning}, got {value}.")
    if value > maximum:
        raise SpecdecError(f"{option} must be at most {maximum}, got {value}; give a smaller number.")


def check_seed(option: str, seed: int | None) -> None:
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise SpecdecError(f"{option} must be between 0 and {MAX_SEED} (2**63 - 1), got {seed}; pick a seed in "
                           "that range.")


def check_temperature(option: str, temperature: float) -> None:
    if not (math.isfinite(temperature) and temperature >= 0):
        raise SpecdecError(f"{option} must be a finite number >= 0 (0 means greedy), got {temperature}.")


def check_top_p(option: str, top_p: float) -> None:
    if not 0.0 < top_p <= 1.0:  # nan fails both comparisons
        raise SpecdecError(f"{option} must be in (0, 1] (1 turns it off), got {top_p}.")


def check_positive(option: str, value: float) -> None:
    """A float option that must be a finite number above zero (--epsilon)."""
    if not (math.isfinite(value) and value > 0):
        raise SpecdecError(f"{option} must be a positive finite number, got {value}.")


def check_text(option: str, value: str) -> None:
    """A text option is UTF-8 (a command-line byte that is not UTF-8 arrives as a lone surrogate)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = ord(value[exc.start])
        what = f"byte 0x{bad - 0xDC00:02x}" if 0xDC80 <= bad <= 0xDCFF else f"character U+{bad:04X}"
        raise SpecdecError(f"{option} {value!r} is not valid UTF-8 ({what}); give it in UTF-8.") from None


def check_device(device: str | None) -> None:
    """A --device that names a device this machine has; None (the default) is always fine."""
    if device is not None:
        from .loading import resolve_device

        resolve_device(device)


def parse_draft_budget(text: str) -> int | None:
    """--draft-budget: "auto" -> None (adaptive), a whole number >= 0 -> that number."""
    if text.strip().lower() == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise SpecdecError(f"--draft-budget must be auto or a whole number of at least 0, got {text!r}.") from None
    check_count("--draft-budget", value, minimum=0, off="0 is plain decoding")
    return value


def checked_proposer(proposer: str | None, model: str | None, draft: str | None, opts: tuple[str, ...],
                     verifier: str | None, sampling: Any = None) -> tuple[str, dict[str, Any]]:
    """The proposer's name (default: the best for `model`) and its options (--opt pairs, --draft), every one
    validated, and the verifier's name checked (for `sampling` when given), before any model loads."""
    from .api import build_proposer_config, check_verifier, default_proposer

    options: dict[str, Any] = parse_options(opts)
    if draft is not None:
        options["draft"] = draft
    name = proposer or default_proposer(model)
    build_proposer_config(name, options)
    if verifier is not None:
        check_verifier(verifier, sampling)
    return name, options
