"""Ragged rows in the native cache and forward (issue 22, item 2): per-row lengths, crop and retain per row, rows
leaving and joining the batch, against a brute-force reference.

The reference keeps each row as its own B = 1 TargetModel with transformers' forward and DynamicCache, mirrors
every operation on it, and at the end re-runs each row's tokens from scratch with no cache at all.

Exactness: a row of a batch is not bit-identical to the same row run alone, on this CPU, even when every row holds
one length (today's path): the BLAS picks its blocking by matrix shape (a [4 x 37, 32] product rounds row 1
differently from a [37, 32] one in float64), and SDPA's reductions over the longer, masked key range of a ragged
batch add in another order. Both are rounding only, so the reference comparisons run in float64 with an absolute
tolerance of 1e-12 (observed: about 2e-16 on logits of size ~1; a wrong position, slot or mask moves them by more
than 1e-3). Where exactness does hold it is tested bit for bit: a row's logits and taps do not depend on the
other rows' tokens nor on what is left in the slots past its length (same shapes, so the same kernels).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.errors import SpecdecError
from specdec.native_cache import NativeKVCache, row_mask
from specdec.target import TargetModel

TAPS = [0, 2]
ATOL = 1e-12  # float64; see the module docstring
BASE = {kind: tiny_model(kind, seed=3) for kind in ("llama", "qwen3")}  # float64, 4 layers, GQA 4/2


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=ATOL)


def same_output(out, row: int, positions: int, ref) -> None:
    """Row `row`'s first `positions` logits and taps of a batched output against a B = 1 reference output."""
    close(out.logits[row, :positions], ref.logits[0])
    assert out.taps.keys() == ref.taps.keys()
    for layer in TAPS:
        close(out.taps[layer][row, :positions], ref.taps[layer][0])


