"""Prompt lookup: the scan that defines it, and the incremental index that must answer exactly like it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.lookup import NgramIndex, find_continuation, find_continuations


def test_ngram_lookup_prefers_the_longest_then_latest_or_earliest_match():
    tokens = np.array([5, 6, 1, 5, 6, 2, 9, 6, 3, 5, 6])
    assert find_continuation(tokens, 1, 3, 2).tolist() == [2, 9]  # suffix (5, 6): latest earlier match at 3
    assert find_continuation(tokens, 1, 3, 2, latest=False).tolist() == [1, 5]  # first match at 0
    assert find_continuation(tokens, 1, 1, 3).tolist() == [3, 5, 6]  # only 1-grams: latest earlier 6 at 7
    assert find_continuation(np.array([1, 2, 3]), 1, 3, 4).tolist() == []  # no match: no draft


def test_ngram_candidates_are_distinct_longest_match_first():
    tokens = np.array([5, 6, 1, 5, 6, 2, 9, 6, 3, 5, 6])
    # (5, 6) matched at 3 then 0; then the 1-gram (6) at 7 (its continuation 3 is new), at 4 and 1 (repeats)
    found = find_continuations(tokens, 1, 3, 2, limit=5)
    assert [f.tolist() for f in found] == [[2, 9], [1, 5], [3, 5]]
    assert [f.tolist() for f in find_continuations(tokens, 1, 3, 2, limit=2)] == [[2, 9], [1, 5]]


def as_lists(found: list[np.ndarray]) -> list[list[int]]:
    return [f.tolist() for f in found]


@settings(max_examples=300, deadline=None)
@given(
    # a small alphabet makes repeats, and so matches, frequent
    chunks=st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=12), min_size=1, max_size=5),
    extra=st.lists(st.integers(0, 4), max_size=4),
    min_n=st.integers(1, 3), span=st.integers(0, 2), num_tokens=st.integers(1, 6), limit=st.integers(1, 4),
    latest=st.booleans(),
)
def test_index_answers_exactly_like_the_scan(chunks, extra, min_n, span, num_tokens, limit, latest):
    """After each chunk of committed tokens, with and without a query-only extension (dflash's seeded
    lookup), the index finds the same continuations in the same order as scanning the whole sequence."""
    index = NgramIndex(min_n, min_n + span)
    sequence: list[int] = []
    for chunk in chunks:
        index.extend(chunk)
        sequence += chunk
        assert index.tokens.tolist() == sequence
        for suffix in ([], extra):
            expected = find_continuations(np.array(sequence + suffix, dtype=np.int64), min_n, min_n + span,
                                          num_tokens, limit, latest)
            got = index.continuations(num_tokens, limit, latest, extra=suffix)
            assert as_lists(got) == as_lists(expected), (sequence, suffix)


def test_sync_reads_only_new_positions_and_restarts_on_another_sequence():
    index = NgramIndex(1, 3)
    buffer = torch.tensor([[5, 6, 1, 5, 6, 2, 9, 6, 3, 5, 6, 0, 0]])
    index.sync(buffer[:, :6])
    assert index.tokens.tolist() == [5, 6, 1, 5, 6, 2]
    index.sync(buffer[:, :11])  # the same buffer, grown: appended, not rebuilt
    assert index.tokens.tolist() == buffer[0, :11].tolist()
    assert as_lists(index.continuations(2, 5)) == [[2, 9], [1, 5], [3, 5]]
    other = torch.tensor([[1, 2, 1]])
    index.sync(other)  # another tensor: a new sequence
    assert index.tokens.tolist() == [1, 2, 1]
    assert as_lists(index.continuations(3)) == [[2, 1]]
    index.sync(other[:, :2])  # shorter than what was indexed: a new sequence too
    assert index.tokens.tolist() == [1, 2]


def test_index_grows_past_its_initial_capacity():
    index = NgramIndex(1, 2)
    tokens = np.arange(1000) % 7
    for start in range(0, 1000, 97):
        index.extend(tokens[start: start + 97])
    assert index.tokens.tolist() == tokens.tolist()
    assert as_lists(index.continuations(3, 2)) == as_lists(find_continuations(tokens, 1, 2, 3, 2))


def test_index_rejects_an_empty_n_range():
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramIndex(3, 2)
