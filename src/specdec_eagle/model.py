"""The EAGLE-3 draft model (Li et al. 2025, arXiv 2503.01840), top to bottom in one file.

One Llama decoder layer drafts token by token. At position i its input is two vectors of width H side
by side: the embedding of token i + 1 and a *feature* for position i, and it predicts token i + 2.
The feature is, for positions the target has read, the target's hidden states at three layers (low,
middle, high) fused by ``fc`` (3H -> H); for positions the draft is guessing, the draft's own output at
the previous position ("training-time test": the draft is trained on its own outputs, so its guesses
stay good several tokens deep). The attention projections read the 2H-wide input; everything after is
a plain Llama layer of width H. The head scores a reduced draft vocabulary (``draft_vocab_size``);
``d2t`` maps a draft index to a target id as an offset (target id = index + d2t[index]).

Weights and config are named as EAGLE-3's reference code, SpecForge and vLLM's ``LlamaForCausalLMEagle3``
name them (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``); the embeddings are the
target's. Shapes: B batch, n new positions, c cached positions, H hidden, h heads, g key/value heads,
d head dim, V' draft vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from specdec.hidden_state import DraftLayerConfig


class Eagle3Config(DraftLayerConfig):
    """The draft's hyper-parameters (the layer's shape: DraftLayerConfig's). `target_layer_ids` are specdec
    tap ids (the output of decoder layer L); the checkpoint stores them as vLLM's
    `eagle_aux_hidden_state_layer_ids` (the input of layer L + 1)."""

    rope_theta: float = 10_000.0
    vocab_size: int = Field(gt=0)
    draft_vocab_size: int = Field(gt=0)
    # None in a SpecForge config that names neither: vLLM then takes its default from the target, and so
    # does `for_target`
    target_layer_ids: list[int] | None = None
    num_target_layers: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> Eagle3Config:
        if self.target_layer_ids is not None and not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size ({self.draft_vocab_size}) exceeds vocab_size ({self.vocab_size})")
        return self

    @staticmethod
    def default_target_layer_ids(num_target_layers: int) -> list[int]:
        """EAGLE-3's low, middle and high layers: outputs of layers 1, L/2 - 1 and L - 4 (SpecForge's choice,
        vLLM's default aux layers (2, L/2, L - 3) counted as inputs)."""
        picks = [1, num_target_layers // 2 - 1, num_target_layers - 4]
        # repeats kept (a shallow target), as vLLM keeps them: fc always reads three states
        return [min(max(i, 0), num_target_layers - 1) for i in picks]

    def for_target(self, num_target_layers: int) -> Eagle3Config:
        """This config with the target's depth filled in where the checkpoint left it out."""
        layers = self.num_target_layers or num_target_layers
        taps = self.target_layer_ids or self.default_target_layer_ids(layers)
        return self.model_copy(update={"num_target_layers": layers, "target_layer_ids": taps})

    @classmethod
    def from_checkpoint_json(cls, raw: dict) -> Eagle3Config:
        """Read SpecForge's / vLLM's config.json, whose fields specdec_eagle.checkpoint.read_config has checked
        (each one read here, known to be inert, or set to a value this draft implements)."""
        flat = {k: v for k, v in raw.items() if k not in ("eagle_config", "auto_map")}
        eagle = raw.get("eagle_config") or {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"))
        if aux is not None:
            flat["target_layer_ids"] = [int(i) - 1 for i in aux]
        flat.setdefault("draft_vocab_size", flat.get("vocab_size"))
        if flat.get("head_dim") is None and flat.get("hidden_size") and flat.get("num_attention_heads"):
            flat["head_dim"] = flat["hidden_size"] // flat["num_attention_heads"]
        if "rope_theta" not in flat:
            rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
            if "rope_theta" in rope:
                flat["rope_theta"] = rope["rope_theta"]
        flat.pop("rope_scaling", None)
        return cls.model_validate(flat)

    def to_checkpoint_json(self) -> dict:
        """The layout SpecForge writes and vLLM / SGLang serve (`method: eagle3`)."""
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "num_hidden_layers": 1,
            **self.layer_fields(),
            "rope_theta": self.rope_theta,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.hidden_size,
            "num_target_layers": self.num_target_layers,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i + 1 for i in self.target_layer_ids],
                             "use_aux_hidden_state": True},
        }


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


