"""Time one DFlash draft step against one target verification step and one plain 1-token decoding step.

    python scripts/measure_dflash_step.py [--draft PATH] [--block-size N] [--dtype bfloat16|float32] [--repeats 30]
                                          [--cache auto|native|dynamic]

All are timed in the same process, interleaved, after a warm-up; medians are reported, with the draft's
KV-cache bytes per context token. When the draft has a reduced vocabulary (draft_vocab.json), the same
draft scoring the whole vocabulary is timed too, on the same inputs. A step pays off when
(draft + verification) / plain is below the mean acceptance length.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec import SpeculativeDecoder
from specdec.contracts import DecodeState, Verdict
from specdec_dflash.proposer import DFlashProposer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--draft", default=None)
    parser.add_argument("--block-size", type=int, default=None, help="default: the draft's")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--context", type=int, default=256, help="committed tokens before the timed step")
    parser.add_argument("--cache", default="auto", help="the target's KV cache (native: specdec's own forward)")
    args = parser.parse_args()
    options = {"tree_size": 0, "lookup": 0}  # the draft's own chain step; trees are measured by `specdec bench`
    if args.draft:
        options["draft"] = args.draft
    if args.block_size:
        options["block_size"] = args.block_size
    decoder = SpeculativeDecoder.from_pretrained(proposer="dflash", dtype=args.dtype, cache=args.cache, **options)
    target, proposer = decoder.target, decoder.proposer
    proposers = [proposer]
    if proposer.vocab_ids is not None:  # the same draft over the whole vocabulary, for comparison
        proposers.append(DFlashProposer(proposer.config.model_copy(update={"vocab": "full"}), target))
    block = proposer.block_size
    tokens = torch.randint(100, 40000, (1, args.context), generator=torch.Generator().manual_seed(0))
    draft_times, full_vocab_times, verify_times, plain_times = [], [], [], []
    out = target.prefill(tokens[:, :-1])
    for each in proposers:
        each.reset()
        each.prefill(DecodeState(tokens=tokens, max_draft_tokens=0, prompt_length=args.context - 1), out)
    for i in range(args.repeats + 3):
        state = DecodeState(tokens=tokens, max_draft_tokens=block - 1, prompt_length=args.context - 1)
        if len(proposers) > 1:
            t0 = time.perf_counter()
            proposers[1].propose(state)
            if i >= 3:
                full_vocab_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        draft = proposer.propose(state)
        t1 = time.perf_counter()
        out = target.forward(torch.cat([tokens[:, -1:], draft.tokens], dim=1))
        t2 = time.perf_counter()
        target.forward(tokens[:, -1:])  # a plain decoding step at the same context length, then undone
        t3 = time.perf_counter()
        target.crop(tokens.shape[1] - 1 + block)
        if i >= 3:  # warm-up
            draft_times.append(t1 - t0)
            verify_times.append(t2 - t1)
            plain_times.append(t3 - t2)
        # steady state: pretend the whole block was accepted, so every step adds block_size context tokens
        k = draft.num_tokens
        bonus = out.logits[:, -1:].argmax(-1)
        tokens = torch.cat([tokens, draft.tokens, bonus], dim=1)
        verdict = Verdict(num_accepted=torch.tensor([k]), emitted=torch.cat([draft.tokens, bonus], dim=1))
        for each in proposers:
            each.observe(DecodeState(tokens=tokens, max_draft_tokens=0, prompt_length=args.context - 1), verdict, out)
    cache = proposer.cache
    per_token = cache.nbytes() / max(1, cache.length())
    d, v, p = (statistics.median(t) * 1e3 for t in (draft_times, verify_times, plain_times))
    print(f"| {args.dtype} | {block} | {d:.1f} ms | {v:.1f} ms | {d / v:.2f} | {p:.1f} ms | {(d + v) / p:.2f} "
          f"| {per_token:.0f} B |")
    if full_vocab_times:
        f = statistics.median(full_vocab_times) * 1e3
        print(f"draft vocabulary {proposer.vocab_ids.numel()}: draft step {d:.1f} ms; the same draft over the whole "
              f"vocabulary: {f:.1f} ms ((draft + verification) / plain {(f + v) / p:.2f})")


if __name__ == "__main__":
    main()
