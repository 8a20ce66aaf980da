"""The DFlash2 draft model (z-lab, 2026-08), top to bottom: DFlash with convolutions and a candidate selector.

DFlash2 keeps DFlash's block, context features and KV injection (specdec_dflash.model) and adds two things:

1. In every layer, a **grouped dynamic causal convolution** around each sublayer, inside the residual branch:
   the normed input is convolved along the block before attention (and before the MLP), and the sublayer's
   output is convolved again after it. Tap j of output position t multiplies the input at t - j (j = 0 is t
   itself; nothing before the block's first position), with a learned base kernel per channel plus a
   per-position part projected from the normed input, shared by a group of ``conv_group_size`` channels:
   ``out[t, c] = sum_j (base[s, j, c] + proj(h[t])[s, j, c // group]) * x[t - j, c]`` with s = 0 before the
   sublayer and s = 1 after it, both kernels computed from the sublayer's normed input h.
2. A **candidate selector**: at each draft slot, the ``selector_top_k`` likeliest tokens of the (transformed)
   draft logits are rescored with a low-rank bilinear term between the token before (the anchor at slot 1,
   then the token chosen at the slot before), the slot's hidden state and the candidate:
   ``score(c) = logit(c) + sum_r pred[prev, r] * (W h)[r] * succ[c, r]``, walking the block left to right.
   At temperature T > 0 the draft distribution of a slot is softmax(score / T) over its k candidates.

Weights are named as z-lab's checkpoints store them (``layers.{i}.attention_conv.base_kernel``, the selector's
codebooks as bare ``candidate_selector.predecessor_codebook``/``successor_codebook``).

Shapes: B batch, n positions, H hidden, K taps, G groups (H / conv_group_size), V vocabulary, r selector rank,
k candidates, S draft slots.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from .model import MLP, Attention, DFlashConfig, DFlashDraftModel, RMSNorm


class DFlash2Config(DFlashConfig):
    """DFlash's fields plus the convolution's and the selector's, as in a z-lab DFlash2 ``config.json``."""

    conv_kernel_size: int = Field(ge=1)
    conv_group_size: int = Field(ge=1)
    selector_rank: int = Field(ge=1)
    selector_top_k: int = Field(ge=1)
    vocab_size: int = Field(gt=0)  # the selector's codebooks have a row per token

    DFLASH_KEYS: ClassVar[tuple[str, ...]] = DFlashConfig.DFLASH_KEYS + (
        "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")

    @model_validator(mode="after")
    def _groups_divide(self) -> DFlash2Config:
        if self.hidden_size % self.conv_group_size:
            raise ValueError(f"conv_group_size ({self.conv_group_size}) must divide hidden_size "
                             f"({self.hidden_size}): it is the number of channels per group")
        return self

    def to_checkpoint_json(self) -> dict:
        config = super().to_checkpoint_json()
        config["architectures"] = ["DFlash2DraftModel"]
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            config["dflash_config"][key] = getattr(self, key)
        return config


