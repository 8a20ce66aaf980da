"""A DFlash draft's hyper-parameters as z-lab's ``config.json`` holds them, resolved as z-lab's code resolves them."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, StrictBool, model_validator

from specdec.hidden_state import DraftLayerConfig

#: transformers' Qwen3Config default: layers from this index on are sliding_attention when layer_types is absent
QWEN3_MAX_WINDOW_LAYERS = 28

#: transformers' Qwen3Config default window, where `use_sliding_window` is true and `sliding_window` absent
QWEN3_SLIDING_WINDOW = 4096


class DFlashConfig(DraftLayerConfig):
    """The draft's hyper-parameters, as stored in a z-lab DFlash ``config.json`` (the layers' shape:
    DraftLayerConfig's)."""

    num_hidden_layers: int = Field(gt=0)
    rope_theta: float = 1_000_000.0
    block_size: int = Field(16, ge=2)
    mask_token_id: int = Field(ge=0)
    target_layer_ids: list[int]
    num_target_layers: int = Field(gt=0)
    vocab_size: int | None = None
    sliding_window: int | None = None
    # "full_attention" or "sliding_attention" per layer; None: the window (if any) on every layer
    layer_types: list[str] | None = None
    # attention inside the block: None = as z-lab's code: causal in sliding_attention layers, both ways elsewhere
    is_causal: StrictBool | None = None
    # z-lab's newer fields: block embeddings x input_embedding_scale; draft logits x output_multiplier, then
    # softcapped (cap * tanh(logits / cap)) when final_logit_softcapping > 0
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # specdec's own (not z-lab's): each tapped hidden state RMS-normalised, with its own weight, before `fc`.
    # The target's residual stream grows with depth and spikes at position 0 (RMS ~1000 in SmolLM2), so
    # unnormalised taps reach `fc` on very different scales. z-lab's code, vLLM and SGLang have no such norm:
    # specdec refuses to export a draft that uses it to their layouts.
    tap_norm: StrictBool = False

    @model_validator(mode="after")
    def _consistent(self) -> DFlashConfig:
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} "
                                 "layers")
            unknown = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
            if unknown:
                raise ValueError(f"layer_types holds {unknown[0]!r}; a DFlash layer is full_attention or "
                                 "sliding_attention")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window is {self.sliding_window}; it must be at least 1")
        return self

    def window_of(self, layer: int) -> int | None:
        """How many context positions layer `layer` sees (None: all)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def causal_of(self, layer: int) -> bool:
        """Whether block position i sees only block positions <= i in layer `layer` (the context it always sees).
        z-lab's rule: `is_causal` where the config sets it, else causal exactly in sliding_attention layers."""
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types is not None and self.layer_types[layer] == "sliding_attention"

    @property
    def transforms_logits(self) -> bool:
        return self.output_multiplier != 1 or (self.final_logit_softcapping or 0) > 0

    @staticmethod
    def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
        """Evenly spread taps from layer 1 to layer L-3 (the middle layer for a one-layer draft)."""
        if num_draft_layers == 1:
            return [num_target_layers // 2]
        span = num_target_layers - 4
        return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]

    #: keys z-lab's code reads from `dflash_config` first, then from the top level (`is_causal` it reads at the
    #: top level only; specdec.checkpoint checks a `dflash_config.is_causal` against that)
    DFLASH_KEYS: ClassVar[tuple[str, ...]] = (
        "mask_token_id", "target_layer_ids", "block_size", "input_embedding_scale", "output_multiplier",
        "final_logit_softcapping", "tap_norm")

    @classmethod
    def from_checkpoint_json(cls, raw: dict) -> DFlashConfig:
        """Read a z-lab config.json as z-lab's code does (through transformers' Qwen3Config): the DFLASH_KEYS
        from `dflash_config` before the top level; a window only where `use_sliding_window` is true, on the
        layers `layer_types` names sliding_attention (absent: the layers from `max_window_layers` (default 28)
        on); `auto_map` ignored."""
        flat = {k: v for k, v in raw.items() if k not in ("auto_map", "dflash_config")}
        dflash = raw.get("dflash_config") or {}
        for key in cls.DFLASH_KEYS:
            if key in dflash and dflash[key] is not None:
                flat[key] = dflash[key]
        # transformers' default window is 4096 where use_sliding_window asks for one and none is named
        window = raw.get("sliding_window", QWEN3_SLIDING_WINDOW) if raw.get("use_sliding_window") else None
        flat["sliding_window"] = window
        if flat.get("layer_types") is None and "num_hidden_layers" in flat:
            first = raw.get("max_window_layers")
            first = QWEN3_MAX_WINDOW_LAYERS if first is None else first
            flat["layer_types"] = ["sliding_attention" if window is not None and i >= first else "full_attention"
                                   for i in range(flat["num_hidden_layers"])]
        if "rope_theta" not in flat:
            rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
            if "rope_theta" in rope:
                flat["rope_theta"] = rope["rope_theta"]
        if not flat.get("target_layer_ids") and "num_target_layers" in flat and "num_hidden_layers" in flat:
            flat["target_layer_ids"] = cls.default_target_layer_ids(flat["num_target_layers"],
                                                                    flat["num_hidden_layers"])
        return cls.model_validate(flat)

    def to_checkpoint_json(self) -> dict:
        """The z-lab layout, which z-lab's code, vLLM and SGLang (`method: dflash`) read."""
        config = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            **self.layer_fields(),
            "num_hidden_layers": self.num_hidden_layers,
            "rope_theta": self.rope_theta,
            "vocab_size": self.vocab_size,
            "num_target_layers": self.num_target_layers,
            "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids),
                              "block_size": self.block_size},
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
        }
        n = self.num_hidden_layers
        # spelled out, so that every reader (z-lab's code, vLLM, SGLang) resolves the same attention per layer
        config["layer_types"] = list(self.layer_types) if self.layer_types is not None else \
            ["sliding_attention" if self.window_of(i) is not None else "full_attention" for i in range(n)]
        if self.is_causal is not None or self.layer_types is None:  # None with no layer_types: both ways
            config["is_causal"] = bool(self.is_causal)
        newer = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None,
                 "tap_norm": False}
        for key, default in newer.items():
            if getattr(self, key) != default:
                config["dflash_config"][key] = getattr(self, key)
        return config
