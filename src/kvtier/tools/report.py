"""Reports of ``kvtier bench``: JSON, CSV, a Markdown table and plots.

One or more :class:`~kvtier.tools.loadgen.BenchReport` (one per
configuration) go side by side: the Markdown table has a column per
configuration; the plots are a TTFT CDF per configuration and TTFT against
the request's cache hit fraction.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Sequence

from kvtier.tools.loadgen import BenchReport


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


_ROWS = (
    ("requests (ok / failed)", lambda s, h: f"{s['succeeded']} / {s['failed']}"),
    ("errors", lambda s, h: ", ".join(f"{k} {v}" for k, v in s["errors"].items()) or "-"),
    ("TTFT mean (ms)", lambda s, h: _ms(s["ttft_s"]["mean"])),
    ("TTFT p50 (ms)", lambda s, h: _ms(s["ttft_s"]["p50"])),
    ("TTFT p90 (ms)", lambda s, h: _ms(s["ttft_s"]["p90"])),
    ("TTFT p99 (ms)", lambda s, h: _ms(s["ttft_s"]["p99"])),
    ("TPOT mean (ms)", lambda s, h: _ms(s["tpot_s"]["mean"])),
    ("ITL p50 (ms)", lambda s, h: _ms(s["itl_s"]["p50"])),
    ("E2EL mean (s)", lambda s, h: _s(s["e2el_s"]["mean"])),
    ("E2EL p99 (s)", lambda s, h: _s(s["e2el_s"]["p99"])),
    ("prompt / cached tokens", lambda s, h: f"{s['prompt_tokens']} / "
     f"{'-' if s.get('cached_tokens') is None else s['cached_tokens']}"),
    ("output throughput (tok/s)", lambda s, h: f"{s['output_throughput']:.1f}"),
    ("total throughput (tok/s)", lambda s, h: f"{s['total_throughput']:.1f}"),
    ("h1 device", lambda s, h: f"{h.h1:.1%}" if h else "-"),
    ("h2 external", lambda s, h: f"{h.h2:.1%}" if h else "-"),
    ("h_all", lambda s, h: f"{h.h_all:.1%}" if h else "-"),
    ("tokens from host / disk", lambda s, h: f"{h.by_source.get('host', 0):.0f} / {h.by_source.get('disk', 0):.0f}"
     if h else "-"),
)


def markdown(reports: Sequence[BenchReport]) -> str:
    lines = ["| measure | " + " | ".join(r.label for r in reports) + " |",
             "|---|" + "---|" * len(reports)]
    for name, cell in _ROWS:
        lines.append(f"| {name} | " + " | ".join(cell(r.summary, r.hits) for r in reports) + " |")
    return "\n".join(lines) + "\n"


def write_csv(report: BenchReport, path: str) -> None:
    fields = ("session", "turn", "ok", "error_kind", "start_s", "ttft_s", "tpot_s", "e2e_s", "prompt_tokens",
              "completion_tokens", "cached_tokens", "error")
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(fields)
        for r in report.results:
            w.writerow([getattr(r, k) for k in fields])


def plot(reports: Sequence[BenchReport], out_dir: str) -> list[str]:
    """TTFT CDF per configuration, and TTFT against each request's cached fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    def figure(name: str, title: str, xlabel: str, ylabel: str, draw) -> str:
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in reports:
            draw(ax, r)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    def cdf(ax, r: BenchReport) -> None:
        ttft = np.sort([x.ttft_s * 1000 for x in r.results if x.ok])
        if len(ttft):
            ax.step(ttft, np.arange(1, len(ttft) + 1) / len(ttft), where="post", label=r.label)

    def by_hit_rate(ax, r: BenchReport) -> None:
        ok = [x for x in r.results if x.ok and x.prompt_tokens and x.cached_tokens is not None]
        ax.scatter([x.cached_tokens / x.prompt_tokens for x in ok], [x.ttft_s * 1000 for x in ok], s=12,
                   alpha=0.7, label=r.label)

    return [figure("ttft_cdf.png", "TTFT CDF", "TTFT (ms)", "fraction of requests", cdf),
            figure("ttft_vs_hit_rate.png", "TTFT against hit rate", "cached fraction of the prompt", "TTFT (ms)",
                   by_hit_rate)]


def write_all(reports: Sequence[BenchReport], out_dir: str, plots: bool = True) -> list[str]:
    """Everything into ``out_dir``: results.json, one CSV per configuration, report.md, plots."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump([r.to_json() for r in reports], f, indent=1)
    written.append(os.path.join(out_dir, "results.json"))
    for r in reports:
        path = os.path.join(out_dir, f"requests-{_slug(r.label)}.csv")
        write_csv(r, path)
        written.append(path)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(markdown(reports))
    written.append(os.path.join(out_dir, "report.md"))
    if plots:
        written.extend(plot(reports, out_dir))
    return written


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in label)
