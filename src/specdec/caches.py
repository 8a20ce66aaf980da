"""Built-in target KV caches."""

from __future__ import annotations

from typing import Any

import torch

from .contracts import KVCache


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
        return self._cache

    def length(self) -> int:
        return int(self._cache.get_seq_length())

    def crop(self, length: int) -> None:
        excess = self.length() - length
        if excess > 0:
            self._cache.crop(-excess)

    @property
    def can_retain(self) -> bool:
        from transformers.cache_utils import DynamicLayer

        # a sliding-window layer keeps only its window, so positions cannot be picked out of it
        return all(type(layer) is DynamicLayer for layer in self._cache.layers)

    def retain(self, length: int, indices: torch.Tensor) -> None:
        if not self.can_retain:
            raise NotImplementedError(f"The {self.name!r} cache cannot keep a tree draft's accepted path for "
                                      "sliding-window layers.")
        for layer in self._cache.layers:
            if not layer.is_initialized:
                continue
            n = int(indices.shape[0])
            # accepted node i sits at length + indices[i] >= length + i: the gather reads before it writes
            source = indices.to(layer.keys.device) + length
            layer.keys[..., length: length + n, :] = layer.keys[..., source, :]
            layer.values[..., length: length + n, :] = layer.values[..., source, :]
            layer.keys = layer.keys[..., : length + n, :]
            layer.values = layer.values[..., : length + n, :]
