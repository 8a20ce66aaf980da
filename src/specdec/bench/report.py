"""The written results of `specdec bench`: results.md rendered from results.json's dict, and
results.json, results.md and the plots written to the output folder."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .plots import write_plots


def _fmt_speedup(s: Mapping[str, float] | None) -> str:
    return "n/a" if not s else f"{s['median']:.2f}x [{s['q25']:.2f}-{s['q75']:.2f}]"


def render_markdown(results: Mapping[str, Any]) -> str:
    meta, runners = results["meta"], results["proposers"]
    ds = meta["dataset"]
    lines = [
        f"# specdec bench: {ds['name']} ({ds['num_prompts']} prompts, {ds['num_turns']} turns)",
        "",
        f"`{meta['command']}`" if meta["command"] else "",
        "",
        f"model {meta['model']}, {meta['dtype']} on {meta['accelerator']}; "
        f"max_new_tokens {meta['max_new_tokens']}, temperature {meta['temperature']}; "
        f"torch {meta['versions']['torch']}, transformers {meta['versions']['transformers']}; "
        f"{meta['timestamp']}"
        + ("; **interrupted: partial results**" if meta["interrupted"] else ""),
        "",
    ]
    if meta.get("draft_budget") is not None:  # --draft-budget N (results before it existed lack the key: adaptive)
        lines += [f"Draft budget: pinned at {meta['draft_budget']} draft tokens per row per step (`--draft-budget`)",
                  ""]
    if meta.get("caches"):  # which forward each specdec runner used (native: specdec's own, dynamic: transformers')
        lines += ["KV cache: " + ", ".join(f"{name} {cache}" for name, cache in meta["caches"].items()), ""]
    if results.get("batched"):  # `--batch-size`: first turns, every runner at each batch size
        from .batched import render_batched_markdown

        return "\n".join(lines + render_batched_markdown(results["batched"]))
    # the hf-pld column only when that baseline ran (results written before it existed lack the key)
    with_pld = any(r["speedup"].get("vs_hf_pld") for r in runners.values())
    lines += [
        "| runner | mean acceptance length | tokens/s (median) | speedup vs autoregressive "
        "| speedup vs hf-greedy |" + (" speedup vs hf-pld |" if with_pld else "") + " exact match | peak RSS (MiB) |",
        "| --- | ---: | ---: | ---: | ---: |" + (" ---: |" if with_pld else "") + " ---: | ---: |",
    ]
    for name, r in runners.items():
        tau = "n/a" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"
        if r["exact_match_rate"] is None:
            match = "n/a"
        else:
            match = f"{100 * r['exact_match_rate']:.0f}%"
            labels = {"near_tie": ("near-tie", "near-ties"), "mismatch": ("mismatch", "mismatches")}
            extra = [f"{n} {labels[k][n != 1]}" for k, n in r["matches"].items() if k in labels and n]
            match += f" ({', '.join(extra)})" if extra else ""
        speedup = r["speedup"]
        lines.append(f"| {name} | {tau} | {r['tokens_per_second']['median']:.1f} | "
                     f"{_fmt_speedup(speedup['vs_autoregressive'])} | "
                     f"{_fmt_speedup(speedup['vs_hf_greedy'])} | "
                     + (f"{_fmt_speedup(speedup.get('vs_hf_pld'))} | " if with_pld else "")
                     + f"{match} | {r['peak_rss_mb']:.0f} |")
    lines += ["", "Speedup: median of paired per-prompt tokens/s ratios, interquartile range in brackets. "
              "Mean acceptance length counts the bonus token (plain decoding = 1.00). A near-tie is a "
              f"bf16/fp16 divergence whose float32 logit gap is below epsilon = {meta['epsilon']}.", ""]
    with_positions = {n: r["acceptance_rate_per_position"] for n, r in runners.items()
                      if r["acceptance_rate_per_position"]}
    if with_positions:
        width = max(len(v) for v in with_positions.values())
        lines += ["## Acceptance rate per draft position", "",
                  "| runner | " + " | ".join(str(j + 1) for j in range(width)) + " |",
                  "| --- |" + " ---: |" * width]
        for name, rates in with_positions.items():
            cells = [f"{rates[j]:.2f}" if j < len(rates) else "" for j in range(width)]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    split = {n: r["time_split_seconds"] for n, r in runners.items() if r["time_split_seconds"]}
    if split:
        lines += ["## Time split (seconds, summed over prompts)", "",
                  "| runner | prefill | propose | verify | other | total | steps | propose ms/step "
                  "| verify ms/step |", "| --- |" + " ---: |" * 8]
        for name, s in split.items():
            # steps: one per verification (the histogram counts each step's accepted length)
            steps = sum((runners[name].get("acceptance_length_histogram") or {}).values())
            per_step = (f"{steps} | {1e3 * s['propose'] / steps:.2f} | {1e3 * s['verify'] / steps:.2f}"
                        if steps else "n/a | n/a | n/a")
            lines.append(f"| {name} | {s['prefill']:.3f} | {s['propose']:.3f} | {s['verify']:.3f} | "
                         f"{s['other']:.3f} | {runners[name]['seconds']:.3f} | {per_step} |")
        lines.append("")
    return "\n".join(lines)


#: the plots write_plots may write (a rerun with --overwrite removes those it does not write again)
PLOT_FILES = ("acceptance_lengths.png", "acceptance_per_position.png", "speedup.png", "throughput_by_batch.png",
              "speedup_by_batch.png")


def write_results(results: Mapping[str, Any], out: str | os.PathLike) -> list[Path]:
    """results.json, results.md and the plots in `out` (created); returns the paths written.

    Each file is written atomically (a temporary file renamed over the old one), so a reader or an
    interrupted run sees a whole file, from this run or the one before it, never half of one; results.json
    comes last, so its presence means the run's files are complete."""
    import shutil
    import tempfile

    from ..files import atomic_write_json, atomic_write_text

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    markdown = atomic_write_text(out / "results.md", render_markdown(results))
    staging = Path(tempfile.mkdtemp(prefix=".plots-", dir=out))
    try:
        plots = []
        for staged in write_plots(results, staging):
            with open(staged, "rb") as handle:
                os.fsync(handle.fileno())
            os.replace(staged, out / staged.name)
            plots.append(out / staged.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for name in PLOT_FILES:  # a plot from an earlier run that this one has no data for
        if out / name not in plots:
            (out / name).unlink(missing_ok=True)
    results_json = atomic_write_json(out / "results.json", results)
    return [results_json, markdown] + plots
