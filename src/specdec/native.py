"""specdec's own forward for Llama-family targets (Llama, Qwen2, Qwen3): the transformers model's weights and
math, without its per-call machinery.

For a small target on a CPU, a transformers forward spends about a quarter of its time outside the matrix
products: module dispatch, mask construction, cache bookkeeping, hooks. This forward runs the same operations
in the same order on the same weights (it calls the model's own rotary embedding, and keeps every projection
separate, since a fused QKV product rounds differently in bfloat16), so its logits are bit-identical to the
transformers forward's; tests/test_native.py holds it to that. Keys and values live in `NativeKVCache`
(native_cache.py), one preallocated buffer for all layers, so a step writes in place instead of concatenating,
rolling back is a length change and keeping a tree's accepted path is one gather.

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

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .native_cache import NativeKVCache, row_mask
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


#: a forward of several rows with at most this many new tokens per row may take `grouped_attention` on a CPU
GROUPED_MAX_QUERIES = 4
#: which attention such a forward takes: "auto" (grouped_attention where a probe on this machine measures it
#: GROUPED_MARGIN times faster than torch's fused kernel: `grouped_pays`), "grouped" or "fused"
GROUPED_ATTENTION = "auto"
#: how much faster grouped attention must measure to be taken: where the two are close, the choice stays the
#: fused kernel's, so that timing noise does not flip it (and with it the rounding) from one process to the next
GROUPED_MARGIN = 1.5
_grouped_verdicts: dict[tuple[int, int, int, torch.dtype], bool] = {}  # (heads, kv heads, head dim, dtype)


def grouped_pays(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether a CPU forward of several rows with few new tokens each takes `grouped_attention` (see
    GROUPED_ATTENTION). The answer differs by machine: on one of this project's CPUs torch's fused kernel took
    ~2.4 ms per layer where grouped attention took ~0.35 ms (16 rows of one token over 300 positions), on
    another (Intel, AMX, torch 2.13) the fused kernel took 0.2 ms against grouped attention's 0.7. So it is
    measured, once per process and attention shape, at first use."""
    if GROUPED_ATTENTION != "auto":
        return GROUPED_ATTENTION == "grouped"
    return _clearly_faster(_grouped_verdicts, (heads, kv_heads, head_dim, dtype), GROUPED_MARGIN,
                           lambda: _probe_attention(heads, kv_heads, head_dim, dtype))


def _clearly_faster(verdicts: dict, key: tuple, margin: float,
                    probe: Callable[[], tuple[float, float]]) -> bool:
    """Whether the second of `probe`'s two timings (seconds: the default path's, the candidate's) is `margin`
    times faster, measured once per key and kept in `verdicts`."""
    if key not in verdicts:
        default, candidate = probe()
        verdicts[key] = candidate * margin <= default
    return verdicts[key]


def _probe_inputs(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                  n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention probes' step: 16 rows of n new tokens over 300 - b + n positions for row b (rows of different
    lengths, so a per-row mask). Returns q [16, H, n, d], k, v [16, KV, T, d] and the mask [16, n, T]."""
    generator = torch.Generator().manual_seed(0)
    lengths = [300 - b for b in range(16)]
    q = torch.randn(16, heads, n, head_dim, generator=generator).to(dtype)
    k, v = (torch.randn(16, kv_heads, max(lengths) + n, head_dim, generator=generator).to(dtype) for _ in range(2))
    return q, k, v, row_mask(lengths, n, None, torch.device("cpu"))


@torch.inference_mode()
def _probe_attention(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[float, float]:
    """Seconds per call of torch's fused attention and of grouped_attention on the step they were first compared
    on: 16 rows of one new token over 286-301 cached positions (rows of different lengths, so a per-row mask),
    best of 5 after a warm-up each (a few milliseconds in all)."""
    q, k, v, mask = _probe_inputs(heads, kv_heads, head_dim, dtype, 1)
    scale = head_dim ** -0.5
    return (_best_seconds(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale,
                                                                 enable_gqa=True)),
            _best_seconds(lambda: grouped_attention(q, k, v, mask, scale)))


#: a CPU forward of several rows with 2 .. FOLD_MAX_QUERIES / group new tokens per row may fold each key head's
#: query heads into its queries (`folded_attention`); FOLDED_ATTENTION: "auto" (where a probe on this machine
#: measures it FOLD_MARGIN times faster than the fused kernel's grouped-query layout: `folding_pays`), "folded"
#: or "fused"
FOLD_MAX_QUERIES = 32
FOLDED_ATTENTION = "auto"
FOLD_MARGIN = 1.2
_folded_verdicts: dict[tuple[int, int, int, torch.dtype], bool] = {}


def folding_pays(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether a CPU forward of several rows of a few new tokens each takes `folded_attention` (see
    FOLDED_ATTENTION). On this project's Intel CPU (AMX, torch 2.13) torch's fused kernel took 0.58 ms per layer
    for 16 rows of 2 new tokens over 300 positions in the grouped-query layout (9 query heads on 3 key heads)
    and 0.29 ms folded, where one new token per row took 0.18 ms: a verification of one draft token per row
    cost 44% more than plain decoding's forward, mostly here. Measured once per process and attention shape."""
    if FOLDED_ATTENTION != "auto":
        return FOLDED_ATTENTION == "folded"
    return _clearly_faster(_folded_verdicts, (heads, kv_heads, head_dim, dtype), FOLD_MARGIN,
                           lambda: _probe_folding(heads, kv_heads, head_dim, dtype))


