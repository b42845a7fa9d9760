"""The node pool's configuration files: MemCache's ``mmc-meta.conf`` and ``mmc-local.conf``.

Runs once at start in every process of the node pool: ``kvtier meta`` (the
node's meta service) and each vLLM instance that attaches to it. Nothing
here opens sockets, maps memory or creates files; it reads the two files
and the environment, and returns a frozen :class:`PoolConfig` or raises
:class:`~kvtier.errors.ConfigError` naming the file and line, the key, the
value and what is allowed.

Order of calls::

    cfg = load_pool_config()        # files from MMC_META_CONFIG_PATH / MMC_LOCAL_CONFIG_PATH
    for line in cfg.ignored: log.info(line)
    for line in cfg.warnings: log.warning(line)
    store_cfg = cfg.store_config()  # the KvtierConfig the service's store is built from

Files are ``key = value`` lines; ``#`` starts a comment line; blank lines
are skipped; a value may be empty (MemCache's own files leave TLS paths
empty). A line without ``=``, an empty key, or a key given twice in one
file is an error. Keys are spelled as MemCache 1.2 and 1.3 spell them,
including the UBS-IO (``ubsio.*``) keys MemCache hands to its SSD layer,
plus kvtier's own ``kvtier.*`` keys. :data:`KEYS` is the one table of them:
for each key, the :class:`PoolConfig` field it sets and its parser, or why
kvtier has no use for it. An ignored key is still checked against
MemCache's range (a file MemCache would refuse is refused here too) and
produces exactly one line in ``PoolConfig.ignored``. An unknown key is an
error naming the closest known one: MemCache refuses unknown keys too, and
a typo that silently fell back to a default would be worse.

Both files may be read by one process (a single node runs the meta service
and the instances). Each key has an owning file: meta keys (addresses, eviction,
leases) come from the meta file, local keys (protocol, sizes, devices, SSD)
from the local file, and each falls back to the other file, then to the
defaults below. ``ock.mmc.meta_service_url`` is read from both: the meta
file's is where the service listens (``meta_url``), the local file's where
instances connect (``client_url``).
"""

from __future__ import annotations

import difflib
import enum
import logging
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace

from kvtier.config import (
    HOST_RE,
    PLACEHOLDER_RE,
    POOL_CALL_TIMEOUT_S,
    ClusterConfig,
    KvtierConfig,
    PublishOn,
    ServiceAddress,
    check_dram_fits,
    parse_bool,
    parse_enum,
    parse_host_port,
    parse_int_range,
    parse_path,
    parse_paths,
    parse_seconds,
    parse_service_url,
    parse_size,
)
from kvtier.errors import ConfigError

Parser = Callable[[str, object, str], object]

META_ENV = "MMC_META_CONFIG_PATH"
LOCAL_ENV = "MMC_LOCAL_CONFIG_PATH"
TOKEN_ENV = "KVTIER_TOKEN"
DRAM_SIZE_KEY = "ock.mmc.local_service.dram.size"

MAX_DRAM_PER_DEVICE = 1 << 40  # MemCache's limit for dram.size
DRAM_ALIGN = 2 << 20  # MemCache rounds dram.size up to 2 MiB for host protocols


class Protocol(enum.Enum):
    """How instances reach the node's pool. Only host protocols: kvtier's blocks pass through host memory."""

    HOST_SHM = "host_shm"  # one node: instances map the service's arena
    HOST_TCP = "host_tcp"  # accepted, works as host_shm (the service's address is meta_service_url's)


# MemCache's protocols that move data device to device or over RDMA:
# kvtier has no such transport, and pretending to would be a silent slowdown.
_REFUSED_PROTOCOLS = ("device_rdma", "device_urma", "device_uboe", "device_sdma", "host_rdma", "host_urma")


# --- value parsers (key, raw value, "file:line") -> value --------------------


def _parse_tcp_url(key: str, value: object, source: str = "") -> str:
    """An address kvtier does not use, checked as MemCache checks it: ``tcp://HOST:PORT``."""
    text = str(value).strip()
    if not text.startswith("tcp://"):
        raise ConfigError(key, value, "expected tcp://HOST:PORT", source)
    parse_host_port(key, value, text[len("tcp://"):], "tcp://HOST:PORT", source, allow_zero=False)
    return text


def _parse_metrics_url(key: str, value: object, source: str = "") -> tuple[str, int]:
    """``http://HOST:PORT`` or ``HOST:PORT`` (both spellings are in MemCache's files); no path."""
    text = str(value).strip()
    bare = text.removeprefix("http://").removesuffix("/")
    if "/" in bare:
        raise ConfigError(key, value, "expected http://HOST:PORT or HOST:PORT (plain HTTP, no path)", source)
    return parse_host_port(key, value, bare, "http://HOST:PORT or HOST:PORT", source, allow_zero=False)


def _parse_protocol(key: str, value: object, source: str = "") -> Protocol:
    text = str(value).strip().lower()
    try:
        return Protocol(text)
    except ValueError:
        pass
    if text in _REFUSED_PROTOCOLS:
        raise ConfigError(key, value, "kvtier moves blocks through host memory only: use host_shm (one node) "
                                      "or host_tcp", source)
    raise ConfigError(key, value, "expected host_shm or host_tcp", source)


