"""specdec's own forward for Llama-family targets (Llama, Qwen2, Qwen3): the transformers model's weights and
math, without its per-call machinery.

For a small target on a CPU, a transformers forward spends about a quarter of its time outside the matrix
products: module dispatch, mask construction, cache bookkeeping, hooks. This forward runs the same operations
in the same order on the same weights (it calls the model's own rotary embedding, and keeps every projection
separate, since a fused QKV product rounds differently in bfloat16), so its logits are bit-identical to the
transformers forward's; tests/test_native.py holds it to that. Keys and values live in `NativeKVCache`, one
preallocated buffer for all layers, so a step writes in place instead of concatenating, rolling back is a
length change and keeping a tree's accepted path is one gather.

Rows may hold different lengths (batching): the cache keeps a length per row, and the forward writes row b's
tokens at its own offset and masks each row to its own past (`row_mask`). While every row holds one length the
forward takes the single-length path, call for call, so the bit-identity above holds there. With ragged rows a
row's logits equal that row run alone up to rounding: the matrix products and SDPA's reductions over the longer,
masked key range round by shape (so do batched rows of one length against B = 1 on this CPU); tests/
test_ragged_cache.py holds them to 1e-12 in float64, and bit for bit to the same row beside other rows' data.

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

from .contracts import KVCache
from .prepacked import PrepackedLinears

SUPPORTED = {
    # model_type -> (decoder layer class, whether attention normalises q and k per head)
    "llama": ("LlamaDecoderLayer", False),
    "qwen2": ("Qwen2DecoderLayer", False),
    "qwen3": ("Qwen3DecoderLayer", True),
}


def is_specdec_hook(hook: Any) -> bool:
    return bool(getattr(hook, "specdec_tap", False))


def is_inert_hook(hook: Any) -> bool:
    """specdec's tap hooks, and the output-capturing hooks transformers (5.x) leaves on a model's layers after
    a forward with output_hidden_states: they only record outputs while transformers' own forward collects
    them (they never change one), so the native forward, which collects nothing, may skip them."""
    return is_specdec_hook(hook) or (getattr(hook, "__module__", None) == "transformers.utils.output_capturing"
                                     and getattr(hook, "__name__", None) == "output_capturing_hook")


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
        if hasattr(module, "_hf_hook") or any(not is_inert_hook(hook) for hook in hooks):
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


def _capacity(needed: int) -> int:
    """Positions a buffer holding `needed` per row gets: the power of two at or above it, at least 256."""
    return max(256, 1 << (max(1, needed) - 1).bit_length())


class NativeKVCache(KVCache):
    """Keys and values of every layer in one preallocated buffer [layers, B, kv_heads, capacity, head_dim], and a
    length per row. Read by specdec's native forward (through `specdec.backends.NativeBackend`), never by a
    transformers model.

    Rows are ragged: row b holds its first `lengths()[b]` positions; the slots after them are stale or zero and
    masked out by the forward. crop is a length change per row, retain one gather per row.

    Memory: 2 x layers x B x kv_heads x capacity x head_dim elements, where capacity is the power of two (at
    least 256) at or above the longest row held plus the tokens being fed. It grows by doubling with the longest
    row, so it is proportional to the batch times the longest row actually held, never to the batch times the
    context window. Shorter rows leave the tail of their slab unused (a paged layout would reclaim it). crop frees
    nothing; `drop_rows` and `append_rows` reallocate to fit the rows then held, so the buffer shrinks when the
    longest row leaves.
    """

    name = "native"
    description = "preallocated buffers for specdec's own Llama/Qwen forward (bit-identical to transformers')"

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self._lengths: list[int] = []  # one per row, on the host: no device sync to read them

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
        if self.keys is None:
            self._lengths = [0] * batch
        longest = max(self._lengths, default=0)
        needed = longest + new_tokens
        if self.keys is not None and self.keys.shape[3] >= needed:
            return
        shape = (layers, batch, kv_heads, _capacity(needed), head_dim)
        keys = torch.zeros(shape, dtype=dtype, device=device)
        values = torch.zeros(shape, dtype=dtype, device=device)
        if self.keys is not None and self.values is not None:
            keys[:, :, :, :longest] = self.keys[:, :, :, :longest]
            values[:, :, :, :longest] = self.values[:, :, :, :longest]
        self.keys, self.values = keys, values

    def advance(self, n: int | Sequence[int]) -> None:
        """Count `n` more positions in every row, or `n[b]` more in row b."""
        if isinstance(n, int):
            self._lengths = [length + n for length in self._lengths]
        else:
            self._lengths = [length + int(m) for length, m in zip(self._lengths, self._check_rows(n, "advance"),
                                                                   strict=True)]

    def drop_rows(self, rows: Sequence[int]) -> None:
        """Rows leave the batch: remove them and close up the rest, in order, into a buffer sized for the rows
        that stay (shrinking it when the longest row left). Dropping every row empties the cache."""
        drop = {int(r) for r in rows}
        if any(not 0 <= r < len(self._lengths) for r in drop):
            raise ValueError(f"drop_rows: rows {sorted(drop)} are not all among the {len(self._lengths)} held.")
        if not drop:
            return
        stay = [b for b in range(len(self._lengths)) if b not in drop]
        self._lengths = [self._lengths[b] for b in stay]
        if not stay or self.keys is None or self.values is None:
            self.keys = self.values = None
            self._lengths = []
            return
        capacity = min(int(self.keys.shape[3]), _capacity(max(self._lengths)))
        index = torch.tensor(stay, device=self.keys.device)
        self.keys = self.keys[:, :, :, :capacity].index_select(1, index)
        self.values = self.values[:, :, :, :capacity].index_select(1, index)

    def append_rows(self, other: NativeKVCache) -> None:
        """Rows join the batch: `other`'s rows (e.g. new prompts prefilled into a cache of their own) are placed
        after these, which keep their state; the buffer is reallocated to fit the longest row now held."""
        if other.keys is None or other.values is None or not other._lengths:
            return
        if self.keys is None or self.values is None or not self._lengths:
            self.keys, self.values, self._lengths = None, None, []
            parts = [other]
        else:
            mine, theirs = self.keys.shape, other.keys.shape
            if (mine[0], mine[2], mine[4]) != (theirs[0], theirs[2], theirs[4]) or \
                    (self.keys.dtype, self.keys.device) != (other.keys.dtype, other.keys.device):
                raise ValueError(f"append_rows: caches of different layouts ({tuple(mine)} {self.keys.dtype} on "
                                 f"{self.keys.device} and {tuple(theirs)} {other.keys.dtype} on {other.keys.device}).")
            parts = [self, other]
        lengths = [n for part in parts for n in part._lengths]
        layers, _, kv_heads, _, head_dim = other.keys.shape
        shape = (layers, len(lengths), kv_heads, _capacity(max(lengths)), head_dim)
        keys = other.keys.new_zeros(shape)
        values = other.values.new_zeros(shape)
        first = 0
        for part in parts:
            assert part.keys is not None and part.values is not None
            rows, longest = len(part._lengths), max(part._lengths)
            keys[:, first: first + rows, :, :longest] = part.keys[:, :, :, :longest]
            values[:, first: first + rows, :, :longest] = part.values[:, :, :, :longest]
            first += rows
        self.keys, self.values, self._lengths = keys, values, lengths


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


#: a forward of several rows with at most this many new tokens per row takes `grouped_attention` on a CPU
GROUPED_MAX_QUERIES = 4


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float) -> torch.Tensor:
    """Attention for a batch of rows with few new tokens each: q [B, H, n, d] against k, v [B, KV, T, d] (the
    H / KV query heads of one key head stacked as rows of one product), scores and softmax in float32 (float64
    stays float64). mask: bool, True = may attend, [n, T] for every row or [B, n, T]; None: all of T.
    Returns [B, H, n, d].

    Why not the fused kernel: on a CPU, torch's flash attention spends its time per (row, head) when n is small
    (at 16 rows of one query over 300 cached positions, ~2.4 ms per layer against ~0.35 ms here, for the same
    error against a float64 reference). One row keeps transformers' kernel, so its logits stay bit-identical."""
    batch, heads, n, dim = q.shape
    kv_heads, total = k.shape[1], k.shape[2]
    group = heads // kv_heads
    work = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.reshape(batch, kv_heads, group * n, dim).to(work), k.to(work).transpose(-1, -2))
    scores = scores * scale  # [B, KV, group * n, T]
    if mask is not None:
        rows = mask if mask.dim() == 3 else mask.unsqueeze(0)  # [B or 1, n, T]
        scores = scores.view(batch, kv_heads, group, n, total).masked_fill(~rows[:, None, None], float("-inf"))
        scores = scores.view(batch, kv_heads, group * n, total)
    out = torch.matmul(torch.softmax(scores, dim=-1), v.to(work))  # [B, KV, group * n, d]
    return out.to(q.dtype).view(batch, heads, n, dim)


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
                 logits_to_keep: int = 0,
                 counts: Sequence[int] | None = None) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
        """input_ids, position_ids [B, n]; attention_mask: bool [n, past + n] (True = may attend) or None for
        causal. Without a cache the forward sees only these n tokens. Returns (logits, taps); logits is None
        when `stop_after` ends the forward after that layer (taps only).

        When the cache's rows hold different lengths, row b's tokens are written at its own slots lengths[b] ..
        lengths[b] + n - 1 and attention_mask is per row, bool [B, n, max(lengths) + n] (`row_mask`; None builds
        the causal one). When rows hold one length this is the path of one shared length, call for call.
        counts: row b's first counts[b] tokens are real, the rest right padding: the cache counts only the real
        ones, and `logits_to_keep` counts back from each row's last real token (default: all n are real)."""
        assert stop_after is None or cache is None, "a taps-only forward leaves the cache half-written"
        batch, n = input_ids.shape
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        x = self.inner.embed_tokens(input_ids)
        cos, sin = self.inner.rotary_emb(x, position_ids)  # the model's own, so any RoPE scaling carries over
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        start = 0
        rows: list[int] | None = None  # the per-row lengths, when rows differ
        if cache is not None:
            lengths = cache.lengths()
            # rows of different lengths, or a mask per row (a tree per row): per-row slots and masks
            if lengths and (any(length != lengths[0] for length in lengths)
                            or (attention_mask is not None and attention_mask.dim() == 3)):
                rows = lengths
            else:
                start = cache.length()
            cache.reserve(len(self.layers), batch, kv_heads, head_dim, n, x.dtype, x.device)
        if rows is not None:  # ragged rows: per-row slots and masks, built once for every layer
            if attention_mask is None:
                attention_mask = row_mask(rows, n, None, x.device)
            if attention_mask.shape != (batch, n, max(rows) + n):
                raise ValueError(f"Rows of different lengths {rows} take a per-row mask [B, n, longest + n] "
                                 f"({batch}, {n}, {max(rows) + n}), not {tuple(attention_mask.shape)}.")
            total = max(rows) + n
            # row b's n tokens go to its slots rows[b] .. rows[b] + n - 1: an index_put with [B, n] indices (on
            # this CPU ~15 us per layer at 16 rows, where a scatter_ with its [B, kv, n, d] index took ~0.2 ms)
            slots = torch.tensor(rows, device=x.device).unsqueeze(1) + torch.arange(n, device=x.device)  # [B, n]
            row_index = torch.arange(batch, device=x.device).unsqueeze(1).expand(batch, n)  # [B, n]
            mask4d = attention_mask[:, None]
            sdpa_mask = mask4d
        else:
            if attention_mask is None and start > 0 and n > 1:  # causal among the new tokens, all of the past
                attention_mask = torch.ones(n, start + n, dtype=torch.bool, device=x.device).tril_(start)
            mask4d = None if attention_mask is None else attention_mask[None, None]
            sdpa_mask = attention_mask
        cpu_gqa = x.device.type == "cpu" and kv_heads != heads and head_dim <= 256
        # several rows decoding a few tokens each: grouped_attention (one row keeps transformers' kernel)
        grouped = x.device.type == "cpu" and batch > 1 and n <= GROUPED_MAX_QUERIES and heads % kv_heads == 0
        grouped_mask = attention_mask
        if grouped and attention_mask is None and n > 1:  # causal among the new tokens, all of the past
            grouped_mask = torch.ones(n, start + n, dtype=torch.bool, device=x.device).tril_(start)
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
            if cache is not None and rows is not None:
                assert cache.keys is not None and cache.values is not None
                cache.keys[i][row_index, :, slots] = k.transpose(1, 2)  # [B, n, kv, d] at [b, :, slot]
                cache.values[i][row_index, :, slots] = v.transpose(1, 2)
                k, v = cache.keys[i, :, :, :total], cache.values[i, :, :, :total]
            elif cache is not None:
                assert cache.keys is not None and cache.values is not None
                cache.keys[i, :, :, start: start + n] = k
                cache.values[i, :, :, start: start + n] = v
                k, v = cache.keys[i, :, :, : start + n], cache.values[i, :, :, : start + n]
            if grouped:
                out = grouped_attention(q, k, v, grouped_mask, attention.scaling).transpose(1, 2)
            elif cpu_gqa:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, scale=attention.scaling,
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
            cache.advance(n if counts is None else counts)
        norm = self.inner.norm
        x = _rms_norm(x, norm.weight, norm.variance_epsilon)
        if logits_to_keep and counts is None:
            x = x[:, -logits_to_keep:]
        elif logits_to_keep:  # each row's last real tokens
            last = torch.tensor(list(counts), device=x.device).unsqueeze(1)
            index = (last - logits_to_keep + torch.arange(logits_to_keep, device=x.device)).clamp_(min=0)
            x = x.gather(1, index.unsqueeze(2).expand(-1, -1, x.shape[2]))
        return linear(x, self.model.get_output_embeddings()), taps
