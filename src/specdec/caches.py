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

    def retain(self, length: int, indices: torch.Tensor) -> None:
        from transformers.cache_utils import DynamicLayer

        for layer in self._cache.layers:
            if type(layer) is not DynamicLayer:  # a sliding window keeps a ring, not a prefix
                raise NotImplementedError(f"The {self.name!r} cache cannot keep a tree draft's accepted path for "
                                          f"{type(layer).__name__} layers; use a chain draft with this model.")
            if not layer.is_initialized:
                continue
            n = int(indices.shape[0])
            # accepted node i sits at length + indices[i] >= length + i: the gather reads before it writes
            source = indices.to(layer.keys.device) + length
            layer.keys[..., length: length + n, :] = layer.keys[..., source, :]
            layer.values[..., length: length + n, :] = layer.values[..., source, :]
            layer.keys = layer.keys[..., : length + n, :]
            layer.values = layer.values[..., : length + n, :]