def _parse_dram_size(key: str, value: object, source: str = "") -> int:
    try:
        size = parse_size(key, value, source)
    except ConfigError as err:  # the range with the reason: above 0, at most 1TB
        raise ConfigError(key, value, f"{err.reason}; a size above 0 and at most 1TB per device", source) from None
    size = -(-size // DRAM_ALIGN) * DRAM_ALIGN  # up to 2 MiB, as MemCache does
    if size > MAX_DRAM_PER_DEVICE:
        raise ConfigError(key, value, "a size above 0 and at most 1TB per device", source)
    return size


def _parse_part_size(key: str, value: object, source: str = "") -> int:
    try:
        size = parse_size(key, value, source)
    except ConfigError as err:
        raise ConfigError(key, value, f"{err.reason}; a size above 0 and at most 16GiB", source) from None
    if not 0 < size <= 1 << 34:  # as the handshake takes an instance's bytes per rank
        raise ConfigError(key, value, "a size above 0 and at most 16GiB", source)
    return size


def _parse_gib(key: str, value: object, source: str = "") -> int:
    return parse_int_range(0, 1024)(key, value, source) << 30  # type: ignore[operator]


def _parse_power_of_two(lo: int, hi: int) -> Parser:
    def parse(key: str, value: object, source: str = "") -> int:
        n = parse_int_range(lo, hi)(key, value, source)
        if n & (n - 1):
            raise ConfigError(key, value, f"expected a power of two from {lo} to {hi}", source)
        return n

    return parse


def _parse_choice(*choices: str) -> Parser:
    def parse(key: str, value: object, source: str = "") -> str:
        text = str(value).strip().lower()
        if text not in choices:
            raise ConfigError(key, value, f"expected one of: {', '.join(choices)}", source)
        return text

    return parse


_LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING, "warning": logging.WARNING,
               "error": logging.ERROR}


def _parse_log_level(key: str, value: object, source: str = "") -> int:
    text = str(value).strip().lower()
    if text not in _LOG_LEVELS:
        raise ConfigError(key, value, "expected one of: debug, info, warn, error", source)
    return _LOG_LEVELS[text]


def _parse_tls_switch(key: str, value: object, source: str = "") -> bool:
    # Accepting "true" and then talking in clear text would be a silent
    # downgrade; refusing it makes the operator choose.
    if parse_bool(key, value, source):
        raise ConfigError(key, value, "kvtier has no TLS: set false (its services bind loopback unless "
                                      "configured, and kvtier.token can require a shared token)", source)
    return False


def _parse_token(key: str, value: object, source: str = "") -> str:
    text = value if isinstance(value, str) else ""
    if not text or text != text.strip() or len(text) > 4096 or not text.isprintable():
        # The token itself stays out of the message and the logs.
        raise ConfigError(key, "<hidden>", "expected 1 to 4096 printable characters, no surrounding spaces",
                          source)
    return text


_SECRET_WORDS = ("token", "key", "pass", "secret", "cred")


def _secret(key: str) -> bool:
    """Whether ``key``'s value may be a secret (a token, a private key or its
    passphrase): such values are never written into a message."""
    return any(word in key.lower() for word in _SECRET_WORDS)


def _parse_abs_path(key: str, value: object, source: str = "") -> str:
    path = parse_path(key, value, source)
    if not path.startswith("/"):
        raise ConfigError(key, value, "expected an absolute path", source)
    return path


def _parse_cluster_protocol(key: str, value: object, source: str = "") -> str:
    text = str(value).strip().lower()
    if text not in ("tcp", "rdma"):
        raise ConfigError(key, value, "expected tcp or rdma (Mooncake's transfer engine protocols)", source)
    return text


def _parse_host(key: str, value: object, source: str = "") -> str:
    text = str(value).strip()
    if not HOST_RE.match(text) or PLACEHOLDER_RE.match(text):
        raise ConfigError(key, value, "expected this node's IP address or host name, reachable by the other nodes",
                          source)
    return text.strip("[]")


def _parse_etcd(key: str, value: object, source: str = "") -> str:
    """``HOST:PORT;HOST:PORT`` (``,`` also separates; ``http://`` allowed),
    returned as ``HOST:PORT;HOST:PORT``: Mooncake's masters and clients take it so."""
    parts = [p.strip() for p in str(value).replace(",", ";").split(";") if p.strip()]
    if not parts and str(value).strip():
        raise ConfigError(key, value, "expected HOST:PORT;HOST:PORT", source)
    out = []
    for part in parts:
        if part.startswith("https://"):
            raise ConfigError(key, value, "etcd over TLS is not supported by Mooncake's client: http:// or "
                              "HOST:PORT", source)
        host, port = parse_host_port(key, value, part.removeprefix("http://"), "HOST:PORT;HOST:PORT", source,
                                allow_zero=False)
        out.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    return ";".join(out)


def accept_any(key: str, value: object, source: str = "") -> object:
    return value


# --- the key table -----------------------------------------------------------


@dataclass(frozen=True)
class PoolKey:
    """One key of the files. ``field``: the PoolConfig field it sets, or None when kvtier ignores it (``why``)."""

    name: str
    field: str | None
    parse: Parser
    owner: str  # "meta" or "local": the file whose value wins when both set it
    example: str  # a value MemCache's files or the seeds use, valid here
    why: str = ""