class Batch:
    """The native target under test, one reference target per row, and each row's tokens."""

    def __init__(self, model) -> None:
        self.model = model
        self.native = TargetModel(model, cache="native")
        self.native.request_taps(TAPS)
        self.native.reset()
        self.refs: list[TargetModel] = []
        self.tokens: list[list[int]] = []

    def reference(self) -> TargetModel:
        ref = TargetModel(self.model, cache="dynamic")
        ref.request_taps(TAPS)
        return ref

    def check_state(self) -> None:
        """Every row holds the positions its reference holds, keys and values alike, in every layer."""
        lengths = self.native.cache_lengths
        assert lengths == [ref.cache_length for ref in self.refs] == [len(t) for t in self.tokens]
        cache = self.native.backend.cache
        assert isinstance(cache, NativeKVCache)
        if not lengths:
            assert cache.keys is None
            return
        assert cache.keys.shape[1] == len(lengths)
        for row, (ref, length) in enumerate(zip(self.refs, lengths, strict=True)):
            for layer, held in enumerate(ref.backend.cache.hf_cache.layers):
                close(cache.keys[layer, row, :, :length], held.keys[0])
                close(cache.values[layer, row, :, :length], held.values[0])

    # -- operations, each mirrored on the references ---------------------------------------------------
    def add(self, prompts: list[list[int]]) -> None:
        out = self.native.add_rows(prompts)
        assert out.logits.shape[:2] == (len(prompts), 1)
        for j, prompt in enumerate(prompts):
            ref = self.reference()
            expected = ref.prefill(torch.tensor([prompt]))
            close(out.logits[j], expected.logits[0])
            for layer in TAPS:
                close(out.taps[layer][j, : len(prompt)], expected.taps[layer][0])
            self.refs.append(ref)
            self.tokens.append(list(prompt))

    def drop(self, rows: list[int]) -> None:
        self.native.drop_rows(rows)
        self.refs = [ref for b, ref in enumerate(self.refs) if b not in rows]
        self.tokens = [t for b, t in enumerate(self.tokens) if b not in rows]

    def chain(self, feed: torch.Tensor, counts: list[int]) -> None:
        """Row b feeds its first counts[b] tokens (the rest is right padding, cropped away after)."""
        lengths = self.native.cache_lengths
        out = self.native.forward(feed)
        assert out.logits.shape[:2] == feed.shape
        for b, (ref, count) in enumerate(zip(self.refs, counts, strict=True)):
            same_output(out, b, count, ref.forward(feed[b: b + 1, :count]))
            self.tokens[b] += feed[b, :count].tolist()
        self.native.crop([length + count for length, count in zip(lengths, counts, strict=True)])

    def last(self, feed: torch.Tensor, counts: list[int]) -> None:
        """forward_last: row b reads its first counts[b] tokens (0 or more; the rest right padding the cache
        does not count) and gets the logits after its last real token only."""
        out = self.native.forward_last(feed, counts)
        assert out.logits.shape[:2] == (feed.shape[0], 1)
        for b, (ref, count) in enumerate(zip(self.refs, counts, strict=True)):
            if count:
                expected = ref.forward(feed[b: b + 1, :count])
                close(out.logits[b, 0], expected.logits[0, -1])
                for layer in TAPS:
                    close(out.taps[layer][b, :count], expected.taps[layer][0])
            self.tokens[b] += feed[b, :count].tolist()

    def tree(self, feed: torch.Tensor, parents: list[int], paths: list[list[int]]) -> None:
        """One tree (the same parents in every row, its own tokens per row) after each row's own length, then
        each row keeps the root and its own accepted path (draft indices), padded with -1 as Verdict.path is."""
        lengths = self.native.cache_lengths
        out = self.native.forward(feed, tree_parents=parents)
        for b, ref in enumerate(self.refs):
            same_output(out, b, feed.shape[1], ref.forward(feed[b: b + 1], tree_parents=parents))
        width = max(len(path) for path in paths)
        indices = torch.tensor([path + [-1] * (width - len(path)) for path in paths], dtype=torch.long)
        self.native.retain([length + 1 for length in lengths], indices)
        for b, (ref, path) in enumerate(zip(self.refs, paths, strict=True)):
            ref.retain(lengths[b] + 1, torch.tensor(path, dtype=torch.long))
            self.tokens[b] += [int(feed[b, 0])] + [int(feed[b, 1 + j]) for j in path]

    def crop(self, lengths: list[int]) -> None:
        self.native.crop(lengths)
        for ref, tokens, length in zip(self.refs, self.tokens, lengths, strict=True):
            ref.crop(length)
            del tokens[length:]

    def from_scratch(self, probe: torch.Tensor) -> None:
        """One more token per row, against the reference and against the row's tokens re-run with no cache."""
        out = self.native.forward(probe)
        for b, (ref, tokens) in enumerate(zip(self.refs, self.tokens, strict=True)):
            same_output(out, b, 1, ref.forward(probe[b: b + 1]))
            with torch.no_grad():
                plain = self.model(torch.tensor([tokens + [int(probe[b, 0])]])).logits[0, -1]
            close(out.logits[b, 0], plain)


