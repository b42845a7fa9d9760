"""One pool for the node: two real vLLM CPU instances on one meta service process.

The service is started from MemCache-style config files, as the seeds do
(``MMC_META_CONFIG_PATH`` / ``MMC_LOCAL_CONFIG_PATH``), and each instance's
transfer config names only the connector and ``"backend": "memcache"``.
Tests run in file order and share the processes: a prefix from A is a hit
on B, from DRAM, then from the SSD once the pool has moved it there; the
service is killed with -9 while an instance holds pins for a load (its
worker stopped at that moment, the other instance at work) and comes back
with its SSD tier; then instance B is killed with -9 while it saves, and
the service gives back everything B held; last, an instance of a second
model joins A on the pool, and each model hits only its own blocks.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvtier.tools.meta import MetaProcess
from kvtier.tools.server import VllmServer, free_port, parse_metrics, poll_until, signal_pids
from tests.e2e.conftest import (BLOCK, PROMOTE_WAIT, assert_loads_succeeded, complete, delta, hit_after_eviction,
                                reconnects, server_options, tokens, wait_reconnected)

pytestmark = pytest.mark.e2e

EXT_HITS = "vllm:external_prefix_cache_hits_total"
DISK = 'vllm:prompt_tokens_cached_by_source_total{source="disk"}'
HOST = 'vllm:prompt_tokens_cached_by_source_total{source="host"}'


def write_configs(folder: Path) -> tuple[Path, Path]:
    """The seeds' two files, addresses and sizes changed: a 24 MiB pool per
    device (about 45 blocks of 512 KiB) over a 256 MiB SSD file."""
    port, metrics = free_port(), free_port()
    meta = folder / "mmc-meta.conf"
    meta.write_text(
        f"ock.mmc.meta_service_url = tcp://127.0.0.1:{port}\n"
        f"ock.mmc.meta_service.config_store_url = tcp://127.0.0.1:{free_port()}\n"
        f"ock.mmc.meta_service.metrics_url = http://127.0.0.1:{metrics}\n"
        "ock.mmc.log_level = info\n"
        "ock.mmc.evict_threshold_high = 90\n"
        "ock.mmc.evict_threshold_low = 80\n")
    local = folder / "mmc-local.conf"
    local.write_text(
        f"ock.mmc.meta_service_url = tcp://127.0.0.1:{port}\n"
        f"ock.mmc.local_service.config_store_url = tcp://127.0.0.1:{port}\n"
        "ock.mmc.local_service.protocol = host_shm\n"
        "ock.mmc.local_service.dram.size = 24MB\n"
        "ock.mmc.local_service.world_size = 1\n"
        "ock.mmc.local_service.storage.enabled = true\n"
        f"ubsio.disk.path = {folder / 'ssd.img'}\n"
        "kvtier.ssd_size = 256MB\n"
        "ock.mmc.rewarm.dram_watermark = 95\n")
    return meta, local


class Node:
    def __init__(self, folder: Path, model: str) -> None:
        self.folder = folder
        self.meta_conf, self.local_conf = write_configs(folder)
        self.meta = MetaProcess(self.meta_conf, self.local_conf, log_path=folder / "meta.log")
        self.model = model
        self.servers: dict[str, VllmServer] = {}

    def instance(self, name: str, model: str | None = None) -> VllmServer:
        opts = server_options(model or self.model, {"backend": "memcache", **PROMOTE_WAIT},
                              env=self.meta.env_for_clients() | {"VLLM_LOG_STATS_INTERVAL": "1"})
        srv = VllmServer(opts, log_path=self.folder / f"vllm-{name}.log")
        self.servers[name] = srv
        return srv.start()

    def wait_released(self, timeout_s: float = 90) -> dict:
        """Until no slot is held for an ended session (they return to the
        free list once the slot grace, 3 x lease_ttl_ms, has passed)."""
        deadline = time.monotonic() + timeout_s
        while True:
            h = self.meta.health()
            if h["slots"]["held"] == 0 or time.monotonic() > deadline:
                return h
            time.sleep(0.2)

    def wait_clients(self, n: int, timeout_s: float = 60) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            h = self.meta.health()
            if len(h["clients"]) == n or time.monotonic() > deadline:
                return h
            time.sleep(0.2)


def worker_pid(srv: VllmServer) -> int:
    """The process of ``srv``'s worker (vLLM names it ``VLLM::Worker``):
    it copies the loads, and reports each step to the engine."""
    for pid in srv.pids():
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"VLLM::Worker"):
                return pid
        except OSError:
            continue
    raise AssertionError(f"no VLLM::Worker among the processes {srv.pids()} of {srv.url}")


@pytest.fixture(scope="module")
def node(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("pool"), tiny_model)
    n.meta.start()
    try:
        n.instance("a")
        n.instance("b")
        yield n
    finally:
        for srv in n.servers.values():
            srv.stop()
        n.meta.stop()


def pool_hits(node: Node) -> dict[tuple[str, str], float]:
    """The service's kvtier_pool_hit_keys_total: (instance, tier) -> keys found."""
    text = httpx.get(node.meta.metrics_url + "/metrics", timeout=5).text
    out = {}
    for key, value in parse_metrics(text).items():
        if key.startswith("kvtier_pool_hit_keys_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', key))
            out[(labels["instance"], labels["tier"])] = value
    return out


def pool_calls(node: Node, call: str) -> float:
    """How many ``call`` messages the service has handled (its RPC histogram's count)."""
    text = httpx.get(node.meta.metrics_url + "/metrics", timeout=5).text
    return parse_metrics(text).get(f'kvtier_pool_rpc_seconds_count{{call="{call}"}}', 0.0)


def test_a_prefix_prefilled_on_a_is_a_dram_hit_on_b(node: Node) -> None:
    a, b = node.servers["a"], node.servers["b"]
    assert len(node.wait_clients(2)["clients"]) == 2
    prompt = tokens(31, 20 * BLOCK + 5)
    complete(a, prompt)
    device_hit = complete(a, prompt)
    pool_before = pool_hits(node)
    touches = pool_calls(node, "Touch")
    before = b.metrics()
    on_b = complete(b, prompt)
    after = b.metrics()
    assert delta(after, before, EXT_HITS) == 20 * BLOCK
    # B counted the run in the service's ready index, mapped: a Touch told
    # the service, no lookup call was answered for it.
    assert pool_calls(node, "Touch") > touches
    assert delta(after, before, HOST) == 20 * BLOCK
    assert_loads_succeeded(before, after, 20 * BLOCK)
    assert on_b["text"] == device_hit["text"]
    # The service counts the hit for one instance (B's), in DRAM: the 20
    # blocks once a lookup, and nothing for A.
    pool_after = pool_hits(node)
    moved = {k: pool_after[k] - pool_before.get(k, 0) for k in pool_after if pool_after[k] != pool_before.get(k, 0)}
    assert len(moved) == 1
    (instance, tier), n = next(iter(moved.items()))
    assert tier == "dram" and n > 0 and n % 20 == 0
    assert pool_after.get((instance, "ssd"), 0) == pool_before.get((instance, "ssd"), 0)


IO_JOBS = "kvtier_pool_io_jobs"


def pool_moves(node: Node) -> dict[str, float]:
    """The service's block counts by tier, its demotions and promotions, and its I/O jobs in flight."""
    text = httpx.get(node.meta.metrics_url + "/metrics", timeout=5).text
    return {k: v for k, v in parse_metrics(text).items() if k.startswith("kvtier_pool_blocks{")
            or k in ('kvtier_pool_events_total{event="blocks_demoted"}',
                     'kvtier_pool_events_total{event="blocks_promoted"}', IO_JOBS)}


def test_a_prefix_a_saved_and_the_pool_moved_to_ssd_is_a_disk_hit_on_b(node: Node) -> None:
    # The pool holds about 45 blocks in DRAM. A saves a 20-block prefix,
    # then 60 blocks of other prompts: the prefix, among the least recently
    # used, is written to SSD and leaves DRAM. B, which never computed it,
    # gets it from the SSD through the pool, with A's output.
    a, b = node.servers["a"], node.servers["b"]
    prompt = tokens(33, 20 * BLOCK + 5)
    complete(a, prompt)
    device_hit = complete(a, prompt)
    for i in range(3):
        complete(a, tokens(34 + i, 20 * BLOCK + 5))
    # Until the service has settled its moves: no I/O job in flight, and the
    # same DRAM and SSD counts and demotions twice in a row, a moment apart.
    prev, now = None, pool_moves(node)
    deadline = time.monotonic() + 120
    while now != prev or now[IO_JOBS]:
        assert time.monotonic() < deadline, f"the pool never settled: {now}"
        time.sleep(1.0)
        prev, now = now, pool_moves(node)
    before = b.metrics()
    on_b = complete(b, prompt)
    after = b.metrics()
    hit = delta(after, before, EXT_HITS)
    assert hit == 20 * BLOCK
    assert delta(after, before, DISK) > 0 and delta(after, before, HOST) + delta(after, before, DISK) == hit
    assert_loads_succeeded(before, after, hit)
    assert on_b["text"] == device_hit["text"]


def test_meta_service_killed_during_loads_then_back_with_its_ssd_tier(node: Node) -> None:
    a, b = node.servers["a"], node.servers["b"]
    prompts = [tokens(40 + i, 12 * BLOCK + 3) for i in range(6)]
    # References: each prompt cold on A, then pushed into the pool. 48
    # tokens each: the 12 requests below run long enough to be seen running
    # (with 12, pool hits could all finish between two looks).
    refs = [complete(a, p, max_tokens=48)["text"] for p in prompts]
    # A prompt A computes last: its blocks are the newest in DRAM, and
    # ready once A's saves are settled, so B's request for it is a DRAM hit.
    held = tokens(46, 12 * BLOCK + 3)
    held_ref = complete(a, held, max_tokens=48)["text"]
    assert poll_until(lambda: not node.meta.health()["slots"]["pending"], 30), "A's saves never settled"
    results: list[str | None] = [None] * 12
    frozen = threading.Event()
    fed: list[tuple[int, str]] = []

    def ask(i: int) -> None:
        srv = b if i % 2 else a
        results[i] = complete(srv, prompts[i % 6], max_tokens=48)["text"]

    def feed(srv: VllmServer, ks: tuple[int, ...]) -> None:
        # A's device cache emptied before each request, so that A loads too
        # until the service is gone (a reset fails while requests run: that
        # request is then a device hit).
        n = 0
        while not frozen.is_set():
            srv.reset_prefix_cache()
            k = ks[n % len(ks)]
            n += 1
            fed.append((k, complete(srv, prompts[k], max_tokens=48)["text"]))

    # B's worker stopped: B's engine schedules the held prompt's load, pins
    # its blocks and waits for the worker, so the service is killed while
    # a load's pins are out, for sure (a load's pins last one step: caught
    # by polling, they were missed for 120 s on a loaded machine).
    worker = worker_pid(b)
    futs = []
    with ThreadPoolExecutor(14) as pool:
        signal_pids([worker], signal.SIGSTOP)
        try:
            on_b = pool.submit(complete, b, held, max_tokens=48)
            assert poll_until(lambda: node.meta.health()["slots"]["pins"], 60, 0.05), "B's load pinned nothing"
            futs = [pool.submit(ask, i) for i in range(12)] + [pool.submit(feed, a, (0, 2, 4))]
            # A at work too when the service dies (not waited for long: B's
            # pins end once its engine has completed no step for a lease).
            poll_until(lambda: a.metrics().get("vllm:num_requests_running", 0) > 0, 5, 0.05)
            assert node.meta.health()["slots"]["pins"], "B's pins ended before the kill"
            node.meta.kill()
        finally:
            frozen.set()
            signal_pids([worker], signal.SIGCONT)
        for f in futs:
            f.result()
        assert on_b.result()["text"] == held_ref
    # Every request completed, with the output vLLM alone gives.
    assert results == [refs[i % 6] for i in range(12)]
    assert all(text == refs[k] for k, text in fed)
    assert httpx.get(a.url + "/health", timeout=5).status_code == 200
    assert httpx.get(b.url + "/health", timeout=5).status_code == 200
    # With the service gone, lookups miss at once and engines serve on.
    fresh = tokens(60, 6 * BLOCK + 1)
    assert complete(b, fresh)["text"] == complete(a, fresh)["text"]

    # Back on the same files: the service adopts the old arena (blocks the
    # index had published that still verify) and recovers the SSD tier's
    # index; the instances reconnect on their own and hits resume.
    # Prompts 0, 2 and 4 never ran on B.
    mark = len(node.meta.log_text())
    seen = reconnects(b)
    node.meta.start()
    assert len(node.wait_clients(2)["clients"]) == 2
    wait_reconnected(b, seen)
    log = node.meta.log_text()[mark:]
    assert re.search(r"[1-9]\d* blocks adopted from the old arena", log)
    arena = re.search(r"DRAM pool (\S+),", log).group(1)
    before = b.metrics()
    again = [complete(b, prompts[i], max_tokens=48)["text"] for i in (0, 2)]
    after = b.metrics()
    hit = delta(after, before, EXT_HITS)
    assert hit > 0 and delta(after, before, HOST) + delta(after, before, DISK) == hit
    assert_loads_succeeded(before, after, hit)
    assert again == [refs[0], refs[2]]

    # A reboot empties /dev/shm but not the SSD: the next start finds no
    # arena, recovers the SSD tier, and hits come from disk.
    node.meta.kill()
    os.unlink(arena)
    mark = len(node.meta.log_text())
    seen = reconnects(b)
    node.meta.start()
    assert len(node.wait_clients(2)["clients"]) == 2
    wait_reconnected(b, seen)
    log = node.meta.log_text()[mark:]
    assert "adopted" not in log and re.search(r"SSD tier on .*, [1-9]\d* blocks recovered", log)
    before = b.metrics()
    again4 = complete(b, prompts[4], max_tokens=48)["text"]
    after = b.metrics()
    hit = delta(after, before, EXT_HITS)
    assert hit == 12 * BLOCK
    assert delta(after, before, DISK) == hit
    assert_loads_succeeded(before, after, hit)
    assert again4 == refs[4]


def freeze_while_saving(srv: VllmServer, node: Node, timeout_s: float = 120) -> dict:
    """Stop every process of ``srv`` (SIGSTOP) at a moment the pool holds
    unwritten saves for it (the only instance at work), and return the
    pool's accounting then: a kill that follows lands mid-save for sure."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if node.meta.health()["slots"]["pending"]:
            pids = srv.pids()
            signal_pids(pids, signal.SIGSTOP)
            # What it sent before it stopped is handled once two looks a
            # moment apart agree.
            slots, prev = node.meta.health()["slots"], None
            while slots != prev and time.monotonic() < deadline:
                time.sleep(0.3)
                prev, slots = slots, node.meta.health()["slots"]
            if slots["pending"] and slots == prev:
                return slots
            signal_pids(pids, signal.SIGCONT)  # its step completed in between: again
        time.sleep(0.01)
    raise AssertionError(f"the pool never held a save of {srv.log_path}'s instance")


def test_killed_instance_leaves_nothing_held_and_the_other_keeps_hitting(node: Node) -> None:
    a, b = node.servers["a"], node.servers["b"]
    assert len(node.wait_clients(2)["clients"]) == 2
    # Four requests at a time, each a fresh prompt, until B is frozen: its
    # saves keep coming until one is caught pending (a step's saves are
    # pending only for that step, and a few steps can all fall between two
    # looks).
    frozen = threading.Event()
    seeds = iter(range(1000, 10**6))
    lock = threading.Lock()

    def ask() -> None:
        while not frozen.is_set():
            with lock:
                seed = next(seeds)
            try:
                complete(b, tokens(seed, 30 * BLOCK + 7), max_tokens=64)
            except (httpx.HTTPError, AssertionError):
                return  # the server dies under it

    assert node.wait_released()["slots"]["held"] == 0  # nothing held from the tests before
    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        holding = freeze_while_saving(b, node)
    finally:
        frozen.set()
    mark = len(node.meta.log_text())
    b.kill()  # the API server and its engine, killed mid-save
    for t in threads:
        t.join()
    b.stop()
    health = node.wait_clients(1)
    assert len(health["clients"]) == 1
    # What B's session held when it was killed is what the service released
    # (logged once the session is gone from /health).
    pattern = r"session \d+ \(.*\) ended: .*; (\d+) pins released, (\d+) unwritten saves dropped"
    assert poll_until(lambda: re.search(pattern, node.meta.log_text()[mark:]), 30)
    ended = re.findall(pattern, node.meta.log_text()[mark:])
    assert ended == [(str(holding["pins"]), str(holding["pending"]))]
    slots = health["slots"]
    assert slots["pinned_entries"] == 0 and slots["unsettled_entries"] == 0
    # Slots B took for saves are held for the grace period, then free again;
    # each slot of the pool is free, under a block or held, counted apart.
    assert slots["held"] == holding["pending"]
    assert slots["free"] + slots["used"] + slots["held"] == slots["total"]
    slots = node.wait_released()["slots"]
    assert slots["held"] == 0
    assert slots["free"] + slots["used"] == slots["total"]
    # A still loads from the pool: a prefix it saved, evicted from its device cache.
    prompt = tokens(80, 16 * BLOCK + 2)
    complete(a, prompt)
    device_hit = complete(a, prompt)
    for i in range(3):
        complete(a, tokens(90 + i, 1500), max_tokens=2)
    before = a.metrics()
    again = complete(a, prompt)
    after = a.metrics()
    assert delta(after, before, EXT_HITS) == 16 * BLOCK
    assert_loads_succeeded(before, after, 16 * BLOCK)
    assert again["text"] == device_hit["text"]


def test_two_models_share_one_pool_and_each_hits_only_its_own_blocks(node: Node, gqa_model: str) -> None:
    """A second model on the same service: one with half the KV per block
    (grouped-query attention, two KV heads instead of four). Its blocks
    take whole slots of the first model's size (the pool's slots were
    sized for A's, the first instance); each model hits its own prefixes
    from the pool and never the other's."""
    mha = node.servers["a"]
    gqa = node.instance("gqa", model=gqa_model)
    health = node.wait_clients(2)
    assert len(health["clients"]) == 2  # the second model was not refused (B is gone: the test above)
    assert "refused this instance" not in gqa.log_text()

    # The same tokens on both: each model's own keys (the namespace).
    prompt = tokens(140, 20 * BLOCK)
    for srv, seed in ((mha, 100), (gqa, 200)):
        device_hit, again, before, after = hit_after_eviction(srv, prompt, filler_seed=seed)
        assert again["text"] == device_hit["text"]
        # From the pool's DRAM, or its SSD where the fillers pushed blocks there.
        assert delta(after, before, EXT_HITS) == 19 * BLOCK == delta(after, before, HOST) + delta(after, before, DISK)
        assert_loads_succeeded(before, after, 19 * BLOCK)

    # A prefix the first model saved is not a hit for the second, however
    # alike the tokens, and the other way round.
    only_mha, only_gqa = tokens(141, 12 * BLOCK), tokens(142, 12 * BLOCK)
    complete(mha, only_mha)
    complete(gqa, only_gqa)
    for srv, other in ((gqa, only_mha), (mha, only_gqa)):
        before = srv.metrics()
        complete(srv, other)
        assert delta(srv.metrics(), before, EXT_HITS) == 0
    acc = node.meta.health()["slots"]
    assert acc["used"] > 0 and acc["used"] + acc["free"] + acc["held"] == acc["total"]