def _used(name: str, field_: str, parse: Parser, owner: str, example: str) -> PoolKey:
    return PoolKey(name, field_, parse, owner, example)


def _ignored(names: str, why: str, parse: Parser = accept_any, owner: str = "meta",
             example: str = "", prefix: str = "") -> list[PoolKey]:
    """Keys kvtier has no use for: ``names`` separated by white space, each after ``prefix``."""
    return [PoolKey(prefix + n, None, parse, owner, example, why) for n in names.split()]


_TLS_WHY = "kvtier has no TLS; its services bind loopback unless configured, and kvtier.token can require a token"
_LOG_WHY = "kvtier logs through Python logging (stderr); where logs go and how they rotate is the caller's setup"
_STORE_WHY = "kvtier has no separate config store: instances attach to the meta service at meta_service_url"
_HCOM_WHY = "kvtier opens no data endpoint of its own: blocks move through the shared-memory arena"
_HA_WHY = "one meta service per node, without a standby; the SSD index is recovered from the disk on restart"
_LRU_WHY = "kvtier orders evictions with its own LRU policy per tier, unsharded"
_EVICT_WHY = "kvtier evicts when a save would pass the high watermark, not on a timer"
_CLIENT_WHY = "instances copy blocks in their own worker processes; SSD I/O threads are kvtier.io_threads"
_HBM_WHY = "device memory stays vLLM's own prefix cache; the pool is host DRAM only"
_FLUSH_WHY = "kvtier writes to SSD while evicting and cleaning DRAM, not on a flush timer"
_MISC_WHY = "a MemCache feature kvtier does not have"
_TIMEOUT_WHY = (f"an instance waits at most {POOL_CALL_TIMEOUT_S:g} s for one answer of the meta service, then "
                "answers a miss and reconnects with a backoff of 0.1 s doubling to 5 s, so the engine never waits "
                "on the pool")
_UBSIO_WHY = "UBS-IO's own tuning; kvtier's SSD tier does its own direct I/O"

