"""Live view of a running server's cache: ``kvtier stats``.

Runs from the command line against vLLM's /metrics (with kvtier's series
when the connector is loaded). Each refresh shows, since the server started
(its counters) and over the last interval: hit rates h1 (device), h2 (external) and h_all,
prompt tokens served by source, the DRAM and SSD tiers' usage, evictions,
demotions and promotions, blocks loaded and saved, load errors, and the
time the engine spent in the connector's hooks.
"""

from __future__ import annotations

import time

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

from kvtier.tools.client import hit_rates
from kvtier.tools.server import parse_metrics

_EVENTS = (
    ("blocks loaded", "kvtier_blocks_loaded_total"),
    ("blocks saved", "kvtier_blocks_saved_total"),
    ("load errors", "kvtier_load_errors_total"),
    ("corrupt blocks", "kvtier_corrupt_blocks_total"),
    ("DRAM evictions", "kvtier_evictions_total"),
    ("freed without SSD copy", "kvtier_evicted_without_copy_total"),
    ("demoted to SSD", "kvtier_blocks_demoted_total"),
    ("promoted from SSD", "kvtier_blocks_promoted_total"),
    ("SSD evictions", "kvtier_ssd_evictions_total"),
    ("SSD corrupt blocks", "kvtier_ssd_corrupt_blocks_total"),
    ("SSD read errors", "kvtier_ssd_read_errors_total"),
)
# Seconds the engine spent inside the connector's hooks, on its own path.
_SECONDS = (
    ("scheduler in kvtier's hooks (s)", "kvtier_scheduler_hook_seconds_total"),
    ("workers in kvtier's hooks (s)", "kvtier_worker_hook_seconds_total"),
)


def snapshot_table(url: str, first: dict[str, float], prev: dict[str, float], now: dict[str, float]) -> Table:
    t = Table(title=f"kvtier stats: {url}  ({time.strftime('%H:%M:%S')})")
    t.add_column("")
    t.add_column("since server start", justify="right")
    t.add_column("last interval", justify="right")
    total, recent = hit_rates(first, now), hit_rates(prev, now)
    t.add_row("h1 device", f"{total.h1:.1%}", f"{recent.h1:.1%}")
    t.add_row("h2 external", f"{total.h2:.1%}", f"{recent.h2:.1%}")
    t.add_row("h_all", f"{total.h_all:.1%}", f"{recent.h_all:.1%}")
    for src in sorted(set(total.by_source) | set(recent.by_source)):
        t.add_row(f"cached tokens: {src}", f"{total.by_source.get(src, 0):,.0f}",
                  f"{recent.by_source.get(src, 0):,.0f}")
    for name, key in _EVENTS:
        if key in now:
            t.add_row(name, f"{now[key] - first.get(key, 0):,.0f}", f"{now[key] - prev.get(key, 0):,.0f}")
    for name, key in _SECONDS:
        if key in now:
            t.add_row(name, f"{now[key] - first.get(key, 0):,.3f}", f"{now[key] - prev.get(key, 0):,.3f}")
    for tier in ("dram", "ssd"):
        used, total_slots = now.get(f"kvtier_{tier}_slots_used"), now.get(f"kvtier_{tier}_slots_total")
        if total_slots:
            t.add_row(f"{tier.upper()} tier in use", f"{used:,.0f} / {total_slots:,.0f} slots",
                      f"{used / total_slots:.1%}")
    return t


def watch(url: str, interval_s: float, once: bool = False, count: int = 0) -> int:
    console = Console()

    def scrape() -> dict[str, float]:
        return parse_metrics(httpx.get(url + "/metrics", timeout=10).text)

    try:
        first = scrape()
    except httpx.HTTPError as err:
        console.print(f"kvtier stats: cannot read {url}/metrics: {err}")
        return 2
    if once:
        # Since the server started: vLLM's counters begin at zero.
        console.print(snapshot_table(url, {}, {}, first))
        return 0
    prev = first
    n = 0
    # The first column counts from the server's start, not from this view's.
    with Live(snapshot_table(url, {}, prev, first), console=console, refresh_per_second=4) as live:
        try:
            while not count or n < count:
                time.sleep(interval_s)
                now = scrape()
                live.update(snapshot_table(url, {}, prev, now))
                prev = now
                n += 1
        except KeyboardInterrupt:
            pass
        except httpx.HTTPError as err:
            console.print(f"kvtier stats: lost {url}: {err}")
            return 2
    return 0
