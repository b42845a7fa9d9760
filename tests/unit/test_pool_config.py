"""kvtier.pool.config: the node pool's mmc-meta.conf / mmc-local.conf files."""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.config import ClusterConfig, KvtierConfig, PublishOn, parse_paths
from kvtier.errors import ConfigError
from kvtier.pool.config import (
    KEYS,
    PoolConfig,
    Protocol,
    accept_any,
    check_pool_fits,
    load_pool_config,
    parse_service_url,
)
from kvtier.tools.sizing import format_pool_totals, pool_totals

GIB = 1 << 30
DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

# The seeds' files, addresses filled in (the seeds write xx.xx.xx.xx).
SEED_A_META = """\
# the master node's address; ports as in the seed
ock.mmc.meta_service_url = tcp://10.1.2.3:5000
ock.mmc.local_service.config_store_url = tcp://10.1.2.3:6000
ock.mmc.meta_service.metrics_url = http://10.1.2.3:8000

# eviction starts above the high mark
ock.mmc.evict_threshold_high = 70

# and stops at the low mark
ock.mmc.evict_threshold_low = 60

ock.mmc.rewarm.dram_watermark = 95
"""
SEED_A_LOCAL = """\
ock.mmc.meta_service_url = tcp://10.1.2.3:5000
ock.mmc.local_service.config_store_url = tcp://10.1.2.3:6000

ock.mmc.local_service.protocol = {protocol}

ock.mmc.local_service.dram.size = 20GB  \n\
ock.mmc.local_service.storage.enabled = true
ubsio.disk.path = /dev/loop0:/dev/loop1:/dev/loop2
ubsio.mem.size_in_gb = 10
ubsio.standalone.device_count = 8
ubsio.bdm.batch_read.standalone.use_scratch_pool = false
"""
SEED_B_META = """\
ock.mmc.meta_service_url = tcp://10.1.2.3:5000
ock.mmc.meta_service.config_store_url = tcp://10.1.2.3:6000
ock.mmc.meta_service.metrics_url = 10.1.2.3:8000
ock.mmc.evict_threshold_high = 100
ock.mmc.evict_threshold_low = 90
"""
SEED_B_LOCAL = """\
ock.mmc.local_service.world_size = 8
ock.mmc.local_service.protocol = {protocol}
ock.mmc.local_service.dram.size = 128GB

ock.mmc.meta_service_url = tcp://10.1.2.3:5000
ock.mmc.local_service.config_store_url = tcp://10.1.2.3:6000
ock.mmc.local_service.hcom_url = tcp://10.1.2.3:7000
"""


def write(tmp_path: Path, name: str, text: str, mode: int = 0o600) -> str:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def load_local(tmp_path: Path, text: str, **kw: object) -> PoolConfig:
    return load_pool_config(local_path=write(tmp_path, "mmc-local.conf", text), env={}, **kw)  # type: ignore[arg-type]


def without_reports(cfg: PoolConfig) -> PoolConfig:
    return dataclasses.replace(cfg, ignored=(), warnings=(), sources=())


# --- defaults and the seeds' files -------------------------------------------


def test_defaults_without_files_bind_loopback() -> None:
    cfg = load_pool_config(env={})
    assert cfg == PoolConfig()
    assert (cfg.meta_url, cfg.meta_host, cfg.meta_port, cfg.unix_path) == ("tcp://127.0.0.1:5000", "127.0.0.1",
                                                                           5000, None)
    assert cfg.client_url == cfg.meta_url
    assert cfg.metrics_host == "127.0.0.1"
    assert cfg.protocol is Protocol.HOST_SHM
    assert (cfg.dram_bytes, cfg.devices, cfg.ssd_paths, cfg.token) == (GIB, 1, (), None)
    assert (cfg.ignored, cfg.warnings, cfg.sources) == ((), (), ())


def test_seed_files_with_device_protocol_are_refused_naming_host_protocols(tmp_path: Path) -> None:
    meta = write(tmp_path, "mmc-meta.conf", SEED_A_META)
    local = write(tmp_path, "mmc-local.conf", SEED_A_LOCAL.format(protocol="device_rdma"))
    with pytest.raises(ConfigError) as info:
        load_pool_config(meta, local, env={})
    assert info.value.key == "ock.mmc.local_service.protocol"
    assert info.value.value == "device_rdma"
    assert info.value.source == f"{local}:4"
    assert "host_shm" in str(info.value) and "host_tcp" in str(info.value)


def test_seed_a_files_parse(tmp_path: Path) -> None:
    # The seed's own choice for a single node without device transfers.
    meta = write(tmp_path, "mmc-meta.conf", SEED_A_META)
    local = write(tmp_path, "mmc-local.conf", SEED_A_LOCAL.format(protocol="host_shm"))
    cfg = load_pool_config(meta, local, env={})
    assert (cfg.meta_host, cfg.meta_port, cfg.client_url) == ("10.1.2.3", 5000, "tcp://10.1.2.3:5000")
    assert (cfg.metrics_host, cfg.metrics_port) == ("10.1.2.3", 8000)
    assert (cfg.evict_threshold_high, cfg.evict_threshold_low, cfg.rewarm_dram_watermark) == (70, 60, 95)
    assert cfg.protocol is Protocol.HOST_SHM
    assert (cfg.dram_size_per_device, cfg.devices, cfg.dram_bytes) == (20 * GIB, 8, 160 * GIB)
    assert cfg.storage_enabled and cfg.ssd_paths == ("/dev/loop0", "/dev/loop1", "/dev/loop2")
    assert cfg.staging_size_per_device == 10 * GIB
    assert cfg.sources == (meta, local)
    # config_store_url is in both files: reported once, from the meta file.
    assert cfg.ignored == (
        f"{meta}:3: ock.mmc.local_service.config_store_url is ignored: " + KEYS[
            "ock.mmc.local_service.config_store_url"].why,
        f"{local}:11: ubsio.bdm.batch_read.standalone.use_scratch_pool is ignored: " + KEYS[
            "ubsio.bdm.batch_read.standalone.use_scratch_pool"].why,
    )
    assert cfg.warnings == ()
    t = pool_totals(cfg)
    assert (t.devices, t.dram_bytes, t.staging_bytes, t.host_bytes) == (8, 160 * GIB, 80 * GIB, 240 * GIB)