KEYS: dict[str, PoolKey] = {k.name: k for k in [
    # Addresses
    _used("ock.mmc.meta_service_url", "meta_url", parse_service_url, "meta", "tcp://127.0.0.1:5000"),
    _used("ock.mmc.meta_service.metrics_url", "metrics", _parse_metrics_url, "meta", "http://127.0.0.1:8000"),
    *_ignored("ock.mmc.meta_service.config_store_url ock.mmc.local_service.config_store_url", _STORE_WHY,
              _parse_tcp_url, example="tcp://127.0.0.1:6000"),
    *_ignored("ock.mmc.local_service.config_store_url_domain", _STORE_WHY, owner="local", example="pool.local"),
    *_ignored("ock.mmc.local_service.hcom_url", _HCOM_WHY, _parse_tcp_url, "local", "tcp://127.0.0.1:7000"),
    # Eviction and leases
    _used("ock.mmc.evict_threshold_high", "evict_threshold_high", parse_int_range(1, 100), "meta", "90"),
    _used("ock.mmc.evict_threshold_low", "evict_threshold_low", parse_int_range(1, 99), "meta", "60"),
    _used("ock.mmc.rewarm.dram_watermark", "rewarm_dram_watermark", parse_int_range(1, 100), "meta", "95"),
    _used("ock.mmc.meta.lease_ttl_ms", "lease_ttl_ms", parse_int_range(6_000, 600_000), "meta", "30000"),
    *_ignored("ock.mmc.evict_check_interval_seconds", _EVICT_WHY, parse_int_range(1, 3600), example="5"),
    *_ignored("ock.mmc.evict_yield_interval", _EVICT_WHY, parse_int_range(0, 1 << 20), example="0"),
    *_ignored("ock.mmc.evict_yield_duration_us", _EVICT_WHY, parse_int_range(0, 10_000_000), example="0"),
    *_ignored("ock.mmc.defrag_evict_threshold", _EVICT_WHY, parse_int_range(0, 100), example="0"),
    *_ignored("ock.mmc.meta_service.lru_type", _LRU_WHY, _parse_choice("sharded_lru", "lru"),
              example="sharded_lru"),
    *_ignored("ock.mmc.meta_service.lru_shard_count", _LRU_WHY, _parse_power_of_two(1, 1024), example="16"),
    # Logging
    _used("ock.mmc.log_level", "log_level", _parse_log_level, "meta", "info"),
    *_ignored("ock.mmc.log_path", _LOG_WHY, example="/var/log/memcache_hybrid"),
    *_ignored("ock.mmc.log_rotation_file_size", _LOG_WHY, parse_int_range(1, 500), example="20"),
    *_ignored("ock.mmc.log_rotation_file_count", _LOG_WHY, parse_int_range(1, 50), example="50"),
    *_ignored("ock.mmc.log_output_target", _LOG_WHY, _parse_choice("screen", "file", "both"), example="file"),
    # The local service: protocol, sizes, devices
    _used("ock.mmc.local_service.protocol", "protocol", _parse_protocol, "local", "host_shm"),
    _used("ock.mmc.local_service.dram.size", "dram_size_per_device", _parse_dram_size, "local", "20GB"),
    _used("ock.mmc.local_service.world_size", "world_size", parse_int_range(1, 1024), "local", "8"),
    *_ignored("ock.mmc.local_service.max.dram.size", "kvtier's arena has one size: dram.size x devices",
              parse_size, "local", "64GB"),
    *_ignored("ock.mmc.local_service.dram.best_effort.enabled",
              "the arena is allocated whole at start, or refused when it does not fit", parse_bool, "local",
              "false"),
    *_ignored("ock.mmc.local_service.hbm.size ock.mmc.local_service.max.hbm.size", _HBM_WHY,
              lambda k, v, s: parse_size(k, v, s, allow_zero=True), "local", "0"),
    *_ignored("ock.mmc.local_service.backend_id ock.mmc.local_service.tag ock.mmc.local_service.tag_op_info",
              "kvtier has one pool per node", owner="local", example="0"),
    # Client of the meta service
    *_ignored("ock.mmc.client.timeout.seconds", _TIMEOUT_WHY, parse_int_range(1, 600), "local", "60"),
    *_ignored("ock.mmc.client.retry_milliseconds", _TIMEOUT_WHY, parse_int_range(0, 600_000), "local", "0"),
    *_ignored("ock.mmc.client.read_thread_pool.size ock.mmc.client.write_thread_pool.size", _CLIENT_WHY,
              parse_int_range(1, 64), "local", "32"),
    *_ignored("ock.mmc.client.aggregate.io", _CLIENT_WHY, parse_bool, "local", "true"),
    *_ignored("ock.mmc.client.aggregate.num", _CLIENT_WHY, parse_int_range(1, 131072), "local", "122"),
    *_ignored("ock.mmc.client.batch_option.chunk.count ock.mmc.client.batch_option.chunk.size", _CLIENT_WHY,
              owner="local", example="1"),
    # SSD (UBS-IO in MemCache)
    _used("ock.mmc.local_service.storage.enabled", "storage_enabled", parse_bool, "local", "true"),
    _used("ubsio.disk.path", "ssd_paths", parse_paths, "local", "/dev/loop0:/dev/loop1:/dev/loop2"),
    _used("ubsio.mem.size_in_gb", "staging_size_per_device", _parse_gib, "local", "10"),
    _used("ubsio.standalone.device_count", "device_count", parse_int_range(1, 1024), "local", "8"),
    _used("ubsio.standalone.force_new_disk", "force_new_disk", parse_bool, "local", "true"),
    *_ignored("ubsio.bdm.batch_read.standalone.use_scratch_pool ubsio.batch_read.standalone.use_scratch_pool",
              _UBSIO_WHY, parse_bool, "local", "false"),
    *_ignored("ock.mmc.storage.async_flush.interval_ms", _FLUSH_WHY, parse_int_range(200, 1000), example="200"),
    *_ignored("ock.mmc.storage.async_flush.batch_limit", _FLUSH_WHY, parse_int_range(8, 1024), example="64"),
    *_ignored("ock.mmc.meta.backup.enable", _HA_WHY, parse_bool, example="false"),
    *_ignored("ock.mmc.meta_service.storage.metadata_mode",
              "kvtier's SSD index lives with the SSD tier and is recovered from the disk",
              _parse_choice("aggregated", "separated"), example="aggregated"),
    *_ignored("ock.mmc.storage.pending_wait.timeout ock.mmc.storage.prefetch.enabled", _FLUSH_WHY,
              owner="local", example="0"),
    # High availability, dynamic configuration, events, metrics cadence
    *_ignored("ock.mmc.meta.ha.enable", _HA_WHY, parse_bool, example="false"),
    *_ignored("ock.mmc.dynamic_config.enable ock.mmc.dynamic_config.interval",
              "the files are read once at start", example="false"),
    *_ignored("ock.mmc.meta_service.metrics_report_interval_seconds",
              "metrics are computed when /metrics is scraped", example="10"),
    *_ignored("ock.mmc.meta_service.alloc.max_value_mode.enabled",
              "the arena has fixed-size slots, one block each", parse_bool, example="false"),
    *_ignored("enable endpoint transport block_size hash_as_int model_name queue_capacity tenant_id",
              _MISC_WHY + " (KV events)", example="false", prefix="ock.mmc.kv_events."),
    *_ignored("ock.mmc.zmq.enable_curve ock.mmc.zmq.private_key ock.mmc.zmq.public_key",
              _MISC_WHY + " (KV events over ZeroMQ)", example="false"),
    # TLS: every switch refuses "true"; paths are ignored
    *_ignored(" ".join(f"ock.mmc.{p}tls.enable" for p in ("", "config_store.", "metrics.", "local_service.hcom.")),
              _TLS_WHY, _parse_tls_switch, example="false"),
    *_ignored(" ".join(f"ock.mmc.{p}tls.{k}" for p in ("", "config_store.", "metrics.", "local_service.hcom.")
                       for k in ("ca.path", "ca.crl.path", "cert.path", "key.path", "key.pass.path",
                                 "package.path", "decrypter.path")
                       if not (p == "local_service.hcom." and k == "package.path")),
              _TLS_WHY, example=""),
    # UBS-IO's other keys (MemCache 1.2 and 1.3 pass them to UBS-IO)
    *_ignored("""
        batch_read.copy_workers batch_read.pipeline_depth bdm.batch_read.pipeline_depth batchget.thread.num
        bdm.batch_read.temp_pool_mb bdm.batch_read.window_bytes_mb bdm.batch_read.window_keys bdm.io_engine
        bdm.io_uring.sqpoll_mode bdm.sync.worker_num cache.disk_read_write_ratio cache.mem_read_write_ratio
        cache.qos.enable cli_tools.enable cm.copy_num cm.initial.nodes_count cm.pts_count
        cm.register_perm_timeout_sec cm.register_timeout_sec cm.zk_host data.crc.enable log.level log.path
        net.data.ip_mask net.data.listen_port net.data.protocol net.data.segment_size
        net.ipc.data.busy_polling_mode net.ipc.data.workers_count net.request.executor.queue.size
        net.request.executor.thread.num net.rpc.data.busy_polling_mode net.rpc.data.workers_count
        net.tls.ca.cert.path net.tls.ca.crl.path net.tls.enable.switch net.tls.server.cert.path
        net.tls.server.decrypter.lib.path net.tls.server.key.pass.path net.tls.server.key.path
        net.tls.server.ssl.lib.dir prometheus.enable prometheus.exposer prometheus.scrape_interval_sec
        rcache.evict_water_level sdkmem.size_in_mb segment.size_in_mb standalone.device_id_gather_timeout_sec
        trace.enable underfs.batch_read.worker_num underfs.ceph.cfg.path underfs.ceph.cluster
        underfs.ceph.pool underfs.ceph.user underfs.file_system_type underfs.hdfs.name_node
        underfs.hdfs.working_path underfs.local.root_path wcache.compaction_threshold
        wcache.disk_evict_water_level wcache.evict_water_level wcache.negotiate.delay wcache.partition_count
        work.io.alignsize work.io.timeout work.net.timeout work.scene""",
              _UBSIO_WHY, owner="local", example="1", prefix="ubsio."),
    # kvtier's own keys
    _used("kvtier.token", "token", _parse_token, "meta", "0123456789abcdef"),
    _used("kvtier.shm_dir", "shm_dir", _parse_abs_path, "local", "/dev/shm"),
    _used("kvtier.ssd_size", "ssd_size_bytes", parse_size, "local", "64GB"),
    _used("kvtier.io_threads", "io_threads", parse_int_range(1, 64), "local", "4"),
    _used("kvtier.slot_rank_bytes", "slot_rank_bytes", _parse_part_size, "local", "256KiB"),
    _used("kvtier.warm_interval", "warm_interval_s", parse_seconds, "local", "5"),
    # The cluster tier (Mooncake Store under the node pool; docs/configuration.md)
    _used("kvtier.node_service_url", "node_service_url", parse_service_url, "local", "tcp://127.0.0.1:5010"),
    _used("kvtier.cluster.enabled", "cluster_enabled", parse_bool, "local", "true"),
    _used("kvtier.cluster.master_port", "cluster_master_port", parse_int_range(1025, 65535), "meta", "50051"),
    _used("kvtier.cluster.master_metrics_port", "cluster_master_metrics_port", parse_int_range(1025, 65535),
          "meta", "50052"),
    _used("kvtier.cluster.eviction_watermark", "cluster_eviction_watermark", parse_int_range(50, 99), "meta", "90"),
    _used("kvtier.cluster.etcd_endpoints", "cluster_etcd_endpoints", _parse_etcd, "meta",
          "127.0.0.1:2379;127.0.0.1:2381"),
    _used("kvtier.cluster.local_hostname", "cluster_local_hostname", _parse_host, "local", "127.0.0.1"),
    _used("kvtier.cluster.segment_size", "cluster_segment_bytes",
          lambda k, v, s: parse_size(k, v, s, allow_zero=True), "local", "4GB"),
    _used("kvtier.cluster.protocol", "cluster_protocol", _parse_cluster_protocol, "local", "tcp"),
    _used("kvtier.cluster.rdma_devices", "cluster_rdma_devices", accept_any, "local", "mlx5_0"),
    _used("kvtier.cluster.metadata_server", "cluster_metadata_server", accept_any, "local", "P2PHANDSHAKE"),
    _used("kvtier.cluster.replicas", "cluster_replicas", parse_int_range(1, 8), "local", "1"),
    _used("kvtier.cluster.publish", "cluster_publish", parse_enum(PublishOn), "local", "save"),
]}


