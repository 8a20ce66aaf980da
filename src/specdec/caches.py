"""Built-in target KV caches."""

from __future__ import annotations

from typing import Any

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
