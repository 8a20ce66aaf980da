#!/usr/bin/env python
"""GPU check of the verification kernels (meant for the device tool's H200, when one is lent).

1. Runs tests/test_kernels.py and tests/test_ragged_verify.py on CUDA (compiled kernels, not the interpreter).
2. At B in {1, 32, 128}, k in {7, 15}, V in {49152, 151936}, bf16 and fp32 inputs: checks each Triton kernel
   gives exactly the torch reference's output, times both, and prints a Markdown table.

Bandwidth: "GB/s" is the bytes the op must read divided by the time, the same numerator for both columns.
greedy: the logits, B*(k+1)*V elements. rejection (draft_probs given): p and q at the race position plus the
float64 exponentials, B*V*(2*itemsize + 8); the k gathered scalars are negligible. The fraction is of the
card's peak (H200: 4.8 TB/s; --peak-tbps to change). L2 (50 MB on H200) is flushed before every timed call.

Without CUDA it prints a one-line note and exits 0.

    python scripts/gpu_kernels.py [--skip-tests] [--quick] [--peak-tbps 4.8] [--markdown table.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # this script is about the compiled kernels

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run_tests(examples: int) -> int:
    env = {**os.environ, "SPECDEC_KERNEL_TEST_DEVICE": "cuda", "SPECDEC_KERNEL_TEST_EXAMPLES": str(examples)}
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "pytest", str(ROOT / "tests" / "test_kernels.py"),
           str(ROOT / "tests" / "test_ragged_verify.py"), "-q", "-x", "-p", "no:cacheprovider"]
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=ROOT, env=env)
    print(f"kernel tests on CUDA: exit {result.returncode} in {time.perf_counter() - start:.0f} s", flush=True)
    return result.returncode


class Timer:
    """Median milliseconds of `fn()`: CUDA events with L2 flushed before each call (wall clock on the CPU)."""

    def __init__(self, device: str, budget_ms: float):
        self.cuda = device == "cuda"
        self.budget_ms = budget_ms
        self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda") if self.cuda else None

    def _once(self, fn) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        self.flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def __call__(self, fn) -> float:
        for _ in range(2):
            fn()  # compile / warm up
        if self.cuda:
            torch.cuda.synchronize()
        times: list[float] = []
        while len(times) < 3 or (sum(times) < self.budget_ms and len(times) < 50):
            times.append(self._once(fn))
        return statistics.median(times)


def greedy_inputs(batch: int, k: int, vocab: int, dtype: torch.dtype, gen: torch.Generator):
    dev = gen.device
    logits = torch.randn(batch, k + 1, vocab, device=dev, generator=gen, dtype=torch.float32).mul_(3).to(dtype)
    draft = logits[:, :k].argmax(-1)
    flip = torch.rand(batch, k, device=dev, generator=gen) < 0.2  # some rejections
    draft = torch.where(flip, (draft + 1) % vocab, draft)
    return logits, draft


def rejection_inputs(batch: int, k: int, vocab: int, dtype: torch.dtype, gen: torch.Generator):
    dev = gen.device
    logits = torch.randn(batch, k + 1, vocab, device=dev, generator=gen, dtype=torch.float32).mul_(3)
    p = torch.softmax(logits, -1).to(dtype)
    noise = torch.randn(batch, k, vocab, device=dev, generator=gen, dtype=torch.float32)
    q = torch.softmax(logits[:, :k] + noise, -1).to(dtype)
    draft = q.float().argmax(-1)
    u = torch.rand(batch, k, device=dev, generator=gen, dtype=torch.float64)
    e = torch.empty(batch, vocab, device=dev, dtype=torch.float64).exponential_(generator=gen)
    return p, draft, q, u, e


def measure_greedy(timer, batch, k, vocab, dtype, gen) -> dict:
    from specdec_kernels.reference import greedy_verify_torch
    from specdec_kernels.triton_kernels import greedy_verify_triton

    logits, draft = greedy_inputs(batch, k, vocab, dtype, gen)
    want = greedy_verify_torch(logits, draft)
    got = greedy_verify_triton(logits, draft)
    return dict(op="greedy", nbytes=batch * (k + 1) * vocab * logits.element_size(),
                exact=all(torch.equal(g, w) for g, w in zip(got, want, strict=True)),
                torch_ms=timer(lambda: greedy_verify_torch(logits, draft)),
                triton_ms=timer(lambda: greedy_verify_triton(logits, draft)))


def measure_rejection(timer, batch, k, vocab, dtype, gen) -> dict:
    from specdec_kernels.reference import rejection_sample_torch
    from specdec_kernels.triton_kernels import rejection_sample_triton

    p, draft, q, u, e = rejection_inputs(batch, k, vocab, dtype, gen)
    want = rejection_sample_torch(p, draft, q, uniforms=u, exponentials=e)
    got = rejection_sample_triton(p, draft, q, u, e)
    return dict(op="rejection", nbytes=batch * vocab * (2 * p.element_size() + 8),
                exact=all(torch.equal(g, w) for g, w in zip(got, want, strict=True)),
                torch_ms=timer(lambda: rejection_sample_torch(p, draft, q, uniforms=u, exponentials=e)),
                triton_ms=timer(lambda: rejection_sample_triton(p, draft, q, u, e)))


def bench(args, device: str) -> list[dict]:
    timer = Timer(device, budget_ms=args.budget_ms)
    gen = torch.Generator(device=device).manual_seed(0)
    if args.dry_run:
        batches, ks, vocabs = [1, 2], [1], [300]
    elif args.quick:
        batches, ks, vocabs = [1, 128], [7], [151936]
    else:
        batches, ks, vocabs = [1, 32, 128], [7, 15], [49152, 151936]
    rows = []
    for vocab in vocabs:
        for k in ks:
            for batch in batches:
                for dtype in (torch.bfloat16, torch.float32):
                    for measure in (measure_greedy, measure_rejection):
                        row = measure(timer, batch, k, vocab, dtype, gen)
                        rows.append(dict(row, dtype=str(dtype).removeprefix("torch."), B=batch, k=k, V=vocab))
                        if device == "cuda":
                            torch.cuda.empty_cache()
                print(f"  measured V={vocab} k={k} B={batch}", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict], peak_tbps: float) -> str:
    head = ("| op | dtype | B | k | V | exact | torch ms | triton ms | speedup | torch GB/s | triton GB/s "
            f"| triton % of {peak_tbps:g} TB/s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        gbs_t, gbs_k = r["nbytes"] / r["torch_ms"] / 1e6, r["nbytes"] / r["triton_ms"] / 1e6
        lines.append(
            f"| {r['op']} | {r['dtype']} | {r['B']} | {r['k']} | {r['V']} | {'yes' if r['exact'] else '**NO**'} "
            f"| {r['torch_ms']:.3f} | {r['triton_ms']:.3f} | {r['torch_ms'] / r['triton_ms']:.1f}x "
            f"| {gbs_t:.0f} | {gbs_k:.0f} | {100 * gbs_k / (peak_tbps * 1e3):.1f}% |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-tests", action="store_true", help="only the timing table")
    parser.add_argument("--skip-bench", action="store_true", help="only the tests")
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--examples", type=int, default=30, help="hypothesis examples per property test")
    parser.add_argument("--budget-ms", type=float, default=40.0, help="timing budget per measurement")
    parser.add_argument("--peak-tbps", type=float, default=4.8, help="memory bandwidth of the card (H200: 4.8)")
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    parser.add_argument("--dry-run", action="store_true",
                        help="check this script's plumbing on the CPU (Triton interpreter, toy shapes, no tests)")
    args = parser.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported (lazily, in measure_*)
        device, status = "cpu", 0
    elif not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device here; nothing to check (run it on the GPU machine).")
        return 0
    else:
        device = "cuda"
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
        status = 0 if args.skip_tests else run_tests(args.examples)
    if not args.skip_bench:
        rows = bench(args, device)
        text = table(rows, args.peak_tbps)
        print(text, flush=True)
        if args.markdown:
            args.markdown.write_text(text + "\n")
        if not all(r["exact"] for r in rows):
            print("MISMATCH: a Triton kernel differs from its torch reference (see 'exact').", flush=True)
            status = status or 1
    return status


if __name__ == "__main__":
    sys.exit(main())