def known_pool_keys() -> list[str]:
    return sorted(KEYS)


# --- the result --------------------------------------------------------------


@dataclass(frozen=True)
class PoolConfig:
    """The node pool's settings. Sizes in bytes, thresholds in percent of the DRAM tier.

    ``meta_url`` is where ``kvtier meta`` listens (``meta_host``/``meta_port``
    for TCP, ``unix_path`` for a Unix socket); ``client_url`` is where this
    node's instances connect (the local file's ``meta_service_url``, else
    ``meta_url``). ``dram_size_per_device`` x ``devices`` is the node's DRAM
    arena (:attr:`dram_bytes`). ``ssd_paths`` is empty unless
    ``storage_enabled``. ``token`` None: no token is required. ``ignored``
    and ``warnings`` are lines for the caller to log at info and warning
    level; ``sources`` are the files read, meta first.
    """

    meta_url: str = "tcp://127.0.0.1:5000"
    meta_host: str | None = "127.0.0.1"
    meta_port: int | None = 5000
    unix_path: str | None = None
    client_url: str = "tcp://127.0.0.1:5000"
    # MemCache's default is 8000, which is also vLLM's default API port:
    # kvtier's default keeps the two apart when neither is configured.
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 5001
    protocol: Protocol = Protocol.HOST_SHM
    dram_size_per_device: int = 1 << 30
    devices: int = 1
    world_size: int = 256
    staging_size_per_device: int = 0  # ubsio.mem.size_in_gb: counted in host memory, not allocated by kvtier
    evict_threshold_high: int = 90
    evict_threshold_low: int = 80
    rewarm_dram_watermark: int = 95
    storage_enabled: bool = False
    ssd_paths: tuple[str, ...] = ()
    ssd_size_bytes: int | None = None
    force_new_disk: bool = False
    lease_ttl_ms: int = 10_000
    token: str | None = field(default=None, repr=False)
    shm_dir: str = "/dev/shm"
    io_threads: int = 4
    slot_rank_bytes: int | None = None  # a slot's part for each rank; None: the first instance's block
    warm_interval_s: float | None = None  # the arena: a byte of each page read this often (as kv_warm_interval_s)
    log_level: int = logging.INFO
    # The cluster tier: off unless cluster_enabled. The master runs on the
    # host of meta_url (the master node), found by other nodes through the
    # host of their local file's meta_service_url.
    node_service_url: str | None = None
    cluster_enabled: bool = False
    cluster_master_host: str = "127.0.0.1"
    cluster_master_port: int = 50051
    cluster_master_metrics_port: int = 50052
    cluster_eviction_watermark: int = 90
    cluster_etcd_endpoints: str = ""
    cluster_local_hostname: str | None = None
    cluster_segment_bytes: int = 1 << 30
    cluster_protocol: str = "tcp"
    cluster_rdma_devices: str = ""
    cluster_metadata_server: str = "P2PHANDSHAKE"
    cluster_replicas: int = 1
    cluster_publish: PublishOn = PublishOn.SAVE
    ignored: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    sources: tuple[str, ...] = ()
    size_sources: tuple[tuple[str, str], ...] = ()  # (key, "path:line") of dram.size and the device count

    @property
    def dram_bytes(self) -> int:
        """The node's DRAM arena: dram.size per device x devices."""
        return self.dram_size_per_device * self.devices

    @property
    def listen_url(self) -> str:
        """Where this node's pool listens: ``kvtier.node_service_url`` on a
        worker node (``kvtier meta --role local``), else ``meta_url``."""
        return self.node_service_url or self.meta_url

    def cluster_config(self) -> ClusterConfig | None:
        """The cluster tier's settings, or None when ``kvtier.cluster.enabled`` is not true."""
        if not self.cluster_enabled:
            return None
        return ClusterConfig(
            master_host=self.cluster_master_host, master_port=self.cluster_master_port,
            master_metrics_port=self.cluster_master_metrics_port,
            local_hostname=self.cluster_local_hostname or self.cluster_master_host,
            segment_bytes=self.cluster_segment_bytes, protocol=self.cluster_protocol,
            rdma_devices=self.cluster_rdma_devices, metadata_server=self.cluster_metadata_server,
            replicas=self.cluster_replicas, etcd_endpoints=self.cluster_etcd_endpoints,
            eviction_high_watermark=self.cluster_eviction_watermark / 100, publish_on=self.cluster_publish)

    def store_config(self) -> KvtierConfig:
        """The :class:`KvtierConfig` the meta service builds its store from (the node's whole arena)."""
        return KvtierConfig(
            dram_size_bytes=self.dram_bytes,
            evict_threshold_high=float(self.evict_threshold_high),
            evict_threshold_low=float(self.evict_threshold_low),
            shm_dir=self.shm_dir,
            ssd_paths=self.ssd_paths,
            ssd_size_bytes=self.ssd_size_bytes,
            force_new_disk=self.force_new_disk,
            rewarm_dram_watermark=float(self.rewarm_dram_watermark),
            io_threads=self.io_threads,
            kv_warm_interval_s=self.warm_interval_s,
        )