def test_seed_b_files_parse(tmp_path: Path) -> None:
    meta = write(tmp_path, "mmc-meta.conf", SEED_B_META)
    local = write(tmp_path, "mmc-local.conf", SEED_B_LOCAL.format(protocol="host_tcp"))
    cfg = load_pool_config(meta, local, env={})
    assert (cfg.metrics_host, cfg.metrics_port) == ("10.1.2.3", 8000)  # written without http://
    assert (cfg.evict_threshold_high, cfg.evict_threshold_low) == (100, 90)
    assert cfg.protocol is Protocol.HOST_TCP
    # world_size without a device count: the seed's "128 GB per card".
    assert (cfg.world_size, cfg.devices, cfg.dram_bytes) == (8, 8, 1024 * GIB)
    assert not cfg.storage_enabled and cfg.ssd_paths == ()
    assert [line.split(": ")[1] for line in cfg.ignored] == [
        "ock.mmc.meta_service.config_store_url is ignored",
        "ock.mmc.local_service.config_store_url is ignored",
        "ock.mmc.local_service.hcom_url is ignored"]
    assert [line.split(": ")[1] for line in cfg.warnings] == [
        "ock.mmc.local_service.protocol = host_tcp works as host_shm"]
    assert cfg.store_config().evict_threshold_high == 100.0


def test_memcache_shipped_default_files_parse(tmp_path: Path) -> None:
    """The active lines of MemCache 1.3's own files, with its protocol set to one kvtier has."""
    meta = write(tmp_path, "mmc-meta.conf", "ock.mmc.meta_service_url = tcp://127.0.0.1:5000\n"
                 "ock.mmc.meta_service.config_store_url = tcp://127.0.0.1:6000\n"
                 "ock.mmc.meta_service.metrics_url = http://127.0.0.1:8000\n"
                 "ock.mmc.log_level = info\n"
                 "# ock.mmc.meta_service.lru_shard_count = 16\n")
    local = write(tmp_path, "mmc-local.conf", "ock.mmc.meta_service_url = tcp://127.0.0.1:5000\n"
                  "ock.mmc.local_service.config_store_url = tcp://127.0.0.1:6000\n"
                  "ock.mmc.log_level = info\n"
                  "ock.mmc.local_service.world_size = 256\n"
                  "ock.mmc.local_service.protocol = host_shm\n"
                  "ock.mmc.local_service.dram.size = 1GB\n"
                  "ock.mmc.tls.decrypter.path =\n")
    cfg = load_pool_config(meta, local, env={})
    assert (cfg.devices, cfg.dram_bytes) == (256, 256 * GIB)  # world_size alone counts as the node's devices
    assert len(cfg.ignored) == 3


# --- every key ---------------------------------------------------------------

SSD_ON = "ock.mmc.local_service.storage.enabled = true\nubsio.disk.path = /tmp/kvtier-ssd\n"
CLUSTER_ON = "kvtier.cluster.enabled = true\n"

