"""The meta service's HTTP side: Prometheus metrics, health, MemCache-style queries.

Runs in the meta service's process, on its own thread, at the address of
``ock.mmc.meta_service.metrics_url`` (loopback by default). Read-only:
nothing here changes the pool.

* ``/metrics``: Prometheus text (prometheus_client): capacity and usage
  per tier, keys looked up, found (by tier) and missed, by instance, evictions,
  demotions, promotions (rewarms), leases (pinned and unsettled blocks,
  expired sessions), RPC latency per call, clients connected;
* ``/health``: JSON, 200 while the service serves: connected instances
  and the slot accounting (:meth:`MetaService.accounting`);
* ``/query_key?key=HEX``, ``/batch_query_keys?keys=HEX,HEX`` (or a POST of
  ``{"keys": [...]}``), ``/get_all_segments``, ``/api/v1/capacity/usage``:
  JSON in the shape MemCache's own endpoints answer. Keys are the pool's
  16-byte block keys in hex, as ``kvtier stats`` and the logs show them.

The pool is made when the first instance connects (its slots are cut to
that instance's block size): until then there are no segments, no
capacity figures and no blocks to query.
"""

from __future__ import annotations

import io
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from kvtier.pool.service import MetaService

log = logging.getLogger(__name__)

MAX_BATCH = 4096
MAX_BODY = 1 << 20  # bytes of a POST body
# Each path and the methods it answers; any other method gets 405 with Allow.
ENDPOINTS = {"/metrics": ("GET",), "/health": ("GET",), "/query_key": ("GET",),
             "/batch_query_keys": ("GET", "POST"), "/get_all_segments": ("GET",),
             "/api/v1/capacity/usage": ("GET",)}
HTTP_TIMEOUT_S = 10.0  # an idle or stalled HTTP connection is dropped after this long


MAX_HTTP_CONNECTIONS = 32  # served at once (a thread each); past this a new one is closed at once


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, all of them by ``deadline`` (``time.monotonic()``):
    each read waits for the time left, so a peer that sends a byte now and
    then cannot keep a request open past it."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive in time")
        self._sock.settimeout(left)
        return self._sock.recv_into(b)


class _Server(ThreadingHTTPServer):
    """A thread per connection, at most :data:`MAX_HTTP_CONNECTIONS` at
    once: a client's socket timeout bounds each read alone, so peers that
    trickle their requests could otherwise hold threads and descriptors
    without end (the metrics port needs no token)."""

    daemon_threads = True

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self._slots = threading.BoundedSemaphore(MAX_HTTP_CONNECTIONS)
        self.refused = 0

    def process_request(self, request: object, client_address: object) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)  # type: ignore[arg-type]
            return
        try:
            super().process_request(request, client_address)  # type: ignore[arg-type]
        except BaseException:
            self._slots.release()  # no thread started: it would not release its slot
            raise

    def process_request_thread(self, request: object, client_address: object) -> None:
        try:
            super().process_request_thread(request, client_address)  # type: ignore[arg-type]
        finally:
            self._slots.release()


class _ServerV6(_Server):
    """The same server on an IPv6 address (``http://[::1]:5001``)."""

    address_family = socket.AF_INET6


