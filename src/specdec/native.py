"""specdec's own forward for Llama-family targets (Llama, Qwen2, Qwen3): the transformers model's weights and
math, without its per-call machinery.

For a small target on a CPU, a transformers forward spends about a quarter of its time outside the matrix
products: module dispatch, mask construction, cache bookkeeping, hooks. This forward runs the same operations
in the same order on the same weights (it calls the model's own rotary embedding, and keeps every projection
separate, since a fused QKV product rounds differently in bfloat16), so its logits are bit-identical to the
transformers forward's; tests/test_native.py holds it to that. Keys and values live in `NativeKVCache`, one
preallocated buffer for all layers, so a step writes in place instead of concatenating, rolling back is a
length change and keeping a tree's accepted path is one gather.

Models it does not cover exactly (other architectures, sliding windows, non-SDPA attention, quantized or
replaced layers) keep the transformers forward: `unsupported_reason` says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .contracts import KVCache, same_length
from .prepacked import PrepackedLinears

SUPPORTED = {
    # model_type -> (decoder layer class, whether attention normalises q and k per head)
    "llama": ("LlamaDecoderLayer", False),
    "qwen2": ("Qwen2DecoderLayer", False),
    "qwen3": ("Qwen3DecoderLayer", True),
}


def is_specdec_hook(hook: Any) -> bool:
    return bool(getattr(hook, "specdec_tap", False))


def unsupported_reason(model: nn.Module) -> str | None:
    """None when `NativeForward` reproduces this model's forward exactly; otherwise why it does not.

    Forward hooks count against it: the native forward does not call the modules, so a hook that changes
    activations (steering, adapters, offloading) would be skipped silently. specdec's own tap hooks are
    the exception. A TargetModel checks again before each generation and each training forward.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        return f"model type {model_type!r} is not one of {', '.join(sorted(SUPPORTED))}"
    layer_class, _ = SUPPORTED[model_type]
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is not None:
        layers = layers[: config.num_hidden_layers]  # transformers runs only these
    if layers is None or any(type(layer).__name__ != layer_class for layer in layers):
        return f"its decoder layers are not all transformers' {layer_class}"
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return f"attention implementation {getattr(config, '_attn_implementation', None)!r} is not 'sdpa'"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {config.hidden_act!r} is not 'silu'"
    if any(kind != "full_attention" for kind in (getattr(config, "layer_types", None) or [])):
        return "some layers use sliding-window attention"
    if getattr(config, "use_sliding_window", False):
        return "it uses sliding-window attention"
    if not getattr(config, "is_causal", True):
        return "its config asks for bidirectional attention (is_causal=False)"
    for name, module in model.named_modules():
        hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
        if hasattr(module, "_hf_hook") or any(not is_specdec_hook(hook) for hook in hooks):
            return f"module {name or 'model'} has forward hooks, which only transformers' forward would run"
    if type(model.get_output_embeddings()) is not nn.Linear:
        return "its LM head is not a plain nn.Linear"
    if any(type(p) is not nn.Linear for layer in layers for p in projections(layer)):
        return "some projections are not plain nn.Linear layers (quantized or adapted)"
    return None


def projections(layer: nn.Module) -> tuple[nn.Module, ...]:
    """A decoder layer's seven projections: q, k, v, o, gate, up, down."""
    attention, mlp = layer.self_attn, layer.mlp
    return (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj,
            mlp.gate_proj, mlp.up_proj, mlp.down_proj)


