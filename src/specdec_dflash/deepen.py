"""Deepen a trained DFlash or DFlash2 draft without changing what it drafts.

A one-layer draft that has seen all the data it can fit stops improving (docs/training.md, "Run 5"): its
training accuracy on fresh sequences is flat, so more data alone no longer helps and capacity is what is
missing. Starting a deeper draft from random weights would throw away the CPU-hours the shallow one cost.
Instead the trained layers are kept and new layers are appended, each a copy of the last trained layer with
its two residual outputs (attention's `o_proj`, the MLP's `down_proj`) set to zero. A zeroed output adds
nothing to the residual stream, and a DFlash2 layer's convolutions are linear in what they convolve, so the
deeper draft computes exactly the same hidden states, logits and selector scores as the shallow one until
training moves the new outputs away from zero (the zero-initialised residual branch of ReZero and of
GPT-2-style initialisations, applied to growth as in Net2Net's function-preserving "deeper" operator).
"""

from __future__ import annotations

import torch

from specdec.errors import SpecdecError

from .model import DFlashDraftModel


def deepen(draft: DFlashDraftModel, num_layers: int) -> DFlashDraftModel:
    """A draft of `num_layers` layers (of `draft`'s type, device and dtype) that drafts what `draft` does."""
    config = draft.config
    have = config.num_hidden_layers
    if num_layers < have:
        raise SpecdecError(f"num_layers {num_layers} is fewer than the {have} layers of the draft to start from; "
                           f"a trained draft can be deepened, not cut: use --opt num_layers={have} or more.")
    if num_layers == have:
        return draft
    extra = num_layers - have
    fields = config.model_dump() | {"num_hidden_layers": num_layers}
    if config.layer_types is not None:  # the new layers attend as the last one does
        fields["layer_types"] = list(config.layer_types) + [config.layer_types[-1]] * extra
    parameter = next(draft.parameters())  # built in the draft's dtype, so that no weight is rounded on the way
    deeper = type(draft)(type(config)(**fields)).to(device=parameter.device, dtype=parameter.dtype)
    state = draft.state_dict()
    last = f"layers.{have - 1}."
    for i in range(have, num_layers):
        for key in [k for k in state if k.startswith(last)]:
            state[f"layers.{i}." + key[len(last):]] = state[key].clone()
    deeper.load_state_dict(state, strict=True)
    with torch.no_grad():
        for layer in deeper.layers[have:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return deeper.train(draft.training)