class _PoolCollector:
    def __init__(self, svc: MetaService) -> None:
        self.svc = svc

    def collect(self) -> Iterator[object]:
        svc = self.svc
        store = svc.store
        cap = GaugeMetricFamily("kvtier_pool_capacity_bytes", "Bytes each tier can hold", labels=["tier"])
        used = GaugeMetricFamily("kvtier_pool_used_bytes", "Bytes of blocks each tier holds", labels=["tier"])
        blocks = GaugeMetricFamily("kvtier_pool_blocks", "Blocks each tier holds", labels=["tier"])
        for tier, total, n, size in _tiers(svc):
            cap.add_metric([tier], total * size)
            used.add_metric([tier], n * size)
            blocks.add_metric([tier], n)
        yield cap
        yield used
        yield blocks
        clients = GaugeMetricFamily("kvtier_pool_clients", "Instances connected")
        sessions = svc.sessions()
        clients.add_metric([], len(sessions))
        yield clients
        looked = CounterMetricFamily("kvtier_pool_lookup_keys", "Block keys looked up, by instance",
                                     labels=["instance"])
        found = CounterMetricFamily("kvtier_pool_hit_keys", "Block keys found, by the tier a load is served "
                                    "from (ssd: read back into DRAM first) and instance", labels=["tier", "instance"])
        missed = CounterMetricFamily("kvtier_pool_miss_keys", "Block keys looked up and not found, by instance",
                                     labels=["instance"])
        clustered = svc.opts.cluster is not None
        for name, (n_look, n_dram, n_ssd, n_cluster) in svc.lookups_by_instance().items():
            looked.add_metric([name], n_look)
            found.add_metric(["dram", name], n_dram)
            found.add_metric(["ssd", name], n_ssd)
            if clustered:
                found.add_metric(["cluster", name], n_cluster)
            missed.add_metric([name], n_look - n_dram - n_ssd - n_cluster)
        yield looked
        yield found
        yield missed
        if clustered:
            yield from _cluster_metrics(svc)
        events = CounterMetricFamily("kvtier_pool_events", "Pool events by kind", labels=["event"])
        if store is not None:
            c = store.counters()
            for name in ("evictions", "blocks_demoted", "demote_failures", "evicted_without_copy",
                         "blocks_promoted", "promote_failures", "ssd_evictions", "ssd_corrupt_blocks",
                         "ssd_read_errors", "corrupt_blocks", "pins_expired", "moves_stalled"):
                events.add_metric([name], c.get(name, 0))
        events.add_metric(["sessions_started"], svc.sessions_started)
        events.add_metric(["sessions_expired"], svc.sessions_expired)
        events.add_metric(["bad_messages"], svc.bad_messages)
        yield events
        acc = svc.accounting()
        leases = GaugeMetricFamily("kvtier_pool_leased_blocks", "Blocks pinned for loads or taken for saves",
                                   labels=["kind"])
        leases.add_metric(["pinned"], acc["pinned_entries"])
        leases.add_metric(["unsettled"], acc["unsettled_entries"])
        yield leases
        if store is not None:
            moving = store.moving()
            blocks_moving = GaugeMetricFamily("kvtier_pool_moving_blocks", "Blocks being moved now: written "
                                              "to SSD or published to the cluster, read back into DRAM from "
                                              "either", labels=["move"])
            for f in fields(moving):
                if f.name != "jobs":
                    blocks_moving.add_metric([f.name], getattr(moving, f.name))
            yield blocks_moving
            jobs = GaugeMetricFamily("kvtier_pool_io_jobs", "The pool's I/O jobs (moves, clearing SSD headers) "
                                     "running or queued")
            jobs.add_metric([], moving.jobs)
            yield jobs


# What the Mooncake master's own /metrics says about the whole cluster, re-exported.
_MASTER_GAUGES = {"master_allocated_bytes": "used_bytes", "master_total_capacity_bytes": "capacity_bytes",
                  "master_key_count": "keys", "master_active_clients": "clients"}


def _cluster_metrics(svc: MetaService) -> Iterator[object]:
    """The cluster tier: this node's counts (by cause for what it dropped),
    whether it is reachable, and the master's usage when it answers."""
    store = svc.store
    mover = store.cluster if store is not None else None
    up = GaugeMetricFamily("kvtier_cluster_up", "1 while the cluster tier's master answers this node")
    up.add_metric([], 1 if mover is not None and mover.up else 0)
    yield up
    ev = CounterMetricFamily("kvtier_cluster_events", "Cluster tier events on this node, by kind", labels=["event"])
    dropped = CounterMetricFamily("kvtier_cluster_dropped_blocks",
                                  "Blocks the cluster said it held but that could not be used, by cause",
                                  labels=["cause"])
    if store is not None:
        c = store.counters()
        for name in ("cluster_lookups", "cluster_hits", "cluster_fetched", "cluster_published",
                     "cluster_publish_failures", "cluster_publish_skipped", "cluster_down", "cluster_lost",
                     "cluster_vanished"):
            ev.add_metric([name.removeprefix("cluster_")], c.get(name, 0))
        for cause, name in (("gone", "cluster_gone"), ("corrupt", "cluster_corrupt"),
                            ("transfer_error", "cluster_fetch_errors")):
            dropped.add_metric([cause], c.get(name, 0))
    yield ev
    yield dropped
    sup = svc.cluster_master
    if sup is not None:
        r = GaugeMetricFamily("kvtier_cluster_master_restarts", "Times this node restarted the Mooncake master")
        r.add_metric([], sup.restarts)
        yield r
        pid = GaugeMetricFamily("kvtier_cluster_master_pid", "Process id of the Mooncake master this node runs")
        pid.add_metric([], sup.pid or 0)
        yield pid
        role = sup.role()
        if role:
            # With etcd, one master leads and the others stand by (their
            # figures below are empty until one takes over).
            g = GaugeMetricFamily("kvtier_cluster_master_role",
                                  "1 for the role the Mooncake master this node runs says it has",
                                  labels=["role"])
            g.add_metric([role], 1)
            yield g
    usage = _master_usage(svc)
    if usage:
        g = GaugeMetricFamily("kvtier_cluster_master", "The Mooncake master's figures for the whole cluster",
                              labels=["figure"])
        for name, value in usage.items():
            g.add_metric([name], value)
        yield g


