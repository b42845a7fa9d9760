"""TTFT of an 8k-token prompt: cold, device hit, kvtier DRAM hit; cost of kvtier at 0 % hits.

Runs two vLLM CPU servers one after the other on the benchmark model
(hidden 512, 4 layers): vLLM alone, then vLLM with kvtier. Prints ratios
against peers measured in the same run:

* DRAM-hit TTFT / device-hit TTFT (goal <= 1.15);
* with no prefix ever repeated: TTFT and throughput with kvtier / without
  (goal within 3 %);
* memory: PSS of the kvtier server minus PSS of vLLM alone, against
  dram_size + 100 MB;
* kvtier's block load bandwidth / single-thread memcpy bandwidth.

Usage: .venv/bin/python bench/ttft.py [--rounds 5] [--prompt-tokens 8192] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from kvtier.config import parse_size
from kvtier.tools.client import stream_completion
from kvtier.tools.model import build_model
from kvtier.tools.server import ServerOptions, VllmServer


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, vocab) for _ in range(n)]


def ttft(client: httpx.Client, srv: VllmServer, p: list[int], max_tokens: int = 4) -> float:
    r = stream_completion(client, srv.url, p, max_tokens=max_tokens)
    if not r.ok:
        raise RuntimeError(r.error)
    return r.ttft_s


def memcpy_gbps(size: int = 256 << 20) -> float:
    src = torch.empty(size, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = max(best, size / (time.perf_counter() - t) / 1e9)
    return best


def no_hit_run(client: httpx.Client, srv: VllmServer, args, vocab: int, seed0: int) -> dict:
    ttfts = [ttft(client, srv, prompt(seed0 + i, args.prompt_tokens, vocab)) for i in range(args.rounds)]
    # Throughput: concurrent distinct 2k-token prompts, 64 output tokens each.
    prompts = [prompt(seed0 + 1000 + i, 2048, vocab) for i in range(args.concurrency)]
    t = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        rs = list(pool.map(lambda p: stream_completion(client, srv.url, p, max_tokens=64, ignore_eos=True),
                           prompts))
    wall = time.perf_counter() - t
    if not all(r.ok for r in rs):
        raise RuntimeError([r.error for r in rs if not r.ok])
    tokens = sum(r.prompt_tokens + r.completion_tokens for r in rs)
    return {"ttft_s": statistics.median(ttfts), "ttfts": ttfts, "tokens_per_s": tokens / wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--dram-size", default="2GB")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    model = str(build_model("bench"))
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(model))
    common = dict(model=model, block_size=64, max_num_batched_tokens=2048, max_model_len=args.prompt_tokens + 256)
    out: dict = {"prompt_tokens": args.prompt_tokens, "rounds": args.rounds, "memcpy_GBps": memcpy_gbps()}

    with httpx.Client() as client:
        with VllmServer(ServerOptions(kvtier=None, **common), log_path="/tmp/kvtier-bench-plain.log") as srv:
            ttft(client, srv, prompt(999, 256, vocab))  # first request pays one-time set-up
            out["plain"] = no_hit_run(client, srv, args, vocab, seed0=10_000)
            out["plain"]["pss_bytes"] = srv.pss_bytes()
        with VllmServer(ServerOptions(kvtier={"dram_size": args.dram_size}, **common),
                        log_path="/tmp/kvtier-bench-kvtier.log") as srv:
            ttft(client, srv, prompt(999, 256, vocab))
            out["kvtier"] = no_hit_run(client, srv, args, vocab, seed0=20_000)
            out["kvtier"]["pss_bytes"] = srv.pss_bytes()
            cold, device, dram = [], [], []
            for i in range(args.rounds):
                p = prompt(30_000 + i, args.prompt_tokens, vocab)
                cold.append(ttft(client, srv, p))
                device.append(ttft(client, srv, p))
                srv.reset_prefix_cache()  # the device cache forgets; kvtier keeps
                dram.append(ttft(client, srv, p))
            m = srv.metrics()
            out["hits"] = {"cold_s": cold, "device_s": device, "dram_s": dram}
            secs = m.get("kvtier_load_seconds_total", 0.0)
            out["load_GBps"] = m.get("kvtier_bytes_loaded_total", 0.0) / secs / 1e9 if secs else 0.0
            out["ext_hits_tokens"] = m.get("vllm:external_prefix_cache_hits_total", 0.0)

    med = statistics.median
    dram_dev = med(dram) / med(device)
    ttft_ratio = out["kvtier"]["ttft_s"] / out["plain"]["ttft_s"]
    tput_ratio = out["kvtier"]["tokens_per_s"] / out["plain"]["tokens_per_s"]
    extra_mb = (out["kvtier"]["pss_bytes"] - out["plain"]["pss_bytes"]) / 1e6
    budget_mb = parse_size("dram_size", args.dram_size) / 1e6 + 100
    out["ratios"] = {"dram_over_device": dram_dev, "nohit_ttft_kvtier_over_plain": ttft_ratio,
                     "nohit_throughput_kvtier_over_plain": tput_ratio, "extra_memory_MB": extra_mb,
                     "memory_budget_MB": budget_mb, "load_over_memcpy": out["load_GBps"] / out["memcpy_GBps"]}

    print(f"\n## TTFT, {args.prompt_tokens}-token prompt, model hidden 512 / 4 layers, {args.rounds} rounds (median)\n")
    print("| measure | value | peer | ratio | goal |")
    print("|---|---|---|---|---|")
    print(f"| TTFT cold | {med(cold) * 1000:.0f} ms | | | |")
    print(f"| TTFT device hit | {med(device) * 1000:.1f} ms | | | |")
    print(f"| TTFT kvtier DRAM hit | {med(dram) * 1000:.1f} ms | device hit | {dram_dev:.2f}x | <= 1.15x |")
    print(f"| TTFT, 0 % hits, kvtier | {out['kvtier']['ttft_s'] * 1000:.0f} ms | vLLM alone "
          f"{out['plain']['ttft_s'] * 1000:.0f} ms | {ttft_ratio:.3f}x | within 3 % |")
    print(f"| throughput, 0 % hits, kvtier | {out['kvtier']['tokens_per_s']:.0f} tok/s | vLLM alone "
          f"{out['plain']['tokens_per_s']:.0f} tok/s | {tput_ratio:.3f}x | within 3 % |")
    print(f"| memory beyond vLLM's own (PSS) | {extra_mb:.0f} MB | dram_size + 100 MB = {budget_mb:.0f} MB | "
          f"{extra_mb / budget_mb:.2f}x | < 1 |")
    print(f"| kvtier block load bandwidth | {out['load_GBps']:.2f} GB/s | memcpy {out['memcpy_GBps']:.2f} GB/s | "
          f"{out['load_GBps'] / out['memcpy_GBps']:.2f}x | |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
