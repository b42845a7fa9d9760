"""The node pool: lookups through the meta service, calls as instances are added, TTFT across instances.

Three measurements, each against a peer measured in the same run:

* ``lookup`` (no vLLM): probe of a 64k-token request (4,096 keys of blocks
  of 16 tokens, 1,024 keys of blocks of 64) through a meta service in its
  own process (``python -m kvtier.meta`` started from generated config
  files, as :class:`~kvtier.tools.meta.MetaProcess` does), over a Unix
  socket and over TCP on loopback. Peer: the same calls on a store in this
  process (:class:`~kvtier.placement.EmbeddedPlacement`, the embedded
  backend) holding the same keys, each call given them in new objects, as
  a new request has them (:func:`fresh_keys`). The service gets the keys
  as the connector hands them, a :class:`~kvtier.keys.KeyRun` whose buffer
  the client sends (the connector joins a request's keys once, as they
  are made). The service's own time in
  its store comes from its /metrics (``kvtier_pool_rpc_seconds``, mean):
  the rest of a call is the wire (MessagePack both ways, the socket, two threads
  waking). Also the round trip of an empty request (``Ping``) on a raw
  session, the wire alone. Goal: p99 <= 1 ms through the service.
  Then the load's next call, the pin of the 4,096 keys (each pin's step
  completed, not timed, before the next), the same ways.
  ``--against SRC``: instead, the probes to this tree's service and to one
  running the code of SRC (an export of another commit's ``src``), in turn
  from one client, 50 calls each at a time (:func:`run_lookup_against`).
  ``--gap-ms``: a pause between calls, not timed (a scheduler probes a
  request, then runs steps); back to back, a probe also waits for the
  service to finish refreshing the previous probe's run.
* ``scale`` (no vLLM): 1, 2 and 4 client processes, each its own
  :class:`~kvtier.pool.client.PoolPlacement` on one service, each looping
  for ``--seconds`` over: save a new prefix of its own (prepare_save, seal
  every slot as a worker does through ``DramTier.attach``, complete_step),
  load the prefix all clients share (probe, pin, complete_step) and load its
  own last prefix (probe, pin, complete_step). Pool calls per second in all
  and per client, and the p50 / p99 of the shared prefix's probe as clients
  are added. Peers: one client's rate, and the same loop on a store in this
  process (no socket). The pool is small enough that saves evict all along.
* ``ttft`` (runs vLLM CPU servers, two or three at a time, one request at
  a time): TTFT of an 8k-token prompt on instance B after instance A
  prefilled it (a DRAM hit across instances, through the pool) against a
  device hit on A and against the DRAM hit of an embedded-backend instance
  running beside them, sample by sample; and with
  no prefix ever repeated, TTFT and throughput of two instances on the
  pool against two instances of vLLM alone running beside them, request
  by request and run by run in turn. Goals: cross-instance hit <=
  1.15x the device hit and within 5 % of the embedded hit; 0 % hits within
  3 % of vLLM alone. Also B's load time of each hit (copies and
  checksums, from its counters) against the same load outside vLLM
  measured in the same run (bench/blockcopy.py). Each instance of vLLM
  keeps its own speed for its life (two identical pairs of vLLM alone
  measured side by side ran up to 8 % apart): ``--sets N`` runs the 0 %
  hits phase on N sets of new instances in turn and pools the samples,
  and ``--control`` adds a second pair of vLLM alone to each, compared
  with the first the same way (the spread of the ratios between
  identical configurations).

Usage: .venv/bin/python bench/pool.py {lookup,scale,ttft,all} [--seconds 10] [--json out.json]
       lookup: [--tokens 65536] [--reps 1000] [--ssd] [--gap-ms 0] | [--against SRC [--transport unix]]
       scale:  [--clients 1,2,4] [--transport tcp|unix] [--shared-blocks 1024] [--own-blocks 32]
       ttft:   [--geometry bench] [--prompt-tokens 8192] [--rounds 5] [--hit-reps 3] [--gap 2.0]
               [--concurrency 8] [--tput-reps 4] [--dram-size 2GB] [--hits-only | --no-hits]
               [--kv-warm-interval S] [--sets N] [--control] [--bind]
               [--env KEY=VALUE] [--kvtier KEY=VALUE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import random
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import numpy as np

from kvtier.config import KvtierConfig, parse_size
from kvtier.keys import KeyNamespace, KeyRun, block_keys
from kvtier.placement import EmbeddedPlacement, Placement, open_store
from kvtier.pool import wire
from kvtier.pool.client import PoolPlacement
from kvtier.pool.service import parse_url
from kvtier.tier.dram import DramTier, checksum
from kvtier.tools.client import QUIET_S
from kvtier.tools.meta import MetaProcess
from kvtier.tools.server import free_port, parse_metrics

GOAL_LOOKUP_P99_US = 1000.0
GOAL_DRAM_OVER_DEVICE = 1.15
GOAL_POOL_OVER_EMBEDDED = 0.05  # within 5 %
GOAL_NO_HIT = 0.03  # within 3 %
RANK_BYTES = 4096  # the index's cost does not depend on the block's size; a small arena does
RANKS = 1
AGAINST_BLOCK = 50  # lookup --against: calls to one service before the other's turn
SSD_SIZE = "256MB"  # lookup --ssd: an SSD tier larger than the keys probed (its size does not change a probe)


def percentiles_us(samples_s: Sequence[float], qs: Sequence[float] = (50, 99)) -> list[float]:
    """Percentiles ``qs`` of durations in seconds, in microseconds (numpy's linear interpolation)."""
    if not samples_s:
        return [float("nan")] * len(qs)
    return [float(v) for v in np.percentile(np.asarray(samples_s, dtype=np.float64) * 1e6, list(qs))]


def shm_root() -> str:
    """Where arenas go: /dev/shm, as in a deployment, unless it is missing."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


# --- a meta service in its own process -------------------------------------------


def write_configs(folder: Path, url: str, dram_size: str, shm_dir: str,
                  warm_interval: float | None = None, ssd_file: str | None = None) -> tuple[Path, Path]:
    """The two files the seeds give ``kvtier meta``: one device of ``dram_size``;
    ``warm_interval``: the arena's ``kvtier.warm_interval`` (None: kvtier's default);
    ``ssd_file``: an SSD tier of ``SSD_SIZE`` on that file (None: no SSD)."""
    meta = folder / "mmc-meta.conf"
    meta.write_text(f"ock.mmc.meta_service_url = {url}\n"
                    f"ock.mmc.meta_service.metrics_url = http://127.0.0.1:{free_port()}\n"
                    "ock.mmc.meta.lease_ttl_ms = 30000\n"
                    "ock.mmc.evict_threshold_high = 90\n"
                    "ock.mmc.evict_threshold_low = 80\n")
    local = folder / "mmc-local.conf"
    local.write_text(f"ock.mmc.meta_service_url = {url}\n"
                     "ock.mmc.local_service.protocol = host_shm\n"
                     f"ock.mmc.local_service.dram.size = {dram_size}\n"
                     "ock.mmc.local_service.world_size = 1\n"
                     + ("ock.mmc.local_service.storage.enabled = false\n" if ssd_file is None else
                        "ock.mmc.local_service.storage.enabled = true\n"
                        f"ubsio.disk.path = {ssd_file}\n"
                        f"kvtier.ssd_size = {SSD_SIZE}\n")
                     + f"kvtier.shm_dir = {shm_dir}\n"
                     + ("" if warm_interval is None else f"kvtier.warm_interval = {warm_interval}\n"))
    return meta, local


@contextmanager
def meta_service(transport: str, dram_size: str, warm_interval: float | None = None,
                 ssd: bool = False, env: dict[str, str] | None = None) -> Iterator[MetaProcess]:
    """A meta service on a Unix socket or on TCP loopback, its files, socket,
    log, arena and (``ssd``) SSD file in temporary folders removed on exit;
    ``env``: more environment variables of its process."""
    folder = Path(tempfile.mkdtemp(prefix="kvtier-bench-pool-"))
    shm = ""
    try:  # the folders go whatever fails after they are made
        shm = tempfile.mkdtemp(prefix="kvtier-bench-pool-", dir=shm_root())
        url = f"unix://{folder}/meta.sock" if transport == "unix" else f"tcp://127.0.0.1:{free_port()}"
        meta_conf, local_conf = write_configs(folder, url, dram_size, shm, warm_interval,
                                              ssd_file=str(folder / "ssd") if ssd else None)
        proc = MetaProcess(meta_conf, local_conf, log_path=folder / "meta.log", env=env)
        with proc:
            yield proc
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if shm:
            shutil.rmtree(shm, ignore_errors=True)


@contextmanager
def embedded_store(dram_size_bytes: int, ssd: bool = False) -> Iterator[EmbeddedPlacement]:
    """The embedded backend's store in this process, with the service's
    watermarks; ``ssd``: with an SSD tier of ``SSD_SIZE`` on a temporary file."""
    shm = tempfile.mkdtemp(prefix="kvtier-bench-pool-", dir=shm_root())
    disk = None
    placement = None
    try:  # the folders go whatever fails after they are made
        disk = tempfile.mkdtemp(prefix="kvtier-bench-pool-") if ssd else None
        cfg = KvtierConfig(dram_size_bytes=dram_size_bytes, shm_dir=shm, evict_threshold_high=90.0,
                           evict_threshold_low=80.0,
                           ssd_paths=(os.path.join(disk, "ssd"),) if disk else (),
                           ssd_size_bytes=parse_size("kvtier.ssd_size", SSD_SIZE) if disk else None)
        placement = EmbeddedPlacement(open_store(cfg, os.path.join(shm, "arena"), RANK_BYTES, RANKS, bytes(16),
                                                 reaper=False))
        yield placement
    finally:
        if placement is not None:
            placement.shutdown()
        shutil.rmtree(shm, ignore_errors=True)
        if disk:
            shutil.rmtree(disk, ignore_errors=True)


class PingSession:
    """A session on the raw wire: Hello, then empty requests. What a call
    costs before the store does anything (framing, MessagePack, the socket,
    the service's thread); the client's own lock and bookkeeping excluded."""

    def __init__(self, url: str) -> None:
        scheme, host, port = parse_url(url)
        if scheme == "unix":
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(host)
        else:
            self.sock = socket.create_connection((host, port))
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(wire.encode(wire.Hello(wire.PROTOCOL_VERSION, os.environ.get("KVTIER_TOKEN", ""),
                                                 "bench-ping", os.getpid(), RANKS, RANK_BYTES)))
        self._expect(wire.Welcome)
        self._id = 0

    def _expect(self, kind: type) -> object:
        body = wire.recv_frame(self.sock)
        msg = wire.decode_server(body) if body is not None else None
        if not isinstance(msg, kind):
            raise RuntimeError(f"expected {kind.__name__} from the meta service, got {msg!r}")
        return msg

    def ping(self) -> None:
        self._id += 1
        self.sock.sendall(wire.encode(wire.Ping(self._id)))
        self._expect(wire.Ok)

    def close(self) -> None:
        self.sock.close()


def seal(tier: DramTier, keys: Sequence[bytes], slots: Sequence[int | None]) -> None:
    """What each worker does after copying its part of a block: checksum it and seal the slot."""
    for key, slot in zip(keys, slots):
        if slot is not None:
            tier.seal(slot, key, 0, checksum(tier.rank_view(slot, 0), key))


def save(placement: Placement, tier: DramTier, keys: Sequence[bytes], step: int) -> int:
    """prepare_save, seal, complete_step: one step's saves. Returns how many keys got a slot."""
    slots = placement.prepare_save(keys, step)
    seal(tier, keys, slots)
    placement.complete_step(step)
    return sum(s is not None for s in slots)


def request_keys(seed: int, tokens: int, block: int) -> list[bytes]:
    rng = random.Random(seed)
    ids = [rng.randrange(16, 128_000) for _ in range(tokens)]
    ns = KeyNamespace(model="bench-pool", dtype="torch.bfloat16", layout="cpu", block_tokens=block)
    return block_keys(ns.seed(), ids, block)


# --- lookup -----------------------------------------------------------------------


def time_calls(fn: Callable[..., object], n: int, gap_s: float = 0.0,
               make_arg: Callable[[], object] | None = None) -> list[float]:
    """Seconds of each of ``n`` calls, ``gap_s`` apart (the gap not timed);
    with ``make_arg``, each call is ``fn(make_arg())``, the argument made
    before the timing."""
    out = []
    for _ in range(n):
        arg = make_arg() if make_arg is not None else None
        t = time.perf_counter()
        if make_arg is not None:
            fn(arg)
        else:
            fn()
        out.append(time.perf_counter() - t)
        if gap_s:
            time.sleep(gap_s)
    return out


def service_probe_seconds(meta: MetaProcess, call: str = "Probe") -> tuple[float, float]:
    """(seconds, calls) the service has spent in its store on ``call`` so far (its /metrics)."""
    m = parse_metrics(httpx.get(meta.metrics_url + "/metrics", timeout=10).text)
    return (m.get(f'kvtier_pool_rpc_seconds_sum{{call="{call}"}}', 0.0),
            m.get(f'kvtier_pool_rpc_seconds_count{{call="{call}"}}', 0.0))


def fresh_keys(keys: Sequence[bytes]) -> list[bytes]:
    """Equal keys in new objects, as a new request's scheduler computes
    them (and as the service decodes them): Python has not hashed them yet.
    A store probed again and again with the same objects finds each key's
    hash cached, and its lookup costs half as much as a new request's."""
    return wire.unpack_keys(wire.pack_keys(keys))


def time_pins(placement: Placement, keys: list[bytes], n: int, first_step: int, gap_s: float) -> list[float]:
    """Seconds of each of ``n`` pins of ``keys``, each for a step of its own
    that is completed (not timed) before the next pin, as a load's step is.
    The same key objects each time: a scheduler pins the keys it probed."""
    out = []
    for step in range(first_step, first_step + n):
        t = time.perf_counter()
        slots = placement.pin(keys, step)
        out.append(time.perf_counter() - t)
        assert None not in slots, "a block of the request was not pinned"
        placement.complete_step(step)
        if isinstance(placement, PoolPlacement):
            placement.flush()  # the service has unpinned them: the next pin starts from the same state
        if gap_s:
            time.sleep(gap_s)
    return out


def lookup_requests(tokens: int) -> tuple[dict[int, KeyRun], int]:
    """The lookup's requests of ``tokens`` tokens by block size (16 and 64),
    their keys as the connector hands them (the list, and the buffer made
    with the keys), and the DRAM bytes that hold both below the low
    watermark (80 %): nothing is evicted."""
    requests = {b: KeyRun(k, b"".join(k)) for b in (16, 64) for k in [request_keys(b, tokens, b)]}
    needed = sum(len(k) for k in requests.values())
    return requests, -(-int(needed / 0.7 * (RANK_BYTES + 512)) // (2 << 20)) * (2 << 20)


def save_requests(placement: Placement, tier: DramTier, requests: dict[int, KeyRun], step: int | None = None) -> None:
    """Save every request (in step ``step``, or in the step of its block size), then check that a probe finds it."""
    for b, keys in requests.items():
        assert save(placement, tier, keys, step=b if step is None else step) == len(keys), "no room for a request"
        assert placement.probe(keys).ready == len(keys)


def wait_mapped(pool: PoolPlacement, requests: dict[int, KeyRun], timeout_s: float = 30.0) -> None:
    """Until the service's ready index holds the requests saved: a few tens
    of ms after their saves (READY_LAG_S, or the service's timer), their
    lookups are counted without a call."""
    deadline = time.monotonic() + timeout_s
    for keys in requests.values():
        while True:
            before = pool.mapped_lookups
            assert pool.probe(keys).ready == len(keys)
            if pool.mapped_lookups > before:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the service's ready index never held the requests saved")
            time.sleep(0.01)


def run_lookup(args: argparse.Namespace) -> dict:
    requests, dram_bytes = lookup_requests(args.tokens)
    blocks = tuple(requests)
    rounds = 10  # the service's and the in-process probes alternate in rounds: both see the same noise
    per_round = max(1, args.reps // rounds)
    gap = args.gap_ms / 1000
    out: dict = {"tokens": args.tokens, "reps": per_round * rounds, "ssd": args.ssd, "gap_ms": args.gap_ms,
                 "rows": []}

    with embedded_store(dram_bytes, ssd=args.ssd) as local:
        out["embedded_ssd_slots"] = local.store.ssd.num_slots if local.store.ssd is not None else 0
        save_requests(local, local.store.tier, requests, step=0)
        for transport in ("unix", "tcp"):
            with meta_service(transport, str(dram_bytes), ssd=args.ssd) as meta:
                pool = PoolPlacement(meta.address, ranks=RANKS, rank_bytes=RANK_BYTES, name="bench-lookup")
                # The same lookups as calls: the service's ready index not mapped.
                called = PoolPlacement(meta.address, ranks=RANKS, rank_bytes=RANK_BYTES, name="bench-lookup-call",
                                       map_ready=False)
                tier = DramTier.attach(pool.arena_path)
                try:
                    m = parse_metrics(httpx.get(meta.metrics_url + "/metrics", timeout=10).text)
                    out.setdefault("ssd_bytes", {})[transport] = m.get('kvtier_pool_capacity_bytes{tier="ssd"}', 0.0)
                    save_requests(pool, tier, requests)
                    wait_mapped(pool, requests)
                    for b, keys in requests.items():
                        remote: list[float] = []
                        by_call: list[float] = []
                        here: list[float] = []
                        known: list[float] = []
                        # A request whose last block is new (a conversation's
                        # next turn): the run stops before the last key.
                        new = hashlib.blake2b(b"new turn", digest_size=16).digest()
                        partial = KeyRun([*keys, new], keys.packed + new)
                        head: list[float] = []
                        head_call: list[float] = []
                        spent = [0.0, 0.0]  # the service's seconds and calls in its store, for the probes by call
                        mapped, heads = pool.mapped_lookups, pool.mapped_heads
                        for _ in range(rounds):
                            remote += time_calls(lambda: pool.probe(keys), per_round, gap)
                            before = service_probe_seconds(meta)
                            by_call += time_calls(lambda: called.probe(keys), per_round, gap)
                            after = service_probe_seconds(meta)
                            spent = [spent[0] + after[0] - before[0], spent[1] + after[1] - before[1]]
                            head += time_calls(lambda: pool.probe(partial), per_round, gap)
                            head_call += time_calls(lambda: called.probe(partial), per_round, gap)
                            here += time_calls(local.probe, per_round, gap, make_arg=lambda: fresh_keys(keys))
                            known += time_calls(lambda: local.probe(keys), per_round, gap)
                        in_store = spent[0] / max(1.0, spent[1])
                        out["rows"].append({"transport": transport, "block": b, "keys": len(keys),
                                            "service_s": remote, "by_call_s": by_call,
                                            "mapped": (pool.mapped_lookups - mapped) / len(remote),
                                            "last_new_s": head, "last_new_by_call_s": head_call,
                                            "heads": (pool.mapped_heads - heads) / len(head),
                                            "embedded_s": here, "embedded_known_s": known,
                                            "in_store_s": in_store})
                    # The load's next call: the scheduler pins the blocks it found.
                    keys = requests[blocks[0]]
                    remote, here = [], []
                    before = service_probe_seconds(meta, "Pin")
                    for r in range(rounds):
                        first = 1000 + r * per_round
                        remote += time_pins(pool, keys, per_round, first, gap)
                        here += time_pins(local, keys, per_round, first, gap)
                    after = service_probe_seconds(meta, "Pin")
                    out["rows"].append({"transport": transport, "block": blocks[0], "keys": len(keys), "call": "pin",
                                        "service_s": remote, "embedded_s": here,
                                        "in_store_s": (after[0] - before[0]) / max(1.0, after[1] - before[1])})
                    ping = PingSession(meta.address)
                    try:
                        time_calls(ping.ping, 50)
                        out["rows"].append({"transport": transport, "block": 0, "keys": 0,
                                            "service_s": time_calls(ping.ping, per_round * rounds, gap),
                                            "embedded_s": []})
                    finally:
                        ping.close()
                finally:
                    tier.close()
                    pool.shutdown()
                    called.shutdown()
    return out


def run_lookup_against(args: argparse.Namespace) -> dict:
    """Probes of one client to two meta services in turn: one running this
    tree's code, one the code at ``args.against`` (a ``src`` folder, an
    export of another commit), in blocks of ``AGAINST_BLOCK`` calls, the
    order swapped every block, so both see the same noise (on a noisy host
    two runs one after the other differ more than the versions do). The
    client's code is this tree's for both, and it looks up by call (the
    ready index not mapped): the services' probes are what is compared."""
    requests, dram_bytes = lookup_requests(args.tokens)
    rounds = max(2, args.reps // AGAINST_BLOCK)
    transport = "unix" if args.transport == "unix" else "tcp"
    out: dict = {"tokens": args.tokens, "reps": rounds * AGAINST_BLOCK, "against": args.against,
                 "transport": transport, "rows": []}
    with ExitStack() as stack:
        pools: dict[str, PoolPlacement] = {}
        metas: dict[str, MetaProcess] = {}
        here = Path(__file__).resolve().parents[1] / "src"  # this tree's, whatever PYTHONPATH says
        for side, src in (("this tree", str(here)), ("against", args.against)):
            env = {"PYTHONPATH": os.pathsep.join([os.path.abspath(src), os.environ.get("PYTHONPATH", "")])}
            meta = stack.enter_context(meta_service(transport, str(dram_bytes), env=env))
            pool = PoolPlacement(meta.address, ranks=RANKS, rank_bytes=RANK_BYTES, name=f"bench-{side}",
                                 map_ready=False)  # the services are compared: every lookup a call
            stack.callback(pool.shutdown)
            tier = DramTier.attach(pool.arena_path)
            stack.callback(tier.close)
            save_requests(pool, tier, requests)
            pools[side], metas[side] = pool, meta
        for b, keys in requests.items():
            times: dict[str, list[float]] = {side: [] for side in pools}
            before = {side: service_probe_seconds(m) for side, m in metas.items()}
            for r in range(rounds):
                for side in (list(pools) if r % 2 == 0 else list(pools)[::-1]):
                    times[side] += time_calls(lambda: pools[side].probe(keys), AGAINST_BLOCK)
            after = {side: service_probe_seconds(m) for side, m in metas.items()}
            out["rows"].append({"block": b, "keys": len(keys), "times_s": times, "in_store_s": {
                side: (after[side][0] - before[side][0]) / max(1.0, after[side][1] - before[side][1])
                for side in pools}})
    return out


def print_lookup_against(res: dict) -> None:
    via = "Unix socket" if res["transport"] == "unix" else "TCP loopback"
    print(f"\n## Lookup of a {res['tokens']}-token request: this tree's meta service against "
          f"{res['against']}'s, in turn ({res['reps']} calls each, {via})\n")
    print("| probe | this tree, p50 / p99 (us) | against, p50 / p99 (us) | in the store, mean, this / against (us) "
          "| this / against, p50 | this / against, p99 |")
    print("|---|---|---|---|---|---|")
    for row in res["rows"]:
        (a50, a99), (b50, b99) = (percentiles_us(row["times_s"][side]) for side in ("this tree", "against"))
        st = row["in_store_s"]
        print(f"| {row['keys']} keys (block {row['block']}) | {a50:.0f} / {a99:.0f} | {b50:.0f} / {b99:.0f} | "
              f"{st['this tree'] * 1e6:.0f} / {st['against'] * 1e6:.0f} | {a50 / b50:.2f}x | {a99 / b99:.2f}x |")


def print_lookup(res: dict) -> None:
    print(f"\n## Lookup of a {res['tokens']}-token request through the meta service "
          f"({res['reps']} calls each{', SSD tier on' if res.get('ssd') else ''}"
          f"{', %g ms apart' % res['gap_ms'] if res.get('gap_ms') else ''})\n")
    print("(in process, a new request: the keys in new objects, as the service decodes them; keys known: the "
          "same objects again, their hashes cached, as a scheduler asks again for a waiting request; "
          "a pin's peer is always the keys known)\n")
    print("| call | via | p50 (us) | p99 (us) | of which in the service's store, mean (us) | "
          "in process, a new request, p50 / p99 (us) | in process, keys known, p50 / p99 (us) | "
          "service / in process (p50; a probe's: a new request) | goal: p99 <= 1000 us |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in res["rows"]:
        s50, s99 = percentiles_us(row["service_s"])
        via = "Unix socket" if row["transport"] == "unix" else "TCP loopback"
        if not row["keys"]:
            print(f"| round trip alone (Ping) | {via} | {s50:.0f} | {s99:.0f} | | | | | |")
            continue
        e50, e99 = percentiles_us(row["embedded_s"])
        call = row.get("call", "probe")
        goal = f"{s99 / GOAL_LOOKUP_P99_US:.2f}x of budget" if call == "probe" else ""
        if "embedded_known_s" in row:
            k50, k99 = percentiles_us(row["embedded_known_s"])
            new, known = f"{e50:.0f} / {e99:.0f}", f"{k50:.0f} / {k99:.0f}"
        else:
            new, known = "", f"{e50:.0f} / {e99:.0f}"
        what = f"{call} {row['keys']} keys (block {row['block']})"
        store = f"{row['in_store_s'] * 1e6:.0f}"
        if "by_call_s" in row:  # the instance counted in the mapped ready index, the service told
            c50, c99 = percentiles_us(row["by_call_s"])
            print(f"| {what}, by call | {via} | {c50:.0f} | {c99:.0f} | {store} | {new} | {known} | "
                  f"{c50 / e50:.2f}x | {c99 / GOAL_LOOKUP_P99_US:.2f}x of budget |")
            print(f"| {what}, ready index mapped ({row['mapped']:.0%} without a call) | {via} | {s50:.0f} | "
                  f"{s99:.0f} | | {new} | {known} | {s50 / e50:.2f}x | {goal} |")
            mapped_label = f", ready index mapped ({row['heads']:.0%} of heads counted there)"
            for label, times in ((", by call", row["last_new_by_call_s"]), (mapped_label, row["last_new_s"])):
                h50, h99 = percentiles_us(times)
                print(f"| {call} {row['keys'] + 1} keys, the last one new{label} | {via} | {h50:.0f} | {h99:.0f} | "
                      f"| | | | |")
            continue
        print(f"| {what} | {via} | {s50:.0f} | {s99:.0f} | {store} | {new} | {known} | {s50 / e50:.2f}x | {goal} |")


# --- scale ------------------------------------------------------------------------


def scale_loop(placement: Placement, tier: DramTier, shared: list[bytes], seed: int, own_blocks: int,
               seconds: float) -> dict:
    """One instance's loop for ``seconds``: save a new prefix of its own, load the
    shared prefix, load its own last prefix. Returns its counts and probe times."""
    rng = random.Random(seed)
    calls = loops = saved = loaded = probes = 0
    probe_s: list[float] = []
    step = 0
    last: list[bytes] = []
    start = time.monotonic()
    end = start + seconds
    while time.monotonic() < end:
        own = [rng.randbytes(16) for _ in range(own_blocks)]  # a new prompt's keys; hashing is not measured
        step += 1
        saved += save(placement, tier, own, step)
        calls += 2
        for keys in (shared, last):
            if not keys:
                continue
            step += 1
            # A new request's keys, not hashed yet: made outside the probe's timing, inside
            # the loop's (about 50 us for 1,024 keys, on every side alike).
            request = fresh_keys(keys)
            t = time.perf_counter()
            hit = placement.probe(request).ready
            probes += 1
            if keys is shared:
                probe_s.append(time.perf_counter() - t)
            slots = placement.pin(request[:hit], step) if hit else []
            placement.complete_step(step)
            loaded += sum(s is not None for s in slots)
            calls += 3 if hit else 2
        last = own
        loops += 1
    return {"calls": calls, "loops": loops, "saved": saved, "loaded": loaded, "probe_s": probe_s,
            "probes": probes, "seconds": time.monotonic() - start}


def _client(url: str, shared: list[bytes], index: int, own_blocks: int, seconds: float,
            ready: mp.Queue, go: mp.Event, results: mp.Queue, map_ready: bool = True) -> None:
    """One client process: an instance's scheduler (its own session) and its workers (the mapped arena)."""
    pool = PoolPlacement(url, ranks=RANKS, rank_bytes=RANK_BYTES, name=f"bench-client-{index}", map_ready=map_ready)
    tier = DramTier.attach(pool.arena_path)
    try:
        ready.put(index)
        go.wait()
        res = scale_loop(pool, tier, shared, 1000 + index, own_blocks, seconds)
        res["failures"] = pool.failures
        res["mapped"] = pool.mapped_lookups  # lookups counted in the mapped ready index, without a call
        results.put((index, res))
    finally:
        tier.close()
        pool.shutdown()


def run_clients(url: str, shared: list[bytes], n: int, own_blocks: int, seconds: float,
                map_ready: bool = True) -> list[dict]:
    ctx = mp.get_context("spawn")  # the parent holds sockets and threads; a fork would copy them
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_client, args=(url, shared, i, own_blocks, seconds, ready, go, results, map_ready))
             for i in range(n)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=120)  # connected and mapped: start-up is not measured
        go.set()
        got = dict(results.get(timeout=seconds + 120) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return [got[i] for i in range(n)]


def run_scale(args: argparse.Namespace) -> dict:
    counts = [int(x) for x in args.clients.split(",")]
    shared = request_keys(7, args.shared_blocks * 64, 64)
    # The pool holds the shared prefix and a few seconds' worth of own
    # prefixes at most: saves evict all along, as on a busy node.
    dram_bytes = (args.shared_blocks + 256 * args.own_blocks) * (RANK_BYTES + 512)
    dram_bytes = -(-dram_bytes // (2 << 20)) * (2 << 20)
    out: dict = {"transport": args.transport, "seconds": args.seconds, "shared_blocks": len(shared),
                 "by_call": args.by_call,
                 "own_blocks": args.own_blocks, "cpus": os.cpu_count(), "load_avg": os.getloadavg()[0],
                 "runs": []}

    with embedded_store(dram_bytes) as local:
        save(local, local.store.tier, shared, step=0)
        res = scale_loop(local, local.store.tier, shared, 999, args.own_blocks, args.seconds)
        out["embedded"] = res

    with meta_service(args.transport, str(dram_bytes)) as meta:
        seeder = PoolPlacement(meta.address, ranks=RANKS, rank_bytes=RANK_BYTES, name="bench-seeder")
        tier = DramTier.attach(seeder.arena_path)
        try:
            assert save(seeder, tier, shared, step=1) == len(shared), "the pool had no room"
            out["num_slots"] = seeder.num_slots
        finally:
            tier.close()
            seeder.shutdown()
        for n in counts:
            clients = run_clients(meta.address, shared, n, args.own_blocks, args.seconds,
                                  map_ready=not args.by_call)
            out["runs"].append({"clients": n, "per_client": clients})
        out["pool_counters"] = meta.health()
    return out


def mapped_share(clients: list[dict]) -> float:
    """Of the clients' lookups, the share counted in the mapped ready index."""
    return sum(c.get("mapped", 0) for c in clients) / max(1, sum(c["probes"] for c in clients))


def print_scale(res: dict) -> None:
    via = "Unix socket" if res["transport"] == "unix" else "TCP loopback"
    print(f"\n## Pool calls as instances are added ({via}, {res['seconds']} s each, "
          f"{res['cpus']} CPUs, load average {res['load_avg']:.1f} at start)\n")
    print(f"Each loop: save {res['own_blocks']} new blocks (prepare_save, seal, complete_step), load the "
          f"{res['shared_blocks']}-block shared prefix and its own last prefix "
          "(probe, pin, complete_step).\n")
    if res.get("by_call"):
        print("Every lookup by call (--by-call: the clients do not map the service's ready index).\n")
    else:
        shares = ", ".join(f"{mapped_share(r['per_client']):.0%} with {r['clients']}" for r in res["runs"])
        print(f"Lookups counted in the mapped ready index where the run is whole, else by call: {shares}.\n")
    print("| instances | calls/s, all | calls/s per instance | loops/s, all | shared probe p50 / p99 (us) | "
          "all / one instance | per instance / in process | p99 goal <= 1000 us |")
    print("|---|---|---|---|---|---|---|---|")
    emb = res["embedded"]
    emb_rate = emb["calls"] / emb["seconds"]
    e50, e99 = percentiles_us(emb["probe_s"])
    print(f"| in process (embedded store, no socket) | {emb_rate:.0f} | {emb_rate:.0f} | "
          f"{emb['loops'] / emb['seconds']:.0f} | {e50:.0f} / {e99:.0f} | | 1.00x | |")
    one = None
    for run in res["runs"]:
        cl = run["per_client"]
        rate = sum(c["calls"] / c["seconds"] for c in cl)
        loops = sum(c["loops"] / c["seconds"] for c in cl)
        p50, p99 = percentiles_us([x for c in cl for x in c["probe_s"]])
        one = one or rate
        failures = sum(c["failures"] for c in cl)
        note = f" ({failures} calls missed: pool unreachable)" if failures else ""
        print(f"| {run['clients']}{note} | {rate:.0f} | {rate / run['clients']:.0f} | {loops:.0f} | "
              f"{p50:.0f} / {p99:.0f} | {rate / one:.2f}x | {rate / run['clients'] / emb_rate:.2f}x | "
              f"{p99 / GOAL_LOOKUP_P99_US:.2f}x of budget |")


# --- ttft (vLLM) -------------------------------------------------------------------


def cpu_by_process(pids: list[int]) -> dict[str, float]:
    """CPU seconds (user + system, all threads) used so far, by process name
    (/proc/<pid>/comm: vLLM's API server, engine core and worker, the meta
    service): where the work went, whatever else the machine was doing."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        name = raw[raw.index("(") + 1:raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2:].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def standalone_load_s(args: argparse.Namespace) -> float | None:
    """The median time of one hit's load (copies and checksums) outside
    vLLM, on this machine now (bench/blockcopy.py); None for a model
    whose geometry blockcopy does not know."""
    from blockcopy import run as blockcopy

    import torch

    from kvtier.layout import kv_bytes_per_token
    from kvtier.tools.model import GEOMETRIES

    geo = GEOMETRIES.get(args.geometry)
    if geo is None:
        return None
    token = kv_bytes_per_token(geo.num_layers, geo.num_kv_heads, geo.head_size, getattr(torch, args.dtype).itemsize)
    kv_bytes = max(1 << 30, 2 * (args.prompt_tokens + args.block) * token)  # the loads' sources and destinations
    res = blockcopy(argparse.Namespace(geometry=args.geometry, dtype=args.dtype, prompt_tokens=args.prompt_tokens,
                                       block=args.block, reps=15, kv_size=kv_bytes))
    return statistics.median(res["load"])


HOOK_SERIES = ("kvtier_scheduler_hook_seconds_total", "kvtier_worker_hook_seconds_total")


def hook_seconds(servers: Sequence) -> float:
    """The time the servers' engines have spent in kvtier's hooks so far
    (0 for vLLM alone, which has none)."""
    return sum(m.get(k, 0.0) for m in (srv.metrics() for srv in servers) for k in HOOK_SERIES)


def rotation(names: Sequence[str], k: int) -> list[str]:
    """``names`` starting at the ``k``-th (modulo): over ``len(names)``
    consecutive ``k`` each comes first once."""
    k %= len(names)
    return list(names[k:]) + list(names[:k])


def merge_sets(sets: list[dict[str, dict]]) -> dict[str, dict]:
    """Each configuration's samples over every set of instances (in set
    order, so that the pairs stay aligned), their medians, its CPU."""
    out = {}
    for n in sets[0]:
        ttfts = [t for s in sets for t in s[n]["ttfts"]]
        rates = [r for s in sets for r in s[n]["rates"]]
        cpu: dict[str, float] = {}
        for s in sets:
            for k, v in s[n]["cpu_s"].items():
                cpu[k] = cpu.get(k, 0.0) + v
        out[n] = {"ttft_s": statistics.median(ttfts), "ttfts": ttfts,
                  "tokens_per_s": statistics.median(rates), "rates": rates, "cpu_s": cpu,
                  "cpu_ms_per_1k_tokens": 1e6 * sum(cpu.values()) / sum(s[n]["tokens"] for s in sets),
                  "set_ttfts": [s[n]["ttfts"] for s in sets], "set_rates": [s[n]["rates"] for s in sets],
                  "hook_s_per_prompt": sum(s[n].get("hook_s", 0.0) for s in sets) / len(ttfts)}
    return out


def run_ttft(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer
    from ttft import memcpy_gbps  # bench/ttft.py: this machine's memcpy, the loads' limit

    from kvtier.tools.client import quiet_ttft, random_prompt, stream_completion
    from kvtier.tools.model import build_model
    from kvtier.tools.server import ServerOptions, VllmServer

    model = str(build_model(args.geometry, dtype=args.dtype))
    vocab = len(AutoTokenizer.from_pretrained(model))
    logs = Path(tempfile.mkdtemp(prefix="kvtier-bench-pool-ttft-"))
    common = dict(model=model, dtype=args.dtype, block_size=args.block,
                  max_num_batched_tokens=args.chunk, max_model_len=args.prompt_tokens + 256)
    hit_tokens = (args.prompt_tokens - 1) // args.block * args.block  # one token is always computed

    def prompt(seed: int, n: int) -> list[int]:
        return random_prompt(seed, n, vocab)

    def ttft(client: httpx.Client, srv: VllmServer, p: list[int]) -> float:
        return quiet_ttft(client, srv.url, p, args.gap)  # see quiet_ttft on why the gap

    def no_hits(client: httpx.Client, configs: dict[str, tuple[VllmServer, VllmServer, list[int]]],
                seed0: int) -> dict[str, dict]:
        """0 % hits, every configuration (two instances and any other
        process of theirs) up at once and measured in turn: distinct
        prompts, none repeated, each sent to every configuration (the order
        rotating) on instance A and B in turn; then throughput of
        concurrent 2k-token prompts split over a configuration's two
        instances, configurations in turn. Side by side in time, so that a
        slow phase of the machine falls on both (measured one configuration
        after the other, the two drifted 5-12 % apart between runs). Also
        the CPU seconds every process of each configuration used meanwhile,
        idle ones included."""
        names = list(configs)

        def turn(k: int) -> list[str]:
            return rotation(names, k)

        pids = {n: a.pids() + b.pids() + extra for n, (a, b, extra) in configs.items()}
        cpu0 = {n: cpu_by_process(p) for n, p in pids.items()}
        ttfts: dict[str, list[float]] = {n: [] for n in names}
        hooks0 = {n: hook_seconds(configs[n][:2]) for n in names}
        for i in range(2 * args.rounds):  # as many on A as on B, each configuration first as often on each
            p = prompt(seed0 + i, args.prompt_tokens)
            for n in turn(i // 2):
                ttfts[n].append(ttft(client, configs[n][i % 2], p))
        # kvtier's hooks on the engine's path over those prompts (counted
        # inside the instances, whatever another instance runs like). The
        # time a report has not carried yet (at most HOOK_FLUSH_S of hooks)
        # falls outside the window, the warm-up prompt's inside it.
        hooks = {n: hook_seconds(configs[n][:2]) - hooks0[n] for n in names}
        rates: dict[str, list[float]] = {n: [] for n in names}
        tokens = dict.fromkeys(names, 0)
        # Rep -1's rates are not counted: an instance's first batch of
        # concurrent prompts may pay one-time set-up (vLLM alone's first
        # ran 12 % below its next two in one run).
        reps = -(-args.tput_reps // len(names)) * len(names)  # each configuration first as often
        for rep in range(-1, reps):
            prompts = [prompt(seed0 + 1000 * (rep + 2) + i, 2048) for i in range(args.concurrency)]
            for n in turn(rep):
                pair = configs[n][:2]
                time.sleep(args.gap)
                t = time.perf_counter()
                with ThreadPoolExecutor(args.concurrency) as ex:
                    rs = list(ex.map(lambda ip: stream_completion(client, pair[ip[0] % 2].url, ip[1],
                                                                  max_tokens=64, ignore_eos=True),
                                     enumerate(prompts)))
                wall = time.perf_counter() - t
                if not all(r.ok for r in rs):
                    raise RuntimeError([r.error for r in rs if not r.ok])
                got = sum(r.prompt_tokens + r.completion_tokens for r in rs)
                tokens[n] += got  # all of them, for the CPU a token
                if rep >= 0:
                    rates[n].append(got / wall)
        out = {}
        for n in names:
            cpu = {k: v - cpu0[n].get(k, 0.0) for k, v in cpu_by_process(pids[n]).items()}
            out[n] = {"ttfts": ttfts[n], "rates": rates[n], "cpu_s": cpu, "hook_s": hooks[n],
                      "tokens": tokens[n] + len(ttfts[n]) * (args.prompt_tokens + 4)}
        return out

    def hit_phase(client: httpx.Client, a: VllmServer, b: VllmServer, embedded: VllmServer) -> tuple[dict, dict]:
        """Every sample takes E's device hit, A's device hit, B's pool hit
        and E's DRAM hit one after the other, so each ratio compares
        requests seconds apart: a 50 ms request on two shared cores spreads
        36-122 ms, and measuring E in a phase of its own made the
        pool-vs-embedded ratio swing by 10 % between runs."""
        cold, device, cross, same, dram, edevice = [], [], [], [], [], []
        b_loads: list[float] = []  # B's load time (copy and checksum) of each pool hit
        with embedded as e:
            ttft(client, e, prompt(999, 256))
            before = b.metrics()
            for i in range(args.rounds):
                p = prompt(30_000 + i, args.prompt_tokens)
                cold.append(ttft(client, a, p))
                ttft(client, e, p)  # E's own prefill: it shares nothing with the pool
                for _ in range(args.hit_reps):
                    # Each measured request follows another instance's:
                    # the one before leaves its own blocks in the caches.
                    edevice.append(ttft(client, e, p))
                    e.reset_prefix_cache()  # the device cache forgets; kvtier keeps
                    device.append(ttft(client, a, p))
                    loaded = b.metrics().get("kvtier_load_seconds_total", 0.0)
                    cross.append(ttft(client, b, p))  # B's device cache never holds it: from the pool
                    b_loads.append(b.metrics().get("kvtier_load_seconds_total", 0.0) - loaded)
                    b.reset_prefix_cache()
                    dram.append(ttft(client, e, p))
                a.reset_prefix_cache()
                same.append(ttft(client, a, p))  # A's own blocks, back from the pool
            after = b.metrics()
        counters = {k: after.get(k, 0.0) - before.get(k, 0.0)
                    for k in ("vllm:external_prefix_cache_hits_total", "kvtier_blocks_loaded_total",
                              "kvtier_load_errors_total", "kvtier_bytes_loaded_total",
                              "kvtier_load_seconds_total")}
        return {"dram_s": dram, "device_s": edevice}, {
            "cold_s": cold, "device_s": device, "cross_s": cross, "same_s": same, "b_counters": counters,
            "b_load_s": b_loads, "b_expected_hit_tokens": hit_tokens * args.rounds * args.hit_reps}

    def server(name: str, kvtier: dict | None, env: dict | None = None) -> VllmServer:
        return VllmServer(ServerOptions(kvtier=kvtier, env=env or {}, **common),
                          log_path=logs / f"vllm-{name}.log")

    warm = {} if args.kv_warm_interval is None else {"kv_warm_interval_s": args.kv_warm_interval}
    # --kvtier: more connector config of every kvtier instance (defer_saves=true, ...).
    warm |= dict(kv.split("=", 1) for kv in args.kvtier)
    # --bind: in the 0 % hits phase, instance A of each configuration on
    # the first half of this process's CPUs, B on the other half (vLLM's
    # VLLM_CPU_OMP_THREADS_BIND), as separate instances on one host are
    # deployed; by default each binds its threads to every CPU.
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    instance_env = ([{"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, c))} for c in (cpus[:half], cpus[half:] or cpus)]
                    if args.bind else [{}, {}])
    instance_env = [e | dict(kv.split("=", 1) for kv in args.env) for e in instance_env]  # A's, B's
    hits = not args.no_hits
    out: dict = {"geometry": args.geometry, "dtype": args.dtype,
                 "memcpy_GBps": memcpy_gbps() if hits else None,
                 "kv_warm_interval_s": args.kv_warm_interval, "kvtier": args.kvtier,
                 "standalone_load_s": standalone_load_s(args) if hits else None,
                 "prompt_tokens": args.prompt_tokens, "rounds": args.rounds,
                 "hit_reps": args.hit_reps, "gap": args.gap, "hits_only": args.hits_only,
                 "no_hits": args.no_hits, "instance_env": instance_env, "logs": str(logs)}
    with httpx.Client(timeout=600) as client:
        # Two instances on one meta service (A, B): for the hits, one
        # instance of the embedded backend (E) beside them on the empty
        # pool; then, for 0 % hits, two new instances on the pool beside two
        # of vLLM alone (and two more with --control).
        with meta_service("tcp", args.dram_size, args.kv_warm_interval) as meta:
            env = meta.env_for_clients()
            # The service's address: from the files env names, as the seeds do.
            pool_cfg = {"backend": "pool"} | warm
            out["pool"] = {}
            if hits:
                with server("pool-a", pool_cfg, env) as a, server("pool-b", pool_cfg, env) as b:
                    for s in (a, b):
                        ttft(client, s, prompt(999, 256))  # the first request pays one-time set-up
                    out["embedded"], out["pool"] = hit_phase(client, a, b, server("embedded", {
                        "dram_size": args.dram_size} | warm))
            if not args.hits_only:
                # A second pair of vLLM alone (--control), measured the same
                # way: what two identical configurations differ by here.
                kinds = {"plain": (None, {}), "pool": (pool_cfg, env)} | (
                    {"control": (None, {})} if args.control else {})
                sets = []
                for k in range(args.sets):
                    # Each set of instances new, started in turn in another
                    # order: an instance's speed is its own for its life
                    # (two identical pairs of vLLM alone ran 4-8 % apart).
                    with ExitStack() as stack:
                        started = {}
                        for name in rotation(list(kinds), k):
                            kvtier, extra = kinds[name]
                            started[name] = [
                                stack.enter_context(server(f"{name}{k}-{x}", kvtier, extra | instance_env[i]))
                                for i, x in enumerate("ab")]
                            for i, s in enumerate(started[name]):
                                # One full-size prompt first, its own (no hit):
                                # an instance's first 8k prompt took 1.3-3.5x
                                # the next ones' time (first chunks of its size).
                                ttft(client, s, prompt(900_000 + 100 * k + 10 * len(started) + i, args.prompt_tokens))
                        configs = {n: (*started[n], [meta.proc.pid] if n == "pool" else []) for n in kinds}
                        # Seeds far from the hits' prompts and from other sets':
                        # none is a prefix of another.
                        sets.append(no_hits(client, configs, seed0=1_000_000 * (k + 1)))
                zero = merge_sets(sets)
                out["plain"] = zero["plain"]
                out["pool"].update(zero["pool"])
                if args.control:
                    out["control"] = zero["control"]
    return out


def print_ttft(res: dict) -> None:
    med = statistics.median
    pool = res["pool"]
    shape = (f"{2 * res['rounds']} prompts a configuration" if res.get("no_hits") else
             f"{res['rounds']} prompts x {res.get('hit_reps', 1)} hits each")
    print(f"\n## TTFT across instances on the node pool, {res['prompt_tokens']}-token prompt, model "
          f"'{res['geometry']}' ({res.get('dtype', 'bfloat16')}), {shape}, "
          f"{res.get('gap', 0)} s quiet before each request, kv_warm_interval_s "
          f"{'default' if res.get('kv_warm_interval_s') is None else res['kv_warm_interval_s']}"
          + "".join(f", kvtier {kv}" for kv in res.get("kvtier") or [])
          + "".join(f", 0 % hits' instance {x} with {' '.join(f'{k}={v}' for k, v in b.items())}"
                    for x, b in zip("AB", res.get("instance_env") or [{}, {}]) if b)
          + " (median)\n")
    print("| measure | value | peer | ratio of medians | median of paired ratios | goal |")
    print("|---|---|---|---|---|---|")
    if "device_s" in pool:
        print_hits(res)
    plain = res.get("plain")
    if plain and "ttft_s" in pool:
        ttft_ratio = pool["ttft_s"] / plain["ttft_s"]
        tput_ratio = pool["tokens_per_s"] / plain["tokens_per_s"]
        # The same prompt (TTFT) or prompt set (throughput) on both, seconds apart.
        ttft_paired = med(p / q for p, q in zip(pool["ttfts"], plain["ttfts"]))
        tput_paired = med(p / q for p, q in zip(pool["rates"], plain["rates"]))
        print(f"| TTFT, 0 % hits, two instances on the pool | {pool['ttft_s'] * 1000:.0f} ms | vLLM alone "
              f"{plain['ttft_s'] * 1000:.0f} ms | {ttft_ratio:.3f}x | {ttft_paired:.3f}x | "
              f"within {GOAL_NO_HIT:.0%} |")
        print(f"| throughput, 0 % hits, two instances on the pool | {pool['tokens_per_s']:.0f} tok/s | "
              "vLLM alone "
              f"{plain['tokens_per_s']:.0f} tok/s | {tput_ratio:.3f}x | {tput_paired:.3f}x | "
              f"within {GOAL_NO_HIT:.0%} |")
        if pool.get("hook_s_per_prompt"):
            # What the pool adds on the engine's path, measured inside the
            # instances (free of the spread between instances): every hook of
            # a TTFT prompt's steps, its prefill and 3 decode steps, scheduler
            # and worker, against the mean TTFT (an upper bound on its share).
            hook, mean_ttft = pool["hook_s_per_prompt"], statistics.mean(pool["ttfts"])
            print(f"| kvtier's hooks on the engine's path per prompt, 0 % hits (all its steps) | "
                  f"{hook * 1000:.1f} ms | mean TTFT on the pool {mean_ttft * 1000:.0f} ms | "
                  f"{hook / mean_ttft:.1%} of it | | within {GOAL_NO_HIT:.0%} |")
        control = res.get("control")
        if control:
            print(f"| TTFT, 0 % hits, a second pair of vLLM alone (control) | {control['ttft_s'] * 1000:.0f} ms | "
                  f"vLLM alone {plain['ttft_s'] * 1000:.0f} ms | {control['ttft_s'] / plain['ttft_s']:.3f}x | "
                  f"{med(p / q for p, q in zip(control['ttfts'], plain['ttfts'])):.3f}x | |")
            print(f"| throughput, 0 % hits, a second pair of vLLM alone (control) | "
                  f"{control['tokens_per_s']:.0f} tok/s | vLLM alone {plain['tokens_per_s']:.0f} tok/s | "
                  f"{control['tokens_per_s'] / plain['tokens_per_s']:.3f}x | "
                  f"{med(p / q for p, q in zip(control['rates'], plain['rates'])):.3f}x | |")
        sets = plain.get("set_rates") or []
        if len(sets) > 1:
            def per_set(key: str, n: str) -> str:
                return ", ".join(f"{med(p / q for p, q in zip(a, b)):.3f}x"
                                 for a, b in zip(res[n][key], plain[key]))

            print(f"| per set of instances ({len(sets)}), paired: TTFT, pool / vLLM alone | "
                  f"{per_set('set_ttfts', 'pool')} | | | | |")
            print(f"| per set of instances, paired: throughput, pool / vLLM alone | "
                  f"{per_set('set_rates', 'pool')} | | | | |")
            if control:
                print(f"| per set of instances, paired: throughput, control / vLLM alone | "
                      f"{per_set('set_rates', 'control')} | | | | |")
        cpu_ratio = pool["cpu_ms_per_1k_tokens"] / plain["cpu_ms_per_1k_tokens"]
        print(f"| CPU per 1k tokens, 0 % hits, all processes | {pool['cpu_ms_per_1k_tokens']:.0f} ms | vLLM alone "
              f"{plain['cpu_ms_per_1k_tokens']:.0f} ms | {cpu_ratio:.3f}x | | |")
        print("\nCPU seconds of the 0 % hits phase by process (both instances together):\n")
        print("| process | vLLM alone | on the pool |")
        print("|---|---|---|")
        for name in sorted(set(plain["cpu_s"]) | set(pool["cpu_s"])):
            print(f"| {name} | {plain['cpu_s'].get(name, 0.0):.1f} | {pool['cpu_s'].get(name, 0.0):.1f} |")
    if "b_counters" in pool:
        print_loads(res)


def print_hits(res: dict) -> None:
    med = statistics.median
    pool = res["pool"]
    device, cross, same = med(pool["device_s"]), med(pool["cross_s"]), med(pool["same_s"])
    emb = med(res["embedded"]["dram_s"])
    # Each sample's own ratio (the requests of one sample ran seconds apart), then their median.
    paired_dev = med(c / d for c, d in zip(pool["cross_s"], pool["device_s"]))
    paired_emb = med(c / e for c, e in zip(pool["cross_s"], res["embedded"]["dram_s"]))
    print(f"| TTFT cold, instance A | {med(pool['cold_s']) * 1000:.0f} ms | | | | |")
    print(f"| TTFT device hit, instance A | {device * 1000:.1f} ms | | | | |")
    print(f"| TTFT pool DRAM hit, instance B (A prefilled) | {cross * 1000:.1f} ms | device hit on A | "
          f"{cross / device:.3f}x | {paired_dev:.3f}x | <= {GOAL_DRAM_OVER_DEVICE:.2f}x |")
    print(f"| TTFT pool DRAM hit, instance B | {cross * 1000:.1f} ms | "
          f"embedded DRAM hit {emb * 1000:.1f} ms | "
          f"{cross / emb:.3f}x | {paired_emb:.3f}x | within {GOAL_POOL_OVER_EMBEDDED:.0%} |")
    edev = med(res["embedded"]["device_s"]) if res["embedded"].get("device_s") else 0.0
    if edev:
        print(f"| TTFT embedded DRAM hit (instance E) | {emb * 1000:.1f} ms | its device hit "
              f"{edev * 1000:.1f} ms | {emb / edev:.3f}x | "
              f"{med(d / v for d, v in zip(res['embedded']['dram_s'], res['embedded']['device_s'])):.3f}x | |")
    print(f"| TTFT pool DRAM hit, instance A (own blocks) | {same * 1000:.1f} ms | device hit on A | "
          f"{same / device:.3f}x | | |")


def print_loads(res: dict) -> None:
    med = statistics.median
    pool = res["pool"]
    c = pool["b_counters"]
    print(f"\nInstance B: {c['vllm:external_prefix_cache_hits_total']:.0f} tokens hit in the pool (expected "
          f"{pool['b_expected_hit_tokens']}), {c['kvtier_blocks_loaded_total']:.0f} blocks loaded, "
          f"{c['kvtier_load_errors_total']:.0f} load errors. Server logs: {res['logs']}")
    if c.get("kvtier_load_seconds_total") and res.get("memcpy_GBps"):
        # The copy and checksum of a hit, against memcpy on this machine measured in the same run.
        load = c["kvtier_bytes_loaded_total"] / c["kvtier_load_seconds_total"] / 1e9
        print(f"B's loads (copy and checksum): {load:.1f} GB/s, {load / res['memcpy_GBps']:.2f}x this "
              f"machine's memcpy ({res['memcpy_GBps']:.1f} GB/s); "
              f"{c['kvtier_bytes_loaded_total'] / max(1, c['kvtier_blocks_loaded_total']) / 1024:.0f} KiB "
              "a block.")
    loads = sorted(pool.get("b_load_s") or [])
    if loads:
        # A hit's load inside vLLM, against the same copies and checksums
        # outside it measured in this run: what the machine adds, hit by hit.
        p90 = loads[min(len(loads) - 1, round(0.9 * (len(loads) - 1)))]
        line = (f"B's load a hit: median {med(loads) * 1000:.1f} ms, p90 {p90 * 1000:.1f} ms, "
                f"max {loads[-1] * 1000:.1f} ms")
        alone = res.get("standalone_load_s")
        if alone:
            slow = sum(t > 2 * alone for t in loads)
            line += (f"; the same load outside vLLM {alone * 1000:.1f} ms (bench/blockcopy.py): median "
                     f"{med(loads) / alone:.2f}x, {slow} of {len(loads)} hits over 2x")
        print(line + ".")


# --- main -------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("lookup", "scale", "ttft", "all"))
    ap.add_argument("--json", default=None, help="write every sample and count here")
    ap.add_argument("--tokens", type=int, default=65536, help="lookup: tokens of the request")
    ap.add_argument("--reps", type=int, default=1000, help="lookup: calls per measure")
    ap.add_argument("--ssd", action="store_true",
                    help=f"lookup: the service and the store in this process with an SSD tier ({SSD_SIZE} file)")
    ap.add_argument("--gap-ms", type=float, default=0.0,
                    help="lookup: pause between calls, not timed (0: back to back)")
    ap.add_argument("--against", default=None, metavar="SRC",
                    help="lookup: probe this tree's service and one running the code of SRC (an export of "
                         "another commit's src folder) in turn, instead of the usual measures (--transport)")
    ap.add_argument("--seconds", type=float, default=10.0, help="scale: seconds per number of instances")
    ap.add_argument("--clients", default="1,2,4", help="scale: numbers of client processes")
    ap.add_argument("--transport", choices=("tcp", "unix"), default="tcp",
                    help="scale, lookup --against: the service's socket")
    ap.add_argument("--shared-blocks", type=int, default=1024, help="scale: blocks of the prefix all share")
    ap.add_argument("--own-blocks", type=int, default=32, help="scale: blocks each client saves per loop")
    ap.add_argument("--by-call", action="store_true",
                    help="scale: every lookup a call (the clients do not map the service's ready index)")
    ap.add_argument("--geometry", default="bench", help="ttft: test model (kvtier.tools.model.GEOMETRIES)")
    ap.add_argument("--prompt-tokens", type=int, default=8192, help="ttft")
    ap.add_argument("--rounds", type=int, default=5, help="ttft: prompts per measure")
    ap.add_argument("--concurrency", type=int, default=8, help="ttft: concurrent prompts for throughput")
    ap.add_argument("--dram-size", default="2GB", help="ttft: DRAM of the embedded store and of the pool")
    ap.add_argument("--hit-reps", type=int, default=3, help="ttft: hits measured per prompt")
    ap.add_argument("--tput-reps", type=int, default=4,
                    help="ttft: throughput runs per configuration and set of instances (median; rounded up "
                         "to a multiple of the configurations)")
    ap.add_argument("--gap", type=float, default=QUIET_S,
                    help="ttft: seconds of quiet before each request (kvtier.tools.client.quiet_ttft)")
    ap.add_argument("--block", type=int, default=64, help="ttft: vLLM block size")
    ap.add_argument("--dtype", default="bfloat16",
                    help="ttft: the model's dtype (float32 for a real model on a CPU without bf16)")
    ap.add_argument("--chunk", type=int, default=2048, help="ttft: --max-num-batched-tokens")
    ap.add_argument("--kv-warm-interval", type=float, default=None,
                    help="ttft: the instances' kv_warm_interval_s and the meta service's "
                         "kvtier.warm_interval (default: kvtier's; 0: off)")
    ap.add_argument("--control", action="store_true",
                    help="ttft: a second pair of vLLM alone in the 0 %% hits phase, compared with the first "
                         "the same way (the noise floor of the ratios)")
    ap.add_argument("--sets", type=int, default=1,
                    help="ttft: sets of new instances the 0 %% hits phase runs on, one after the other "
                         "(every measure over all of them)")
    ap.add_argument("--bind", action="store_true",
                    help="ttft: in the 0 %% hits phase, each configuration's instance A on half of the CPUs "
                         "and B on the other half (default: each instance on all of them)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="ttft: an environment variable of every instance of the 0 %% hits phase")
    ap.add_argument("--kvtier", action="append", default=[], metavar="KEY=VALUE",
                    help="ttft: a kv_connector_extra_config key of every kvtier instance (defer_saves=true)")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--hits-only", action="store_true", help="ttft: the hit measures only (no 0 %% hits phases)")
    only.add_argument("--no-hits", action="store_true", help="ttft: the 0 %% hits measures only")
    args = ap.parse_args(argv)
    for flag, values in (("--env", args.env), ("--kvtier", args.kvtier)):
        for kv in values:
            if "=" not in kv or kv.startswith("="):
                ap.error(f"{flag} {kv!r}: expected KEY=VALUE")

    results: dict = {}
    steps = [("lookup", run_lookup, print_lookup), ("scale", run_scale, print_scale),
             ("ttft", run_ttft, print_ttft)]
    if args.against is not None:
        if args.what != "lookup":
            ap.error("--against goes with lookup only")
        if not os.path.isdir(os.path.join(args.against, "kvtier")):
            ap.error(f"--against {args.against}: no kvtier package there (give the src folder of an export)")
        steps = [("lookup", run_lookup_against, print_lookup_against)]
    for name, run, show in steps:
        if args.what in (name, "all"):
            results[name] = run(args)
            show(results[name])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    from blockcopy import copies_as_instances

    copies_as_instances()  # the load timed outside vLLM copies as the instances do
    sys.exit(main())
