"""The plots of `specdec bench` (matplotlib, Agg, headless): acceptance-length distribution, per-position
acceptance rate and speedup, from results.json's dict."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _figure(width: float = 6.4, height: float = 4.0) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)  # Agg, headless, no pyplot global state
    return fig


def write_plots(results: Mapping[str, Any], out: Path) -> list[Path]:
    """acceptance_lengths.png, acceptance_per_position.png, speedup.png (where there is data for them)."""
    if results.get("batched"):
        return plot_batched(results["batched"], out)
    runners = results["proposers"]
    written: list[Path] = []
    hists = {n: r["acceptance_length_histogram"] for n, r in runners.items()
             if r["acceptance_length_histogram"]}
    if hists:
        fig = _figure()
        ax = fig.add_subplot()
        longest = max(int(k) for h in hists.values() for k in h)
        width = 0.8 / len(hists)
        for i, (name, hist) in enumerate(hists.items()):
            total = sum(hist.values())
            xs = list(range(1, longest + 1))
            fractions = [hist.get(str(x), 0) / total for x in xs]
            ax.bar([x - 0.4 + width * (i + 0.5) for x in xs], fractions, width, label=name)
        ax.set_xticks(list(range(1, longest + 1)))
        ax.set_xlabel("tokens committed per target forward (acceptance length)")
        ax.set_ylabel("fraction of steps")
        ax.set_title("Acceptance length distribution")
        ax.legend()
        fig.tight_layout()
        written.append(out / "acceptance_lengths.png")
        fig.savefig(written[-1])
    curves = {n: r["acceptance_rate_per_position"] for n, r in runners.items()
              if r["acceptance_rate_per_position"]}
    if curves:
        fig = _figure()
        ax = fig.add_subplot()
        for name, rates in curves.items():
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=name)
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(0, 1.05)
        ax.set_title("Per-position acceptance rate")
        ax.legend()
        fig.tight_layout()
        written.append(out / "acceptance_per_position.png")
        fig.savefig(written[-1])
    has_hf = any(r["speedup"]["vs_hf_greedy"] for r in runners.values())
    key = "vs_hf_greedy" if has_hf else "vs_autoregressive"
    bars = {n: r["speedup"][key] for n, r in runners.items() if r["speedup"][key]}
    if bars:
        fig = _figure()
        ax = fig.add_subplot()
        names = list(bars)
        medians = [bars[n]["median"] for n in names]
        errors = [[bars[n]["median"] - bars[n]["q25"] for n in names], [bars[n]["q75"] - bars[n]["median"]
                                                                       for n in names]]
        ax.bar(names, medians, yerr=errors, capsize=4, color="tab:blue")
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_ylabel("speedup vs hf-greedy" if key == "vs_hf_greedy" else "speedup vs autoregressive")
        ax.set_title("Speedup (median of per-prompt ratios, IQR bars)")
        ax.tick_params(axis="x", labelrotation=20)
        fig.tight_layout()
        written.append(out / "speedup.png")
        fig.savefig(written[-1])
    return written


def plot_batched(batched: Mapping[str, Any], out: Path) -> list[Path]:
    """throughput_by_batch.png and speedup_by_batch.png (vs specdec's plain batched decoding)."""
    sizes = [int(b) for b in batched]
    names = list(next(iter(batched.values())))
    written = []
    for file, key, label in (("throughput_by_batch.png", "tokens_per_second", "generated tokens per second"),
                             ("speedup_by_batch.png", "speedup_vs_autoregressive",
                              "speedup vs specdec plain batched decoding")):
        fig = _figure()
        ax = fig.add_subplot()
        for name in names:
            values = [batched[str(b)][name][key] for b in sizes]
            if any(v is None for v in values):
                continue
            ax.plot(sizes, values, marker="o", label=name)
        if key == "speedup_vs_autoregressive":
            ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("batch size")
        ax.set_ylabel(label)
        ax.legend()
        path = out / file
        fig.savefig(path)
        written.append(path)
    return written
