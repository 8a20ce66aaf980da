"""Built-in target KV caches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .contracts import KVCache, same_length


class DynamicKVCache(KVCache):
    """transformers' DynamicCache (grows by concatenation); rollback slices every layer."""

    name = "dynamic"
    description = "transformers DynamicCache, cropped on rejection"

    def __init__(self, model: Any) -> None:
        from transformers import DynamicCache

        super().__init__(model)
        self._cache = DynamicCache(config=model.config)

    @property
    def hf_cache(self) -> Any:
        """The object passed to the transformers model as its cache."""
        return self._cache

    def lengths(self) -> list[int]:
        for layer in self._cache.layers:
            if layer.is_initialized:
                return [int(self._cache.get_seq_length())] * int(layer.keys.shape[0])
        return []

    def crop(self, lengths: Sequence[int]) -> None:
        excess = int(self._cache.get_seq_length()) - same_length(lengths, "The dynamic cache")
        if excess > 0:
            self._cache.crop(-excess)

    @property
    def can_retain(self) -> bool:
        from transformers.cache_utils import DynamicLayer

        # a sliding-window layer keeps only its window, so positions cannot be picked out of it
        return all(type(layer) is DynamicLayer for layer in self._cache.layers)

    def retain(self, lengths: Sequence[int], indices: torch.Tensor) -> None:
        if not self.can_retain:
            raise NotImplementedError(f"The {self.name!r} cache cannot keep a tree draft's accepted path for "
                                      "sliding-window layers.")
        length = same_length(lengths, "The dynamic cache")
        n = int(indices.shape[1])
        for layer in self._cache.layers:
            if not layer.is_initialized:
                continue
            for row in range(indices.shape[0]):
                # accepted node i sits at length + indices[i] >= length + i: the gather reads before it writes
                source = indices[row].to(layer.keys.device) + length
                layer.keys[row, :, length: length + n] = layer.keys[row, :, source]
                layer.values[row, :, length: length + n] = layer.values[row, :, source]
            layer.keys = layer.keys[..., : length + n, :]
            layer.values = layer.values[..., : length + n, :]
