"""The DFlash draft model (arXiv 2602.06036), top to bottom in one file.

A block of ``block_size`` positions, ``[last committed token, mask, ..., mask]``, is embedded with the
target's embeddings and denoised in one forward pass. Every layer attends over the whole block (both ways,
unless the config makes the layer causal) and over *context features*: the target's hidden states at a few
layers, fused by ``fc`` and ``hidden_norm``, projected to keys and values by that layer's own k/v projections
("KV injection"). The target's LM head reads the last ``block_size - 1`` positions as draft tokens. Newer
z-lab fields (``is_causal``, ``layer_types``, ``input_embedding_scale``, ``output_multiplier``,
``final_logit_softcapping``) mean what they mean in z-lab's current ``dflash/model.py``.

Shapes: B batch, n block positions, c context positions, H hidden, h heads, g key/value heads, d head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import QWEN3_MAX_WINDOW_LAYERS, DFlashConfig

__all__ = ["QWEN3_MAX_WINDOW_LAYERS", "DFlashConfig", "DFlashDraftModel", "DraftCache"]

class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, n] -> cos, sin [B, 1, n, d] (broadcast over heads)."""
        freqs = positions.unsqueeze(-1).float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def block_attention_mask(context: int, n: int, window: int | None, causal: bool,
                         device: torch.device) -> torch.Tensor | None:
    """[n, context + n] bool, True where block position i may attend, or None where it sees everything.

    The keys are the `context` positions just before the block, then the block's n; as z-lab's code has it, a
    window lets query position p see key position p' when |p - p'| < window (p' <= p only, when causal), and
    a causal layer lets block position i see block positions <= i."""
    if not causal and (window is None or context + n - 1 < window):  # every query sees every key
        return None
    query = context + torch.arange(n, device=device).unsqueeze(1)  # [n, 1]
    key = torch.arange(context + n, device=device).unsqueeze(0)  # [1, c + n]
    visible = torch.ones(n, context + n, dtype=torch.bool, device=device)
    if causal:
        visible &= key <= query
    if window is not None:
        visible &= (query - key < window) & (key - query < window)
    return visible