def _master_usage(svc: MetaService) -> dict[str, float]:
    """The master's capacity, use, keys and evictions, from its metrics endpoint ({} if it does not answer)."""
    cfg = svc.opts.cluster
    if cfg is None:
        return {}
    from kvtier.cluster.client import master_figures

    out: dict[str, float] = {}
    for name, value in master_figures(cfg).items():
        key = _MASTER_GAUGES.get(name) or (name.removeprefix("master_") if name.startswith("master_") and
                                           "evict" in name else None)
        if key:
            out[key] = value
    return out


def _tiers(svc: MetaService) -> list[tuple[str, int, int, int]]:
    """(tier, slots, slots used, bytes per slot) of each tier the pool has."""
    store = svc.store
    if store is None:
        return []
    c = store.counters()
    out = [("dram", c["dram_slots_total"], c["dram_slots_used"], store.tier.slot_stride)]
    if store.ssd is not None:
        out.append(("ssd", c["ssd_slots_total"], c["ssd_slots_used"], store.ssd.slot_bytes))
    return out


class PoolHttp:
    """The HTTP server; :meth:`start` binds and serves on a daemon thread."""

    def __init__(self, svc: MetaService, host: str, port: int) -> None:
        self.svc = svc
        self.registry = CollectorRegistry()
        self.registry.register(_PoolCollector(svc))  # type: ignore[arg-type]
        self.rpc = Histogram("kvtier_pool_rpc_seconds", "Time the service spent on each call", ["call"],
                             registry=self.registry,
                             buckets=(2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2, 0.1, 1.0))
        svc.rpc_seconds = lambda call, s: self.rpc.labels(call).observe(s)
        http = self

        class Handler(BaseHTTPRequestHandler):
            # A connection that sends nothing (or less body than it announced)
            # is dropped after this long instead of holding a thread and a
            # descriptor for good.
            timeout = HTTP_TIMEOUT_S

            def setup(self) -> None:
                super().setup()
                # The whole request (line, headers, body) within HTTP_TIMEOUT_S
                # of the connection, not each read.
                self.rfile = io.BufferedReader(_DeadlineReader(self.connection, time.monotonic() + HTTP_TIMEOUT_S))

            def log_message(self, fmt: str, *args: object) -> None:
                log.debug("kvtier meta http: " + fmt, *args)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                http._dispatch(self, None)

            def do_POST(self) -> None:  # noqa: N802
                if self.headers.get("Transfer-Encoding"):
                    _reply(self, 411, {"error": "send the body with a Content-Length, not Transfer-Encoding"})
                    return
                given = (self.headers.get("Content-Length") or "0").strip()
                if not (given.isascii() and given.isdigit() and len(given) <= 12):
                    _reply(self, 400, {"error": f"Content-Length {given[:32]!r} is not a number of bytes"})
                    return
                n = int(given)
                if n > MAX_BODY:
                    _reply(self, 413, {"error": f"Content-Length {n}: at most {MAX_BODY} bytes (1 MiB)"})
                    return
                body = self.rfile.read(n)
                if len(body) < n:
                    _reply(self, 400, {"error": f"the body ended after {len(body)} of {n} bytes"})
                    return
                http._dispatch(self, body)

            def _other_method(self) -> None:
                http._dispatch(self, None)

            do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _other_method  # noqa: N815 - 405 each

        server_class = _ServerV6 if ":" in host else _Server
        self.server = server_class((host, port), Handler)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self) -> None:
        self._thread = threading.Thread(target=self.server.serve_forever, name="kvtier-meta-http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _dispatch(self, h: BaseHTTPRequestHandler, body: bytes | None) -> None:
        h.connection.settimeout(HTTP_TIMEOUT_S)  # the reply's writes: not bound by the request's deadline
        url = urlsplit(h.path)
        q = parse_qs(url.query)
        try:
            allowed = ENDPOINTS.get(url.path)
            if allowed is not None and h.command not in allowed:
                _reply(h, 405, {"error": f"{h.command} {url.path}: use {' or '.join(allowed)}"},
                       allow=", ".join(allowed), body=h.command != "HEAD")
            elif url.path == "/metrics":
                data = generate_latest(self.registry)
                h.send_response(200)
                h.send_header("Content-Type", CONTENT_TYPE_LATEST)
                h.send_header("Content-Length", str(len(data)))
                h.end_headers()
                h.wfile.write(data)
            elif url.path == "/health":
                _reply(h, 200, {"status": "ok", "pool": self.svc.store is not None,
                                "clients": [{"session": s.id, "name": s.name, "pid": s.pid}
                                            for s in self.svc.sessions()],
                                "slots": self.svc.accounting(),
                                "sessions_started": self.svc.sessions_started,
                                "sessions_expired": self.svc.sessions_expired})
            elif url.path == "/query_key":
                key = (q.get("key") or [""])[0]
                _reply(h, 200, self.svc.key_info(_hex_key(key)))
            elif url.path == "/batch_query_keys":
                keys = _batch_keys(q, body)
                _reply(h, 200, {"results": [self.svc.key_info(_hex_key(k)) for k in keys]})
            elif url.path == "/get_all_segments":
                _reply(h, 200, {"segments": [
                    {"name": tier, "path": path, "capacity_bytes": total * size, "used_bytes": n * size,
                     "blocks": n, "block_bytes": size}
                    for (tier, total, n, size), path in zip(_tiers(self.svc), self.svc.tier_paths())]})
            elif url.path == "/api/v1/capacity/usage":
                _reply(h, 200, {tier: {"total_bytes": total * size, "used_bytes": n * size,
                                       "usage": round(n / total, 6) if total else 0.0}
                                for tier, total, n, size in _tiers(self.svc)})
            else:
                _reply(h, 404, {"error": f"no such endpoint: {url.path}", "endpoints": list(ENDPOINTS)},
                       body=h.command != "HEAD")
        except ValueError as err:
            _reply(h, 400, {"error": str(err)})
        except (ConnectionError, TimeoutError):
            pass  # the client went away, or stopped reading: nothing to answer
        except Exception:  # noqa: BLE001 - a bug answers 500; the service and this thread go on
            log.exception("kvtier meta http: %s %s failed", h.command, url.path)
            try:
                _reply(h, 500, {"error": "internal error (see the meta service's log)"})
            except OSError:
                pass


def _hex_key(text: str) -> bytes:
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        key = b""
    if len(key) != 16:
        raise ValueError(f"key {text[:64]!r}: expected 32 hex digits (a 16-byte block key)")
    return key


def _batch_keys(q: dict[str, list[str]], body: bytes | None) -> list[str]:
    if body:
        try:
            doc = json.loads(body)
        except json.JSONDecodeError as err:
            raise ValueError(f"body: not JSON ({err.msg})") from None
        except RecursionError:
            raise ValueError("body: JSON nested too deeply") from None
        keys = doc.get("keys") if isinstance(doc, dict) else None
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ValueError('body: expected {"keys": ["<hex>", ...]}')
    else:
        keys = [k for v in q.get("keys", []) for k in v.split(",") if k]
    if len(keys) > MAX_BATCH:
        raise ValueError(f"keys: {len(keys)} given, at most {MAX_BATCH} per call")
    return keys


def _reply(h: BaseHTTPRequestHandler, code: int, doc: object, allow: str | None = None, body: bool = True) -> None:
    data = json.dumps(doc).encode()
    h.send_response(code)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(data)))
    if allow is not None:
        h.send_header("Allow", allow)
    h.end_headers()
    if body:
        h.wfile.write(data)
