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


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="4,16,64,128")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    hidden, inner = 576, 1536

    def weight(out_features: int, in_features: int) -> torch.Tensor:
        return (torch.randn(out_features, in_features, generator=generator) * 0.05).bfloat16()

    gate, up, down = weight(inner, hidden), weight(inner, hidden), weight(hidden, inner)
    q, k, v = weight(576, hidden), weight(192, hidden), weight(192, hidden)
    p_gate, p_up, p_down, p_q, p_k, p_v = map(pack, (gate, up, down, q, k, v))
    p_gate_up, p_qkv = pack(torch.cat([gate, up])), pack(torch.cat([q, k, v]))
    for rows in (int(r) for r in args.rows.split(",")):
        h = torch.randn(1, rows, hidden, generator=generator).bfloat16()
        x = torch.randn(1, rows, hidden, generator=generator).bfloat16()

        def mlp():
            g, u = linear(h, p_gate, None, "none", [], ""), linear(h, p_up, None, "none", [], "")
            return x + linear(F.silu(g) * u, p_down, None, "none", [], "")

        def mlp_post_ops():
            g = linear(h, p_gate, None, "swish", [], "")
            act = torch.ops.mkldnn._linear_pointwise.binary(h, g, p_up, None, "mul")
            return torch.ops.mkldnn._linear_pointwise.binary(act, x, p_down, None, "add")

        def mlp_gate_up():
            g, u = linear(h, p_gate_up, None, "none", [], "").split(inner, -1)
            return x + linear(F.silu(g) * u, p_down, None, "none", [], "")

        def qkv():
            return [linear(h, p, None, "none", [], "") for p in (p_q, p_k, p_v)]

        def qkv_one():
            return linear(h, p_qkv, None, "none", [], "").split([576, 192, 192], -1)

        reference = mlp().float()
        post_diff = (mlp_post_ops().float() - reference).abs().max().item()
        print(f"{rows} rows: MLP {median_us(mlp):.0f} us, post-ops {median_us(mlp_post_ops):.0f} us "
              f"(max diff {post_diff:.3g}), gate+up one product {median_us(mlp_gate_up):.0f} us; "
              f"q, k, v {median_us(qkv):.0f} us, as one product {median_us(qkv_one):.0f} us")


if __name__ == "__main__":
    main()
