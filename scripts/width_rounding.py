"""Does the width of a bf16 forward alone decide a greedy choice? For a divergence that `specdec bench` could not
certify as a near-tie: decode a dataset prompt plainly in bf16 up to POSITION, then score the next token by
forwards of different widths over the same prefix (a cached prefix, then the last W tokens in one forward; W=0:
one forward over everything), in bf16 and in float32, and print the two tokens' logits and the top 3.

    python scripts/width_rounding.py --dataset mt_bench --id 90 --position 57 --tokens 284,2

If bf16's choice flips with the width while float32's does not, the divergence is rounding of the verification
forward (whose width differs from plain decoding's one token), not a lossless failure; confirm with the same
runner in float32, which must match plain decoding exactly."""

from __future__ import annotations

import argparse

import torch

from specdec import SpeculativeDecoder
from specdec.bench.datasets import load_dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--id", required=True, help="the prompt's id in the dataset (its first turn is used)")
    parser.add_argument("--position", type=int, required=True, help="generated tokens before the divergence")
    parser.add_argument("--tokens", required=True, help="the two competing token ids, comma-separated")
    parser.add_argument("--widths", default="0,1,8,20")
    args = parser.parse_args()
    first, second = (int(t) for t in args.tokens.split(","))
    _, prompts = load_dataset(args.dataset)
    prompt = next(p for p in prompts if p.id == args.id).turns[0]
    plain = SpeculativeDecoder.from_pretrained(proposer="autoregressive", dtype="bfloat16")
    generated = plain.generate(prompt, max_new_tokens=args.position).token_ids
    seq = torch.tensor([plain.encode_prompt(prompt)[0].tolist() + generated[:args.position]])
    for dtype in (torch.bfloat16, torch.float32):
        model = plain.target.model.to(dtype)
        for width in (int(w) for w in args.widths.split(",")):
            with torch.no_grad():
                if width == 0:
                    logits = model(seq).logits[0, -1].float()
                else:
                    cached = model(seq[:, :-width], use_cache=True).past_key_values
                    logits = model(seq[:, -width:], past_key_values=cached).logits[0, -1].float()
            top = logits.topk(3)
            print(f"{str(dtype)[6:]:8} width {width or 'all':>3}: {first} {float(logits[first]):.3f}  "
                  f"{second} {float(logits[second]):.3f}  top 3 {top.indices.tolist()} "
                  f"{[round(v, 3) for v in top.values.tolist()]}")


if __name__ == "__main__":
    main()