class Eagle3Cache:
    """Rotated keys and values [B, g, c, d] of every position the draft has read; `crop` drops guesses."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def length(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[2])

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is not None:
            keys, values = torch.cat([self.keys, keys], dim=2), torch.cat([self.values, values], dim=2)
        self.keys, self.values = keys, values
        return keys, values

    def crop(self, length: int) -> None:
        if self.keys is not None and self.keys.shape[2] > length:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]


def causal_after(past: int, n: int, device: torch.device) -> torch.Tensor:
    """[n, past + n] bool: n new positions see every cached one and, among themselves, their predecessors."""
    mask = torch.ones(n, past + n, dtype=torch.bool, device=device)
    mask[:, past:] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return mask


class Attention(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        h, g, d, hidden = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.hidden_size
        self.heads, self.kv_heads, self.head_dim = h, g, d
        self.q_proj = nn.Linear(2 * hidden, h * d, bias=False)
        self.k_proj = nn.Linear(2 * hidden, g * d, bias=False)
        self.v_proj = nn.Linear(2 * hidden, g * d, bias=False)
        self.o_proj = nn.Linear(h * d, hidden, bias=False)

    def _heads(self, x: torch.Tensor, proj: nn.Linear, heads: int) -> torch.Tensor:
        return proj(x).view(x.shape[0], x.shape[1], heads, self.head_dim).transpose(1, 2)  # [B, heads, n, d]

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """x [B, n, 2H] -> rotated q [B, h, n, d], rotated k and v [B, g, n, d]."""
        q = apply_rope(self._heads(x, self.q_proj, self.heads), *rope)
        k = apply_rope(self._heads(x, self.k_proj, self.kv_heads), *rope)
        return q, k, self._heads(x, self.v_proj, self.kv_heads)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """[B, h, n, d] attention output -> [B, n, H]."""
        batch, _, n, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(batch, n, self.heads * self.head_dim))

    def forward(self, x: torch.Tensor, rope, cache: Eagle3Cache, mask: torch.Tensor | None) -> torch.Tensor:
        """Inference: x [B, n, 2H] after the c cached positions; `mask` [n, c + n] bool (None: n == 1 sees all)."""
        q, k, v = self.project(x, rope)
        k, v = cache.append(k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        return self.output(out)

    def forward_unrolled(self, x: torch.Tensor, rope, earlier: list[tuple[torch.Tensor, torch.Tensor]]
                         ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Training, unrolled step j = len(earlier) over every row i of a sequence at once.

        Row i stands for drafting j tokens past position i: it sees step 0's keys at rows <= i (what the
        target read) and its own keys from steps 1..j (its earlier guesses), exactly the keys the chain
        proposer's query at position i + j sees. earlier: (k, v) of steps 0..j-1, [B, g, T, d] each; the
        first entry is step 0's (an empty list: this is step 0). Returns the output [B, T, H] and this step's
        (k, v).
        """
        q, k, v = self.project(x, rope)
        groups = self.heads // self.kv_heads
        if not earlier:  # step 0: plain causal attention
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups > 1)
            return self.output(out), (k, v)
        scale = self.head_dim ** -0.5
        k0, v0 = (t.repeat_interleave(groups, dim=1) for t in earlier[0])  # [B, h, T, d]
        scores = (q @ k0.transpose(-1, -2)) * scale  # [B, h, T, T]
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        # steps 1..j: each row sees only its own key of each step (the diagonal)
        diagonal = [(kk.repeat_interleave(groups, dim=1), vv.repeat_interleave(groups, dim=1))
                    for kk, vv in earlier[1:] + [(k, v)]]
        own = torch.stack([(q * kk).sum(-1) * scale for kk, _ in diagonal], dim=-1)  # [B, h, T, j]
        rows = scores.shape[-1]
        wide = torch.promote_types(q.dtype, torch.float32)  # the softmax in float32 at least (bf16 autocast)
        probs = torch.cat([scores.to(wide), own.to(wide)], dim=-1).softmax(dim=-1).to(q.dtype)
        out = probs[..., :rows] @ v0
        for s, (_, vv) in enumerate(diagonal):
            out = out + probs[..., rows + s: rows + s + 1] * vv
        return self.output(out), (k, v)


