"""The main job: serve a model with kvtier and show the TTFT and hit-rate gain.

Long-document QA on a vLLM server whose device cache is too small for the
documents: round 1 asks each document twice in a row (cold, then a device
prefix-cache hit); round 2 asks every document again, after the device
cache has moved on, so the prefix comes from kvtier's DRAM tier. Prints
TTFT per kind of request and the hit rates h1 (device), h2 (external) and
h_all = h1 + (1 - h1) * h2 read from vLLM's /metrics. Stops the server it
started.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import httpx
from rich.console import Console
from rich.table import Table

from kvtier.tools.client import RequestResult, hit_rates, scrape, stream_chat
from kvtier.tools.corpus import QUESTIONS, documents
from kvtier.tools.model import build_model
from kvtier.tools.server import ServerOptions, VllmServer


@dataclass
class DemoOptions:
    geometry: str = "bench"
    docs: int = 6
    doc_tokens: int = 3000
    device_blocks: int = 110  # ~7k tokens: two documents fit, six do not
    block_size: int = 64
    dram_size: str = "1GB"
    max_tokens: int = 8
    log_path: str | None = None


def run_demo(opts: DemoOptions, console: Console | None = None) -> dict:
    console = console or Console()
    t_start = time.monotonic()
    console.print(f"[bold]kvtier demo[/]: building the '{opts.geometry}' test model ...")
    model = str(build_model(opts.geometry))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    docs = documents(tok, opts.docs, opts.doc_tokens)
    server_opts = ServerOptions(model=model, kvtier={"dram_size": opts.dram_size}, block_size=opts.block_size,
                                num_gpu_blocks=opts.device_blocks, max_num_batched_tokens=2048)
    console.print(f"starting vLLM with kvtier (device cache {opts.device_blocks * opts.block_size} tokens, "
                  f"DRAM tier {opts.dram_size}); {opts.docs} documents of {opts.doc_tokens} tokens "
                  f"from the Python library's own documentation")
    results: dict[str, list[RequestResult]] = {"cold": [], "device hit": [], "kvtier hit": []}
    with VllmServer(server_opts, log_path=opts.log_path) as srv, httpx.Client() as client:
        console.print(f"server ready at {srv.url}")

        def ask(doc: str, q: str, kind: str) -> None:
            msgs = [{"role": "system", "content": "Answer questions about the document."},
                    {"role": "user", "content": f"{doc}\n\nQuestion: {q}"}]
            r = stream_chat(client, srv.url, msgs, max_tokens=opts.max_tokens)
            if not r.ok:
                raise RuntimeError(f"request failed: {r.error}")
            results[kind].append(r)
            console.print(f"  {kind:<11} TTFT {r.ttft_s * 1000:7.1f} ms, cached {r.cached_tokens:5d} "
                          f"of {r.prompt_tokens} prompt tokens")

        before = scrape(srv.url)
        console.print("round 1: each document asked twice")
        for _, text in docs:
            ask(text, QUESTIONS[0], "cold")
            ask(text, QUESTIONS[0], "device hit")
        mid = scrape(srv.url)
        console.print("round 2: every document again, after the device cache moved on")
        for _, text in docs:
            ask(text, QUESTIONS[0], "kvtier hit")
        after = scrape(srv.url)

    table = Table(title="TTFT by where the prompt's KV came from")
    table.add_column("request")
    table.add_column("n", justify="right")
    table.add_column("TTFT mean (ms)", justify="right")
    table.add_column("TTFT p50 (ms)", justify="right")
    table.add_column("cached tokens", justify="right")
    table.add_column("vs cold", justify="right")
    cold = statistics.mean(r.ttft_s for r in results["cold"])
    summary: dict = {"ttft_ms": {}}
    for kind, rs in results.items():
        mean = statistics.mean(r.ttft_s for r in rs)
        summary["ttft_ms"][kind] = mean * 1000
        table.add_row(kind, str(len(rs)), f"{mean * 1000:.1f}",
                      f"{statistics.median(r.ttft_s for r in rs) * 1000:.1f}",
                      f"{statistics.mean(r.cached_tokens for r in rs):.0f}", f"{cold / mean:.1f}x faster"
                      if kind != "cold" else "-")
    console.print(table)

    rates = Table(title="Prefix-cache hit rates (from vLLM's /metrics)")
    for col in ("interval", "h1 device", "h2 external", "h_all", "tokens from host (DRAM)"):
        rates.add_column(col, justify="right")
    for name, a, b in (("round 1", before, mid), ("round 2", mid, after), ("whole run", before, after)):
        h = hit_rates(a, b)
        rates.add_row(name, f"{h.h1:.1%}", f"{h.h2:.1%}", f"{h.h_all:.1%}", f"{h.by_source.get('host', 0):.0f}")
        summary[name] = {"h1": h.h1, "h2": h.h2, "h_all": h.h_all, "external_tokens": h.external_tokens,
                         "loaded_blocks": h.loaded_blocks, "load_errors": h.load_errors}
    console.print(rates)
    console.print(f"done in {time.monotonic() - t_start:.0f} s; server stopped")
    return summary