# key -> (value, field, expected, other lines the file needs)
USED: dict[str, tuple[str, str, object, str]] = {
    "ock.mmc.meta_service_url": ("unix:///run/kvtier/meta.sock", "unix_path", "/run/kvtier/meta.sock", ""),
    "ock.mmc.meta_service.metrics_url": ("127.0.0.1:9100", "metrics_port", 9100, ""),
    "ock.mmc.evict_threshold_high": ("85", "evict_threshold_high", 85, ""),
    "ock.mmc.evict_threshold_low": ("33", "evict_threshold_low", 33, ""),
    "ock.mmc.rewarm.dram_watermark": ("97", "rewarm_dram_watermark", 97, ""),
    "ock.mmc.meta.lease_ttl_ms": ("30000", "lease_ttl_ms", 30000, ""),
    "ock.mmc.log_level": ("warn", "log_level", logging.WARNING, ""),
    "ock.mmc.local_service.protocol": ("host_tcp", "protocol", Protocol.HOST_TCP, ""),
    "ock.mmc.local_service.dram.size": ("2.5G", "dram_size_per_device", 5 * GIB // 2, ""),
    "ock.mmc.local_service.world_size": ("16", "world_size", 16, ""),
    "ock.mmc.local_service.storage.enabled": ("1", "storage_enabled", True, "ubsio.disk.path = /tmp/a\n"),
    "ubsio.disk.path": ("/tmp/a:/tmp/b", "ssd_paths", ("/tmp/a", "/tmp/b"),
                        "ock.mmc.local_service.storage.enabled = true\n"),
    "ubsio.mem.size_in_gb": ("5", "staging_size_per_device", 5 * GIB, SSD_ON),
    "ubsio.standalone.device_count": ("4", "devices", 4, ""),
    "ubsio.standalone.force_new_disk": ("true", "force_new_disk", True, SSD_ON),
    "kvtier.token": ("s3cret-token", "token", "s3cret-token", ""),
    "kvtier.shm_dir": ("/dev/hugepages", "shm_dir", "/dev/hugepages", ""),
    "kvtier.ssd_size": ("64GB", "ssd_size_bytes", 64 * GIB, SSD_ON),
    "kvtier.io_threads": ("8", "io_threads", 8, ""),
    "kvtier.slot_rank_bytes": ("512KiB", "slot_rank_bytes", 512 << 10, ""),
    "kvtier.warm_interval": ("2.5s", "warm_interval_s", 2.5, ""),
    "kvtier.node_service_url": ("tcp://127.0.0.1:5010", "node_service_url", "tcp://127.0.0.1:5010", ""),
    "kvtier.cluster.enabled": ("true", "cluster_enabled", True, ""),
    "kvtier.cluster.master_port": ("50061", "cluster_master_port", 50061, CLUSTER_ON),
    "kvtier.cluster.master_metrics_port": ("50062", "cluster_master_metrics_port", 50062, CLUSTER_ON),
    "kvtier.cluster.eviction_watermark": ("80", "cluster_eviction_watermark", 80, CLUSTER_ON),
    "kvtier.cluster.etcd_endpoints": ("10.0.0.1:2379;10.0.0.2:2379", "cluster_etcd_endpoints",
                                      "10.0.0.1:2379;10.0.0.2:2379", CLUSTER_ON),
    "kvtier.cluster.local_hostname": ("10.0.0.2", "cluster_local_hostname", "10.0.0.2", CLUSTER_ON),
    "kvtier.cluster.segment_size": ("0", "cluster_segment_bytes", 0, CLUSTER_ON),
    "kvtier.cluster.protocol": ("rdma", "cluster_protocol", "rdma", CLUSTER_ON),
    "kvtier.cluster.rdma_devices": ("mlx5_1", "cluster_rdma_devices", "mlx5_1", CLUSTER_ON),
    "kvtier.cluster.metadata_server": ("http://10.0.0.1:8080/metadata", "cluster_metadata_server",
                                       "http://10.0.0.1:8080/metadata", CLUSTER_ON),
    "kvtier.cluster.replicas": ("2", "cluster_replicas", 2, CLUSTER_ON),
    "kvtier.cluster.publish": ("evict", "cluster_publish", PublishOn.EVICT, CLUSTER_ON),
}


def test_every_used_key_has_a_case() -> None:
    assert set(USED) == {k for k, spec in KEYS.items() if spec.field is not None}


@pytest.mark.parametrize("key", sorted(USED))
def test_used_key_lands_in_its_field(tmp_path: Path, key: str) -> None:
    value, field, expected, extra = USED[key]
    cfg = load_local(tmp_path, f"{extra}{key} = {value}\n")
    assert getattr(cfg, field) == expected
    assert expected != getattr(PoolConfig(), field)  # so a key that landed nowhere fails
    assert not any(key in line for line in cfg.ignored)
    # The example in the table is valid too.
    load_local(tmp_path, f"{extra}{key} = {KEYS[key].example}\n")


IGNORED = sorted(k for k, spec in KEYS.items() if spec.field is None)


@pytest.mark.parametrize("key", IGNORED)
def test_ignored_key_reports_one_line_and_changes_nothing(tmp_path: Path, key: str) -> None:
    cfg = load_local(tmp_path, f"{key} = {KEYS[key].example}\n")
    assert cfg.ignored == (f"{tmp_path / 'mmc-local.conf'}:1: {key} is ignored: {KEYS[key].why}",)
    assert KEYS[key].why
    assert without_reports(cfg) == PoolConfig()


def test_every_key_is_documented() -> None:
    text = DOCS.read_text()
    missing = [k for k in KEYS if f"`{k}`" not in text]
    assert not missing


def test_keys_span_memcache_generations() -> None:
    # 1.2.0 only: rewarm and backup; 1.2.1 and later: async flush; 1.3: LRU.
    for key in ("ock.mmc.rewarm.dram_watermark", "ock.mmc.meta.backup.enable",
                "ock.mmc.storage.async_flush.interval_ms", "ock.mmc.storage.async_flush.batch_limit",
                "ock.mmc.meta_service.lru_type", "ock.mmc.meta_service.lru_shard_count",
                "ubsio.bdm.batch_read.standalone.use_scratch_pool", "ubsio.batch_read.standalone.use_scratch_pool"):
        assert key in KEYS


# --- bad values --------------------------------------------------------------

BAD: list[tuple[str, str, str]] = [
    ("ock.mmc.evict_threshold_high", "0", "from 1 to 100"),
    ("ock.mmc.evict_threshold_high", "101", "from 1 to 100"),
    ("ock.mmc.evict_threshold_high", "70%", "from 1 to 100"),
    ("ock.mmc.evict_threshold_high", "", "from 1 to 100"),
    ("ock.mmc.evict_threshold_low", "0", "from 1 to 99"),
    ("ock.mmc.evict_threshold_low", "100", "from 1 to 99"),
    ("ock.mmc.rewarm.dram_watermark", "101", "from 1 to 100"),
    ("ock.mmc.local_service.world_size", "0", "from 1 to 1024"),
    ("ock.mmc.local_service.world_size", "1025", "from 1 to 1024"),
    ("ock.mmc.local_service.world_size", "８", "from 1 to 1024"),  # a full-width digit
    ("ock.mmc.local_service.dram.size", "0", "positive; a size above 0 and at most 1TB per device"),
    ("ock.mmc.local_service.dram.size", "2TB", "a size above 0 and at most 1TB per device"),
    ("ock.mmc.local_service.dram.size", "20PB", "at most 1TB per device"),
    ("ock.mmc.local_service.dram.size", "20XB", "size"),
    ("ock.mmc.local_service.protocol", "udp", "host_shm or host_tcp"),
    ("ock.mmc.meta_service.lru_shard_count", "12", "power of two"),
    ("ock.mmc.meta_service.lru_shard_count", "2048", "from 1 to 1024"),
    ("ock.mmc.meta_service.lru_type", "fifo", "sharded_lru, lru"),
    ("ock.mmc.log_rotation_file_count", "0", "from 1 to 50"),
    ("ock.mmc.log_rotation_file_count", "51", "from 1 to 50"),
    ("ock.mmc.log_rotation_file_size", "501", "from 1 to 500"),
    ("ock.mmc.log_level", "verbose", "debug, info, warn, error"),
    ("ock.mmc.log_output_target", "syslog", "screen, file, both"),
    ("ock.mmc.storage.async_flush.interval_ms", "100", "from 200 to 1000"),
    ("ock.mmc.storage.async_flush.batch_limit", "4", "from 8 to 1024"),
    ("ock.mmc.client.read_thread_pool.size", "65", "from 1 to 64"),
    ("ock.mmc.client.write_thread_pool.size", "0", "from 1 to 64"),
    ("ock.mmc.client.timeout.seconds", "0", "from 1 to 600"),
    ("ock.mmc.client.retry_milliseconds", "600001", "from 0 to 600000"),
    ("ock.mmc.meta.lease_ttl_ms", "5000", "from 6000 to 600000"),
    ("ock.mmc.meta_service_url", "http://127.0.0.1:5000", "tcp://HOST:PORT or unix:///"),
    ("ock.mmc.meta_service_url", "tcp://127.0.0.1", "tcp://HOST:PORT"),
    ("ock.mmc.meta_service_url", "tcp://127.0.0.1:80", "1025 to 65535"),
    ("ock.mmc.meta_service_url", "tcp://127.0.0.1:70000", "1025 to 65535"),
    ("ock.mmc.meta_service_url", "tcp://xx.xx.xx.xx:5000", "placeholder"),
    ("ock.mmc.meta_service_url", "unix://run/meta.sock", "absolute"),
    ("ock.mmc.meta_service_url", "unix:///" + "a" * 120, "longer than 107"),
    ("ock.mmc.meta_service.metrics_url", "https://127.0.0.1:8000", "HOST:PORT"),
    ("ock.mmc.meta_service.metrics_url", "127.0.0.1:8000/metrics", "no path"),
    ("ock.mmc.meta_service.metrics_url", "127.0.0.1", "HOST:PORT"),
    ("ock.mmc.meta_service.metrics_url", "127.0.0.1:0", "1025 to 65535"),
    ("ock.mmc.local_service.config_store_url", "127.0.0.1:6000", "tcp://HOST:PORT"),
    ("ock.mmc.local_service.hcom_url", "tcp://host name:7000", "tcp://HOST:PORT"),
    ("ock.mmc.local_service.storage.enabled", "maybe", "true or false"),
    ("ock.mmc.meta.backup.enable", "yes please", "true or false"),
    ("ock.mmc.tls.enable", "true", "no TLS"),
    ("ock.mmc.config_store.tls.enable", "1", "no TLS"),
    ("ubsio.disk.path", "/a::/b", "empty path"),
    ("ubsio.disk.path", "/a:/a", "twice"),
    ("ubsio.mem.size_in_gb", "10GB", "from 0 to 1024"),
    ("ubsio.mem.size_in_gb", "-1", "from 0 to 1024"),
    ("ubsio.standalone.device_count", "0", "from 1 to 1024"),
    ("ubsio.standalone.force_new_disk", "2", "true or false"),
    ("kvtier.io_threads", "65", "from 1 to 64"),
    ("kvtier.warm_interval", "-1", "seconds"),
    ("kvtier.warm_interval", "inf", "seconds"),
    ("kvtier.warm_interval", "1e10", "from 0 to 604800"),  # a wait that long overflows the warmer's
    ("kvtier.warm_interval", "5ss", "seconds"),
    ("kvtier.warm_interval", "1_000", "seconds"),
    ("kvtier.io_threads", "1_0", "from 1 to 64"),
    ("kvtier.io_threads", "+8", "from 1 to 64"),
    ("kvtier.io_threads", "9" * 5000, "from 1 to 64"),  # past Python's int() digit limit: still one line
    ("kvtier.warm_interval", "\uff15", "seconds"),  # a full-width 5
    ("ock.mmc.meta_service_url", "tcp://-:5000", "tcp://HOST:PORT"),
    ("ock.mmc.meta_service_url", "tcp://...:5000", "tcp://HOST:PORT"),
    ("kvtier.shm_dir", "dev/shm", "absolute"),
    ("kvtier.ssd_size", "lots", "size"),
]


@pytest.mark.parametrize(("key", "value", "reason"), BAD)
def test_bad_value_names_key_value_and_range(tmp_path: Path, key: str, value: str, reason: str) -> None:
    text = f"# header\n{key} = {value}\n"
    with pytest.raises(ConfigError) as info:
        load_local(tmp_path, text)
    err = info.value
    assert (err.key, err.value) == (key, value)
    assert err.source == f"{tmp_path / 'mmc-local.conf'}:2"
    msg = str(err)
    assert reason in msg and key in msg and repr(value) in msg and "\n" not in msg


CHECKED = sorted(k for k, spec in KEYS.items() if spec.parse is not accept_any)  # the others take any text


@pytest.mark.parametrize("key", CHECKED)
def test_fuzzed_values_give_one_clear_error_or_a_config(tmp_path: Path, key: str) -> None:
    rng = random.Random(key)
    alphabet = "0123456789 .:/-_abcxyzGBMKT%#=\t[]８é"
    refused = 0
    for _ in range(25):
        value = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24))).strip()
        extra = "".join(line + "\n" for line in SSD_ON.splitlines() if not line.startswith(key + " ")) \
            if key.startswith(("ubsio.", "kvtier.ssd", "ock.mmc.local_service.storage")) else ""
        try:
            load_local(tmp_path, f"{extra}{key} = {value}\n")
        except ConfigError as err:
            refused += 1
            assert err.key in (key, "ock.mmc.evict_threshold_low", "ock.mmc.evict_threshold_high",
                               "ock.mmc.rewarm.dram_watermark", "ock.mmc.local_service.storage.enabled")
            assert err.source.startswith(str(tmp_path))
            assert "\n" not in str(err)
    # A key none of whose random values is refused would check nothing
    # here, but paths: they take most text (only an empty one between ':').
    assert refused or KEYS[key].parse is parse_paths


