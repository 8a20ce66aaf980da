"""One layer's projections at batched widths: as the native forward runs them, and fused two ways.

    python scripts/projection_fusions.py [--rows 4,16,64,128]

Random bf16 weights of the embedded target's layer shapes (hidden 576, MLP 1536, 9 query and 3 key-value
heads of 64), packed for oneDNN as specdec.prepacked packs them. Per width, the median microseconds of:
the MLP as the forward runs it (gate, up, SiLU x up, down, residual add); with oneDNN's post-ops (SiLU fused
into the gate product, the multiply and the residual add into the next product); with gate and up as one
product; and q, k, v as three products or one. Prints each fused variant's largest difference from the
unfused result (they round differently in bf16). docs/benchmarks.md, stop 28.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

pack = torch.ops.mkldnn._reorder_linear_weight
linear = torch.ops.mkldnn._linear_pointwise


def median_us(call, repeats: int = 200) -> float:
    for _ in range(10):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(rows: int, h: torch.Tensor, x: torch.Tensor, packed: dict[str, torch.Tensor]) -> None:
    """One width: h the normed input [1, rows, 576], x the residual stream; packed: the layer's weights."""
    p = packed

    def mlp():
        g, u = linear(h, p["gate"], None, "none", [], ""), linear(h, p["up"], None, "none", [], "")
        return x + linear(F.silu(g) * u, p["down"], None, "none", [], "")

    def mlp_post_ops():
        g = linear(h, p["gate"], None, "swish", [], "")
        act = torch.ops.mkldnn._linear_pointwise.binary(h, g, p["up"], None, "mul")
        return torch.ops.mkldnn._linear_pointwise.binary(act, x, p["down"], None, "add")

    def mlp_gate_up():
        g, u = linear(h, p["gate_up"], None, "none", [], "").chunk(2, -1)
        return x + linear(F.silu(g) * u, p["down"], None, "none", [], "")

    def qkv():
        return [linear(h, p[n], None, "none", [], "") for n in ("q", "k", "v")]

    def qkv_one():
        return linear(h, p["qkv"], None, "none", [], "").split([576, 192, 192], -1)

    reference = mlp().float()
    post_diff = (mlp_post_ops().float() - reference).abs().max().item()
    print(f"{rows} rows: MLP {median_us(mlp):.0f} us, post-ops {median_us(mlp_post_ops):.0f} us "
          f"(max diff {post_diff:.3g}), gate+up one product {median_us(mlp_gate_up):.0f} us; "
          f"q, k, v {median_us(qkv):.0f} us, as one product {median_us(qkv_one):.0f} us")


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="4,16,64,128")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    hidden, inner = 576, 1536

    def weight(out_features: int, in_features: int) -> torch.Tensor:
        return (torch.randn(out_features, in_features, generator=generator) * 0.05).bfloat16()

    weights = {"gate": weight(inner, hidden), "up": weight(inner, hidden), "down": weight(hidden, inner),
               "q": weight(576, hidden), "k": weight(192, hidden), "v": weight(192, hidden)}
    packed = {name: pack(w) for name, w in weights.items()}
    packed["gate_up"] = pack(torch.cat([weights["gate"], weights["up"]]))
    packed["qkv"] = pack(torch.cat([weights["q"], weights["k"], weights["v"]]))
    for rows in (int(r) for r in args.rows.split(",")):
        measure(rows, torch.randn(1, rows, hidden, generator=generator).bfloat16(),
                torch.randn(1, rows, hidden, generator=generator).bfloat16(), packed)


if __name__ == "__main__":
    main()