class MLP(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The decoder layer: [norm(embedding), norm(feature)] -> attention (2H in, H out) -> MLP, with the
    feature as the residual stream."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def joined(self, embeds: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(feature)], dim=-1)

    def finish(self, feature: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        x = feature + attended
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3DraftModel(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * hidden, hidden, bias=False)
        self.midlayer = MidLayer(config)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        # draft index -> target id offset, and the target ids the draft can propose (EAGLE-3's tables)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool)
                             if config.draft_vocab_size == config.vocab_size
                             else torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)

    def set_vocabulary(self, token_ids: torch.Tensor) -> None:
        """Draft index i proposes target id token_ids[i] (ascending, draft_vocab_size of them)."""
        token_ids = token_ids.to(self.d2t.device)
        self.d2t.copy_(token_ids - torch.arange(token_ids.numel(), device=token_ids.device))
        self.t2d.zero_()
        self.t2d[token_ids] = True

    def target_ids(self, draft_indices: torch.Tensor) -> torch.Tensor:
        return draft_indices + self.d2t[draft_indices]

    def fuse(self, tapped: torch.Tensor) -> torch.Tensor:
        """[B, n, len(target_layer_ids) * H] target hidden states -> [B, n, H] features."""
        return self.fc(tapped)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] draft outputs -> [..., V'] logits over the draft vocabulary."""
        return self.lm_head(self.norm(hidden))

    def forward(
        self,
        embeds: torch.Tensor,  # [B, n, H] target embeddings of tokens i + 1
        features: torch.Tensor,  # [B, n, H] fused target states at i, or the draft's outputs at i - 1
        positions: torch.Tensor,  # [B, n]
        cache: Eagle3Cache,
        mask: torch.Tensor | None = None,  # [n, c + n] bool, True = may attend; default: causal
    ) -> torch.Tensor:
        """Inference: n new positions after the cache's, causal among themselves unless `mask` says
        otherwise (a tree's nodes see only their ancestors). Returns the outputs [B, n, H] that are both
        the next feature and, through `logits`, the prediction of token i + 2."""
        layer = self.midlayer
        n = embeds.shape[1]
        if mask is None and n > 1:
            mask = causal_after(cache.length(), n, embeds.device)
        rope = self.rotary(positions, embeds.dtype)
        attended = layer.self_attn(layer.joined(embeds, features), rope, cache, mask)
        return layer.finish(features, attended)

    def forward_rows(
        self,
        embeds: torch.Tensor,  # [1, S, H] every row's new positions, row after row (S = sum of counts)
        features: torch.Tensor,  # [1, S, H]
        positions: torch.Tensor,  # [1, S]
        counts: list[int],  # n_r new positions per row
        caches: list[Eagle3Cache],  # one per row
        masks: list[torch.Tensor | None],  # per row [n_r, c_r + n_r] bool, or None: causal
    ) -> torch.Tensor:
        """`forward` for R sequences at once, each with its own cache, count and mask: the projections, the MLP
        and (through `logits`) the head run once over every row's positions; attention row by row. Returns the
        outputs [1, S, H]."""
        layer, attn = self.midlayer, self.midlayer.self_attn
        q, k, v = attn.project(layer.joined(embeds, features), self.rotary(positions, embeds.dtype))
        out, start = [], 0  # q [1, h, S, d]; k, v [1, g, S, d]
        for cache, n, mask in zip(caches, counts, masks, strict=True):
            if mask is None and n > 1:
                mask = causal_after(cache.length(), n, embeds.device)
            rows = slice(start, start + n)
            keys, values = cache.append(k[:, :, rows].contiguous(), v[:, :, rows].contiguous())
            mask = None if mask is None else mask.to(embeds.device)
            out.append(F.scaled_dot_product_attention(q[:, :, rows], keys, values, attn_mask=mask,
                                                      enable_gqa=attn.heads != attn.kv_heads))
            start += n
        return layer.finish(features, attn.output(torch.cat(out, dim=2)))

    def forward_unrolled(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                         earlier: list[tuple[torch.Tensor, torch.Tensor]]):
        """Training step j = len(earlier) (see `Attention.forward_unrolled`): embeds, features, positions
        [B, T, ...] for every row; returns the outputs [B, T, H] and this step's keys and values."""
        layer = self.midlayer
        rope = self.rotary(positions, embeds.dtype)
        attended, kv = layer.self_attn.forward_unrolled(layer.joined(embeds, features), rope, earlier)
        return layer.finish(features, attended), kv
