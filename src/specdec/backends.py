"""How the target runs: a backend owns its forward, its KV cache and how hidden-state taps are read.

`TargetModel` (specdec.target) delegates forward, crop, retain, reset and taps to one backend, chosen in one
place (`make_backend`, from the `cache` argument: auto | native | dynamic | a registered KVCache class):

- `NativeBackend`: specdec's own forward for Llama-family models (`specdec.native`), its preallocated
  `NativeKVCache`, taps read inside the forward.
- `TransformersBackend`: the transformers model's own forward with a cache that has `hf_cache` (transformers'
  DynamicCache by default), taps captured with forward hooks on the tapped decoder layers only.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from . import native, native_cache, tree
from .caches import DynamicKVCache
from .contracts import KVCache, TargetOutput, cache_api_problem, same_length
from .errors import SpecdecError

#: a tree draft's parents for the verification forward: one list for every row, a list per row, or None (chains)
TreeParents = list[int] | list[list[int]] | None

BUILTIN_CACHES: dict[str, type[KVCache]] = {"native": native_cache.NativeKVCache, "dynamic": DynamicKVCache}


def base_model(model: nn.Module) -> nn.Module | None:
    return getattr(model, "model", None) or getattr(model, getattr(model, "base_model_prefix", ""), None)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(base_model(model), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise SpecdecError(f"{type(model).__name__} has no `model.layers` list of decoder layers; specdec supports "
                           "decoder-only transformers models laid out like Llama, Qwen or Mistral.")
    return layers


def positions_after(lengths: Sequence[int], n: int, tree_parents: list[int] | None,
                    device: torch.device) -> torch.Tensor:
    """Position ids [B, n] of n new tokens after each row's cached ones; a tree's nodes sit at their depth."""
    if tree_parents is None:
        offsets = torch.arange(n, device=device)
    else:
        offsets = torch.tensor([0] + tree.depths(tree_parents), device=device)
    if all(length == lengths[0] for length in lengths):  # no per-row host-to-device copy while rows agree
        return (offsets + lengths[0]).expand(len(lengths), -1)
    return torch.tensor(list(lengths), device=device).unsqueeze(1) + offsets


class TargetBackend:
    """A target's forward and KV cache. Lengths are per row: the native backend holds rows of different lengths,
    the transformers backend rows of one length."""

    cache: KVCache | None

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.cache = None

    @property
    def cache_name(self) -> str:
        raise NotImplementedError  # pragma: no cover - interface

    def reset(self) -> None:
        """A fresh, empty cache (before each generation)."""
        raise NotImplementedError  # pragma: no cover - interface

    def lengths(self) -> list[int]:
        return [] if self.cache is None else self.cache.lengths()

    def crop(self, lengths: Sequence[int]) -> None:
        assert self.cache is not None, "call reset() before the first forward"
        self.cache.crop(lengths)

    @property
    def can_retain(self) -> bool:
        return self.cache is not None and self.cache.can_retain

    def retain(self, lengths: Sequence[int], indices: torch.Tensor) -> None:
        assert self.cache is not None, "call reset() before the first forward"
        self.cache.retain(lengths, indices)

    def drop_rows(self, rows: Sequence[int]) -> None:
        """Remove these rows from the batch (see TargetModel.drop_rows)."""
        raise NotImplementedError(self._fixed_rows())

    def add_rows(self, prompts: Sequence[torch.Tensor], tap_ids: list[int]) -> TargetOutput:
        """Prefill these prompts (1-D) into new rows after the others (see TargetModel.add_rows)."""
        raise NotImplementedError(self._fixed_rows())

    def _fixed_rows(self) -> str:
        return (f"The {self.cache_name!r} cache keeps one batch of rows of one length, so rows cannot leave or join "
                "it; the native cache (cache='native', for Llama, Qwen2 and Qwen3 targets) can.")

    def add_tap(self, layer_id: int) -> None:
        """Capture this decoder layer's output in every later forward."""

    def fork(self) -> TargetBackend:
        """The same forward over the same weights, with no cache and no taps yet (see TargetModel.fork)."""
        clone = copy.copy(self)
        clone.cache = None
        return clone

    def forward(self, input_ids: torch.Tensor, tap_ids: list[int], logits_to_keep: int,
                tree_parents: TreeParents, counts: Sequence[int] | None = None) -> TargetOutput:
        """Feed [B, n] tokens after the cached ones (a tree under the first when `tree_parents` is given: one
        list of n - 1 parents for every row, or a list per row; only the native backend takes a list per row).
        `counts`: row b's first counts[b] tokens are real and the rest right padding, which the cache does not
        count; `logits_to_keep` then counts back from each row's last real token (see TargetModel.forward_last)."""
        raise NotImplementedError  # pragma: no cover - interface

    def taps_only(self, input_ids: torch.Tensor, tap_ids: list[int]) -> dict[int, torch.Tensor]:
        """The taps of a cache-free forward over [B, T] that stops after the deepest tap."""
        raise NotImplementedError  # pragma: no cover - interface

    def taps_and_logits(self, input_ids: torch.Tensor,
                        tap_ids: list[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The logits [B, T, V] and taps of a whole cache-free forward over [B, T] (distillation)."""
        raise NotImplementedError  # pragma: no cover - interface

    def coverage_problem(self) -> str | None:
        """Why this backend no longer runs the model exactly (checked before each generation), or None."""
        return None

    def refresh_weights(self) -> None:
        """Catch up with weights changed in place since the last generation (fine-tuning)."""


class NativeBackend(TargetBackend):
    """specdec's own forward (bit-identical to transformers') and its preallocated cache (NativeKVCache or a
    registered subclass of it)."""

    def __init__(self, model: nn.Module,
                 cache_class: type[native_cache.NativeKVCache] = native_cache.NativeKVCache) -> None:
        super().__init__(model)
        self.forward_pass = native.NativeForward(model)
        self.cache_class = cache_class

    @property
    def cache_name(self) -> str:
        return self.cache_class.name

    def reset(self) -> None:
        self.cache = self.cache_class(self.model)

    def coverage_problem(self) -> str | None:
        return native.unsupported_reason(self.model)

    def refresh_weights(self) -> None:
        self.forward_pass.prepacked.refresh()  # weights changed in place since are packed again

    def forward(self, input_ids: torch.Tensor, tap_ids: list[int], logits_to_keep: int,
                tree_parents: TreeParents, counts: Sequence[int] | None = None) -> TargetOutput:
        cache = self.cache
        assert isinstance(cache, native_cache.NativeKVCache), "call reset() before the first forward"
        assert counts is None or tree_parents is None, "right padding is for chains of tokens, not trees"
        batch, n = input_ids.shape
        lengths = cache.lengths() or [0] * batch
        if len(lengths) != batch:
            raise ValueError(f"The cache holds a batch of {len(lengths)} rows, not {batch}; reset it first.")
        per_row = tree_parents is not None and bool(tree_parents) and isinstance(tree_parents[0], list)
        if per_row:  # a tree per row: positions and masks per row, whatever the lengths
            rows_parents: list[list[int]] = tree_parents  # type: ignore[assignment]
            if len(rows_parents) != batch or any(len(p) != n - 1 for p in rows_parents):
                raise ValueError(f"Per-row tree parents take {batch} lists of {n - 1} ints.")
            offsets = torch.tensor([[0, *tree.depths(p)] for p in rows_parents], device=input_ids.device)
            positions = torch.tensor(lengths, device=input_ids.device).unsqueeze(1) + offsets
            visible = torch.stack([tree.visibility(p) for p in rows_parents])  # [B, n, n]
            mask = native_cache.row_mask(lengths, n, visible, input_ids.device)
        elif all(length == lengths[0] for length in lengths):  # one shared length: the path it always took
            start = lengths[0]
            positions = positions_after([start] * batch, n, tree_parents, input_ids.device)  # type: ignore[arg-type]
            mask = None if tree_parents is None else tree.bool_mask(tree_parents, start, input_ids.device)  # type: ignore[arg-type]
        else:  # ragged rows: each row's tokens after its own length, masks per row (native_cache.row_mask)
            positions = positions_after(lengths, n, tree_parents, input_ids.device)  # type: ignore[arg-type]
            visible = None if tree_parents is None else tree.visibility(tree_parents)  # type: ignore[arg-type]
            mask = native_cache.row_mask(lengths, n, visible, input_ids.device)
        logits, taps = self.forward_pass(input_ids, positions, cache, mask, tap_ids, logits_to_keep=logits_to_keep,
                                         counts=counts)
        assert logits is not None
        return TargetOutput(logits=logits, taps=taps)

    def drop_rows(self, rows: Sequence[int]) -> None:
        assert isinstance(self.cache, native_cache.NativeKVCache), "call reset() before the first forward"
        self.cache.drop_rows(rows)

    def add_rows(self, prompts: Sequence[torch.Tensor], tap_ids: list[int]) -> TargetOutput:
        assert isinstance(self.cache, native_cache.NativeKVCache), "call reset() before the first forward"
        counts = [int(p.numel()) for p in prompts]
        ids = prompts[0].new_zeros(len(prompts), max(counts))  # right padding (token 0): masked, then not counted
        for row, prompt in enumerate(prompts):
            ids[row, : counts[row]] = prompt
        joining = self.cache_class(self.model)  # the new rows are read alone (one length: 0), then appended
        positions = positions_after([0] * len(prompts), ids.shape[1], None, ids.device)
        logits, taps = self.forward_pass(ids, positions, joining, None, tap_ids, logits_to_keep=1, counts=counts)
        assert logits is not None
        self.cache.append_rows(joining)
        return TargetOutput(logits=logits, taps=taps)

    def taps_only(self, input_ids: torch.Tensor, tap_ids: list[int]) -> dict[int, torch.Tensor]:
        positions = positions_after([0] * input_ids.shape[0], input_ids.shape[1], None, input_ids.device)
        _, taps = self.forward_pass(input_ids, positions, None, None, tap_ids, stop_after=max(tap_ids))
        return taps

    def taps_and_logits(self, input_ids: torch.Tensor,
                        tap_ids: list[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        positions = positions_after([0] * input_ids.shape[0], input_ids.shape[1], None, input_ids.device)
        return self.forward_pass(input_ids, positions, None, None, tap_ids)


class _TapsComplete(Exception):
    """Raised by the deepest tap's hook to end a taps-only forward: nothing after that layer is needed."""


class TransformersBackend(TargetBackend):
    """The model's own transformers forward, with a KV cache class that provides `hf_cache`."""

    def __init__(self, model: nn.Module, cache_class: type[KVCache]) -> None:
        super().__init__(model)
        self.cache_class = cache_class
        self.layers = decoder_layers(model)
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks: list[Any] = []
        self._stop_after: int | None = None  # set during a taps-only forward
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    @property
    def cache_name(self) -> str:
        return self.cache_class.name

    def _one_length(self, lengths: Sequence[int]) -> int:
        if lengths and any(int(n) != int(lengths[0]) for n in lengths):
            raise NotImplementedError(
                f"The transformers backend (cache {self.cache_name!r}) keeps rows of one length; got per-row lengths "
                f"{[int(n) for n in lengths]}. Rows of different lengths need the native cache (cache='native', "
                "for Llama, Qwen2 and Qwen3 targets).")
        return same_length(lengths, "The transformers backend")

    def crop(self, lengths: Sequence[int]) -> None:
        if self.cache is not None and self.cache.lengths():
            self._one_length(lengths)
        super().crop(lengths)

    def retain(self, lengths: Sequence[int], indices: torch.Tensor) -> None:
        self._one_length(lengths)
        super().retain(lengths, indices)

    def reset(self) -> None:
        self.cache = self.cache_class(self.model)
        if not hasattr(self.cache, "hf_cache"):  # a property, or an attribute set by the cache's __init__
            raise SpecdecError(f"The cache {self.cache_class.name!r} has no `hf_cache` for transformers' forward; "
                               "choose a cache made for it (dynamic).")

    def fork(self) -> TransformersBackend:
        clone = super().fork()
        assert isinstance(clone, TransformersBackend)
        clone._captured, clone._hooks = {}, []  # the fork's own hooks capture into its own dict
        return clone

    def add_tap(self, layer_id: int) -> None:
        def hook(_module, _inputs, output):
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output
            if layer_id == self._stop_after:
                raise _TapsComplete

        hook.specdec_tap = True  # type: ignore[attr-defined]  # not a user hook (see native.unsupported_reason)
        self._hooks.append(self.layers[layer_id].register_forward_hook(hook))

    def forward(self, input_ids: torch.Tensor, tap_ids: list[int], logits_to_keep: int,
                tree_parents: TreeParents, counts: Sequence[int] | None = None) -> TargetOutput:
        assert self.cache is not None, "call reset() before the first forward"
        batch, n = input_ids.shape
        if counts is not None and any(int(c) != n for c in counts):
            raise NotImplementedError(f"The transformers backend (cache {self.cache_name!r}) reads every token it is "
                                      "given; right-padded rows need the native cache.")
        if tree_parents and isinstance(tree_parents[0], list):
            raise NotImplementedError(f"The transformers backend (cache {self.cache_name!r}) takes one tree for every "
                                      "row; a tree per row needs the native cache.")
        start = self._one_length(self.cache.lengths() or [0] * batch)
        extra: dict[str, Any] = {}
        if tree_parents is not None:
            dtype = self.model.get_input_embeddings().weight.dtype
            extra["attention_mask"] = tree.attention_mask(tree_parents, start, dtype, input_ids.device)
        self._captured = {}
        out = self.model(
            input_ids=input_ids,
            position_ids=positions_after([start] * batch, n, tree_parents, input_ids.device),
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **{self._cache_kwarg: self.cache.hf_cache},  # type: ignore[attr-defined]
            **extra,
        )
        taps, self._captured = self._captured, {}
        return TargetOutput(logits=out.logits, taps=taps)

    def taps_only(self, input_ids: torch.Tensor, tap_ids: list[int]) -> dict[int, torch.Tensor]:
        positions = positions_after([0] * input_ids.shape[0], input_ids.shape[1], None, input_ids.device)
        self._captured, self._stop_after = {}, max(tap_ids)
        try:
            base_model(self.model)(input_ids=input_ids, position_ids=positions, use_cache=False)
        except _TapsComplete:
            pass
        finally:
            self._stop_after = None
        taps, self._captured = self._captured, {}
        return taps

    def taps_and_logits(self, input_ids: torch.Tensor,
                        tap_ids: list[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        positions = positions_after([0] * input_ids.shape[0], input_ids.shape[1], None, input_ids.device)
        self._captured = {}
        logits = self.model(input_ids=input_ids, position_ids=positions, use_cache=False).logits
        taps, self._captured = self._captured, {}
        return logits, taps


def make_backend(model: nn.Module, cache: str | type[KVCache]) -> TargetBackend:
    """The one place a target's forward is chosen. `cache`: "auto" (native when `specdec.native` covers the
    model exactly, else transformers' DynamicCache), "native", "dynamic", or a KVCache class (a registered
    cache; look names up with `specdec.plugins.get_cache_class`)."""
    unsupported = native.unsupported_reason(model)
    if cache == "auto":
        cache = "dynamic" if unsupported else "native"
    if isinstance(cache, str):
        if cache not in BUILTIN_CACHES:
            raise SpecdecError(f"Unknown cache {cache!r}; choose auto, native or dynamic, or pass a registered "
                               "cache's class (specdec.plugins.get_cache_class).")
        cache = BUILTIN_CACHES[cache]
    problem = cache_api_problem(cache)
    if problem is not None:
        raise SpecdecError(problem)
    if issubclass(cache, native_cache.NativeKVCache):
        if unsupported:
            raise SpecdecError(f"The native cache needs specdec's own forward, which does not cover this model "
                               f"({unsupported}); use cache='dynamic' or 'auto'.")
        return NativeBackend(model, cache)
    return TransformersBackend(model, cache)
