"""Soak: concurrent streams for minutes under constant eviction on both tiers.

One vLLM CPU server with kvtier (tiny model, small device cache, a DRAM tier
of ~31 blocks and an SSD tier of ~120 blocks under a working set of 2,400
blocks, so both tiers evict all the time) serves ``--streams`` clients that
each send request after request until ``--minutes`` are up. Every
``--interval`` seconds the run samples the server's processes (resident
memory, open files), the shared-memory files of kvtier in /dev/shm, and the
requests finished in the interval.

    .venv/bin/python -m tests.stress.soak --streams 32 --minutes 10

The server runs with tcmalloc preloaded, as vLLM's CPU install guide sets
it up (``--allocator glibc|jemalloc`` for the others).

Verdict (after the warm-up, the first ``--warmup`` intervals): resident
memory flat (the last sample within 5 % of the first), open files and
shared-memory files constant, no interval without a finished request (no
stall), throughput steady (no interval under half the median), no request
failed. Prints a table and a JSON summary; exit status 1 on a failed verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

BLOCK = 64


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def memory_by_process(pids: list[int]) -> dict[str, dict[str, int]]:
    """Per process (by its name in /proc/<pid>/comm, e.g. vLLM's worker):
    anonymous, shared-memory and file-backed resident MiB. Growth that is
    anonymous is the heap; shared memory is the arena and vLLM's queues."""
    out: dict[str, dict[str, int]] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if line.startswith("Rss"))
        except OSError:
            continue
        out[f"{name}:{pid}"] = {k[3:].lower(): int(v.split()[0]) >> 10 for k, v in fields.items()}
    return out


def open_files(pids: list[int]) -> int:
    n = 0
    for pid in pids:
        try:
            n += len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            pass
    return n


def shm_files(pids: list[int]) -> int:
    """kvtier's files in /dev/shm that belong to the server: arenas are
    named ``kvtier-dram-<pid>-...`` after the engine process that owns
    them (other programs on the host may have arenas of their own)."""
    mine = {f"kvtier-dram-{pid}-" for pid in pids}
    return sum(1 for name in os.listdir("/dev/shm") if any(name.startswith(p) for p in mine))


