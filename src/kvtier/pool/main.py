"""Start the node's meta service from its configuration files: ``kvtier meta``.

Runs as the service's main thread: reads the pool's config files
(pool/config.py), logs each key it ignores once, opens the socket and the
HTTP endpoint, prints where both are, and waits for SIGINT or SIGTERM; then
it stops the service (sessions closed, I/O finished, arena removed) and
exits 0. A bad configuration or an address in use exits 2 with one line
naming the key; nothing it created stays behind.

With the cluster tier on (``kvtier.cluster.enabled``), ``--role meta`` (the
master node, the default) also starts Mooncake's master as a supervised
child (cluster/master.py) before the pool; ``--role local`` (every other
node) starts only the node's pool, at ``kvtier.node_service_url``, which
joins the master found at the host of the local file's
``ock.mmc.meta_service_url``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from kvtier.errors import ConfigError

log = logging.getLogger("kvtier.meta")


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="kvtier meta", description="the node's pool: one meta service per node")
    p.add_argument("--meta-config", "--config", dest="meta_config", default=None,
                   help="the meta config file (default: $MMC_META_CONFIG_PATH)")
    p.add_argument("--local-config", default=None, help="the local config file (default: $MMC_LOCAL_CONFIG_PATH)")
    p.add_argument("--role", choices=("meta", "local"), default="meta",
                   help="meta: the master node (starts Mooncake's master when the cluster tier is on); "
                        "local: another node's pool, listening at kvtier.node_service_url")
    p.add_argument("--ready-file", default=None,
                   help="write the service's socket and metrics URLs here once it serves (for scripts)")
    p.add_argument("--cluster-log", default=None,
                   help="with the cluster tier on, where Mooncake's master writes its log (default: nowhere)")
    return p


def run(args: argparse.Namespace) -> int:
    from kvtier.pool.config import DRAM_SIZE_KEY, LOCAL_ENV, check_pool_fits, load_pool_config
    from kvtier.pool.http import PoolHttp
    from kvtier.pool.service import MetaService, ServiceOptions, leftover_bytes

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        cfg = load_pool_config(args.meta_config, args.local_config)
    except ConfigError as err:
        log.error("%s", err)
        return 2
    logging.getLogger().setLevel(cfg.log_level)
    for line in cfg.ignored:
        log.info("%s", line)
    for line in cfg.warnings:
        log.warning("%s", line)
    gib = 1 << 30
    log.info("kvtier meta: a DRAM pool of %g GiB, %g GiB per device x %d device(s) (%s)", cfg.dram_bytes / gib,
             cfg.dram_size_per_device / gib, cfg.devices,
             ", ".join(f"{key} at {where}" for key, where in cfg.size_sources) or "kvtier's defaults")
    if DRAM_SIZE_KEY not in dict(cfg.size_sources):
        log.warning("kvtier meta: no file read sets ock.mmc.local_service.dram.size (%s: %s): the pool has "
                    "kvtier's default size; on one node, set %s before starting kvtier meta to size it from the "
                    "local file", LOCAL_ENV, os.environ.get(LOCAL_ENV) or "not set", LOCAL_ENV)
    role = getattr(args, "role", "meta")
    cluster = cfg.cluster_config()
    if role == "local" and not cfg.node_service_url:
        log.error("kvtier meta --role local needs kvtier.node_service_url in the local file: where this node's pool "
                  "listens (its local file's ock.mmc.meta_service_url names the master node)")
        return 2
    opts = ServiceOptions(url=cfg.listen_url if role == "local" else cfg.meta_url, store=cfg.store_config(),
                          lease_ttl_ms=cfg.lease_ttl_ms, token=cfg.token, cluster=cluster,
                          slot_rank_bytes=cfg.slot_rank_bytes)
    try:
        check_pool_fits(cfg, leftover_bytes(opts))
    except ConfigError as err:
        log.error("%s", err)
        return 2
    svc = MetaService(opts)
    http: PoolHttp | None = None
    master = None
    try:
        if cluster is not None:
            from kvtier.cluster.master import MasterSupervisor, preflight

            preflight(cluster)  # the extra is installed, etcd answers if configured; else one line saying why
            if role == "meta":
                master = MasterSupervisor(cluster, log_path=args.cluster_log or None)
                master.start()
                svc.cluster_master = master
        svc.start()
        try:
            http = PoolHttp(svc, cfg.metrics_host, cfg.metrics_port)
        except OSError as err:
            raise ConfigError("ock.mmc.meta_service.metrics_url", f"{cfg.metrics_host}:{cfg.metrics_port}",
                              f"cannot listen there: {err.strerror}") from None
        http.start()
    except ConfigError as err:
        log.error("%s", err)
        svc.stop(keep_adoptable=True)
        if master is not None:
            master.stop()
        return 2
    except OSError as err:
        log.error("kvtier meta: cannot start: %s", err)
        svc.stop(keep_adoptable=True)
        if master is not None:
            master.stop()
        return 2
    log.info("kvtier meta: serving the node pool at %s; metrics at %s/metrics (files: %s)", svc.address, http.url,
             ", ".join(cfg.sources) or "none, defaults")
    if args.ready_file:
        try:
            with open(args.ready_file, "w") as f:
                f.write(f"{svc.address}\n{http.url}\n")
        except OSError as err:
            log.error("kvtier meta: --ready-file %s: cannot write it: %s; stopping", args.ready_file,
                      err.strerror or err)
            http.stop()
            svc.stop(keep_adoptable=True)
            if master is not None:
                master.stop()
            return 2
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(3600):
        pass
    log.info("kvtier meta: stopping")
    http.stop()
    svc.stop()
    if master is not None:
        master.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))
