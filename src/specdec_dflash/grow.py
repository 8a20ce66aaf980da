"""Grow a trained DFlash or DFlash2 draft (deeper or wider) without changing what it drafts.

A one-layer draft that has seen all the data it can fit stops improving (docs/training.md, "Run 5"): its
training accuracy on fresh sequences is flat, so more data alone no longer helps and capacity is what is
missing. Starting a deeper draft from random weights would throw away the CPU-hours the shallow one cost.
Instead the trained layers are kept and new layers are appended, each a copy of the last trained layer with
its two residual outputs (attention's `o_proj`, the MLP's `down_proj`) set to zero. A zeroed output adds
nothing to the residual stream, and a DFlash2 layer's convolutions are linear in what they convolve, so the
deeper draft computes exactly the same hidden states, logits and selector scores as the shallow one until
training moves the new outputs away from zero (the zero-initialised residual branch of ReZero and of
GPT-2-style initialisations, applied to growth as in Net2Net's function-preserving "deeper" operator).

`widen` adds capacity across instead: every MLP gets more units, the new ones reading the input through
fresh gate and up rows and writing nothing yet (their `down_proj` columns zero), Net2Net's "wider" operator
in the same zero-residual form. Which is cheaper per draft step depends on the machine: timed alone with
its weights in cache, MLP units cost far less than a layer, but in decoding on a CPU the target's forward
evicts the draft's weights between steps and the cost follows the bytes read (docs/training.md, "Run 7").
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


def widen(draft: DFlashDraftModel, intermediate_size: int) -> DFlashDraftModel:
    """A draft whose MLPs have `intermediate_size` units (of `draft`'s type, device and dtype) that drafts what
    `draft` does: each MLP keeps its trained units and adds new ones whose outputs are zero."""
    config = draft.config
    have = config.intermediate_size
    if intermediate_size < have:
        raise SpecdecError(f"intermediate_size {intermediate_size} is smaller than the {have} MLP units of the "
                           f"draft to start from; a trained draft can be widened, not cut: use "
                           f"--opt intermediate_size={have} or more.")
    if intermediate_size == have:
        return draft
    parameter = next(draft.parameters())
    wider = type(draft)(type(config)(**(config.model_dump() | {"intermediate_size": intermediate_size})))
    wider = wider.to(device=parameter.device, dtype=parameter.dtype)
    state = draft.state_dict()
    generator = torch.Generator(device="cpu").manual_seed(intermediate_size)
    for i in range(config.num_hidden_layers):
        prefix = f"layers.{i}.mlp."
        for name in ("gate_proj", "up_proj"):  # [I, H]: new rows as spread as the trained ones, so the new
            trained = state[prefix + name + ".weight"]  # units switch on about as often as the old ones
            fresh = torch.randn(intermediate_size - have, trained.shape[1], generator=generator,
                                dtype=torch.float64) * trained.double().std()
            state[prefix + name + ".weight"] = torch.cat([trained, fresh.to(trained)], dim=0)
        down = state[prefix + "down_proj.weight"]  # [H, I]: the new units write nothing yet
        state[prefix + "down_proj.weight"] = torch.cat([down, down.new_zeros(down.shape[0], intermediate_size - have)],
                                                       dim=1)
    wider.load_state_dict(state, strict=True)
    return wider.train(draft.training)
