"""The native forward's KV cache: every layer's keys and values in one preallocated buffer with a length per row
(rows of a batch may hold different lengths), and the per-row attention mask such ragged rows need. Read by
`specdec.native.NativeForward` (through `specdec.backends.NativeBackend`), never by a transformers model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .contracts import KVCache


def _capacity(needed: int) -> int:
    """Positions a buffer holding `needed` per row gets: the power of two at or above it, at least 256."""
    return max(256, 1 << (max(1, needed) - 1).bit_length())


#: a buffer moves to a smaller one when the rows it holds fit in this share of its positions or less: rows that join
#: short and grow would otherwise cross one power of two down and up again (shrinking when the rest fitted in half
#: reallocated the buffer twice for nearly every row of a batch of 16 GSM8K rows, whose lengths straddle 256)
_SHRINK = 4


class NativeKVCache(KVCache):
    """Keys and values of every layer in one preallocated buffer [layers, B, kv_heads, capacity, head_dim], and a
    length per row. Read by specdec's native forward (through `specdec.backends.NativeBackend`), never by a
    transformers model.

    Rows are ragged: row b holds its first `lengths()[b]` positions; the slots after them are stale or zero and
    masked out by the forward. crop is a length change per row, retain one gather per row.

    Memory: 2 x layers x R x kv_heads x capacity x head_dim elements, where R is the most rows held at once since
    the cache was made (at most the batch size) and capacity is the power of two (at least 256) at or above the
    longest row held plus the tokens being fed. It grows by doubling with the longest row and shrinks once the rows
    held fit in a quarter of it, so it stays within a small factor of the batch times the longest row actually
    held, never the batch times the context window. Shorter rows
    leave the tail of their slab unused (a paged layout would reclaim it). crop frees nothing.

    Rows leaving and joining copy only what moves, never the whole buffer: `drop_rows` closes up the rows after a
    leaving one in place, each only as far as it holds positions, and keeps the freed rows as room; `append_rows`
    writes the joining rows into that room. (Reallocating the buffer at every row that left or joined cost ~200 ms
    a time for 16 rows of 512 positions in float32 on this project's CPU, two plain decoding steps, and a batch
    whose rows finish at different steps, as speculative decoding's do, paid it for nearly every row.) The buffer
    is reallocated only when a row outgrows its capacity, when the rows joining exceed its room, and, smaller,
    when the longest row leaves and the rest fit in a quarter of its positions or less (`_SHRINK`).
    """

    name = "native"
    description = "preallocated buffers for specdec's own Llama/Qwen forward (bit-identical to transformers')"

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        # the buffers [layers, R, kv_heads, capacity, head_dim]; rows past the held ones are room for rows joining
        self._key_slab: torch.Tensor | None = None
        self._value_slab: torch.Tensor | None = None
        # the rows held, views of the buffers' first rows ([layers, B, ...]; each layer's part is contiguous)
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self._lengths: list[int] = []  # one per row, on the host: no device sync to read them

    def _hold(self, key_slab: torch.Tensor | None, value_slab: torch.Tensor | None, lengths: list[int]) -> None:
        """Take these buffers (None: nothing held) and hold their first len(lengths) rows."""
        if key_slab is None or value_slab is None or not lengths:
            key_slab = value_slab = None
        self._key_slab, self._value_slab = key_slab, value_slab
        self._lengths = [] if key_slab is None else list(lengths)
        self.keys = None if key_slab is None else key_slab[:, : len(lengths)]
        self.values = None if value_slab is None else value_slab[:, : len(lengths)]

    def _regrown(self, rows: int, capacity: int, sources: Sequence[tuple[torch.Tensor, torch.Tensor, list[int]]]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """New zeroed buffers of `rows` rows and `capacity` positions holding, one after another, the rows of each
        source (keys, values [layers, b, kv_heads, c, head_dim], their lengths), each up to its longest row."""
        keys_like = sources[0][0]
        layers, _, kv_heads, _, head_dim = keys_like.shape
        shape = (layers, rows, kv_heads, capacity, head_dim)
        keys, values = keys_like.new_zeros(shape), keys_like.new_zeros(shape)
        first = 0
        for source_keys, source_values, lengths in sources:
            count, longest = len(lengths), max(lengths, default=0)
            keys[:, first: first + count, :, :longest] = source_keys[:, :count, :, :longest]
            values[:, first: first + count, :, :longest] = source_values[:, :count, :, :longest]
            first += count
        return keys, values

    def length(self) -> int:
        """The length every row holds (0 before the first forward); refused while rows differ."""
        if not self._lengths:
            return 0
        first = self._lengths[0]
        if any(n != first for n in self._lengths):
            raise ValueError(f"The native cache's rows hold different lengths {self._lengths}; read lengths().")
        return first

    def lengths(self) -> list[int]:
        return list(self._lengths)

    @property
    def batch_size(self) -> int:
        return len(self._lengths)

    def _check_rows(self, lengths: Sequence[int], what: str) -> list[int]:
        out = [int(n) for n in lengths]
        if len(out) != len(self._lengths):
            raise ValueError(f"{what} takes one length per row: {len(self._lengths)}, not {len(out)}.")
        return out

    def crop(self, lengths: Sequence[int]) -> None:
        """Roll row b back to its first `lengths[b]` positions (a row never grows; negative means 0)."""
        if not self._lengths:
            return  # nothing held yet
        wanted = self._check_rows(lengths, "crop")
        self._lengths = [min(held, max(0, n)) for held, n in zip(self._lengths, wanted, strict=True)]

    @property
    def can_retain(self) -> bool:
        return True

    def retain(self, lengths: Sequence[int], indices: torch.Tensor) -> None:
        """Keep row b's first `lengths[b]` positions, then those at `lengths[b] + indices[b, j]`, in order.

        indices [B, n]: rows that keep fewer positions pad on the right with -1 (as `Verdict.path` does), so row
        b keeps as many as it has entries >= 0. One host copy of `indices` per call.
        """
        if self.keys is None or self.values is None:
            return
        keeps = self._check_rows(lengths, "retain")
        if indices.dim() != 2 or indices.shape[0] != len(keeps):
            raise ValueError(f"retain takes indices [B, n] with B = {len(keeps)} rows, not {tuple(indices.shape)}.")
        counts = []
        rows = indices.tolist()
        for row, (keep, picked) in enumerate(zip(keeps, rows, strict=True)):  # every row checked before any change
            count = next((j for j, i in enumerate(picked) if i < 0), len(picked))
            if any(i >= 0 for i in picked[count:]) or any(i < -1 for i in picked):
                raise ValueError(f"retain: row {row}'s indices {picked} must be >= 0, then only -1 (padding).")
            held = self._lengths[row]
            if not 0 <= keep <= held or (count and keep + max(picked[:count]) >= held):
                raise ValueError(f"retain: row {row} holds {held} positions; it cannot keep {keep} and then "
                                 f"those at {keep} + {picked[:count]}.")
            counts.append(count)
        for row, (keep, picked, count) in enumerate(zip(keeps, rows, counts, strict=True)):
            if count:
                source = torch.tensor(picked[:count], device=self.keys.device) + keep
                # indexing copies first, so overlapping writes are safe
                self.keys[:, row, :, keep: keep + count] = self.keys[:, row, :, source]
                self.values[:, row, :, keep: keep + count] = self.values[:, row, :, source]
            self._lengths[row] = keep + count

    def reserve(self, layers: int, batch: int, kv_heads: int, head_dim: int, new_tokens: int,
                dtype: torch.dtype, device: torch.device) -> None:
        """Make room for `new_tokens` more positions after every row (allocating on first use, doubling with the
        longest row when full). New buffers are zeroed: the forward masks the slots past a row's length, and
        zeros (unlike uninitialised memory) cannot hold a NaN that a mask would not cancel."""
        if self.keys is not None and self.keys.shape[1] != batch:
            raise ValueError(f"The cache holds a batch of {self.keys.shape[1]} rows, not {batch}; reset it first.")
        lengths = self._lengths if self.keys is not None else [0] * batch
        needed = max(lengths, default=0) + new_tokens
        if self._key_slab is not None and self._key_slab.shape[3] >= needed:
            return
        if self._key_slab is None or self._value_slab is None:
            shape = (layers, batch, kv_heads, _capacity(needed), head_dim)
            self._hold(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                       lengths)
            return
        rows = int(self._key_slab.shape[1])  # the room for rows joining is kept
        self._hold(*self._regrown(rows, _capacity(needed), [(self._key_slab, self._value_slab, lengths)]), lengths)

    def advance(self, n: int | Sequence[int]) -> None:
        """Count `n` more positions in every row, or `n[b]` more in row b."""
        if isinstance(n, int):
            self._lengths = [length + n for length in self._lengths]
        else:
            self._lengths = [length + int(m) for length, m in zip(self._lengths, self._check_rows(n, "advance"),
                                                                   strict=True)]

    @torch.inference_mode()  # the buffers are inference tensors (made in the forward)
    def drop_rows(self, rows: Sequence[int]) -> None:
        """Rows leave the batch: remove them and close up the rest, in order. Only the rows after the first one
        leaving move, each one row down per row left before it, as far as it holds positions; the rows freed stay
        as room for rows joining. When the longest row left and the rest fit in a quarter of the positions or less,
        they then move to a buffer that size. Dropping every row empties the cache."""
        drop = {int(r) for r in rows}
        if any(not 0 <= r < len(self._lengths) for r in drop):
            raise ValueError(f"drop_rows: rows {sorted(drop)} are not all among the {len(self._lengths)} held.")
        if not drop:
            return
        stay = [b for b in range(len(self._lengths)) if b not in drop]
        lengths = [self._lengths[b] for b in stay]
        keys, values = self._key_slab, self._value_slab
        if not stay or keys is None or values is None:
            self._hold(None, None, [])
            return
        for slot, row in enumerate(stay):  # slot <= row: each slot written has left or already moved down
            if slot != row and self._lengths[row]:
                held = self._lengths[row]
                keys[:, slot, :, :held] = keys[:, row, :, :held]
                values[:, slot, :, :held] = values[:, row, :, :held]
        capacity = _capacity(max(lengths))
        if capacity * _SHRINK <= keys.shape[3]:  # the longest row left: a smaller buffer, with the same room
            keys, values = self._regrown(int(keys.shape[1]), capacity, [(keys, values, lengths)])
        self._hold(keys, values, lengths)

    @torch.inference_mode()
    def append_rows(self, other: NativeKVCache) -> None:
        """Rows join the batch: `other`'s rows (e.g. new prompts prefilled into a cache of their own) are placed
        after these, which keep their state: written into the buffer's room when it has room for them and
        positions for their longest, else into a buffer reallocated to fit every row now held."""
        if other.keys is None or other.values is None or not other._lengths:
            return
        joining = other._lengths
        keys, values = self._key_slab, self._value_slab
        if self.keys is None or keys is None or values is None:  # nothing held: the joining rows alone
            self._hold(*self._regrown(len(joining), _capacity(max(joining)), [(other.keys, other.values, joining)]),
                       joining)
            return
        mine, theirs = self.keys.shape, other.keys.shape
        if (mine[0], mine[2], mine[4]) != (theirs[0], theirs[2], theirs[4]) or \
                (self.keys.dtype, self.keys.device) != (other.keys.dtype, other.keys.device):
            raise ValueError(f"append_rows: caches of different layouts ({tuple(mine)} {self.keys.dtype} on "
                             f"{self.keys.device} and {tuple(theirs)} {other.keys.dtype} on {other.keys.device}).")
        held, lengths = self._lengths, self._lengths + joining
        if len(lengths) <= keys.shape[1] and max(joining) <= keys.shape[3]:  # into the room
            first, longest = len(held), max(joining)
            keys[:, first: len(lengths), :, :longest] = other.keys[:, :, :, :longest]
            values[:, first: len(lengths), :, :longest] = other.values[:, :, :, :longest]
            self._hold(keys, values, lengths)
            return
        rows = max(len(lengths), int(keys.shape[1]))  # the room is kept
        self._hold(*self._regrown(rows, _capacity(max(lengths)), [(keys, values, held),
                                                                   (other.keys, other.values, joining)]), lengths)


def row_mask(lengths: Sequence[int], n: int, visible: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Bool [B, n, max(lengths) + n] for n new tokens after rows of different lengths (True = may attend): query j
    of row b sees that row's own past (keys 0 .. lengths[b] - 1) and, among the new tokens written at lengths[b]
    onward, those `visible[j]` allows (bool [n, n], or [B, n, n] for a tree per row; None: causal). Every other
    slot (the stale tail of a shorter row) is masked out."""
    batch = len(lengths)
    held = torch.tensor(list(lengths), device=device).view(batch, 1, 1)
    relative = torch.arange(max(lengths) + n, device=device).view(1, 1, -1) - held  # [B, 1, T]: slot - length
    query = torch.arange(n, device=device).view(1, n, 1)
    if visible is None:
        new = (relative >= 0) & (relative <= query)
    else:
        inside = (relative >= 0) & (relative < n)
        index = relative.clamp(0, n - 1).expand(batch, n, -1)
        per_row = visible if visible.dim() == 3 else visible.unsqueeze(0)
        new = inside & per_row.to(device).expand(batch, n, n).gather(2, index)
    return (relative < 0) | new
