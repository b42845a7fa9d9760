"""``kvtier serve`` on vLLM's CPU build: instances on cores of their own against instances that share them.

Starts ``kvtier serve --instances 2`` (the real command, the test model,
a meta service, no prefix ever repeated: 0 % hits) in two ways, one after
the other: with each instance on cores of its own (the default) and with
``--share-cores`` (every instance bound as vLLM binds a lone one: on a
host of one NUMA node, every core). Both with
``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (as the tests run vLLM: on a small
host every core in the OpenMP teams). The peer is the other way, measured in the same run; with
``--sets N`` the two alternate N times each (split, shared, shared, split,
...), so that a slow phase of the machine falls on both. Per way:

* ``ttft_idle``: TTFT of a cold ``--prompt-tokens`` prompt on one
  instance while the other is idle (after ``--gap`` seconds of quiet),
  instances in turn: what a lone request pays for having fewer cores;
* ``ttft_busy``: the same while the other instance serves a stream of
  ``--concurrency`` concurrent 2k-token prompts: what a neighbour costs;
* ``throughput``: tokens per second (prompt and generated) of
  ``--concurrency`` concurrent 2k-token prompts (64 generated tokens
  each) split over both instances.

Every prompt is drawn from a seed of its own (:class:`Seeds`): none is
ever sent twice, so every request is a cold prefill.

Each measure: the median of its samples over all sets; the ratio printed
is split / shared (for TTFT, lower is better; for throughput, higher).

Usage: .venv/bin/python bench/serve.py [--sets 1] [--rounds 4] [--tput-reps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from kvtier.tools.client import QUIET_S, quiet_ttft, random_prompt, stream_completion
from kvtier.tools.model import build_model
from kvtier.tools.serve import host_cpus, physical_cores

KVTIER = str(Path(sys.executable).parent / "kvtier")


class Served:
    """``kvtier serve`` in a process of its own; its instances' URLs."""

    def __init__(self, model: str, log_dir: Path, share: bool, args: argparse.Namespace) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MMC_")}  # loopback defaults
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="0", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
        vllm = ["--served-model-name", "model", "--dtype", args.dtype, "--block-size", str(args.block),
                "--max-num-batched-tokens", str(args.chunk), "--max-model-len", str(args.prompt_tokens + 256),
                "--gpu-memory-utilization", "0.3", "--enforce-eager", "--seed", "0"]
        self.log_dir = log_dir
        self.proc = subprocess.Popen([KVTIER, "serve", "--model", model, "--instances", "2", "--log-dir",
                                      str(log_dir), *(["--share-cores"] if share else []), "--", *vllm],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        self.lines: list[str] = []
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("serving;"):
                break
        else:
            raise RuntimeError("kvtier serve did not start:\n" + "\n".join(self.lines[-30:]))
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()
        self.urls = [m.group(1) for x in self.lines if (m := re.match(r"instance \d+\s+(http://\S+)/v1", x))]
        self.cores = [m.group(1) for x in self.lines if (m := re.search(r", cores (\S+)\)", x))]

    def stop(self) -> None:
        subprocess.run([KVTIER, "stop", "--log-dir", str(self.log_dir)], capture_output=True, timeout=300)
        self.proc.wait(120)


class Seeds:
    """Seeds never handed out twice in a run (threads take them too)."""

    def __init__(self) -> None:
        self._next = 0
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            self._next += 1
            return self._next


def measure(served: Served, args: argparse.Namespace, vocab: int, seeds: Seeds) -> dict:
    a, b = served.urls
    out: dict = {"ttft_idle": [], "ttft_busy": [], "throughput": []}

    def batch(client: httpx.Client, urls: list[str]) -> float:
        prompts = [random_prompt(seeds.take(), 2048, vocab) for _ in range(args.concurrency)]
        t = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as ex:
            rs = list(ex.map(lambda ip: stream_completion(client, urls[ip[0] % len(urls)], ip[1], max_tokens=64,
                                                          ignore_eos=True), enumerate(prompts)))
        wall = time.perf_counter() - t
        if not all(r.ok for r in rs):
            raise RuntimeError([r.error for r in rs if not r.ok])
        return sum(r.prompt_tokens + r.completion_tokens for r in rs) / wall

    with httpx.Client(timeout=600) as client:
        batch(client, [a, b])  # each instance's first batch: one-time set-up, not counted
        for i in range(args.rounds):
            out["ttft_idle"].append(quiet_ttft(client, (a, b)[i % 2],
                                               random_prompt(seeds.take(), args.prompt_tokens, vocab), args.gap))
        for i in range(args.rounds):
            target, other = ((a, b), (b, a))[i % 2]
            stop = threading.Event()
            failed: list[BaseException] = []

            def load(url: str = other) -> None:
                try:
                    while not stop.is_set():
                        batch(client, [url])
                except BaseException as err:  # noqa: BLE001 - raised again below, not lost with the thread
                    failed.append(err)
            loader = threading.Thread(target=load, daemon=True)
            time.sleep(args.gap)
            loader.start()
            try:
                time.sleep(2.0)  # the neighbour's batch under way
                r = stream_completion(client, target, random_prompt(seeds.take(), args.prompt_tokens, vocab),
                                      max_tokens=4)
            finally:
                stop.set()
                loader.join()
            if failed:  # the neighbour was not busy all along: the sample would be an idle one
                raise RuntimeError(f"the neighbour's load failed: {failed[0]!r}")
            if not r.ok:
                raise RuntimeError(r.error)
            out["ttft_busy"].append(r.ttft_s)
        for _ in range(args.tput_reps):
            time.sleep(args.gap)
            out["throughput"].append(batch(client, [a, b]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", default="bench", help="test model (kvtier.tools.model.GEOMETRIES)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=2048, help="--max-num-batched-tokens")
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=4, help="TTFT prompts per measure and set")
    ap.add_argument("--tput-reps", type=int, default=3, help="throughput runs per set")
    ap.add_argument("--concurrency", type=int, default=16, help="concurrent 2k-token prompts")
    ap.add_argument("--sets", type=int, default=1, help="times each way is started (alternating)")
    ap.add_argument("--gap", type=float, default=QUIET_S, help="seconds of quiet before a timed request")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cores = len(physical_cores(host_cpus()))
    if cores < 2:
        print(f"{cores} core here: nothing to split", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    model = str(build_model(args.geometry, dtype=args.dtype))
    vocab = len(AutoTokenizer.from_pretrained(model))
    logs = Path(tempfile.mkdtemp(prefix="kvtier-bench-serve-"))
    samples: dict[str, dict[str, list[float]]] = {w: {"ttft_idle": [], "ttft_busy": [], "throughput": []}
                                                  for w in ("split", "shared")}
    shares: list[str] = []
    seeds = Seeds()
    for s in range(args.sets):
        for way in (("split", "shared") if s % 2 == 0 else ("shared", "split")):
            served = Served(model, logs / f"{way}-{s}", way == "shared", args)
            try:
                if way == "split":
                    shares = served.cores
                got = measure(served, args, vocab, seeds)
            finally:
                served.stop()
            for k, v in got.items():
                samples[way][k] += v
            print(f"set {s} {way}: " + ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in got.items()),
                  flush=True)
    med = {w: {k: statistics.median(v) for k, v in m.items()} for w, m in samples.items()}
    print(f"\n{cores} physical cores; split: {' and '.join(shares) or '?'}; "
          f"{args.sets} set(s), {args.prompt_tokens}-token prompts, concurrency {args.concurrency}")
    print(f"{'measure':<34} {'split':>10} {'shared':>10} {'split/shared':>13}")
    for k, unit, scale in (("ttft_idle", "ms", 1e3), ("ttft_busy", "ms", 1e3), ("throughput", "tok/s", 1.0)):
        print(f"{k + ' (' + unit + ', median)':<34} {med['split'][k] * scale:>10.1f} {med['shared'][k] * scale:>10.1f} "
              f"{med['split'][k] / med['shared'][k]:>12.3f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "cores": cores, "shares": shares,
                                               "samples": samples, "medians": med}, indent=1))
    print(f"logs: {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
