"""`specdec bench --batch-size B[,B...]`: every runner decodes every prompt at each batch size, side by side.

A specdec runner decodes the prompts through the engine's batch (continuous batching: rows leave as they finish
and waiting prompts join); transformers' batched `generate` (hf-greedy) decodes them in static batches of B,
left-padded, each batch running until its last row finishes, as a user of `generate` would. Each prompt is its
first user turn (a second MT-Bench turn needs the first turn's reply, which batching decodes alongside). For each
batch size the runners take turns in a rotating order after a warm-up each; throughput is generated tokens over
the wall-clock time of the whole pass, on one loaded model. With --rounds R each runner makes R passes (the
order rotated each round) and its tokens/s is the median pass.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from typing import Any

import torch

from ..check import Prompt
from .plan import HF_GREEDY, REFERENCE, BenchPlan
from .runners import _sync

WARMUP_TOKENS = 16


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def prompt_ids(prompts: list[Prompt], tokenizer: Any) -> list[list[int]]:
    """Each prompt's first turn through the chat template (or its ids as given)."""
    out = []
    for prompt in prompts:
        if prompt.ids is not None:
            out.append(list(prompt.ids))
            continue
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt.turns[0]}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        out.append(list(ids["input_ids"] if isinstance(ids, Mapping) else ids))
    return out


class HFBatchedGreedy:
    """transformers `generate` over static batches of B prompts, left-padded."""

    def __init__(self, model: Any, eos: list[int], pad: int) -> None:
        self.model, self.eos, self.pad = model, eos, pad
        self.device = model.get_input_embeddings().weight.device

    @torch.inference_mode()
    def run(self, ids: list[list[int]], max_new_tokens: int, batch_size: int, temperature: float,
            seed: int) -> list[list[int]]:
        from transformers import GenerationConfig

        config = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=temperature > 0,
                                  num_beams=1, repetition_penalty=1.0, no_repeat_ngram_size=0,
                                  eos_token_id=self.eos or None, pad_token_id=self.pad, use_cache=True,
                                  **({"temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0
                                     else {}))
        torch.manual_seed(seed)
        outputs: list[list[int]] = []
        for first in range(0, len(ids), batch_size):
            chunk = ids[first: first + batch_size]
            longest = max(len(p) for p in chunk)
            batch = torch.full((len(chunk), longest), self.pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), longest), dtype=torch.long)
            for row, prompt in enumerate(chunk):  # left padding: every row's last prompt token is aligned
                batch[row, longest - len(prompt):] = torch.tensor(prompt)
                mask[row, longest - len(prompt):] = 1
            out = self.model.generate(batch.to(self.device), attention_mask=mask.to(self.device),
                                      generation_config=config)
            for row in out[:, longest:].tolist():
                cut = next((i + 1 for i, token in enumerate(row) if token in self.eos), len(row))
                outputs.append(row[:cut])
        return outputs


def run_batched(plan: BenchPlan, model: Any, tokenizer: Any, runners: list[Any],
                progress: Any = None) -> dict[str, Any]:
    """{batch size: {runner: measurements}} for every batch size in the plan; specdec runners' outputs are
    compared with autoregressive's at the same batch size (greedy only)."""
    from ..target import TargetModel

    ids = prompt_ids(plan.prompts, tokenizer)
    eos = sorted(TargetModel(model, tokenizer).eos_token_ids)
    pad = getattr(tokenizer, "pad_token_id", None)
    hf = HFBatchedGreedy(model, eos, pad if pad is not None else (eos[0] if eos else 0))
    device = model.get_input_embeddings().weight.device
    names = [r.name for r in runners if r.kind == "specdec"] + [b for b in plan.baselines if b == HF_GREEDY]

    def one(name: str, prompts: list[list[int]], max_new: int, batch: int) -> tuple[list[list[int]], float, list]:
        runner = next((r for r in runners if r.name == name), None)
        _sync(device)
        start = time.perf_counter()
        if runner is not None and runner.kind == "specdec":
            outs = runner.decoder.generate_ids([torch.tensor(p) for p in prompts], max_new_tokens=max_new,
                                               temperature=plan.temperature, seed=plan.seed, batch_size=batch,
                                               draft_budget=plan.draft_budget)
            outs = outs if isinstance(outs, list) else [outs]
            tokens, steps = [o.token_ids for o in outs], [n for o in outs for n in o.stats.acceptance_lengths]
        else:
            tokens, steps = hf.run(prompts, max_new, batch, plan.temperature, plan.seed), []
        _sync(device)
        return tokens, time.perf_counter() - start, steps

    results: dict[str, Any] = {}
    for b_index, batch in enumerate(plan.batch_sizes):
        warm = ids[: max(batch, 2)]
        for name in names:
            if progress is not None:
                progress(f"batch {batch}: warm-up {name}")
            one(name, warm, WARMUP_TOKENS, batch)
        passes: dict[str, list[float]] = {name: [] for name in names}
        measured: dict[str, Any] = {}
        outputs: dict[str, list[list[int]]] = {}
        for r in range(plan.rounds):  # each round a rotated order, so no runner always goes first
            shift = (b_index + r) % len(names)
            for name in names[shift:] + names[:shift]:
                if progress is not None:
                    progress(f"batch {batch}: {name}" + (f" (round {r + 1}/{plan.rounds})" if plan.rounds > 1 else ""))
                tokens, seconds, steps = one(name, ids, plan.max_new_tokens, batch)
                outputs[name] = tokens  # the last round's (exact match below compares those)
                total = sum(len(t) for t in tokens)
                passes[name].append(total / seconds)
                measured[name] = {"num_tokens": total, "wall_seconds": seconds,
                                  "tokens_per_second": statistics.median(passes[name]),
                                  "tokens_per_second_rounds": list(passes[name]),
                                  "mean_acceptance_length": (sum(steps) / len(steps)) if steps else None,
                                  "peak_rss_mb": _rss() / 2**20}
        for name, row in measured.items():
            reference = measured.get(REFERENCE)
            row["speedup_vs_autoregressive"] = (row["tokens_per_second"] / reference["tokens_per_second"]
                                                if reference else None)
            hf_row = measured.get(HF_GREEDY)
            row["speedup_vs_hf_greedy"] = row["tokens_per_second"] / hf_row["tokens_per_second"] if hf_row else None
            same = None
            if plan.temperature == 0 and REFERENCE in outputs and name != HF_GREEDY:
                same = sum(a == b for a, b in zip(outputs[name], outputs[REFERENCE], strict=True)) / len(ids)
            row["exact_match_rate"] = same
        results[str(batch)] = {name: measured[name] for name in names}
    return results


def render_batched_markdown(batched: Mapping[str, Any]) -> list[str]:
    lines = ["## Batched decoding", "",
             "| batch | runner | tokens/s | speedup vs autoregressive | speedup vs hf-greedy | mean acceptance length "
             "| exact match | peak RSS (MiB) |", "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def ratio(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}x"

    for batch, runners in batched.items():
        for name, r in runners.items():
            tau = "n/a" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"
            match = "n/a" if r["exact_match_rate"] is None else f"{100 * r['exact_match_rate']:.0f}%"
            lines.append(f"| {batch} | {name} | {r['tokens_per_second']:.1f} | {ratio(r['speedup_vs_autoregressive'])} "
                         f"| {ratio(r['speedup_vs_hf_greedy'])} | {tau} | {match} | {r['peak_rss_mb']:.0f} |")
    return lines + [""]