def test_token_error_does_not_show_the_token(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_pool_config(env={"KVTIER_TOKEN": " secret-with-space "})
    assert info.value.key == "KVTIER_TOKEN"
    assert "secret" not in str(info.value)


# --- file syntax ---------------------------------------------------------------


def test_line_without_equals_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "mmc-local.conf", "# c\n\nock.mmc.log_level = info\nock.mmc.log_level info\n")
    with pytest.raises(ConfigError) as info:
        load_pool_config(local_path=path, env={})
    assert info.value.source == path and info.value.key == "line 4"
    assert "'='" in str(info.value) and path in str(info.value)


def test_empty_key_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no key"):
        load_local(tmp_path, " = 5\n")


def test_key_twice_in_one_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_local(tmp_path, "ock.mmc.evict_threshold_high = 70\n#\nock.mmc.evict_threshold_high = 70\n")
    assert info.value.source.endswith(":3")
    assert "twice" in str(info.value) and "mmc-local.conf:1" in str(info.value)


def test_comments_blank_lines_crlf_bom_and_empty_values(tmp_path: Path) -> None:
    path = tmp_path / "mmc-local.conf"
    path.write_bytes("\ufeff# c\r\n\r\n   # indented\r\nock.mmc.local_service.dram.size=4GB\r\n"
                     "ock.mmc.tls.ca.path =\r\n".encode())
    cfg = load_pool_config(local_path=str(path), env={})
    assert cfg.dram_size_per_device == 4 * GIB
    assert len(cfg.ignored) == 1 and "ock.mmc.tls.ca.path" in cfg.ignored[0]


