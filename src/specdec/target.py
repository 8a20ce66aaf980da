"""The target adapter: one transformers causal LM, its KV cache, and hidden-state taps.

Taps are captured with forward hooks on the requested decoder layers only; layer id L is the output of
decoder layer L (transformers' ``hidden_states[L + 1]``). Llama-family models run through specdec's own
forward (`specdec.native`: bit-identical logits, 15-25% less time per step for the embedded target on a
CPU, and about 20% less again with its bfloat16 weights prepacked for oneDNN, `specdec.prepacked`) with the
"native" cache; the "auto" cache picks it whenever the model qualifies, else transformers'
DynamicCache.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import native, tree
from .contracts import KVCache
from .errors import SpecdecError


@dataclass
class TargetOutput:
    """logits: [B, n, V] (prefill keeps only the last position); taps: layer id -> [B, n_tokens, H]."""

    logits: torch.Tensor
    taps: dict[int, torch.Tensor] = field(default_factory=dict)

    def tapped(self, layer_ids: list[int] | tuple[int, ...]) -> torch.Tensor:
        """The requested taps concatenated on the feature axis: [B, n_tokens, len(layer_ids) * H]."""
        return torch.cat([self.taps[i] for i in layer_ids], dim=-1)

    def select(self, positions: torch.Tensor) -> TargetOutput:
        """The logits and taps at these positions [n] of the forward, in this order (a tree's accepted path
        seen as the chain it became)."""
        logits = self.logits[:, positions.to(self.logits.device)]
        taps = {i: t[:, positions.to(t.device)] for i, t in self.taps.items()}
        return TargetOutput(logits=logits, taps=taps)


class _TapsComplete(Exception):
    """Raised by the deepest tap's hook to end a taps-only forward: nothing after that layer is needed."""