def path_to(parents: list[int], node: int) -> list[int]:
    """Draft indices from the root's first child down to `node` (-1: none)."""
    path = []
    while node >= 0:
        path.insert(0, node)
        node = parents[node]
    return path


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["llama", "qwen3"]), data=st.data())
def test_ragged_rows_match_each_row_run_alone(kind, data):
    batch = Batch(copy.deepcopy(BASE[kind]))  # reference targets hook the model's layers: a copy per example
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))

    def prompt(longest: int = 24) -> list[int]:
        return torch.randint(0, 128, (data.draw(st.integers(1, longest), label="prompt length"),),
                             generator=gen).tolist()

    batch.add([prompt() for _ in range(data.draw(st.integers(1, 3), label="rows"))])
    batch.check_state()
    ops = data.draw(st.lists(st.sampled_from(["chain", "last", "tree", "crop", "drop", "add"]), min_size=3,
                             max_size=8), label="operations")
    for op in ops:
        rows = len(batch.refs)
        if op == "chain":
            n = data.draw(st.integers(1, 6), label="n")
            counts = [data.draw(st.integers(1, n), label="count") for _ in range(rows)]
            batch.chain(torch.randint(0, 128, (rows, n), generator=gen), counts)
        elif op == "last":
            n = data.draw(st.integers(1, 6), label="n")
            counts = [data.draw(st.integers(0, n), label="count") for _ in range(rows)]
            batch.last(torch.randint(0, 128, (rows, n), generator=gen), counts)
        elif op == "tree":
            k = data.draw(st.integers(1, 6), label="tree size")
            parents = [data.draw(st.integers(-1, j - 1), label="parent") for j in range(k)]
            paths = []
            for _ in range(rows):
                path = path_to(parents, data.draw(st.integers(-1, k - 1), label="accepted node"))
                paths.append(path[: data.draw(st.integers(0, len(path)), label="accepted")])
            batch.tree(torch.randint(0, 128, (rows, k + 1), generator=gen), parents, paths)
        elif op == "crop":
            batch.crop([data.draw(st.integers(1, len(t)), label="crop to") for t in batch.tokens])
        elif op == "drop" and rows > 1:
            leaving = data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=rows - 1, unique=True),
                                label="leaving")
            batch.drop(leaving)
        elif op == "add" and rows < 5:
            batch.add([prompt() for _ in range(data.draw(st.integers(1, 5 - rows), label="joining"))])
        batch.check_state()
    batch.from_scratch(torch.randint(0, 128, (len(batch.refs), 1), generator=gen))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_rows_output_does_not_depend_on_other_rows_or_stale_slots_bit_for_bit(kind, dtype):
    model = copy.deepcopy(BASE[kind]).to(dtype)
    gen = torch.Generator().manual_seed(11)
    mine = torch.randint(0, 128, (7,), generator=gen).tolist()
    runs = []
    for variant in range(2):
        target = TargetModel(model, cache="native")
        target.request_taps(TAPS)
        target.reset()
        others = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (12, 3)]
        target.add_rows([mine, *others])
        if variant:  # leave different stale keys past every row's length
            target.forward(torch.randint(0, 128, (3, 9), generator=gen))
            target.crop([7, 12, 3])
        feed = torch.randint(0, 128, (3, 4), generator=gen)
        feed[0] = torch.tensor([5, 6, 7, 8])
        chain = target.forward(feed)
        target.crop([9, 13, 5])  # ragged counts 2, 1, 2
        tree_feed = torch.randint(0, 128, (3, 4), generator=gen)
        tree_feed[0] = torch.tensor([9, 10, 11, 12])
        tree = target.forward(tree_feed, tree_parents=[-1, 0, -1])
        target.retain([10, 14, 6], torch.tensor([[0, 1], [0, 1], [-1, -1]]))  # the root, then a path or none
        step = torch.randint(0, 128, (3, 1), generator=gen)
        step[0] = 13
        runs.append((chain, tree, target.forward(step)))
        assert target.cache_lengths == [13, 17, 7]
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a.logits[0], b.logits[0])
        for layer in TAPS:
            assert torch.equal(a.taps[layer][0], b.taps[layer][0])


def test_row_mask_sees_each_rows_past_and_its_own_new_tokens():
    visible = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a root and two children
    mask = row_mask([2, 4], 3, visible, torch.device("cpu"))
    assert mask.shape == (2, 3, 7)
    assert mask[0].int().tolist() == [[1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 1, 0, 0]]
    assert mask[1].int().tolist() == [[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 1]]
    causal = row_mask([0, 2], 2, None, torch.device("cpu"))
    assert causal.int().tolist() == [[[1, 0, 0, 0], [1, 1, 0, 0]], [[1, 1, 1, 0], [1, 1, 1, 1]]]


def test_memory_follows_the_longest_row_held_not_the_context_window():
    model = tiny_model("llama", seed=0, max_positions=8192)
    target = TargetModel(model, cache="native")
    target.reset()
    target.add_rows([[1] * 5, [2] * 40, [3] * 9])
    cache = target.backend.cache
    layers, kv_heads, head_dim = 4, 2, 8
    assert cache.keys.shape == (layers, 3, kv_heads, 256, head_dim)  # not 8192
    target.add_rows([[4] * 300])  # a long row joins: the buffer doubles with it
    assert cache.keys.shape == (layers, 4, kv_heads, 512, head_dim)
    assert target.cache_lengths == [5, 40, 9, 300]
    target.crop([5, 40, 9, 100])  # crop frees nothing
    assert cache.keys.shape[3] == 512
    target.drop_rows([3])  # the longest row leaves; the rest would fit in half: kept (rows join short, then grow)
    assert cache.keys.shape == (layers, 3, kv_heads, 512, head_dim)
    target.add_rows([[5] * 1000])
    assert cache.keys.shape == (layers, 4, kv_heads, 1024, head_dim)
    target.drop_rows([3])  # the rest fit in a quarter: they move to a buffer sized for them
    assert cache.keys.shape == (layers, 3, kv_heads, 256, head_dim)
    assert target.cache_lengths == [5, 40, 9]
    target.drop_rows([0, 1, 2])
    assert target.cache_lengths == [] and cache.keys is None
    target.add_rows([[7, 8]])  # an emptied cache takes new rows
    assert target.cache_lengths == [2] and cache.keys.shape[1] == 1


