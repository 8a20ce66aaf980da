"""Prompt lookup (Saxena 2023): continue the context's suffix n-gram with what followed its earlier matches.

`find_continuations` is the definition, a scan of the whole context. `NgramIndex` answers the same
question from a table of every n-gram's occurrences, kept up to date as tokens are committed, so a
decoding step reads only its new tokens from the device and looks the suffix up instead of scanning the
context (one host transfer of the whole context per step, and a scan proportional to it, before).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch


def find_continuations(tokens: np.ndarray, min_n: int, max_n: int, num_tokens: int, limit: int = 1,
                       latest: bool = True) -> list[np.ndarray]:
    """Up to `limit` distinct continuations of earlier matches of the context's suffix: the longest suffix
    n-gram (max_n down to min_n) first, and within one n the most recent match first (latest=True) or the
    first one, as transformers' prompt lookup does (latest=False). Shorter n-grams are tried only while
    fewer than `limit` continuations were found."""
    length = tokens.shape[0]
    found: list[np.ndarray] = []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # windows starting at 0 .. length-n-1: every earlier n-gram, never the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        for hit in (hits[::-1] if latest else hits):
            if _keep(tokens[int(hit) + n: int(hit) + n + num_tokens], found) and len(found) == limit:
                return found
    return found


def find_continuation(tokens: np.ndarray, min_n: int, max_n: int, num_tokens: int,
                      latest: bool = True) -> np.ndarray:
    """The first of `find_continuations`, or an empty array."""
    found = find_continuations(tokens, min_n, max_n, num_tokens, 1, latest)
    return found[0] if found else tokens[:0]


def _keep(continuation: np.ndarray, found: list[np.ndarray]) -> bool:
    """Append a non-empty continuation not found before; True when it was appended."""
    if continuation.size and not any(np.array_equal(continuation, f) for f in found):
        found.append(continuation)
        return True
    return False


class NgramIndex:
    """Where each n-gram (min_n <= n <= max_n) of one sequence occurred, for `find_continuations` queries
    in time independent of the sequence's length. The sequence only grows: `sync` appends what a decode
    state committed since the last call, and starts over when handed another sequence."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.clear()

    def clear(self) -> None:
        self._tokens = np.empty(256, dtype=np.int64)
        self.length = 0
        # n-gram -> the positions right after each of its occurrences (where its continuation starts), ascending
        self._after: dict[tuple[int, ...], list[int]] = {}
        self._source: tuple[int, int] | None = None  # (storage pointer, row) of the synced tensor

    @property
    def tokens(self) -> np.ndarray:
        return self._tokens[: self.length]

    def extend(self, new_tokens: Sequence[int] | np.ndarray) -> None:
        new = np.asarray(new_tokens, dtype=np.int64).reshape(-1)
        if self.length + new.size > self._tokens.size:
            grown = np.empty(max(2 * self._tokens.size, self.length + new.size), dtype=np.int64)
            grown[: self.length] = self.tokens
            self._tokens = grown
        self._tokens[self.length: self.length + new.size] = new
        seq = self._tokens
        for end in range(self.length, self.length + new.size):  # the n-grams ending at each new token
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self._after.setdefault(tuple(seq[end + 1 - n: end + 1].tolist()), []).append(end + 1)
        self.length += new.size

    def sync(self, tokens: torch.Tensor, row: int = 0) -> None:
        """Catch up with `tokens` [B, T], row `row`, reading only the positions not indexed yet. A decoding
        loop appends to one buffer, so a different buffer or a shorter sequence means a new sequence."""
        source = (tokens.untyped_storage().data_ptr(), row)
        length = int(tokens.shape[1])
        if source != self._source or length < self.length:
            self.clear()
            self._source = source
        if length > self.length:
            self.extend(tokens[row, self.length:].tolist())

    def continuations(self, num_tokens: int, limit: int = 1, latest: bool = True,
                      extra: Sequence[int] = ()) -> list[np.ndarray]:
        """`find_continuations(tokens + extra, min_n, max_n, num_tokens, limit, latest)` without the scan:
        `extra` extends the sequence for this query only (a few tokens: matches overlapping them are found
        by comparing them directly)."""
        base = self.length
        extra_arr = np.asarray(extra, dtype=np.int64).reshape(-1)
        length = base + extra_arr.size

        def at(start: int, stop: int) -> np.ndarray:  # tokens[start:stop] of the sequence extended by `extra`
            if stop <= base:
                return self.tokens[start:stop]
            if start >= base:
                return extra_arr[start - base: stop - base]
            return np.concatenate([self.tokens[start:base], extra_arr[: stop - base]])

        found: list[np.ndarray] = []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = at(length - n, length)
            # continuation starts s with sequence[s-n:s] == suffix, s < length: those up to `base` are in the
            # table (the suffix's own occurrence, s == length, gives an empty continuation, which is skipped);
            # those past it overlap `extra` and are compared here
            indexed = self._after.get(tuple(suffix.tolist()), [])
            tail = [s for s in range(max(base + 1, n), length) if np.array_equal(at(s - n, s), suffix)]
            # iterators, not copies: a frequent 1-gram occurs hundreds of times
            starts = chain(reversed(tail), reversed(indexed)) if latest else chain(indexed, tail)
            for start in starts:
                # a copy: the caller owns it (through a view it could write into the index)
                if _keep(at(start, min(start + num_tokens, length)).copy(), found) and len(found) == limit:
                    return found
        return found