def base_model(model: nn.Module) -> nn.Module | None:
    return getattr(model, "model", None) or getattr(model, getattr(model, "base_model_prefix", ""), None)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(base_model(model), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise SpecdecError(f"{type(model).__name__} has no `model.layers` list of decoder layers; specdec supports "
                           "decoder-only transformers models laid out like Llama, Qwen or Mistral.")
    return layers


class TargetModel:
    """Wraps a transformers causal LM for speculative decoding (prefill, k-token forward, rollback)."""

    def __init__(self, model: nn.Module, tokenizer: Any = None, cache: str = "auto") -> None:
        from .plugins import get_cache_class

        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = model.config
        self._layers = decoder_layers(model)
        unsupported = native.unsupported_reason(model)
        self._cache_choice = cache
        if cache == "auto":
            cache = "dynamic" if unsupported else "native"
        self._cache_class = get_cache_class(cache)
        self._native: native.NativeForward | None = None
        if issubclass(self._cache_class, native.NativeKVCache):
            if unsupported:
                raise SpecdecError(f"The native cache needs specdec's own forward, which does not cover this model "
                                   f"({unsupported}); use cache='dynamic' or 'auto'.")
            self._native = native.NativeForward(model)
        self._cache: KVCache | None = None
        self._tap_ids: list[int] = []
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks: list[Any] = []
        self._stop_after: int | None = None  # set during a taps-only forward
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    # -- what proposers may read -------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 0) or 2**31 - 1)

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if value is None:
                continue
            ids.update(value if isinstance(value, (list, tuple)) else [value])
        return {int(i) for i in ids}

    # -- taps ----------------------------------------------------------------------------------------
    def request_taps(self, layer_ids: list[int] | tuple[int, ...]) -> None:
        """Capture the outputs of these decoder layers in every later forward (ids in [0, num_layers))."""
        for layer_id in layer_ids:
            if not 0 <= layer_id < self.num_layers:
                raise SpecdecError(f"Hidden-state tap at layer {layer_id} is outside the target's "
                                   f"{self.num_layers} decoder layers (valid ids: 0..{self.num_layers - 1}).")
            if layer_id in self._tap_ids:
                continue
            self._tap_ids.append(layer_id)
            if self._native is None:  # the native forward reads its taps itself
                self._hook_tap(layer_id)

    def _hook_tap(self, layer_id: int) -> None:
        self._hooks.append(self._layers[layer_id].register_forward_hook(self._make_hook(layer_id)))

    def _make_hook(self, layer_id: int):
        def hook(_module, _inputs, output):
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output
            if layer_id == self._stop_after:
                raise _TapsComplete

        hook.specdec_tap = True  # type: ignore[attr-defined]  # not a user hook (see native.unsupported_reason)
        return hook

    # -- cache and forwards -------------------------------------------------------------------------
    @property
    def cache_name(self) -> str:
        """The KV cache in use ("native" means specdec's own forward runs the model)."""
        return self._cache_class.name

    def reset(self) -> None:
        if self._native is not None:
            self._recheck_native()
        self._cache = self._cache_class(self.model)

    def _recheck_native(self) -> None:
        # A hook (or replaced layer) added since this TargetModel was made would be skipped by the native
        # forward, silently changing the output; with cache="auto" the transformers forward takes over.
        # Run before each generation, and before each taps-only forward outside one (training): a walk over
        # the modules, well under 1 ms. A live cache cannot change hands, so mid-generation it is not run.
        reason = native.unsupported_reason(self.model)
        if reason is None:
            assert self._native is not None
            self._native.prepacked.refresh()  # weights changed in place since (fine-tuning) are packed again
            return
        if self._cache_choice != "auto":
            raise SpecdecError(f"The native cache needs specdec's own forward, which no longer covers this model "
                               f"({reason}, since the TargetModel was made); use cache='dynamic' or 'auto'.")
        from .plugins import get_cache_class

        self._native, self._cache_class = None, get_cache_class("dynamic")
        for layer_id in self._tap_ids:  # the transformers forward taps with hooks
            self._hook_tap(layer_id)

    @property
    def cache_length(self) -> int:
        return 0 if self._cache is None else self._cache.length()

    def crop(self, length: int) -> None:
        """Roll the KV cache back to its first `length` positions."""
        assert self._cache is not None
        self._cache.crop(length)

    @property
    def can_retain(self) -> bool:
        """Whether the cache can keep a tree draft's accepted path (see `KVCache.retain`)."""
        return self._cache is not None and self._cache.can_retain

    @torch.inference_mode()  # the cache's tensors were made under it, and are updated in place
    def retain(self, length: int, indices: torch.Tensor) -> None:
        """After a tree forward: keep the first `length` cache positions, then the accepted nodes at
        `length + indices`, in order."""
        assert self._cache is not None
        self._cache.retain(length, indices)

    @torch.inference_mode()
    def _run(self, input_ids: torch.Tensor, logits_to_keep: int,
             tree_parents: list[int] | None = None) -> TargetOutput:
        assert self._cache is not None, "call reset() before the first forward"
        start = self._cache.length()
        device = input_ids.device
        extra: dict[str, Any] = {}
        if tree_parents is None:
            positions = torch.arange(start, start + input_ids.shape[1], device=device).unsqueeze(0)
        else:  # [root, draft...]: each node at its depth, seeing only its ancestors among the new tokens
            positions = torch.tensor([start] + [start + d for d in tree.depths(tree_parents)], device=device)
            positions = positions.unsqueeze(0)
        if self._native is not None:
            mask = None if tree_parents is None else tree.bool_mask(tree_parents, start, device)
            assert isinstance(self._cache, native.NativeKVCache)
            logits, taps = self._native(input_ids, positions.expand(input_ids.shape[0], -1), self._cache, mask,
                                        self._tap_ids, logits_to_keep=logits_to_keep)
            assert logits is not None
            return TargetOutput(logits=logits, taps=taps)
        if tree_parents is not None:
            extra["attention_mask"] = tree.attention_mask(tree_parents, start, self.dtype, device)
        self._captured = {}
        out = self.model(
            input_ids=input_ids,
            position_ids=positions.expand(input_ids.shape[0], -1),
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **{self._cache_kwarg: self._cache.hf_cache},
            **extra,
        )
        taps, self._captured = self._captured, {}
        return TargetOutput(logits=out.logits, taps=taps)

    def prefill(self, input_ids: torch.Tensor) -> TargetOutput:
        """Read the prompt [B, T] into a fresh cache; logits of the last position only, taps for all."""
        self.reset()
        return self._run(input_ids, logits_to_keep=1)

    @torch.inference_mode()
    def tap_hidden_states(self, input_ids: torch.Tensor) -> TargetOutput:
        """Taps only, for every position of [B, T], from a cache-free forward that stops at the deepest tap.

        Training needs the tapped states and nothing else: skipping the later layers and the LM head (whose
        [T, V] product costs as much as several decoder layers) makes each training step cheaper. The KV
        cache is left untouched; `logits` is empty.
        """
        if not self._tap_ids:
            raise SpecdecError("No hidden-state taps were requested; call request_taps(layer_ids) first.")
        if self._native is not None and self._cache is None:  # training; a live generation keeps its forward
            self._recheck_native()
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        logits = torch.empty(input_ids.shape[0], 0, self.vocab_size, device=input_ids.device, dtype=self.dtype)
        if self._native is not None:
            _, taps = self._native(input_ids, positions.expand(input_ids.shape[0], -1), None, None, self._tap_ids,
                                   stop_after=max(self._tap_ids))
            return TargetOutput(logits=logits, taps=taps)
        self._captured, self._stop_after = {}, max(self._tap_ids)
        try:
            base_model(self.model)(input_ids=input_ids, position_ids=positions.expand(input_ids.shape[0], -1),
                                   use_cache=False)
        except _TapsComplete:
            pass
        finally:
            self._stop_after = None
        taps, self._captured = self._captured, {}
        return TargetOutput(logits=logits, taps=taps)

    def forward(self, input_ids: torch.Tensor, tree_parents: list[int] | None = None) -> TargetOutput:
        """Feed [B, n] tokens at the positions following the cache; logits for all n positions. With
        `tree_parents` (n - 1 ints, see `specdec.tree`) the tokens after the first form a tree under it."""
        return self._run(input_ids, logits_to_keep=0, tree_parents=tree_parents)
