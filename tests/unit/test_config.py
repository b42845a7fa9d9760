"""kvtier.config: sizes, the connector's extra config, and the memory check."""

from __future__ import annotations

import pytest

from kvtier.config import (
    Backend,
    KvtierConfig,
    keys_not_used,
    known_connector_keys,
    parse_connector_config,
    parse_size,
)
from kvtier.errors import ConfigError, KvtierError


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("2GB", 2 << 30),  # units are binary with or without the "i"
        ("512MiB", 512 << 20),
        ("1.5g", 3 << 29),
        (4096, 4096),
        ("4096", 4096),
        (" 64 kb ", 64 << 10),
        ("1T", 1 << 40),
        (8192.0, 8192),
    ],
)
def test_parse_size_accepts(value: object, expected: int) -> None:
    assert parse_size("dram_size", value) == expected


@pytest.mark.parametrize("value", ["abc", -1, 0, True, False, "", "2XB", "-5MB", 1.5, None, [1],
                                   "9" * 400, "2EB", "２GB", 1 << 61])
def test_parse_size_refuses_and_names_key_and_value(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size("dram_size", value, "somewhere")
    err = info.value
    assert isinstance(err, KvtierError) and isinstance(err, ValueError)
    assert err.key == "dram_size"
    assert err.value == value
    msg = str(err)
    assert "dram_size" in msg
    assert repr(value) in msg
    assert "somewhere" in msg
    assert "\n" not in msg


def test_defaults() -> None:
    cfg = parse_connector_config(None, check_memory=False)
    assert cfg == KvtierConfig()
    assert cfg.backend is Backend.EMBEDDED
    assert cfg.dram_size_bytes == 1 << 30
    assert (cfg.evict_threshold_high, cfg.evict_threshold_low) == (90.0, 80.0)
    assert cfg.verify_checksums is True
    assert cfg.shm_dir == "/dev/shm"
    assert cfg.model_id == ""
    assert parse_connector_config({}, check_memory=False) == cfg


def test_every_key_parsed() -> None:
    cfg = parse_connector_config(
        {
            "backend": "Embedded",
            "dram_size": "3MiB",
            "evict_threshold_high": "90%",
            "evict_threshold_low": 50,
            "verify_checksums": "off",
            "shm_dir": " /tmp ",
            "model_id": "org/model",
        },
        check_memory=False,
    )
    assert cfg == KvtierConfig(Backend.EMBEDDED, 3 << 20, 90.0, 50.0, False, "/tmp", "org/model")


@pytest.mark.parametrize("backend", ["pool", "memcache"])
def test_checksums_cannot_be_turned_off_on_a_shared_pool(backend: str) -> None:
    # A load whose lease ended can read a slot another instance rewrote:
    # only the checksum turns that into a miss.
    with pytest.raises(ConfigError) as info:
        parse_connector_config({"backend": backend, "verify_checksums": "off"}, check_memory=False)
    assert info.value.key == "verify_checksums" and "shared pool" in str(info.value)
    assert parse_connector_config({"backend": backend}, check_memory=False).verify_checksums is True


def test_the_kv_warm_interval_is_seconds_and_zero_turns_it_off() -> None:
    assert KvtierConfig().kv_warm_interval_s is None  # hostmem.warm_interval_s decides
    assert parse_connector_config({"kv_warm_interval_s": "2.5s"}, check_memory=False).kv_warm_interval_s == 2.5
    assert parse_connector_config({"kv_warm_interval_s": 0}, check_memory=False).kv_warm_interval_s == 0.0


def test_config_is_frozen() -> None:
    cfg = KvtierConfig()
    with pytest.raises(AttributeError):
        cfg.dram_size_bytes = 1  # type: ignore[misc]


def test_unknown_key_names_it_and_lists_known_keys() -> None:
    with pytest.raises(ConfigError) as info:
        parse_connector_config({"dram_size": "1GB", "dram_sise": "2GB"}, check_memory=False)
    err = info.value
    assert err.key == "dram_sise"
    assert err.value == "2GB"
    msg = str(err)
    assert "dram_sise" in msg
    assert "kv_connector_extra_config" in msg
    for key in known_connector_keys():
        assert key in msg
    assert set(known_connector_keys()) >= {"dram_size", "evict_threshold_high", "evict_threshold_low"}


def test_bad_dram_size_is_refused_with_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        parse_connector_config({"dram_size": "lots"}, check_memory=False)
    assert info.value.key == "dram_size"
    assert info.value.value == "lots"
    assert "kv_connector_extra_config" in str(info.value)


@pytest.mark.parametrize(
    "extra",
    [
        {"evict_threshold_low": 90},  # equal to the default high
        {"evict_threshold_low": 99},
        {"evict_threshold_high": 50, "evict_threshold_low": 50},
        {"evict_threshold_high": "60", "evict_threshold_low": "70"},
    ],
)
def test_low_threshold_must_be_below_high(extra: dict) -> None:
    with pytest.raises(ConfigError) as info:
        parse_connector_config(extra, check_memory=False)
    err = info.value
    assert err.key == "evict_threshold_low"
    assert "evict_threshold_high" in str(err)
    assert "kv_connector_extra_config" in str(err)


@pytest.mark.parametrize(("key", "value"), [("evict_threshold_high", 0), ("evict_threshold_high", 101),
                                            ("evict_threshold_low", "x"), ("evict_threshold_low", True),
                                            ("verify_checksums", "maybe"), ("backend", "redis"),
                                            ("shm_dir", ""), ("model_id", 3), ("kv_warm_interval_s", "-1"),
                                            ("kv_warm_interval_s", "often"),
                                            ("kv_warm_interval_s", "inf")])
def test_other_bad_values_name_their_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_connector_config({key: value}, check_memory=False)
    assert info.value.key == key
    assert repr(value) in str(info.value)


def test_dram_size_larger_than_free_memory_refused() -> None:
    extra = {"dram_size": "100TB"}
    with pytest.raises(ConfigError) as info:
        parse_connector_config(extra, check_memory=True)
    assert info.value.key == "dram_size"
    assert "free" in str(info.value)
    # Without the check the same size is only parsed.
    assert parse_connector_config(extra, check_memory=False).dram_size_bytes == 100 << 40


def test_small_dram_size_passes_memory_check() -> None:
    assert parse_connector_config({"dram_size": "1MiB"}).dram_size_bytes == 1 << 20


def test_missing_shm_dir_refused_by_memory_check(tmp_path) -> None:
    missing = str(tmp_path / "absent")
    with pytest.raises(ConfigError) as info:
        parse_connector_config({"dram_size": "1MiB", "shm_dir": missing})
    assert info.value.key == "shm_dir"
    assert info.value.value == missing


def test_the_seed_name_of_the_rewarm_watermark_is_accepted() -> None:
    cfg = parse_connector_config({"ssd_path": "/tmp/x.img", "rewarm.dram_watermark": "97"}, check_memory=False)
    assert cfg.rewarm_dram_watermark == 97
    with pytest.raises(ConfigError) as info:
        parse_connector_config({"rewarm.dram_watermark": 97, "rewarm_dram_watermark": 96}, check_memory=False)
    assert info.value.key == "rewarm_dram_watermark" and "set twice" in str(info.value)
    with pytest.raises(ConfigError, match="rewarm.dram_watermark = 'high'"):
        parse_connector_config({"rewarm.dram_watermark": "high"}, check_memory=False)


def test_dram_size_above_the_containers_memory_limit_is_refused(monkeypatch) -> None:
    import kvtier.config
    from kvtier.hostmem import CgroupMemory

    # A pod limit of 1 GiB with 768 MiB in use leaves 256 MiB, whatever the host has free.
    limit = CgroupMemory("/sys/fs/cgroup/kubepods/pod1", 1 << 30, 768 << 20)
    monkeypatch.setattr(kvtier.config, "cgroup_memory_limit", lambda: limit)
    with pytest.raises(ConfigError) as info:
        parse_connector_config({"dram_size": "300MiB"})
    assert info.value.key == "dram_size" and info.value.value == 300 << 20
    assert str(info.value) == (
        "kvtier config error: kv_connector_extra_config: dram_size = 314572800: larger than the "
        "container's memory limit leaves free (0.2 GiB of the 1.0 GiB limit in "
        "/sys/fs/cgroup/kubepods/pod1, with 0.8 GiB in use); the arena counts against it")
    # What fits under the limit passes.
    assert parse_connector_config({"dram_size": "200MiB"}).dram_size_bytes == 200 << 20


def test_exact_sizes_are_kept_to_the_byte() -> None:
    assert parse_size("dram_size", "9007199254740993") == 9007199254740993  # 2**53 + 1: not through a float
    assert parse_size("dram_size", "0.5KB") == 512


@pytest.mark.parametrize("url", ["tcp://127.0.0.1:\u00b2", "tcp://127.0.0.1:\uff15\uff10\uff10\uff10",
                                 "tcp://xx.xx.xx.xx:5000", "tcp://a b/c:5000", "tcp://127.0.0.1:80",
                                 "tcp://127.0.0.1:0", "unix:///" + "d/" * 60 + "meta.sock", "unix://relative.sock"])
def test_the_instances_service_url_is_checked_as_the_service_checks_it(url: str) -> None:
    """Refused with one line naming the key, where the service (or the
    connection) would have failed later, or a stray digit crashed the parse."""
    with pytest.raises(ConfigError) as info:
        parse_connector_config({"backend": "pool", "meta_service_url": url}, check_memory=False)
    assert info.value.key == "meta_service_url" and "\n" not in str(info.value)


def test_the_instances_service_url_accepts_what_the_service_listens_on() -> None:
    for url in ("tcp://127.0.0.1:5000", "tcp://[::1]:5000", "unix:///run/kvtier/meta.sock"):
        cfg = parse_connector_config({"backend": "pool", "meta_service_url": url}, check_memory=False)
        assert cfg.meta_service_url == url


def test_store_keys_given_to_a_shared_pool_are_named_as_not_used() -> None:
    """The meta service owns a shared pool's store: a dram_size or ssd_path
    left in an instance's extra config would otherwise look in force."""
    extra = {"backend": "pool", "ssd_path": "/tmp/x.img", "dram_size": "1GB", "promote_timeout_s": "9s",
             "rewarm.dram_watermark": 99, "demote_queue_blocks": 8}
    lines = keys_not_used(extra, parse_connector_config(extra, check_memory=False))
    assert len(lines) == 4, lines
    assert lines[0].startswith("'ssd_path' is not used with backend pool") and "(there: ubsio.disk.path)" in lines[0]
    assert "ock.mmc.local_service.dram.size (per device)" in lines[1]
    assert lines[2].startswith("'rewarm.dram_watermark'") and "ock.mmc.rewarm.dram_watermark" in lines[2]
    assert "kvtier's default" in lines[3]


def test_pool_keys_given_to_an_embedded_store_are_named_as_not_used() -> None:
    extra = {"token": "s3cret-s3cret-s3cret", "meta_service_url": "tcp://127.0.0.1:5000", "dram_size": "1GB"}
    lines = keys_not_used(extra, parse_connector_config(extra, check_memory=False))
    assert [line.split(" ", 1)[0] for line in lines] == ["'token'", "'meta_service_url'"]
    assert keys_not_used({"backend": "pool", "token": "s3cret-s3cret-s3cret"},
                         parse_connector_config({"backend": "pool"}, check_memory=False)) == []


def test_the_pool_keys_named_for_store_keys_exist() -> None:
    from kvtier.config import POOL_OWNED_KEYS
    from kvtier.pool.config import KEYS

    assert set(POOL_OWNED_KEYS) <= set(known_connector_keys())
    for where in filter(None, POOL_OWNED_KEYS.values()):
        assert where.split(" ")[0] in KEYS, where