class DraftCache:
    """Per layer, the rotated keys and values of every context position the draft has seen: [B, g, c, d]."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def length(self) -> int:
        return 0 if self.keys[0] is None else int(self.keys[0].shape[2])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values if t is not None)


class Attention(nn.Module):
    def __init__(self, config: DFlashConfig, layer: int) -> None:
        super().__init__()
        h, g, d, hidden = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.hidden_size
        self.heads, self.kv_heads, self.head_dim = h, g, d
        self.window = config.window_of(layer)
        self.causal = config.causal_of(layer)
        self.layer = layer
        self.q_proj = nn.Linear(hidden, h * d, bias=False)
        self.k_proj = nn.Linear(hidden, g * d, bias=False)
        self.v_proj = nn.Linear(hidden, g * d, bias=False)
        self.o_proj = nn.Linear(h * d, hidden, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, proj: nn.Linear, heads: int) -> torch.Tensor:
        return proj(x).view(x.shape[0], x.shape[1], heads, self.head_dim).transpose(1, 2)  # [B, heads, n, d]

    def _project(self, x: torch.Tensor, context: torch.Tensor, rope_block: tuple[torch.Tensor, torch.Tensor],
                 rope_context: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """q [B, h, n, d] and the block's keys and values [B, g, n, d] from x; the context's [B, g, c, d]."""
        q = apply_rope(self.q_norm(self._heads(x, self.q_proj, self.heads)), *rope_block)
        k_block = apply_rope(self.k_norm(self._heads(x, self.k_proj, self.kv_heads)), *rope_block)
        v_block = self._heads(x, self.v_proj, self.kv_heads)
        k_ctx = apply_rope(self.k_norm(self._heads(context, self.k_proj, self.kv_heads)), *rope_context)
        v_ctx = self._heads(context, self.v_proj, self.kv_heads)
        return q, k_block, v_block, k_ctx, v_ctx

    def _extend(self, cache: DraftCache, k_ctx: torch.Tensor,
                v_ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache's context keys and values for this layer followed by the new ones (cut to the window), kept
        in the cache and returned. The block is not kept: the next step's block re-enters at the new committed
        position."""
        past_k, past_v = cache.keys[self.layer], cache.values[self.layer]
        if past_k is not None:
            k_ctx, v_ctx = torch.cat([past_k, k_ctx], dim=2), torch.cat([past_v, v_ctx], dim=2)
        if self.window is not None:
            k_ctx, v_ctx = k_ctx[:, :, -self.window:], v_ctx[:, :, -self.window:]
        cache.keys[self.layer], cache.values[self.layer] = k_ctx, v_ctx
        return k_ctx, v_ctx

    def forward(
        self,
        x: torch.Tensor,  # [B, n, H] normed block hidden states
        context: torch.Tensor,  # [B, c, H] fused context features not yet in the cache
        rope_block: tuple[torch.Tensor, torch.Tensor],
        rope_context: tuple[torch.Tensor, torch.Tensor],
        cache: DraftCache | None,
        attention_mask: torch.Tensor | None,  # [B, 1, n, c_total + n] or [n, ...] bool, True = may attend (training)
    ) -> torch.Tensor:
        batch, n, _ = x.shape
        q, k_block, v_block, k_ctx, v_ctx = self._project(x, context, rope_block, rope_context)
        if cache is not None:
            k_ctx, v_ctx = self._extend(cache, k_ctx, v_ctx)
        if attention_mask is None:
            attention_mask = block_attention_mask(k_ctx.shape[2], n, self.window, self.causal, x.device)
        k = torch.cat([k_ctx, k_block], dim=2)
        v = torch.cat([v_ctx, v_block], dim=2)
        gqa = self.heads != self.kv_heads
        if gqa and attention_mask is not None:
            # training's packed mask: on CUDA, SDPA's kernels that take a mask do not take GQA, so mask plus
            # enable_gqa falls to the math path and its full score tensor; repeated heads keep a fused kernel
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
            gqa = False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=False, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(batch, n, self.heads * self.head_dim))


    def forward_rows(
        self,
        x: torch.Tensor,  # [R, n, H] normed block hidden states, one block per row
        context: torch.Tensor,  # [1, c_1 + ... + c_R, H] every row's new context features, row after row
        counts: list[int],  # c_r per row
        rope_block: tuple[torch.Tensor, torch.Tensor],
        rope_context: tuple[torch.Tensor, torch.Tensor],
        caches: list[DraftCache],  # one per row, each [1, g, past_r, d] per layer
    ) -> torch.Tensor:
        """`forward` for R sequences at once, each with its own cache and context length: the projections run
        once over every row, attention over each row's own context padded to the longest (masked)."""
        rows, n, _ = x.shape
        q, k_block, v_block, k_new, v_new = self._project(x, context, rope_block, rope_context)  # ctx: [1, g, sum c, d]
        keys, values, start = [], [], 0
        for cache, count in zip(caches, counts, strict=True):
            k_ctx, v_ctx = self._extend(cache, k_new[:, :, start: start + count], v_new[:, :, start: start + count])
            start += count
            keys.append(k_ctx)
            values.append(v_ctx)
        longest = max(k.shape[2] for k in keys)
        k = x.new_zeros(rows, self.kv_heads, longest + n, self.head_dim)  # [R, g, longest + n, d]
        v = torch.zeros_like(k)
        mask = torch.zeros(rows, 1, n, longest + n, dtype=torch.bool, device=x.device)
        for r, (k_ctx, v_ctx) in enumerate(zip(keys, values, strict=True)):
            c = k_ctx.shape[2]
            k[r, :, :c], v[r, :, :c] = k_ctx[0], v_ctx[0]
            row = block_attention_mask(c, n, self.window, self.causal, x.device)
            mask[r, 0, :, :c] = True if row is None else row[:, :c]
            mask[r, 0, :, longest:] = True if row is None else row[:, c:]
        k[:, :, longest:], v[:, :, longest:] = k_block, v_block
        gqa = self.heads != self.kv_heads
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(rows, n, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, context, rope_block, rope_context, cache, attention_mask, block: int) -> torch.Tensor:
        """`block`: positions per block along x's sequence axis (one block, or training's packed blocks); a
        DFlash layer mixes positions only by attention, so it needs no more than the mask says."""
        x = x + self.self_attn(self.input_layernorm(x), context, rope_block, rope_context, cache, attention_mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_rows(self, x, context, counts, rope_block, rope_context, caches) -> torch.Tensor:
        x = x + self.self_attn.forward_rows(self.input_layernorm(x), context, counts, rope_block, rope_context, caches)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(nn.Module):
    """Weights named exactly as in z-lab's checkpoints; no embeddings or LM head (they are the target's)."""

    #: the decoder layer (DFlash2's adds convolutions around each sublayer)
    layer_class: type[nn.Module] = DecoderLayer

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_hidden_layers))
        # specdec's tap_norm option (see DFlashConfig): one RMSNorm per tapped layer, before the fusion
        self.tap_norms = nn.ModuleList(RMSNorm(hidden, config.rms_norm_eps) for _ in config.target_layer_ids) \
            if config.tap_norm else None
        self.fc = nn.Linear(len(config.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)

    def scale_embeddings(self, block_embeds: torch.Tensor) -> torch.Tensor:
        """The whole block's embeddings (anchor and masks) x input_embedding_scale, as z-lab's code."""
        scale = self.config.input_embedding_scale
        return block_embeds if scale == 1 else block_embeds * scale

    def transform_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits as z-lab's `compute_logits` leaves them: x output_multiplier, then softcapped
        (cap * tanh(logits / cap)) when final_logit_softcapping > 0; in float32 when either applies."""
        config = self.config
        if not config.transforms_logits:
            return logits
        logits = logits.float() * config.output_multiplier
        cap = config.final_logit_softcapping or 0
        return torch.tanh(logits / cap) * cap if cap > 0 else logits

    def fuse_context(self, tapped: torch.Tensor) -> torch.Tensor:
        """[B, c, len(target_layer_ids) * H] target hidden states -> [B, c, H] context features."""
        if self.tap_norms is not None:
            taps = tapped.chunk(len(self.tap_norms), dim=-1)  # [B, c, H] each, in target_layer_ids' order
            tapped = torch.cat([norm(tap) for norm, tap in zip(self.tap_norms, taps, strict=True)], dim=-1)
        return self.hidden_norm(self.fc(tapped))

    def forward(
        self,
        block_embeds: torch.Tensor,  # [B, n, H] target embeddings of [last token, mask, ...]
        tapped: torch.Tensor,  # [B, c, len(target_layer_ids) * H] target hidden states not yet cached
        context_positions: torch.Tensor,  # [B, c]
        block_positions: torch.Tensor,  # [B, n]
        cache: DraftCache | None = None,
        attention_mask: torch.Tensor | None = None,  # [B, 1, n, c + n] or [n, c + n] bool (training: packed blocks)
        block_size: int | None = None,  # positions per block when n packs several (training); None: one block
    ) -> torch.Tensor:
        """Returns the final-normed block hidden states [B, n, H]; the target's LM head turns them to logits."""
        dtype = block_embeds.dtype
        context = self.fuse_context(tapped)
        rope_block = self.rotary(block_positions, dtype)
        rope_context = self.rotary(context_positions, dtype)
        x = self.scale_embeddings(block_embeds)
        block = block_size or x.shape[1]
        for layer in self.layers:
            x = layer(x, context, rope_block, rope_context, cache, attention_mask, block)
        return self.norm(x)

    def forward_rows(
        self,
        block_embeds: torch.Tensor,  # [R, n, H] target embeddings of each row's [last token, mask, ...]
        tapped: list[torch.Tensor],  # per row [1, c_r, len(target_layer_ids) * H] target states not yet cached
        context_positions: list[torch.Tensor],  # per row [1, c_r]
        block_positions: torch.Tensor,  # [R, n]
        caches: list[DraftCache],  # per row
    ) -> torch.Tensor:
        """`forward` for R sequences in one pass (a batch of rows with their own caches and context lengths):
        returns the final-normed block hidden states [R, n, H]."""
        dtype = block_embeds.dtype
        counts = [int(t.shape[1]) for t in tapped]
        context = self.fuse_context(torch.cat(tapped, dim=1))  # [1, sum c, H]: one product for every row
        rope_block = self.rotary(block_positions, dtype)
        rope_context = self.rotary(torch.cat(context_positions, dim=1), dtype)
        x = self.scale_embeddings(block_embeds)
        for layer in self.layers:
            x = layer.forward_rows(x, context, counts, rope_block, rope_context, caches)
        return self.norm(x)