def test_value_keeps_inner_equals_and_hash(tmp_path: Path) -> None:
    cfg = load_local(tmp_path, "kvtier.token = a=b#c\n")
    assert cfg.token == "a=b#c"


@pytest.mark.parametrize(("typo", "closest"), [
    ("ock.mmc.evict_threshold_hgih", "ock.mmc.evict_threshold_high"),
    ("ock.mmc.lease_ttl_ms", "ock.mmc.meta.lease_ttl_ms"),
    ("ubsio.disk.paths", "ubsio.disk.path"),
    ("ock.mmc.local_service.dram_size", "ock.mmc.local_service.dram.size"),
    ("kvtier.tokens", "kvtier.token"),
    ("OCK.MMC.LOG_LEVEL", "ock.mmc.log_level"),
])
def test_unknown_key_names_the_closest(tmp_path: Path, typo: str, closest: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_local(tmp_path, f"{typo} = 1\n")
    assert info.value.key == typo
    assert str(info.value).endswith(f"the closest known key is {closest}")


def test_an_unknown_keys_value_is_not_shown(tmp_path: Path) -> None:
    """A mistyped key may hold a secret (kvtier.tokn = ...)."""
    with pytest.raises(ConfigError) as info:
        load_local(tmp_path, "kvtier.tokn = S3cr3tValue\n")
    assert "S3cr3tValue" not in str(info.value) and "kvtier.token" in str(info.value)


@pytest.mark.parametrize("url", ["tcp://127.0.0.1:\u00b2", "tcp://127.0.0.1:\uff15\uff10\uff10\uff10"])
def test_a_port_of_non_ascii_digits_is_one_clear_line(tmp_path: Path, url: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_local(tmp_path, f"ock.mmc.meta_service_url = {url}\n")
    assert info.value.key == "ock.mmc.meta_service_url"


# --- protocol ------------------------------------------------------------------


@pytest.mark.parametrize("proto", ["device_rdma", "device_urma", "device_uboe", "device_sdma", "host_rdma",
                                   "host_urma", "DEVICE_SDMA"])
def test_device_and_rdma_protocols_are_refused(tmp_path: Path, proto: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_local(tmp_path, f"ock.mmc.local_service.protocol = {proto}\n")
    assert "use host_shm (one node) or host_tcp" in str(info.value)


@pytest.mark.parametrize(("text", "proto"), [("host_shm", Protocol.HOST_SHM), ("HOST_TCP", Protocol.HOST_TCP)])
def test_host_protocols_work(tmp_path: Path, text: str, proto: Protocol) -> None:
    cfg = load_local(tmp_path, f"ock.mmc.local_service.protocol = {text}\n")
    assert cfg.protocol is proto
    # host_tcp changes nothing in kvtier, and says so.
    said = [line for line in cfg.warnings if "protocol = host_tcp works as host_shm" in line]
    assert len(said) == (proto is Protocol.HOST_TCP) and all(line.startswith(f"{tmp_path}") for line in said)


# --- sizes and totals -----------------------------------------------------------


@pytest.mark.parametrize(("text", "size"), [
    ("20GB", 20 * GIB), ("128GB", 128 * GIB), ("1TB", 1 << 40), ("134217728", 128 << 20),
    ("2048KB", 2 << 20), ("200mb", 200 << 20), ("3MB", 4 << 20), ("1", 2 << 20),
])
def test_dram_size_formats_and_2mib_alignment(tmp_path: Path, text: str, size: int) -> None:
    assert load_local(tmp_path, f"ock.mmc.local_service.dram.size = {text}\n").dram_size_per_device == size


def test_totals_follow_the_seed_formula(tmp_path: Path) -> None:
    cfg = load_local(tmp_path, SSD_ON + "ock.mmc.local_service.dram.size = 20GB\nubsio.mem.size_in_gb = 10\n"
                               "ubsio.standalone.device_count = 8\nock.mmc.local_service.world_size = 16\n")
    assert (cfg.devices, cfg.world_size) == (8, 16)  # the node's devices, not the cluster's ranks
    t = pool_totals(cfg)
    assert t.host_bytes == 8 * (20 + 10) * GIB
    assert (t.dram_bytes, t.staging_bytes) == (160 * GIB, 80 * GIB)
    text = format_pool_totals(t)
    assert "8 device(s) x (20.0 GiB DRAM tier + 10.0 GiB SSD staging) = 240.0 GiB host memory" in text
    assert "DRAM arena of the node: 160.0 GiB" in text and "/tmp/kvtier-ssd" in text
    # 160 GiB of 4 KiB pages: 41,943,040 entries of 8 bytes; of 2 MiB pages, 81,920.
    assert "page tables: 320 MiB in each process that maps the arena" in text
    assert "640 KiB on 2 MiB huge pages" in text


def test_a_pool_the_host_cannot_hold_is_refused_naming_the_keys_it_comes_from(tmp_path: Path) -> None:
    # MemCache's own default world_size (256) read as the node's devices.
    cfg = load_local(tmp_path, "ock.mmc.local_service.dram.size = 1TB\nock.mmc.local_service.world_size = 256\n")
    with pytest.raises(ConfigError) as info:
        check_pool_fits(cfg)
    err = info.value
    assert err.key == "ock.mmc.local_service.dram.size" and "\n" not in str(err)
    assert "1024 GiB x 256 device(s) = 262144 GiB" in str(err)
    assert err.source == f"{tmp_path / 'mmc-local.conf'}:1, {tmp_path / 'mmc-local.conf'}:2"
    assert "free" in err.reason and "ubsio.standalone.device_count" in err.reason
    check_pool_fits(load_local(tmp_path, "ock.mmc.local_service.dram.size = 64MB\n"))  # fits: no error


def test_a_shm_dir_that_is_no_folder_is_blamed_on_its_key_not_the_size(tmp_path: Path) -> None:
    cfg = load_local(tmp_path, f"ock.mmc.local_service.dram.size = 64MB\nkvtier.shm_dir = {tmp_path / 'none'}\n")
    with pytest.raises(ConfigError) as info:
        check_pool_fits(cfg)
    assert info.value.key == "kvtier.shm_dir" and "not a directory" in info.value.reason
    assert "lower this size" not in str(info.value)


def test_a_value_that_may_be_a_secret_is_not_shown_where_the_files_disagree(tmp_path: Path) -> None:
    meta = write(tmp_path, "mmc-meta.conf", "ock.mmc.zmq.private_key = SECRET-A\n")
    local = write(tmp_path, "mmc-local.conf", "ock.mmc.zmq.private_key = SECRET-B\n")
    cfg = load_pool_config(env={"MMC_META_CONFIG_PATH": meta, "MMC_LOCAL_CONFIG_PATH": local})
    text = "\n".join(cfg.warnings + cfg.ignored)
    assert "ock.mmc.zmq.private_key" in text and "SECRET" not in text
    twice = write(tmp_path, "twice.conf", "ock.mmc.tls.key.pass.path = /a\nock.mmc.tls.key.pass.path = /b\n")
    with pytest.raises(ConfigError) as info:
        load_pool_config(env={"MMC_LOCAL_CONFIG_PATH": twice})
    assert "/a" not in str(info.value) and "/b" not in str(info.value)


def test_what_a_killed_service_left_counts_as_free_for_its_restart(tmp_path: Path) -> None:
    # The arena a killed service left still holds its memory until the
    # restart adopts it in place or removes it: the check counts it as
    # free, or a restart of a pool larger than half the memory is refused.
    from kvtier.pool.service import ServiceOptions, _stems, leftover_bytes

    cfg = load_local(tmp_path, "ock.mmc.local_service.dram.size = 1TB\n")
    with pytest.raises(ConfigError):
        check_pool_fits(cfg, leftover_bytes=0)
    check_pool_fits(cfg, leftover_bytes=(1 << 40) - (64 << 20))  # 64 MiB more: fits
    check_pool_fits(cfg, leftover_bytes=1 << 40)
    opts = ServiceOptions(url="tcp://127.0.0.1:5000", store=KvtierConfig(shm_dir=str(tmp_path)))
    assert leftover_bytes(opts) == 0
    (tmp_path / "kvtier-pool-someoneelse-1").write_bytes(b"x" * (1 << 20))  # another service's: not counted
    arena_stem, stats_stem, ready_stem = _stems(opts)
    Path(arena_stem + "dead1").write_bytes(b"x" * (2 << 20))
    Path(stats_stem + "dead1").write_bytes(b"x" * 4096)
    Path(ready_stem + "dead1").write_bytes(b"x" * 8192)
    assert (2 << 20) + 4096 + 8192 <= leftover_bytes(opts) < (3 << 20)
    # A live service's arena under the same address (another container
    # sharing /dev/shm): its owner holds the lock, it keeps its memory.
    live = Path(arena_stem + "live1")
    live.write_bytes(b"x" * (4 << 20))
    fd = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert (2 << 20) + 4096 <= leftover_bytes(opts) < (3 << 20)
    finally:
        os.close(fd)
    assert leftover_bytes(opts) >= (6 << 20)  # its owner gone: counted


def test_kvtier_meta_refuses_a_pool_too_big_before_creating_anything(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    meta = write(tmp_path, "mmc-meta.conf", "ock.mmc.meta_service_url = tcp://127.0.0.1:0\n")
    local = write(tmp_path, "mmc-local.conf", f"kvtier.shm_dir = {shm}\nock.mmc.local_service.dram.size = 1TB\n"
                                              "ubsio.standalone.device_count = 64\n")
    out = subprocess.run([sys.executable, "-m", "kvtier.meta", "--meta-config", meta, "--local-config", local],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    errors = [line for line in out.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "ock.mmc.local_service.dram.size = '1024 GiB x 64 device(s)" in errors[0]
    assert "mmc-local.conf:2, " in errors[0] and "mmc-local.conf:3" in errors[0]
    assert list(shm.iterdir()) == []


def test_more_devices_than_world_size_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_local(tmp_path, "ock.mmc.local_service.world_size = 4\nubsio.standalone.device_count = 8\n")
    assert info.value.key == "ubsio.standalone.device_count" and "world_size (4)" in str(info.value)


def test_storage_off_ignores_ssd_keys(tmp_path: Path) -> None:
    cfg = load_local(tmp_path, "ock.mmc.local_service.storage.enabled = false\nubsio.disk.path = /dev/loop0\n"
                               "ubsio.mem.size_in_gb = 10\nkvtier.ssd_size = 8GB\n")
    assert (cfg.storage_enabled, cfg.ssd_paths, cfg.ssd_size_bytes, cfg.staging_size_per_device) == (
        False, (), None, 0)
    assert [line.split(": ")[1] for line in cfg.ignored] == [
        "ubsio.disk.path is ignored", "ubsio.mem.size_in_gb is ignored", "kvtier.ssd_size is ignored"]
    assert pool_totals(cfg).host_bytes == GIB
    assert cfg.store_config().ssd_paths == ()


def test_storage_on_needs_a_disk(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_local(tmp_path, "ock.mmc.local_service.storage.enabled = true\n")
    assert info.value.key == "ock.mmc.local_service.storage.enabled" and "ubsio.disk.path" in str(info.value)


# --- cross-key checks -------------------------------------------------------------


def test_low_must_be_below_high(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_local(tmp_path, "ock.mmc.evict_threshold_high = 70\nock.mmc.evict_threshold_low = 70\n")
    assert info.value.key == "ock.mmc.evict_threshold_low" and info.value.source.endswith(":2")
    with pytest.raises(ConfigError) as info:
        load_local(tmp_path, "ock.mmc.evict_threshold_high = 50\n")  # below the default low (80)
    assert info.value.key == "ock.mmc.evict_threshold_high" and "(80)" in str(info.value)


def test_rewarm_watermark_above_high_only_with_ssd(tmp_path: Path) -> None:
    text = "ock.mmc.evict_threshold_high = 96\nock.mmc.evict_threshold_low = 90\n"
    assert load_local(tmp_path, text).rewarm_dram_watermark == 95  # no SSD: the watermark has no role
    with pytest.raises(ConfigError) as info:
        load_local(tmp_path, SSD_ON + text)
    assert info.value.key == "ock.mmc.evict_threshold_high" and "rewarm.dram_watermark (95)" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_local(tmp_path, SSD_ON + text + "ock.mmc.rewarm.dram_watermark = 96\n")
    assert info.value.key == "ock.mmc.rewarm.dram_watermark"
    assert load_local(tmp_path, SSD_ON + text + "ock.mmc.rewarm.dram_watermark = 97\n").rewarm_dram_watermark == 97


# --- finding the files, and which file wins ---------------------------------------------------


def test_files_found_through_the_environment(tmp_path: Path) -> None:
    meta = write(tmp_path, "m.conf", "ock.mmc.evict_threshold_high = 85\n")
    local = write(tmp_path, "l.conf", "ock.mmc.local_service.dram.size = 2GB\n")
    cfg = load_pool_config(env={"MMC_META_CONFIG_PATH": meta, "MMC_LOCAL_CONFIG_PATH": local})
    assert (cfg.evict_threshold_high, cfg.dram_size_per_device, cfg.sources) == (85, 2 * GIB, (meta, local))
    # An explicit path wins over the variable; an empty variable is unset.
    other = write(tmp_path, "o.conf", "ock.mmc.local_service.dram.size = 6GB\n")
    cfg = load_pool_config(local_path=other, env={"MMC_META_CONFIG_PATH": "", "MMC_LOCAL_CONFIG_PATH": local})
    assert (cfg.dram_size_per_device, cfg.sources) == (6 * GIB, (other,))


def test_missing_file_names_the_variable(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.conf")
    with pytest.raises(ConfigError) as info:
        load_pool_config(env={"MMC_LOCAL_CONFIG_PATH": missing})
    assert (info.value.key, info.value.value) == ("MMC_LOCAL_CONFIG_PATH", missing)
    assert "no such file" in str(info.value)


def test_both_files_each_key_from_its_owner(tmp_path: Path) -> None:
    meta = write(tmp_path, "mmc-meta.conf", "ock.mmc.evict_threshold_high = 70\nock.mmc.evict_threshold_low = 60\n"
                                           "ock.mmc.local_service.dram.size = 2GB\n")
    local = write(tmp_path, "mmc-local.conf", "ock.mmc.evict_threshold_high = 80\n"
                                             "ock.mmc.local_service.dram.size = 4GB\n")
    cfg = load_pool_config(meta, local, env={})
    assert cfg.evict_threshold_high == 70  # a meta key: the meta file wins
    assert cfg.dram_size_per_device == 4 * GIB  # a local key: the local file sizes the pool
    high_line = f"{local}:1: ock.mmc.evict_threshold_high = '80' is not used: the meta file's value '70' ({meta}:1)"
    size_line = f"{meta}:3: ock.mmc.local_service.dram.size = '2GB' is not used: the local file's value '4GB' ({local}:2)"
    assert cfg.warnings == (f"{high_line} counts", f"{size_line} counts")


def test_meta_file_alone_uses_its_local_keys(tmp_path: Path) -> None:
    meta = write(tmp_path, "mmc-meta.conf", "ock.mmc.local_service.dram.size = 3GB\n"
                                           "ubsio.standalone.device_count = 2\n")
    cfg = load_pool_config(meta_path=meta, env={})
    assert (cfg.dram_bytes, cfg.sources) == (6 * GIB, (meta,))


def test_meta_url_from_meta_file_client_url_from_local_file(tmp_path: Path) -> None:
    meta = write(tmp_path, "mmc-meta.conf", "ock.mmc.meta_service_url = tcp://0.0.0.0:5000\n")
    local = write(tmp_path, "mmc-local.conf", "ock.mmc.meta_service_url = tcp://10.1.2.3:5000\n")
    cfg = load_pool_config(meta, local, env={})
    assert (cfg.meta_url, cfg.meta_host, cfg.client_url) == ("tcp://0.0.0.0:5000", "0.0.0.0", "tcp://10.1.2.3:5000")
    assert len(cfg.warnings) == 1 and "instances connect to" in cfg.warnings[0]
    only_local = load_pool_config(local_path=local, env={})
    assert only_local.meta_url == only_local.client_url == "tcp://10.1.2.3:5000"


def test_service_urls(tmp_path: Path) -> None:
    a = parse_service_url("k", "tcp://[::1]:6000")
    assert (a.host, a.port, a.unix_path) == ("::1", 6000, None)
    a = parse_service_url("k", "tcp://127.0.0.1:0")  # any free port: the service reports the one it got
    assert a.port == 0
    cfg = load_local(tmp_path, "ock.mmc.meta_service_url = unix:///run/kvtier/meta.sock\n")
    assert (cfg.meta_host, cfg.meta_port, cfg.unix_path) == (None, None, "/run/kvtier/meta.sock")
    assert cfg.client_url == "unix:///run/kvtier/meta.sock"


# --- token ------------------------------------------------------------------------------------


def test_token_from_file_env_wins_and_repr_hides_it(tmp_path: Path) -> None:
    local = write(tmp_path, "mmc-local.conf", "kvtier.token = from-file\n")
    assert load_pool_config(local_path=local, env={}).token == "from-file"
    cfg = load_pool_config(local_path=local, env={"KVTIER_TOKEN": "from-env"})
    assert cfg.token == "from-env"
    assert "from-env" not in repr(cfg) and "from-file" not in repr(cfg)
    assert load_pool_config(env={"KVTIER_TOKEN": "only-env"}).token == "only-env"


def test_token_in_both_files_is_not_logged(tmp_path: Path) -> None:
    meta = write(tmp_path, "mmc-meta.conf", "kvtier.token = meta-token\n")
    local = write(tmp_path, "mmc-local.conf", "kvtier.token = local-token\n")
    cfg = load_pool_config(meta, local, env={})
    assert cfg.token == "meta-token"
    assert len(cfg.warnings) == 1 and "kvtier.token is not used" in cfg.warnings[0]
    assert "meta-token" not in cfg.warnings[0] and "local-token" not in cfg.warnings[0]


def test_token_in_a_readable_file_warns(tmp_path: Path) -> None:
    local = write(tmp_path, "mmc-local.conf", "kvtier.token = t0ken\n", mode=0o644)
    cfg = load_pool_config(local_path=local, env={})
    assert len(cfg.warnings) == 1 and "chmod 600" in cfg.warnings[0]
    os.chmod(local, 0o600)
    assert load_pool_config(local_path=local, env={}).warnings == ()


# --- the store's config -------------------------------------------------------------------------


def test_store_config(tmp_path: Path) -> None:
    cfg = load_local(tmp_path, SSD_ON + "ock.mmc.local_service.dram.size = 2GB\nubsio.standalone.device_count = 3\n"
                                        "ock.mmc.evict_threshold_high = 70\nock.mmc.evict_threshold_low = 60\n"
                                        "ock.mmc.rewarm.dram_watermark = 90\nkvtier.ssd_size = 8GB\n"
                                        "ubsio.standalone.force_new_disk = true\nkvtier.io_threads = 2\n"
                                        "kvtier.shm_dir = /tmp\nkvtier.warm_interval = 0\n")
    assert cfg.store_config() == KvtierConfig(
        dram_size_bytes=6 * GIB, evict_threshold_high=70.0, evict_threshold_low=60.0, shm_dir="/tmp",
        ssd_paths=("/tmp/kvtier-ssd",), ssd_size_bytes=8 * GIB, force_new_disk=True, rewarm_dram_watermark=90.0,
        io_threads=2, kv_warm_interval_s=0.0)
    assert PoolConfig().store_config().dram_size_bytes == GIB
    assert PoolConfig().store_config().kv_warm_interval_s is None  # hostmem.warm_interval_s decides


def test_pool_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        PoolConfig().devices = 2  # type: ignore[misc]


# --- the example files ----------------------------------------------------------------------------

EXAMPLES = Path(__file__).resolve().parents[2] / "config"


def test_example_files_parse() -> None:
    meta, local = str(EXAMPLES / "mmc-meta.conf"), str(EXAMPLES / "mmc-local.conf")
    cfg = load_pool_config(meta, local, env={})
    assert (cfg.meta_url, cfg.client_url, cfg.metrics_port) == ("tcp://127.0.0.1:5000", "tcp://127.0.0.1:5000", 5001)
    assert (cfg.devices, cfg.dram_bytes, cfg.storage_enabled, cfg.protocol) == (1, 2 * GIB, False,
                                                                               Protocol.HOST_SHM)
    assert [line.split(": ")[1] for line in cfg.ignored] == [
        "ock.mmc.meta_service.config_store_url is ignored", "ock.mmc.local_service.config_store_url is ignored"]
    assert cfg.warnings == ()


def test_example_files_commented_keys_are_valid(tmp_path: Path) -> None:
    """Uncommenting every commented-out key (and turning the SSD tier on) still loads."""
    out = []
    for name in ("mmc-meta.conf", "mmc-local.conf"):
        lines = []
        for line in (EXAMPLES / name).read_text().splitlines():
            body = line.lstrip("# ")
            if line.startswith("# ") and body.split(" = ")[0] in KEYS:
                line = body
            lines.append(line.replace("storage.enabled = false", "storage.enabled = true"))
        out.append(write(tmp_path, name, "\n".join(lines) + "\n"))
    cfg = load_pool_config(*out, env={})
    assert cfg.token == "change-me"
    assert (cfg.ssd_paths, cfg.ssd_size_bytes, cfg.staging_size_per_device) == (
        ("/dev/loop0", "/dev/loop1"), 64 * GIB, 10 * GIB)
    assert pool_totals(cfg).host_bytes == 1 * (2 + 10) * GIB


# --- the cluster tier ----------------------------------------------------------


def test_cluster_off_by_default_and_its_keys_are_reported_unused(tmp_path: Path) -> None:
    cfg = load_local(tmp_path, "kvtier.cluster.master_port = 50061\n")
    assert cfg.cluster_config() is None
    assert any("kvtier.cluster.master_port is ignored" in line for line in cfg.ignored)


def test_worker_node_finds_the_master_through_its_local_file(tmp_path: Path) -> None:
    """A worker node's local file names the master node's meta service; its
    own pool listens on kvtier.node_service_url, where its instances attach."""
    local = write(tmp_path, "mmc-local.conf", "ock.mmc.meta_service_url = tcp://10.0.0.1:5000\n"
                  "kvtier.node_service_url = tcp://127.0.0.1:5010\n"
                  "kvtier.cluster.enabled = true\nkvtier.cluster.local_hostname = 10.0.0.2\n")
    cfg = load_pool_config(None, local, env={})
    c = cfg.cluster_config()
    assert isinstance(c, ClusterConfig)
    assert (c.master_address, c.local_hostname) == ("10.0.0.1:50051", "10.0.0.2")
    assert (cfg.listen_url, cfg.client_url) == ("tcp://127.0.0.1:5010", "tcp://127.0.0.1:5010")
    assert c.publish_on is PublishOn.SAVE and c.metadata_server == "P2PHANDSHAKE"


def test_etcd_endpoints_are_written_as_mooncake_takes_them(tmp_path: Path) -> None:
    cfg = load_local(tmp_path, "kvtier.cluster.enabled = true\n"
                     "kvtier.cluster.etcd_endpoints = http://10.0.0.1:2379, 10.0.0.2:2379;\n")
    c = cfg.cluster_config()
    assert c is not None and c.etcd_endpoints == "10.0.0.1:2379;10.0.0.2:2379"


@pytest.mark.parametrize("line", ["kvtier.cluster.protocol = udp", "kvtier.cluster.replicas = 0",
                                  "kvtier.cluster.local_hostname = xx.xx.xx.xx",
                                  "kvtier.cluster.etcd_endpoints = 10.0.0.1",
                                  "kvtier.cluster.etcd_endpoints = ;",
                                  "kvtier.cluster.etcd_endpoints = https://10.0.0.1:2379",
                                  "kvtier.cluster.publish = never"])
def test_bad_cluster_values_name_the_key(tmp_path: Path, line: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_local(tmp_path, f"kvtier.cluster.enabled = true\n{line}\n")
    assert line.split(" = ")[0] in str(err.value)