def soak(streams: int, minutes: float, interval_s: float, warmup: int, workdir: str, model: str = "",
         kvtier: bool = True, env: dict[str, str] | None = None, overrides: dict[str, str] | None = None,
         num_gpu_blocks: int = 128) -> dict:
    from kvtier.tools.model import build_model
    from kvtier.tools.server import VllmServer, exit_status
    from tests.e2e.conftest import server_options

    work = Path(workdir or tempfile.mkdtemp(prefix="kvtier-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    model = model or str(build_model("tiny", cache_dir=os.environ.get("KVTIER_MODEL_CACHE")))
    ssd = work / "ssd.img"
    cfg = {"dram_size": "16MB", "ssd_path": str(ssd), "ssd_size": "64MB", "force_new_disk": True,
           **(overrides or {})}
    # kvtier=False: the same load on vLLM alone, the peer for memory growth.
    opts = server_options(model, cfg if kvtier else None, num_gpu_blocks=num_gpu_blocks, max_num_seqs=streams)
    opts.env = {**opts.env, **(env or {})}
    rng = random.Random(0)
    prefixes = [[rng.randrange(16, 900) for _ in range(BLOCK * 8)] for _ in range(300)]
    done: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def stream(i: int) -> None:
        r = random.Random(i)
        with httpx.Client(timeout=300) as client:
            while not stop.is_set():
                # Skewed reuse: a few hot prefixes, a long tail that keeps both tiers evicting.
                p = prefixes[min(int(r.paretovariate(0.6)) - 1, len(prefixes) - 1)] if r.random() < 0.5 \
                    else r.choice(prefixes)
                prompt = p + [r.randrange(16, 900) for _ in range(r.randint(1, 100))]
                try:
                    resp = client.post(url + "/v1/completions", json={
                        "model": "model", "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
                        "ignore_eos": True})
                    ok = resp.status_code == 200
                except httpx.HTTPError as err:
                    ok, resp = False, err
                with lock:
                    if ok:
                        done.append(time.monotonic())
                    else:
                        failures.append(str(resp)[:200])

    samples = []
    with VllmServer(opts, log_path=work / "soak.log") as srv:
        url = srv.url
        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(streams)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        end = t0 + minutes * 60
        last = t0
        while time.monotonic() < end:
            time.sleep(min(interval_s, max(0.0, end - time.monotonic())))
            now = time.monotonic()
            pids = srv.pids()
            with lock:
                finished = sum(1 for t in done if last < t <= now)
            m = srv.metrics()
            samples.append({"t_s": round(now - t0), "requests": finished,
                            "req_per_s": round(finished / (now - last), 2),
                            "rss_mib": round(rss_bytes(pids) / (1 << 20)), "open_files": open_files(pids),
                            "shm_files": shm_files(pids), "by_process": memory_by_process(pids),
                            "dram_evictions": int(m.get("kvtier_evictions_total", 0)),
                            "ssd_evictions": int(m.get("kvtier_ssd_evictions_total", 0)),
                            "disk_hit_tokens": int(m.get(
                                'vllm:prompt_tokens_cached_by_source_total{source="disk"}', 0))})
            last = now
            print(json.dumps(samples[-1]), flush=True)
        stop.set()
        for t in threads:
            t.join(timeout=330)
        alive = srv.proc is not None and exit_status(srv.proc) is None  # not reaped: stop() sweeps its session
    if ssd.exists():
        ssd.unlink()
    return {"streams": streams, "minutes": minutes, "samples": samples, "failures": len(failures),
            "first_failures": failures[:3], "engine_alive": alive, "warmup_intervals": warmup}


def verdict(s: dict) -> list[str]:
    after = s["samples"][s["warmup_intervals"]:]
    problems = []
    if not after:
        return ["no samples after the warm-up"]
    if s["failures"]:
        problems.append(f"{s['failures']} requests failed")
    if not s["engine_alive"]:
        problems.append("the engine died")
    if after[-1]["rss_mib"] > after[0]["rss_mib"] * 1.05:
        problems.append(f"resident memory grew from {after[0]['rss_mib']} to {after[-1]['rss_mib']} MiB")
    # The arena: exactly one file all along. Descriptors: an HTTP connection
    # of the sampler or a client may be open at the moment of a sample, so
    # the count may move by a couple, but never grow away from the start.
    shm = {x["shm_files"] for x in after}
    if shm != ({1} if s.get("kvtier", True) else {0}):
        problems.append(f"shm_files not constantly 1: {sorted(shm)}")
    fds = [x["open_files"] for x in after]
    if max(fds) > fds[0] + 2 or fds[-1] > fds[0] + 1:
        problems.append(f"open_files grew: {fds[0]} -> max {max(fds)}, last {fds[-1]}")
    if any(x["requests"] == 0 for x in after):
        problems.append("an interval finished no request (stall)")
    med = statistics.median(x["req_per_s"] for x in after)
    if any(x["req_per_s"] < med / 2 for x in after):
        problems.append(f"throughput fell under half its median ({med} req/s)")
    first, last = after[0], after[-1]
    if s.get("kvtier", True) and (last["dram_evictions"] <= first["dram_evictions"]
                                  or last["ssd_evictions"] <= first["ssd_evictions"]):
        problems.append("a tier did not evict during the run: not under pressure")
    return problems


ALLOCATORS = {"tcmalloc": "libtcmalloc_minimal.so.4", "jemalloc": "libjemalloc.so.2"}


def preload_library(name: str) -> str:
    """The path of allocator ``name``'s shared library (Debian's
    libtcmalloc-minimal4 / libjemalloc2), or an error that says what to install."""
    soname = ALLOCATORS[name]
    for folder in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"):
        path = os.path.join(folder, soname)
        if os.path.exists(path):
            return path
    pkg = "libtcmalloc-minimal4" if name == "tcmalloc" else "libjemalloc2"
    raise SystemExit(f"soak: --allocator {name}: {soname} not found; install it (apt-get install {pkg}) "
                     "or pass --allocator glibc")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--interval", type=float, default=30.0, help="seconds between samples")
    # Four minutes: vLLM's CPU matmuls keep a oneDNN primitive per batch
    # size (up to 32 per linear layer) and fill those caches as batch sizes
    # vary; a heap profile puts 95 % of the growth before the plateau there
    # (docs/reliability.md, "Where the growth is").
    ap.add_argument("--warmup", type=int, default=8, help="intervals left out of the verdict")
    ap.add_argument("--workdir", default="")
    ap.add_argument("--vllm-alone", action="store_true",
                    help="the same load without kvtier: the peer whose memory growth kvtier's is read against")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="set in the server's environment (e.g. MALLOC_ARENA_MAX=2); repeatable")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a kvtier connector key for this run (e.g. dram_size=32MB); repeatable")
    ap.add_argument("--num-gpu-blocks", type=int, default=128,
                    help="vLLM's device cache in blocks (128 keeps it far below the working set of 2,400)")
    ap.add_argument("--allocator", choices=("tcmalloc", "glibc", "jemalloc"), default="tcmalloc",
                    help="the server's malloc: tcmalloc (LD_PRELOAD, as vLLM's CPU install guide sets up and its "
                         "worker asks for at start), glibc's own, or jemalloc")
    args = ap.parse_args()
    env = dict(kv.split("=", 1) for kv in args.env)
    if args.allocator != "glibc":
        lib = preload_library(args.allocator)
        env["LD_PRELOAD"] = " ".join(x for x in (env.get("LD_PRELOAD", ""), lib) if x)
    overrides = dict(kv.split("=", 1) for kv in args.set)
    s = soak(args.streams, args.minutes, args.interval, args.warmup, args.workdir, kvtier=not args.vllm_alone,
             env=env, overrides=overrides, num_gpu_blocks=args.num_gpu_blocks)
    s["kvtier"] = not args.vllm_alone
    s["allocator"] = args.allocator
    problems = verdict(s)
    s["verdict"] = problems or "pass"
    print(json.dumps({k: v for k, v in s.items() if k != "samples"}, indent=2))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
