"""Time torch's fused attention (SDPA, per-row mask) against specdec's grouped and folded attention per layer call.

    python scripts/attention_kernels.py [--rows 4,16] [--queries 1,2,4,8] [--context 300] [--dtype bfloat16]

The embedded target's attention shape (9 query heads, 3 key heads of 64); each row holds a different number
of cached positions (context - b for row b), read as a slice of a longer cache buffer, as the native forward
reads it; mean microseconds per call over 200 calls after a warm-up (docs/benchmarks.md, stops 26 and 27).
"folded" is the same fused kernel with each key head's query heads folded into its queries
(`specdec.native.folded_attention`, taken for 2 or more new tokens per row).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from specdec.native import fold_mask, folded_attention, grouped_attention
from specdec.native_cache import row_mask


def microseconds(call, repeats: int = 200) -> float:
    for _ in range(10):
        call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="4,16")
    parser.add_argument("--queries", default="1,2,4,8")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    heads, kv_heads, dim = 9, 3, 64
    generator = torch.Generator().manual_seed(0)
    print("| rows x new tokens | fused (SDPA) | grouped | folded |\n| --- | ---: | ---: | ---: |")
    for rows in (int(r) for r in args.rows.split(",")):
        lengths = [args.context - b for b in range(rows)]
        for n in (int(q) for q in args.queries.split(",")):
            total = max(lengths) + n
            q = torch.randn(rows, heads, n, dim, generator=generator).to(dtype)
            k, v = (torch.randn(rows, kv_heads, 2 * total, dim, generator=generator).to(dtype)[:, :, :total]
                    for _ in range(2))
            mask = row_mask(lengths, n, None, torch.device("cpu"))  # [rows, n, total]
            fused = microseconds(lambda q=q, k=k, v=v, mask=mask: F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask[:, None], scale=dim ** -0.5, enable_gqa=True))
            grouped = microseconds(lambda q=q, k=k, v=v, mask=mask: grouped_attention(q, k, v, mask, dim ** -0.5))
            folded_mask = fold_mask(mask, heads // kv_heads)
            folded = microseconds(lambda q=q, k=k, v=v, m=folded_mask: folded_attention(q, k, v, m, dim ** -0.5))
            print(f"| {rows} x {n} | {fused:.0f} us | {grouped:.0f} us | {folded:.0f} us |")


if __name__ == "__main__":
    main()