def check_pool_fits(cfg: PoolConfig, leftover_bytes: int = 0) -> None:
    """Refuse a node pool this host cannot hold (free memory in ``shm_dir``,
    huge pages there, a container's limit), before anything is created:
    the arena is allocated whole, and past the memory there is it would be
    the OOM killer, not an error, that stops it. ``leftover_bytes``: what a
    killed service's files hold there, which the start frees or reuses.
    Names the keys it comes from."""
    store = cfg.store_config()
    if leftover_bytes >= store.dram_size_bytes:
        return
    try:
        check_dram_fits(replace(store, dram_size_bytes=store.dram_size_bytes - leftover_bytes))
    except ConfigError as err:
        if err.key == "shm_dir":  # the folder, not the size
            raise ConfigError("kvtier.shm_dir", cfg.shm_dir, err.reason,
                              ", ".join(cfg.sources) or "kvtier's default") from None
        gib = 1 << 30
        raise ConfigError(
            DRAM_SIZE_KEY,
            f"{cfg.dram_size_per_device / gib:g} GiB x {cfg.devices} device(s) = {cfg.dram_bytes / gib:g} GiB",
            f"the node's DRAM pool (this size per device x the devices): {err.reason}; lower this size, or "
            "the devices (ubsio.standalone.device_count, else ock.mmc.local_service.world_size)",
            ", ".join(where for _, where in cfg.size_sources),
        ) from None