class NativeKVCache(KVCache):
    """Keys and values of every layer in one preallocated buffer [layers, B, kv_heads, capacity, head_dim],
    grown by doubling; crop is a length change, retain one gather. Read by specdec's native forward (through
    `specdec.backends.NativeBackend`), never by a transformers model. Its rows hold one length."""

    name = "native"
    description = "preallocated buffers for specdec's own Llama/Qwen forward (bit-identical to transformers')"

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self._length = 0

    def length(self) -> int:
        """The length every row holds."""
        return self._length

    def lengths(self) -> list[int]:
        return [] if self.keys is None else [self._length] * int(self.keys.shape[1])

    def crop(self, lengths: Sequence[int]) -> None:
        length = same_length(lengths, "The native cache")
        self._length = min(self._length, max(0, length))

    @property
    def can_retain(self) -> bool:
        return True

    def retain(self, lengths: Sequence[int], indices: torch.Tensor) -> None:
        if self.keys is None or self.values is None:
            return
        length = same_length(lengths, "The native cache")
        n = int(indices.shape[1])
        for row in range(indices.shape[0]):
            source = indices[row].to(self.keys.device) + length  # indexing copies first: overlapping writes are safe
            self.keys[:, row, :, length: length + n] = self.keys[:, row, :, source]
            self.values[:, row, :, length: length + n] = self.values[:, row, :, source]
        self._length = length + n

    def reserve(self, layers: int, batch: int, kv_heads: int, head_dim: int, new_tokens: int,
                dtype: torch.dtype, device: torch.device) -> None:
        """Make room for `new_tokens` more positions (allocating on first use, doubling when full)."""
        needed = self._length + new_tokens
        if self.keys is not None and self.keys.shape[1] != batch:
            raise ValueError(f"The cache holds a batch of {self.keys.shape[1]} rows, not {batch}; reset it first.")
        if self.keys is not None and self.keys.shape[3] >= needed:
            return
        capacity = max(256, 1 << (needed - 1).bit_length())
        shape = (layers, batch, kv_heads, capacity, head_dim)
        keys = torch.empty(shape, dtype=dtype, device=device)
        values = torch.empty(shape, dtype=dtype, device=device)
        if self.keys is not None and self.values is not None:
            keys[:, :, :, : self._length] = self.keys[:, :, :, : self._length]
            values[:, :, :, : self._length] = self.values[:, :, :, : self._length]
        self.keys, self.values = keys, values

    def advance(self, n: int) -> None:
        self._length += n


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' LlamaRMSNorm, op for op: statistics in float32, scale in the input dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class NativeForward:
    """One forward of a supported transformers model (see `unsupported_reason`), reading its weights in place."""

    def __init__(self, model: nn.Module) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"specdec's native forward does not cover this model: {reason}.")
        config = model.config
        self.model = model
        self.inner = model.model
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.qk_norm = SUPPORTED[config.model_type][1]
        self.layers = self.inner.layers[: config.num_hidden_layers]  # transformers runs only these
        linears = [p for layer in self.layers for p in projections(layer)]
        self.prepacked = PrepackedLinears([*linears, model.get_output_embeddings()])

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: NativeKVCache | None,
                 attention_mask: torch.Tensor | None, tap_ids: list[int], stop_after: int | None = None,
                 logits_to_keep: int = 0) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
        """input_ids, position_ids [B, n]; attention_mask: bool [n, past + n] (True = may attend) or None for
        causal. Without a cache the forward sees only these n tokens. Returns (logits, taps); logits is None
        when `stop_after` ends the forward after that layer (taps only)."""
        assert stop_after is None or cache is None, "a taps-only forward leaves the cache half-written"
        batch, n = input_ids.shape
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        x = self.inner.embed_tokens(input_ids)
        cos, sin = self.inner.rotary_emb(x, position_ids)  # the model's own, so any RoPE scaling carries over
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        start = 0
        if cache is not None:
            start = cache.length()
            cache.reserve(len(self.layers), batch, kv_heads, head_dim, n, x.dtype, x.device)
        if attention_mask is None and start > 0 and n > 1:  # causal among the new tokens, all of the past
            attention_mask = torch.ones(n, start + n, dtype=torch.bool, device=x.device).tril_(start)
        mask4d = None if attention_mask is None else attention_mask[None, None]
        # transformers repeats the key/value heads for masked GQA steps (CUDA's kernels need it); on the CPU,
        # SDPA's own GQA gives the same bits for heads up to 256 wide (tests/test_native.py) without copying the
        # cache three times over each layer
        cpu_gqa = x.device.type == "cpu" and kv_heads != heads and head_dim <= 256
        linear = self.prepacked.linear
        taps: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            attention, mlp = layer.self_attn, layer.mlp
            h = _rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
            q = linear(h, attention.q_proj).view(batch, n, heads, head_dim)
            k = linear(h, attention.k_proj).view(batch, n, kv_heads, head_dim)
            v = linear(h, attention.v_proj).view(batch, n, kv_heads, head_dim)
            if self.qk_norm:
                q = _rms_norm(q, attention.q_norm.weight, attention.q_norm.variance_epsilon)
                k = _rms_norm(k, attention.k_norm.weight, attention.k_norm.variance_epsilon)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            if cache is not None:
                assert cache.keys is not None and cache.values is not None
                cache.keys[i, :, :, start: start + n] = k
                cache.values[i, :, :, start: start + n] = v
                k, v = cache.keys[i, :, :, : start + n], cache.values[i, :, :, : start + n]
            if cpu_gqa:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=attention.scaling,
                                                     is_causal=attention_mask is None and n > 1, enable_gqa=True)
                out = out.transpose(1, 2)
            else:  # transformers' own wrapper, so its choice of kernel path (and rounding) is taken, not copied
                out, _ = sdpa_attention_forward(attention, q, k, v, mask4d, dropout=0.0, scaling=attention.scaling)
            out = out.reshape(batch, n, heads * head_dim)
            x = x + linear(out, attention.o_proj)
            h = _rms_norm(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
            gate = linear(h, mlp.gate_proj)
            up = linear(h, mlp.up_proj)
            x = x + linear(F.silu(gate) * up, mlp.down_proj)
            if i in tap_ids:
                taps[i] = x
            if i == stop_after:
                return None, taps
        if cache is not None:
            cache.advance(n)
        norm = self.inner.norm
        x = _rms_norm(x, norm.weight, norm.variance_epsilon)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        return linear(x, self.model.get_output_embeddings()), taps