@torch.inference_mode()
def _probe_folding(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[float, float]:
    """Seconds per call of torch's fused attention in the grouped-query layout and folded, on 16 rows of 2 new
    tokens over 287-302 positions (a per-row mask), best of 5 after a warm-up each."""
    q, k, v, mask = _probe_inputs(heads, kv_heads, head_dim, dtype, 2)
    folded = fold_mask(mask, heads // kv_heads)
    scale = head_dim ** -0.5
    return (_best_seconds(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale,
                                                                 enable_gqa=True)),
            _best_seconds(lambda: folded_attention(q, k, v, folded, scale)))


def fold_mask(mask: torch.Tensor, group: int) -> torch.Tensor:
    """A mask for `folded_attention`: bool [n, T] (every row) or [B, n, T] (per row) -> [B or 1, 1, group * n, T],
    query j's mask repeated for each of the group query heads that share a key head."""
    rows = mask if mask.dim() == 3 else mask.unsqueeze(0)  # [B or 1, n, T]
    batch, n, total = rows.shape
    return rows.unsqueeze(1).expand(batch, group, n, total).reshape(batch, 1, group * n, total)


def folded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Grouped-query attention through torch's fused kernel with each key head's query heads folded into its
    queries: q [B, H, n, d] as [B, KV, H / KV * n, d] against k, v [B, KV, T, d], so the kernel runs B x KV
    problems of H / KV * n queries instead of B x H problems of n (the same sums per query, in the same kernel).
    mask: `fold_mask`'s [B or 1, 1, H / KV * n, T]. Returns [B, H, n, d]."""
    batch, heads, n, dim = q.shape
    kv_heads = k.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(batch, kv_heads, heads // kv_heads * n, dim), k, v,
                                         attn_mask=mask, scale=scale)
    return out.view(batch, heads, n, dim)


def _best_seconds(call: Callable[[], object], repeats: int = 5) -> float:
    """The least wall time of `repeats` calls, after one untimed call."""
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


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
        # several rows decoding a few tokens each: grouped_attention where it pays on this machine (one row keeps
        # transformers' kernel)
        grouped = (x.device.type == "cpu" and batch > 1 and n <= GROUPED_MAX_QUERIES and heads % kv_heads == 0
                   and grouped_pays(heads, kv_heads, head_dim, x.dtype))
        grouped_mask = attention_mask
        if grouped and attention_mask is None and n > 1:  # causal among the new tokens, all of the past
            grouped_mask = torch.ones(n, start + n, dtype=torch.bool, device=x.device).tril_(start)
        # several rows verifying a few tokens each: each key head's query heads folded into its queries, where
        # that pays on this machine (one row keeps transformers' kernel and layout)
        folded = (cpu_gqa and not grouped and batch > 1 and 2 <= n and heads % kv_heads == 0
                  and heads // kv_heads * n <= FOLD_MAX_QUERIES
                  and folding_pays(heads, kv_heads, head_dim, x.dtype))
        if folded:
            folded_mask = fold_mask(attention_mask if attention_mask is not None else  # None: causal, no past
                                    torch.ones(n, n, dtype=torch.bool, device=x.device).tril_(), heads // kv_heads)
        # one row keeps products bit-identical to transformers'; several rows (already equal to each row alone
        # only up to rounding) take the packed weights for wider products too
        linear = self.prepacked.linear if batch == 1 else functools.partial(self.prepacked.linear, exact=False)
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
            elif folded:
                out = folded_attention(q, k, v, folded_mask, attention.scaling).transpose(1, 2)
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