_FIELDS = {f.name for f in fields(PoolConfig)}
# Keys whose field is not a PoolConfig field of the same name: resolved in _resolve.
_DERIVED = {"metrics", "device_count"}
assert {k.field for k in KEYS.values() if k.field} <= _FIELDS | _DERIVED


# --- reading -----------------------------------------------------------------


@dataclass(frozen=True)
class _Setting:
    value: str
    source: str  # "path:line"
    parsed: object


def _read_conf(path: str, what: str = "config file") -> dict[str, _Setting]:
    """Read one file: key -> setting, every value checked by its key's parser.

    ``what`` names where the path came from (an environment variable or an
    argument) for the error when the file cannot be read.
    """
    try:
        with open(path, encoding="utf-8-sig") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise ConfigError(what, path, "no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(what, path, f"cannot read it: {err}") from None
    out: dict[str, _Setting] = {}
    for n, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not sep:
            raise ConfigError(f"line {n}", line, "no '=': expected 'key = value' or a '#' comment", path)
        if not key:
            raise ConfigError(f"line {n}", line, "no key before '='", path)
        source = f"{path}:{n}"
        # A value that may be a secret is never written into a message.
        shown = "<hidden>" if _secret(key) else value
        spec = KEYS.get(key)
        if spec is None:
            # Nor an unknown key's value: it may be a secret under a mistyped key.
            closest = difflib.get_close_matches(key.lower(), KEYS, n=1, cutoff=0.0)  # keys are lower case
            raise ConfigError(key, "<not shown>", f"unknown key; the closest known key is {closest[0]}", source)
        if key in out:
            raise ConfigError(key, shown, f"given twice in this file (first at {out[key].source})", source)
        out[key] = _Setting(value, source, spec.parse(key, value, source))
    return out


def _pick(explicit: str | None, env: Mapping[str, str], var: str) -> tuple[str | None, str]:
    if explicit:
        return explicit, "config file"
    return (env.get(var) or None), var


def load_pool_config(meta_path: str | None = None, local_path: str | None = None,
                     env: Mapping[str, str] = os.environ) -> PoolConfig:
    """Read the meta and local files and return the node pool's configuration.

    A path not given comes from ``MMC_META_CONFIG_PATH`` / ``MMC_LOCAL_CONFIG_PATH``
    in ``env``; with neither file, every setting is its default (loopback
    addresses, one device of 1 GiB, no SSD). ``KVTIER_TOKEN`` in ``env``
    sets the token and wins over ``kvtier.token``.
    """
    meta, meta_what = _pick(meta_path, env, META_ENV)
    local, local_what = _pick(local_path, env, LOCAL_ENV)
    files: list[tuple[str, str, dict[str, _Setting]]] = []
    if meta:
        files.append(("meta", meta, _read_conf(meta, meta_what)))
    if local:
        files.append(("local", local, _read_conf(local, local_what)))
    return _resolve(files, env)


def _resolve(files: list[tuple[str, str, dict[str, _Setting]]], env: Mapping[str, str]) -> PoolConfig:
    by_role = {role: settings for role, _, settings in files}
    chosen: dict[str, _Setting] = {}
    warnings: list[str] = []
    for key in dict.fromkeys(k for _, _, settings in files for k in settings):  # first-seen order
        spec = KEYS[key]
        other = "local" if spec.owner == "meta" else "meta"
        first, second = by_role.get(spec.owner, {}).get(key), by_role.get(other, {}).get(key)
        win = first or second
        assert win is not None
        chosen[key] = win
        lose = second if first else None
        if lose is not None and lose.value != win.value and key != "ock.mmc.meta_service_url":
            if _secret(key):  # never in a log line
                warnings.append(f"{lose.source}: {key} is not used: the {spec.owner} file's ({win.source}) counts")
            else:
                warnings.append(f"{lose.source}: {key} = {lose.value!r} is not used: the {spec.owner} file's "
                                f"value {win.value!r} ({win.source}) counts")

    values: dict[str, object] = {}
    ignored: list[str] = []
    for key, s in chosen.items():
        spec = KEYS[key]
        if spec.field is None:
            ignored.append(f"{s.source}: {key} is ignored: {spec.why}")
        else:
            values[spec.field] = s.parsed

    # Addresses: the meta file's meta_service_url is where the service
    # listens; the local file's is where this node's instances connect.
    meta_addr = by_role.get("meta", {}).get("ock.mmc.meta_service_url") \
        or by_role.get("local", {}).get("ock.mmc.meta_service_url")
    client_addr = by_role.get("local", {}).get("ock.mmc.meta_service_url") or meta_addr
    out: dict[str, object] = {}
    if meta_addr is not None:
        a = meta_addr.parsed
        assert isinstance(a, ServiceAddress)
        out.update(meta_url=a.url, meta_host=a.host, meta_port=a.port, unix_path=a.unix_path)
    if client_addr is not None:
        assert isinstance(client_addr.parsed, ServiceAddress)
        out["client_url"] = client_addr.parsed.url
        # The cluster's master runs beside the master node's meta service:
        # a worker node finds it at the host its local file names.
        out["cluster_master_host"] = client_addr.parsed.host or "127.0.0.1"
    if values.get("node_service_url") is not None:
        node = values["node_service_url"]
        assert isinstance(node, ServiceAddress)
        values["node_service_url"] = node.url
        # This node's instances attach to its own pool, not the master node's.
        out["client_url"] = node.url
    if meta_addr is not None and client_addr is not None and client_addr.value != meta_addr.value:
        warnings.append(f"{client_addr.source}: instances connect to {client_addr.value!r} while the meta service "
                        f"listens on {meta_addr.value!r} ({meta_addr.source}): check they are the same service")
    values.pop("meta_url", None)
    if "metrics" in values:
        out["metrics_host"], out["metrics_port"] = values.pop("metrics")  # type: ignore[misc]

    # Devices: the seeds size a node as devices x (dram.size + ubsio.mem.size_in_gb),
    # with devices = ubsio.standalone.device_count; MemCache's world_size is
    # the cluster's rank count, the node's device count only on one node.
    device_count = values.pop("device_count", None)
    world = values.get("world_size")
    if device_count is not None and world is not None and device_count > world:  # type: ignore[operator]
        s = chosen["ubsio.standalone.device_count"]
        raise ConfigError("ubsio.standalone.device_count", s.value,
                          f"more devices than ock.mmc.local_service.world_size ({world}) allows", s.source)
    out["devices"] = device_count or world or 1
    out["size_sources"] = tuple((k, chosen[k].source) for k in (DRAM_SIZE_KEY, "ubsio.standalone.device_count",
                                                                "ock.mmc.local_service.world_size") if k in chosen)

    # SSD: off unless storage.enabled; its keys are then reported, not used.
    if values.get("storage_enabled"):
        if not values.get("ssd_paths"):
            s = chosen["ock.mmc.local_service.storage.enabled"]
            raise ConfigError("ock.mmc.local_service.storage.enabled", s.value,
                              "needs ubsio.disk.path (the devices, partitions or files of the SSD tier)", s.source)
    else:
        for key in ("ubsio.disk.path", "ubsio.mem.size_in_gb", "ubsio.standalone.force_new_disk", "kvtier.ssd_size"):
            if key in chosen:
                field_ = KEYS[key].field
                values.pop(field_, None)  # type: ignore[arg-type]
                ignored.append(f"{chosen[key].source}: {key} is ignored: "
                               "ock.mmc.local_service.storage.enabled is not true")

    if values.get("protocol") is Protocol.HOST_TCP:
        warnings.append(f"{chosen['ock.mmc.local_service.protocol'].source}: ock.mmc.local_service.protocol = "
                       "host_tcp works as host_shm: instances reach the service at ock.mmc.meta_service_url and "
                       "map the node's arena, so they must share its shm_dir; blocks cross nodes only through "
                       "the cluster tier (kvtier.cluster.enabled)")

    if not values.get("cluster_enabled"):
        for key in [k for k in chosen if k.startswith("kvtier.cluster.") and k != "kvtier.cluster.enabled"]:
            field_ = KEYS[key].field
            values.pop(field_, None)  # type: ignore[arg-type]
            ignored.append(f"{chosen[key].source}: {key} is ignored: kvtier.cluster.enabled is not true")

    # Watermarks, checked with the names the files use.
    high = values.get("evict_threshold_high", PoolConfig.evict_threshold_high)
    low = values.get("evict_threshold_low", PoolConfig.evict_threshold_low)
    if low >= high:  # type: ignore[operator]
        key = "ock.mmc.evict_threshold_low" if "ock.mmc.evict_threshold_low" in chosen \
            else "ock.mmc.evict_threshold_high"
        raise ConfigError(key, chosen[key].value,
                          f"ock.mmc.evict_threshold_low ({low}) must be below ock.mmc.evict_threshold_high ({high})",
                          chosen[key].source)
    rewarm = values.get("rewarm_dram_watermark", PoolConfig.rewarm_dram_watermark)
    if values.get("storage_enabled") and rewarm <= high:  # type: ignore[operator]
        key = "ock.mmc.rewarm.dram_watermark" if "ock.mmc.rewarm.dram_watermark" in chosen \
            else "ock.mmc.evict_threshold_high"
        raise ConfigError(key, chosen[key].value,
                          f"with the SSD tier on, ock.mmc.rewarm.dram_watermark ({rewarm}) must be above "
                          f"ock.mmc.evict_threshold_high ({high}), or DRAM eviction never writes to SSD",
                          chosen[key].source)

    # The token: the environment wins; a token in a file others can read is reported.
    token_env = env.get(TOKEN_ENV)
    if token_env:
        values["token"] = _parse_token(TOKEN_ENV, token_env, "environment")
    elif "kvtier.token" in chosen:
        path = chosen["kvtier.token"].source.rpartition(":")[0]
        try:
            mode = os.stat(path).st_mode
        except OSError:
            mode = 0
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            warnings.append(f"{chosen['kvtier.token'].source}: kvtier.token is in a file other users can read "
                            f"(mode {stat.S_IMODE(mode):o}): chmod 600 it, or set {TOKEN_ENV} instead")

    out.update(values)
    out["ignored"] = tuple(ignored)
    out["warnings"] = tuple(warnings)
    out["sources"] = tuple(path for _, path, _ in files)
    return PoolConfig(**out)  # type: ignore[arg-type]