def grouped_dynamic_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int,
                         block: int) -> torch.Tensor:
    """out[t, c] = sum_j (base[j, c] + dynamic[t, j, c // group_size]) * x[t - j, c], taps never reaching
    before the start of t's block.

    x [B, n, H] with n a whole number of blocks of `block` positions; dynamic [B, n, K, G]; base [K, H]."""
    batch, n, hidden = x.shape
    taps, groups = base.shape[0], hidden // group_size
    xs = x.view(batch, n // block, block, groups, group_size)
    dyn = dynamic.reshape(batch, n // block, block, taps, groups, 1)
    out = torch.zeros_like(xs)
    for j in range(min(taps, block)):  # a tap past the block's length only ever reads before its start
        shifted = xs if j == 0 else F.pad(xs[:, :, : block - j], (0, 0, 0, 0, j, 0))  # x[t - j], zero before 0
        out = out + (base[j].view(groups, group_size).to(x.dtype) + dyn[:, :, :, j]) * shifted
    return out.view(batch, n, hidden)


class GroupedDynamicCausalConv(nn.Module):
    """The convolution around one sublayer: side 0 before it (`prepare`), side 1 after it (`finish`)."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden))  # [side, K, H]
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * self.groups, bias=False)

    def reset_to_identity(self) -> None:
        """Tap 0 = 1, nothing else: the layer starts as DFlash's (SpecForge's initialisation)."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1
            self.kernel_projection.weight.zero_()

    def prepare(self, h: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """h [B, n, H] normed sublayer input -> (h convolved, the side-1 kernel [B, n, K, G] for `finish`)."""
        dynamic = self.kernel_projection(h).view(*h.shape[:-1], 2, self.kernel_size, self.groups)
        return grouped_dynamic_conv(h, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size, block), \
            dynamic[..., 1, :, :]

    def finish(self, out: torch.Tensor, dynamic: torch.Tensor, block: int) -> torch.Tensor:
        return grouped_dynamic_conv(out, dynamic, self.base_kernel[1], self.group_size, block)


class DFlash2DecoderLayer(nn.Module):
    def __init__(self, config: DFlash2Config, layer: int) -> None:
        super().__init__()
        hidden, taps, group = config.hidden_size, config.conv_kernel_size, config.conv_group_size
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.attention_conv = GroupedDynamicCausalConv(hidden, taps, group)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.mlp_conv = GroupedDynamicCausalConv(hidden, taps, group)
        self.mlp = MLP(config)

    def forward(self, x, context, rope_block, rope_context, cache, attention_mask, block: int) -> torch.Tensor:
        h, kernel = self.attention_conv.prepare(self.input_layernorm(x), block)
        attended = self.self_attn(h, context, rope_block, rope_context, cache, attention_mask)
        x = x + self.attention_conv.finish(attended, kernel, block)
        h, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(x), block)
        return x + self.mlp_conv.finish(self.mlp(h), kernel, block)

    def forward_rows(self, x, context, counts, rope_block, rope_context, caches) -> torch.Tensor:
        block = x.shape[1]  # one block per row
        h, kernel = self.attention_conv.prepare(self.input_layernorm(x), block)
        attended = self.self_attn.forward_rows(h, context, counts, rope_block, rope_context, caches)
        x = x + self.attention_conv.finish(attended, kernel, block)
        h, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(x), block)
        return x + self.mlp_conv.finish(self.mlp(h), kernel, block)


class CandidateSelector(nn.Module):
    """Rescores each slot's top-k draft tokens by the token before them (module docstring, point 2)."""

    def __init__(self, config: DFlash2Config) -> None:
        super().__init__()
        rank, vocab = config.selector_rank, config.vocab_size
        self.top_k = config.selector_top_k
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, rank))  # [V, r]
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))  # [V, r]

    def edge_factors(self, hidden: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """hidden [..., S, H] final-normed slot states, candidates [..., S, k] token ids -> [..., S, k, r]:
        succ[c] * (W h), so that a slot's scores given predecessor p are unary + factors @ pred[p]."""
        projected = self.hidden_projection(hidden).float()  # [..., S, r]
        return self.successor_codebook[candidates].float() * projected.unsqueeze(-2)  # float32, as training

    def scores(self, unary: torch.Tensor, factors: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """One slot's candidate scores for each of M predecessors: unary [..., k], factors [..., k, r], previous
        [..., M] token ids -> [..., M, k] (float32; the leading dimensions, if any, are rows scored at once)."""
        edge = self.predecessor_codebook[previous].float() @ factors.transpose(-1, -2)  # [..., M, k]
        return unary.float().unsqueeze(-2) + edge


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash's draft with DFlash2 layers and a candidate selector; no embeddings or LM head (the target's)."""

    layer_class = DFlash2DecoderLayer

    def __init__(self, config: DFlash2Config) -> None:
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config)