def test_rows_leaving_and_joining_move_only_the_rows_that_must_move():
    """A row leaving closes up the rows after it in place and a row joining is written into the room left: the
    buffer is not reallocated (which cost ~200 ms a time at 16 rows of 512 positions in float32), and every row
    still holds what its reference holds."""
    batch = Batch(copy.deepcopy(BASE["llama"]))
    batch.add([[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]])
    batch.chain(torch.randint(0, 128, (4, 3), generator=torch.Generator().manual_seed(0)), [3, 1, 2, 3])
    cache = batch.native.backend.cache
    pointers = cache.keys.data_ptr(), cache.values.data_ptr()
    batch.drop([1])
    batch.check_state()
    assert cache.keys.shape[1] == 3 and (cache.keys.data_ptr(), cache.values.data_ptr()) == pointers
    batch.add([[12, 13, 14, 15, 16, 17]])  # into the room row 1 left (its stale positions past this row's)
    batch.check_state()
    assert cache.keys.shape[1] == 4 and (cache.keys.data_ptr(), cache.values.data_ptr()) == pointers
    batch.drop([0, 2])
    batch.add([[18], [19, 20]])
    batch.check_state()
    assert (cache.keys.data_ptr(), cache.values.data_ptr()) == pointers
    batch.add([[21]])  # past the room: a larger buffer
    batch.check_state()
    assert cache.keys.shape[1] == 5 and cache.keys.data_ptr() != pointers[0]
    batch.from_scratch(torch.randint(0, 128, (5, 1), generator=torch.Generator().manual_seed(1)))


def test_bad_per_row_arguments_are_refused_with_a_sentence():
    target = TargetModel(tiny_model("llama", seed=0), cache="native")
    target.reset()
    target.add_rows([[1, 2, 3], [4, 5]])
    target.forward(torch.tensor([[6, 7], [8, 9]]))
    with pytest.raises(ValueError, match="one length per row: 2, not 3"):
        target.crop([1, 1, 1])
    with pytest.raises(ValueError, match=r"must be >= 0, then only -1"):
        target.retain([3, 2], torch.tensor([[-1, 0], [0, 1]]))
    with pytest.raises(ValueError, match=r"row 0 holds 5 positions; it cannot keep 3 and then those at 3 \+ \[0, 2\]"):
        target.retain([3, 2], torch.tensor([[0, 2], [1, -1]]))
    with pytest.raises(ValueError, match="not all among the 2 held"):
        target.drop_rows([2])
    with pytest.raises(SpecdecError, match="prompt 1 is empty"):
        target.add_rows([[1], []])
    with pytest.raises(ValueError, match="rows hold different lengths"):
        target.backend.cache.length()
    with pytest.raises(ValueError, match=r"one count in 0..2 per row of 2, not \[1, 3\]"):
        target.forward_last(torch.tensor([[6, 7], [8, 9]]), [1, 3])
    assert target.cache_lengths == [5, 4]


def test_the_transformers_backend_refuses_ragged_rows_and_rows_leaving_or_joining():
    target = TargetModel(tiny_model("llama", seed=0), cache="dynamic")
    target.prefill(torch.randint(0, 128, (2, 6)))
    with pytest.raises(NotImplementedError, match="keeps rows of one length.*need the native cache"):
        target.crop([5, 4])
    with pytest.raises(NotImplementedError, match="rows cannot leave or join it; the native cache"):
        target.drop_rows([0])
    with pytest.raises(NotImplementedError, match="rows cannot leave or join it"):
        target.add_rows([[1, 2]])
    with pytest.raises(NotImplementedError, match="right-padded rows need the native cache"):
        target.forward_last(torch.randint(0, 128, (2, 3)), [3, 2])
    assert target.forward_last(torch.randint(0, 128, (2, 3)), [3, 3]).logits.shape[:2] == (2, 1)
