"""Seeded randomized correctness run: every greedy output with kvtier equals vLLM alone.

Runs real vLLM CPU servers (float32, so that arithmetic noise can neither
hide nor fake a divergence) on a small model built on the spot:

1. vLLM alone answers every request: the reference;
2. vLLM alone answers them all again at the same concurrency: the
   comparison's own noise (must be 0 divergent, or the run proves nothing);
3. vLLM with kvtier, a device cache, a DRAM tier and an SSD tier all far
   smaller than the working set, answers them in the same order while the
   run (a) flips bytes in every SSD slot a third of the way in, (b) kills
   the server (SIGKILL to every process) half way while requests are loading
   and saving, and starts it again on the same SSD file, (c) flips bytes in
   the DRAM arena and, more sparsely, on SSD again two thirds of the way in.

The workload mixes shared-prefix trees (a root prefix, branches extending it,
leaves with their own suffix), partial prefixes (a earlier prompt cut at a
token that is not a block boundary, with a new ending) and fresh prompts.

    .venv/bin/python -m tests.stress.correctness --requests 1000 --concurrency 8

prints a JSON summary; exit status 1 on any divergence, failed request or
missing hit source. tests/stress/test_correctness.py runs a smaller one in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

BLOCK = 64
MAX_TOKENS = 8
KILL_TOKENS = 200  # the answers of the requests the kill is aimed at


@dataclass(frozen=True)
class StressOptions:
    requests: int = 1000
    concurrency: int = 8
    seed: int = 0
    device_blocks: int = 40  # 2,560 tokens
    dram_size: str = "16MB"  # ~31 blocks of the tiny model (512 KiB each in float32)
    ssd_size: str = "96MB"  # ~190 blocks
    workdir: str = ""
    model: str = ""  # a model directory; empty: the tiny test model, built once
    # Answer every request twice on vLLM alone and compare (the comparison's
    # own noise). The full run does; CI's smaller run leaves it to that one.
    noise_pass: bool = True


def workload(n: int, seed: int, max_len: int) -> list[list[int]]:
    """``n`` prompts (token ids) mixing prefix trees, partial prefixes and fresh prompts."""
    rng = random.Random(seed)

    def toks(k: int) -> list[int]:
        return [rng.randrange(16, 900) for _ in range(k)]

    roots: list[list[int]] = []
    branches: list[list[int]] = []
    prompts: list[list[int]] = []
    for _ in range(n):
        r = rng.random()
        if r < 0.15 or not roots:
            roots.append(toks(BLOCK * rng.randint(3, 10)))
            p = roots[-1] + toks(rng.randint(1, 150))
        elif r < 0.35:
            root = rng.choice(roots[-8:])  # recent trees: reuse while some of it is still held
            branches.append(root + toks(BLOCK * rng.randint(1, 6)))
            p = branches[-1] + toks(rng.randint(1, 150))
        elif r < 0.6 and branches:
            p = rng.choice(branches[-16:]) + toks(rng.randint(1, 200))
        elif r < 0.8 and prompts:
            base = rng.choice(prompts[-32:])
            cut = rng.randint(1, len(base) - 1)
            if cut % BLOCK == 0:
                cut -= 1  # never on a block boundary: a partial block
            p = base[:cut] + toks(rng.randint(1, 120))
        else:
            p = toks(rng.randint(20, 1500))
        prompts.append(p[: max_len - MAX_TOKENS])
    return prompts


def ask(url: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> tuple[list[int], str]:
    r = httpx.post(url + "/v1/completions", timeout=600,
                   json={"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                         "ignore_eos": True, "return_token_ids": True})
    if r.status_code != 200:
        return [], f"HTTP {r.status_code}: {r.text[:200]}"
    choice = r.json()["choices"][0]
    return list(choice.get("token_ids") or []), choice["text"]


def died_with_server(url: str, prompt: list[int], streaming: threading.Event) -> bool:
    """A request that may die with the server (its answer is not compared):
    whether it did. Streamed: ``streaming`` is set once its first tokens
    come, so the engine is then generating it. One refused at connect was
    sent after the server died."""
    body = {"model": "model", "prompt": prompt, "max_tokens": KILL_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    try:
        # Long answers (never compared): a request stays in the engine
        # for a while, so the kill finds some running.
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
            if r.status_code != 200:
                r.read()
                # 5xx: the API server outlived its engine for a moment.
                return r.status_code >= 500
            finished = False
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    finished = True
                elif line.startswith("data: "):
                    if '"error"' in line:
                        return True  # the API server's word that its engine died under the request
                    streaming.set()
        return not finished  # cut short: died; answered in full before the kill: not
    except httpx.ConnectError:
        return False
    except httpx.HTTPError:
        return True


def kill_with_requests_in_flight(srv, prompts: list[list[int]], concurrency: int) -> int:
    """SIGKILL every process of the server while ``prompts`` are being
    served, ``concurrency`` at a time, over and over until the kill (one
    pass can end between two looks); returns how many requests died with
    it (0: the kill missed them)."""
    killed = threading.Event()
    streaming = threading.Event()  # a request's tokens are coming: the engine is on it

    def feed(first: int) -> bool:
        i = first
        while not killed.is_set():
            if died_with_server(srv.url, prompts[i % len(prompts)], streaming):
                return True
            i += concurrency
        return False

    from kvtier.tools.server import signal_pids, vllm_shm_files

    # The server's processes, found before the feeding starts: finding them
    # (and the shared memory they map, for stop() to remove) takes long
    # enough on a loaded machine for every request then running to end.
    pids = srv.pids()
    srv.shm_files |= vllm_shm_files(pids)
    with ThreadPoolExecutor(concurrency) as pool:
        futs = [pool.submit(feed, k) for k in range(concurrency)]
        # Kill once the engine is generating one of them (a gauge of the
        # server's /metrics was no sign: it keeps the last value of the
        # phase before until the next step, and the kill came before the
        # feeders' first requests had reached the server).
        streaming.wait(60)
        # The feeders go on until the processes are gone: a request refused
        # at connect was sent after the kill, and is not counted.
        signal_pids(pids, signal.SIGKILL)
        killed.set()
        srv.wait_exit(60)  # not reaped: stop() sweeps what is left of its session
        return sum(f.result() for f in futs)


def kvtier_arenas(shm_dir: Path) -> int:
    return sum(1 for name in os.listdir(shm_dir) if name.startswith("kvtier-dram-"))


def answer_all(url: str, prompts: list[list[int]], indexes: range, concurrency: int) -> dict[int, tuple]:
    with ThreadPoolExecutor(concurrency) as pool:
        return dict(zip(indexes, pool.map(lambda i: ask(url, prompts[i]), indexes)))


def flip_file(path: str, every_bytes: int, start: int, xor: int = 0x7F) -> int:
    """Flip one byte every ``every_bytes`` from ``start`` on (fsynced, so direct I/O reads see it)."""
    n = 0
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        for off in range(start, size, every_bytes):
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ xor]))
            n += 1
        f.flush()
        os.fsync(f.fileno())
    return n


def flip_arena(log_text: str) -> int:
    """Flip the sign-and-exponent byte of one float32 in every sealed slot of the server's arena."""
    import re

    from kvtier.tier.dram import DramTier

    m = re.search(r"kvtier: DRAM tier (\S+?),", log_text)
    if not m:
        return 0
    tier = DramTier.attach(m.group(1))
    n = 0
    try:
        for slot in range(tier.num_slots):
            if tier.header(slot).ready_mask:
                tier.rank_view(slot, 0)[4 * 1000 + 3] ^= 0x7F
                n += 1
    finally:
        tier.close()
    return n


