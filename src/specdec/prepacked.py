"""bfloat16 projections on a CPU with their weights laid out once in oneDNN's blocked format.

torch's CPU `F.linear` in bfloat16 passes oneDNN a row-major weight on every call. Laying each weight out once
in oneDNN's own format (`torch.ops.mkldnn._reorder_linear_weight`, the step torch.compile's CPU weight
freezing takes) and calling `_linear_pointwise` on it measured 20-35% faster for the few-row products of
decoding and verification on this project's 2-core CPU (embedded target: 1-token forward 32 -> 25 ms,
20-token 40 -> 33 ms), for one extra copy of the weights in memory.

Where oneDNN runs the same kernel for both, the results are bit-identical to `F.linear`'s. That is checked
on the machine, not assumed: a probe, on inputs built to expose the order of summation, compares the two
for every weight shape at the row counts decoding and verification use, and packing stays off if any bit
differs (32- and 64-wide products at one row do differ on this project's CPU). Larger products (prefill)
keep `F.linear`, where the kernel choice was seen to differ, unless the caller asks for no bit-identity (a
forward of several rows: INEXACT_MAX_ROWS). A weight changed in place or replaced after
packing is seen (version counter, storage, identity) and falls back to `F.linear` until `refresh()` packs it
again; a write through `.data` in place is not (as with torch.compile's frozen weights). Products that
need a gradient keep `F.linear`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

#: products of at most this many rows (batch x new tokens) use the packed weight: a tree step here, with its
#: prompt-lookup continuations, verifies up to ~47 tokens
MAX_ROWS = 64
#: the probe checks every row count the packed weights serve bit-identically
PROBE_ROWS = tuple(range(1, MAX_ROWS + 1))
#: products of up to this many rows use the packed weight where the caller needs no bit-identity to F.linear
#: (`linear(..., exact=False)`: a forward of several rows, whose logits already differ from each row's alone by
#: rounding): past MAX_ROWS oneDNN may sum in another order than F.linear's kernel (seen at 96 rows), as
#: accurately, and on this project's Intel CPU measured 1.5-1.6x faster on the embedded target's products at
#: 72-160 rows, 1.3x at 256 (a batch of 4 rows verifying 17-40 tokens each, or 16 rows verifying 5-16)
INEXACT_MAX_ROWS = 256


def _linear_pointwise(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def _key(weight: torch.Tensor) -> tuple[int, int]:
    # in-place changes bump the version counter; `.data = ...` and moves change the storage. Writes through
    # `.data` in place bump neither: call nothing of that kind on packed weights without building anew.
    return weight._version, weight.data_ptr()


def _available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def unpackable_reason(linears: list[nn.Linear]) -> str | None:
    """None when these projections can be packed; otherwise why not (before any probing)."""
    if not linears:
        return "there are no projections"
    if any(m.weight.device.type != "cpu" for m in linears):
        return "the weights are not on a CPU"
    if any(m.weight.dtype != torch.bfloat16 for m in linears):
        return "the weights are not bfloat16"
    if not all(hasattr(torch.ops.mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise")):
        return "this torch build lacks oneDNN's prepacked linear operators"
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return "this CPU or torch build has no oneDNN bfloat16 support"
    needed = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    available = _available_memory_bytes()
    if available is not None and needed > available // 2:
        return f"the packed copy ({needed >> 20} MiB) would take more than half the available memory"
    return None


def _probe_pair(out_features: int, in_features: int, has_bias: bool, rows: tuple[int, ...],
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """A weight and inputs whose products show the kernel's order of summation. Each input has 1 at two
    positions, one early and one late in the row, where every weight row holds +s and -s (s = 2^14..2^18):
    the pair cancels exactly, so the product is the sum of the other terms less what float32 dropped of them
    while s was in the running sum, an amount that depends on the order and is large enough to show after
    rounding to bfloat16."""
    weight = torch.randn(out_features, in_features, generator=generator)
    inputs = [torch.randn(1, n, in_features, generator=generator) for n in rows]
    if in_features >= 4:
        early = int(torch.randint(0, in_features // 4, (1,), generator=generator))
        late = int(torch.randint(in_features - in_features // 4, in_features, (1,), generator=generator))
        scale = torch.exp2(torch.randint(14, 19, (out_features,), generator=generator).float())
        weight[:, early], weight[:, late] = scale, -scale
        for x in inputs:
            x[..., early] = x[..., late] = 1.0
    bias = torch.randn(out_features, generator=generator).to(torch.bfloat16) if has_bias else None
    return weight.to(torch.bfloat16), bias, [x.to(torch.bfloat16) for x in inputs]


class PrepackedLinears:
    """Packed copies of some nn.Linear modules' weights, and a `linear(x, module)` that uses them.

    `enabled` is False (and `reason` says why) when packing does not apply or the probe found a difference;
    `linear` is then plain `F.linear`.
    """

    def __init__(self, linears: list[nn.Linear]) -> None:
        self._packed: dict[nn.Linear, tuple[torch.Tensor, tuple[int, int], torch.Tensor]] = {}
        self.reason = unpackable_reason(linears)
        if self.reason is None:
            self.reason = self._probe(linears)
        if self.reason is None:
            self._linears = list(dict.fromkeys(linears))
            self.refresh()

    @property
    def enabled(self) -> bool:
        return self.reason is None

    @torch.inference_mode()
    def _probe(self, linears: list[nn.Linear]) -> str | None:
        generator = torch.Generator().manual_seed(0)
        shapes = dict.fromkeys((*m.weight.shape, m.bias is not None) for m in linears)
        for out_features, in_features, has_bias in shapes:
            # a trial tests every output column, so narrow weights get more trials
            for _ in range(min(32, max(1, 2048 // out_features))):
                weight, bias, inputs = _probe_pair(out_features, in_features, has_bias, PROBE_ROWS, generator)
                packed = _pack(weight)
                for x in inputs:
                    if not torch.equal(_linear_pointwise(x, packed, bias), F.linear(x, weight, bias)):
                        return (f"oneDNN's packed product differs from F.linear on this machine "
                                f"({out_features}x{in_features} weight, {x.shape[1]} rows)")
        return None

    @torch.inference_mode()
    def refresh(self) -> None:
        """Pack again any weight changed in place or replaced since it was packed."""
        if not self.enabled:
            return
        for module in self._linears:
            weight = module.weight
            if weight.is_inference():  # no version counter to tell a change by: never packed
                self._packed.pop(module, None)
                continue
            entry = self._packed.get(module)
            if entry is None or entry[0] is not weight or entry[1] != _key(weight):
                self._packed[module] = (weight, _key(weight), _pack(weight))

    def linear(self, x: torch.Tensor, module: nn.Linear, exact: bool = True) -> torch.Tensor:
        """module's product with x, packed where that is bit-identical to F.linear (at most MAX_ROWS rows), or,
        with `exact` False, where it is as accurate (at most INEXACT_MAX_ROWS rows)."""
        weight = module.weight
        entry = self._packed.get(module)
        most = MAX_ROWS if exact else INEXACT_MAX_ROWS
        if (entry is None or entry[0] is not weight or entry[1] != _key(weight)
                or x.numel() > most * x.shape[-1] or not x.is_contiguous() or x.dtype != torch.bfloat16
                or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):  # no backward
            return F.linear(x, weight, module.bias)
        return _linear_pointwise(x, entry[2], module.bias)


def route_through_packed(modules: list[nn.Module]) -> PrepackedLinears:
    """Make every nn.Linear inside these inference-only modules (a loaded draft model) compute with packed
    weights: each one's `forward` becomes `PrepackedLinears.linear`. Not for modules being trained: the
    packed product has no gradient. Returns the packs (`enabled` False: nothing was changed)."""
    linears = [m for module in modules for m in module.modules() if type(m) is nn.Linear]
    packs = PrepackedLinears(linears)
    if packs.enabled:
        for module in linears:
            module.forward = functools.partial(packs.linear, module=module)
    return packs