def delta(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


COUNTERS = ("vllm:external_prefix_cache_hits_total", 'vllm:prompt_tokens_cached_by_source_total{source="host"}',
            'vllm:prompt_tokens_cached_by_source_total{source="disk"}', "kvtier_blocks_loaded_total",
            "kvtier_load_errors_total", "kvtier_corrupt_blocks_total", "kvtier_ssd_corrupt_blocks_total",
            "kvtier_blocks_promoted_total", "kvtier_blocks_demoted_total", "kvtier_evictions_total",
            "kvtier_ssd_evictions_total", "kvtier_blocks_saved_total")


def run(opts: StressOptions) -> dict:
    from kvtier.tools.model import build_model
    from kvtier.tools.server import VllmServer, exit_status
    from tests.e2e.conftest import server_options

    work = Path(opts.workdir or tempfile.mkdtemp(prefix="kvtier-stress-"))
    work.mkdir(parents=True, exist_ok=True)
    model = opts.model or str(build_model("tiny", cache_dir=os.environ.get("KVTIER_MODEL_CACHE")))
    plain = server_options(model, None, num_gpu_blocks=opts.device_blocks, max_num_seqs=opts.concurrency)
    prompts = workload(opts.requests, opts.seed, plain.model_len())
    every = range(len(prompts))
    t0 = time.monotonic()
    with VllmServer(plain, log_path=work / "plain.log") as srv:
        reference = answer_all(srv.url, prompts, every, opts.concurrency)
        replay = answer_all(srv.url, prompts, every, opts.concurrency) if opts.noise_pass else reference
        srv.reset_prefix_cache()
    t_plain = time.monotonic() - t0

    ssd = work / "ssd.img"
    if ssd.exists():
        ssd.unlink()
    # The arena in a folder of the run's own: servers that other jobs run on
    # this host make and remove arenas in /dev/shm, which the count of
    # arenas after the restart must not see.
    shm = work / "shm"
    shm.mkdir(exist_ok=True)
    cfg = {"dram_size": opts.dram_size, "ssd_path": str(ssd), "ssd_size": opts.ssd_size, "shm_dir": str(shm)}
    kv_opts = server_options(model, cfg, num_gpu_blocks=opts.device_blocks, max_num_seqs=opts.concurrency)
    n = len(prompts)
    third, half, two_thirds = n // 3, n // 2, 2 * n // 3
    faults: dict[str, int] = {}
    totals: dict[str, float] = {}
    got: dict[int, tuple] = {}

    def add(before: dict, after: dict) -> None:
        for k in COUNTERS:
            totals[k] = totals.get(k, 0.0) + delta(after, before, k)

    t0 = time.monotonic()
    arenas_before = kvtier_arenas(shm)
    with VllmServer(kv_opts, log_path=work / "kvtier-1.log") as srv:
        m0 = srv.metrics()
        got.update(answer_all(srv.url, prompts, range(0, third), opts.concurrency))
        # Every SSD slot gets flipped bytes (one every 96 KiB past the first 64 KiB).
        faults["ssd bytes flipped (1)"] = flip_file(str(ssd), 96 << 10, 64 << 10)
        got.update(answer_all(srv.url, prompts, range(third, half), opts.concurrency))
        add(m0, srv.metrics())
        # The answers to these are not compared: they die with the server.
        died = kill_with_requests_in_flight(srv, prompts[half : half + opts.concurrency], opts.concurrency)
    faults["kill -9 with requests in flight"] = died
    with VllmServer(kv_opts, log_path=work / "kvtier-2.log") as srv:
        recovered = srv.log_text()
        # The killed engine's arena is gone (its reaper, or this start's cleanup): one arena, this one's.
        arenas_after_restart = kvtier_arenas(shm) - arenas_before
        m0 = srv.metrics()
        got.update(answer_all(srv.url, prompts, range(half, two_thirds), opts.concurrency))
        faults["dram slots flipped"] = flip_arena(srv.log_text())
        faults["ssd bytes flipped (2)"] = flip_file(str(ssd), 1 << 20, 200 << 10)
        got.update(answer_all(srv.url, prompts, range(two_thirds, n), opts.concurrency))
        add(m0, srv.metrics())
        alive = srv.proc is not None and exit_status(srv.proc) is None  # not reaped: stop() sweeps its session
    t_kvtier = time.monotonic() - t0
    ssd.unlink()

    failed = sum(1 for i in every if not reference[i][0] or not got[i][0] or not replay[i][0])
    noise = sum(1 for i in every if reference[i] != replay[i]) if opts.noise_pass else None
    divergent = [i for i in every if reference[i] != got[i]]
    summary = {
        "requests": n, "concurrency": opts.concurrency, "seed": opts.seed,
        "prompt_tokens": sum(len(p) for p in prompts),
        "failed_requests": failed, "noise_divergent (vLLM alone vs itself)": noise,
        "divergent (kvtier vs vLLM alone)": len(divergent), "first_divergent": divergent[:10],
        "engine_alive": alive, "recovered_line": "blocks recovered" in recovered, "faults": faults,
        "arenas_after_restart": arenas_after_restart,
        "counters": {k: int(v) for k, v in totals.items()},
        "seconds": {"vllm_alone": round(t_plain), "kvtier": round(t_kvtier)},
    }
    return summary


def verdict(s: dict) -> list[str]:
    """What is wrong with a run's summary (empty: a pass)."""
    c = s["counters"]
    problems = []
    if s["failed_requests"]:
        problems.append(f"{s['failed_requests']} requests failed")
    if s["noise_divergent (vLLM alone vs itself)"]:
        problems.append("vLLM alone is not deterministic at this concurrency: the comparison proves nothing")
    if s["divergent (kvtier vs vLLM alone)"]:
        problems.append(f"{s['divergent (kvtier vs vLLM alone)']} outputs differ from vLLM alone")
    if not s["engine_alive"]:
        problems.append("the engine died")
    if s["arenas_after_restart"] != 1:
        problems.append(f"{s['arenas_after_restart']} arenas after the restart: the killed engine's was left")
    for src in ("host", "disk"):
        if not c.get(f'vllm:prompt_tokens_cached_by_source_total{{source="{src}"}}'):
            problems.append(f"no hits from {src}: that tier was not exercised")
    if not c.get("kvtier_ssd_corrupt_blocks_total"):
        problems.append("no flipped SSD block was ever read: the fault was not exercised")
    if not s["faults"]["kill -9 with requests in flight"]:
        problems.append("no request was in flight when the engine was killed: the fault was not exercised")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=StressOptions.requests)
    ap.add_argument("--concurrency", type=int, default=StressOptions.concurrency)
    ap.add_argument("--seed", type=int, default=StressOptions.seed)
    ap.add_argument("--workdir", default="")
    args = ap.parse_args()
    s = run(StressOptions(requests=args.requests, concurrency=args.concurrency, seed=args.seed,
                          workdir=args.workdir))
    problems = verdict(s)
    s["verdict"] = problems or "pass"
    print(json.dumps(s, indent=2))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
