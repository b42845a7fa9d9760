"""Typed, validated configuration; all parsing of user input lives here.

Runs in every process that builds kvtier parts (vLLM's scheduler and worker
processes, the CLI). The connector hands ``kv_connector_extra_config`` to
:func:`parse_connector_config`, which returns a frozen :class:`KvtierConfig`
or raises :class:`~kvtier.errors.ConfigError` naming the key and the value.
Nothing here touches shared memory or files beyond reading free space and
the memory limit of the current cgroup.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from decimal import Decimal

from kvtier.errors import ConfigError
from kvtier.hostmem import available_memory_bytes, cgroup_memory_limit, free_huge_pages, hugetlbfs_page_size

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE | re.ASCII)
_SIZE_MAX = 1 << 60  # 1 EiB: beyond any memory or disk a node has
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(key: str, value: object, source: str = "", allow_zero: bool = False) -> int:
    """Parse a byte size such as ``"2GB"``, ``"512MiB"``, ``"1.5g"`` or ``4096``.

    Units are binary whether or not they carry an ``i`` (``2GB`` is 2 GiB), as
    in the memory-pool configuration files this accepts unchanged.
    """
    if isinstance(value, bool):
        raise ConfigError(key, value, "expected a size such as '2GB'", source)
    if isinstance(value, int):
        size = value
    elif isinstance(value, float) and value.is_integer():
        size = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m:
            raise ConfigError(key, value, "expected a size such as '2GB', '512MiB' or a byte count", source)
        # Decimal, not float: exact for any length of digits (float made 400
        # nines infinity, and 2**53 + 1 bytes one byte less).
        size = int(Decimal(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    else:
        raise ConfigError(key, value, "expected a size such as '2GB'", source)
    if size < 0 or (size == 0 and not allow_zero):
        raise ConfigError(key, value, "size must be positive", source)
    if size > _SIZE_MAX:
        raise ConfigError(key, value, "size above 1 EiB: a typo?", source)
    return size


def parse_percent(key: str, value: object, source: str = "") -> float:
    try:
        pct = float(str(value).strip().rstrip("%")) if not isinstance(value, bool) else float("nan")
    except ValueError:
        raise ConfigError(key, value, "expected a percentage between 0 and 100", source) from None
    if not 0.0 < pct <= 100.0:
        raise ConfigError(key, value, "expected a percentage between 0 and 100", source)
    return pct


def parse_bool(key: str, value: object, source: str = "") -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(key, value, "expected true or false", source)


class Backend(enum.Enum):
    """Where the pool lives. ``embedded``: inside the vLLM instance's
    processes. ``pool``: the node's meta service (``kvtier meta``), shared by
    every instance on the node; ``memcache`` is the same, under the name the
    seeds' transfer config uses."""

    EMBEDDED = "embedded"
    POOL = "pool"
    MEMCACHE = "memcache"

    @property
    def shared(self) -> bool:
        return self is not Backend.EMBEDDED


def parse_enum(enum_cls: type[enum.Enum]) -> Callable[[str, object, str], enum.Enum]:
    def parse(key: str, value: object, source: str = "") -> enum.Enum:
        try:
            return enum_cls(str(value).strip().lower())
        except ValueError:
            choices = ", ".join(m.value for m in enum_cls)
            raise ConfigError(key, value, f"expected one of: {choices}", source) from None

    return parse


def parse_int_range(lo: int, hi: int) -> Callable[[str, object, str], int]:
    def parse(key: str, value: object, source: str = "") -> int:
        text = str(value).strip()
        # ASCII digits and an optional minus only: int() also takes other
        # scripts' digits ('８'), underscores ('1_0') and a plus sign.
        digits = text[1:] if text.startswith("-") else text
        ok = not isinstance(value, bool) and digits.isascii() and digits.isdigit() and len(digits) <= 18
        n = int(text) if ok else None
        if n is None or not lo <= n <= hi:
            raise ConfigError(key, value, f"expected a whole number from {lo} to {hi}", source)
        return n

    return parse


# An instance waits this long for any answer of its node pool before it
# counts the pool as gone and reconnects (a new session: its pins and
# pending saves released). The pool's own waits inside one answer stay
# well below it: a lookup waits on the cluster half of it at most, so that
# a cluster that stalls costs a miss, not the instance's session.
POOL_CALL_TIMEOUT_S = 2.0
CLUSTER_LOOKUP_WAIT_S = POOL_CALL_TIMEOUT_S / 2

SECONDS_MAX = 7 * 24 * 3600.0  # a week: a longer wait is a mistyped value (and overflows the waits that take it)
_SECONDS_RE = re.compile(r"^(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?\s*s?$", re.ASCII)


def parse_seconds(key: str, value: object, source: str = "") -> float:
    text = str(value).strip()
    t = float(text.rstrip("s")) if not isinstance(value, bool) and _SECONDS_RE.match(text) else -1.0
    if not 0 <= t <= SECONDS_MAX:
        raise ConfigError(key, value, f"expected a number of seconds from 0 to {SECONDS_MAX:.0f} (a week)", source)
    return t


def parse_paths(key: str, value: object, source: str = "") -> tuple[str, ...]:
    """Colon-separated paths, as in ``ubsio.disk.path = /dev/loop0:/dev/loop1``."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(key, value, "expected one or more paths separated by ':'", source)
    paths = tuple(p.strip() for p in value.split(":"))
    if any(not p for p in paths):
        raise ConfigError(key, value, "empty path between ':'", source)
    if len(set(paths)) != len(paths):
        raise ConfigError(key, value, "a path is listed twice", source)
    return paths


def parse_path(key: str, value: object, source: str = "") -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(key, value, "expected a path", source)
    return value.strip()


@dataclass(frozen=True)
class ServiceAddress:
    """A parsed ``tcp://HOST:PORT`` or ``unix:///PATH``. Exactly one of (host, port) and unix_path is set."""

    url: str
    host: str | None = None
    port: int | None = None
    unix_path: str | None = None


# An IPv6 address in brackets, or a name or IPv4 address: labels of letters,
# digits, "_" and "-", not starting or ending with "-", dot-separated.
HOST_RE = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|(?:[A-Za-z0-9_](?:[A-Za-z0-9_-]*[A-Za-z0-9_])?)"
                     r"(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]*[A-Za-z0-9_])?)*\.?)$")
PLACEHOLDER_RE = re.compile(r"^x{1,3}(?:\.x{1,3}){3}$", re.IGNORECASE)  # the seeds' "xx.xx.xx.xx"
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path holds 108 bytes with the NUL


def parse_host_port(key: str, value: object, text: str, form: str, source: str, allow_zero: bool) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not HOST_RE.match(host) or not (port.isascii() and port.isdigit()):
        raise ConfigError(key, value, f"expected {form}", source)
    if PLACEHOLDER_RE.match(host):
        raise ConfigError(key, value, "a placeholder address: write the master node's IP address here", source)
    n = int(port)
    if not (1025 <= n <= 65535 or (allow_zero and n == 0)):
        allowed = "0 (any free port) or 1025 to 65535" if allow_zero else "1025 to 65535"
        raise ConfigError(key, value, f"port must be {allowed}", source)
    return host.strip("[]"), n


def parse_service_url(key: str, value: object, source: str = "") -> ServiceAddress:
    """``tcp://HOST:PORT`` (port 0: any free port, reported by the service) or ``unix:///PATH``."""
    form = "tcp://HOST:PORT or unix:///ABSOLUTE/PATH"
    if not isinstance(value, str):
        raise ConfigError(key, value, f"expected {form}", source)
    text = value.strip()
    if text.startswith("unix://"):
        path = text[len("unix://"):]
        if not path.startswith("/") or path.endswith("/"):
            raise ConfigError(key, value, "a unix socket needs an absolute file path: unix:///run/kvtier/meta.sock",
                              source)
        if len(path.encode()) > _SUN_PATH_MAX:
            raise ConfigError(key, value, f"socket path longer than {_SUN_PATH_MAX} bytes", source)
        return ServiceAddress(text, unix_path=path)
    if text.startswith("tcp://"):
        host, port = parse_host_port(key, value, text[len("tcp://"):], form, source, allow_zero=True)
        return ServiceAddress(text, host=host, port=port)
    raise ConfigError(key, value, f"expected {form}", source)


def parse_url_value(key: str, value: object, source: str = "") -> str:
    """The meta service's ``tcp://HOST:PORT`` or ``unix:///PATH``, checked as
    the service checks its own (``ock.mmc.meta_service_url``), and a port an
    instance can connect to (not 0)."""
    addr = parse_service_url(key, value, source)
    if addr.port == 0:
        raise ConfigError(key, value, "port 0 is for the service (any free port); give the port it listens on",
                          source)
    return addr.url


def parse_token(key: str, value: object, source: str = "") -> str:
    if not isinstance(value, str) or not value or value != value.strip() or len(value) > 4096:
        raise ConfigError(key, "<hidden>", "expected a non-empty string without surrounding spaces", source)
    return value


@dataclass(frozen=True)
class KvtierConfig:
    """What one vLLM instance's kvtier needs. Sizes in bytes, thresholds in percent."""

    backend: Backend = Backend.EMBEDDED
    dram_size_bytes: int = 1 << 30
    evict_threshold_high: float = 90.0
    evict_threshold_low: float = 80.0
    verify_checksums: bool = True
    shm_dir: str = "/dev/shm"
    model_id: str = ""  # overrides the model identity in keys (share a pool across paths)
    # SSD tier (off while ssd_paths is empty)
    ssd_paths: tuple[str, ...] = ()
    ssd_size_bytes: int | None = None  # creates and pre-allocates regular files, split evenly
    force_new_disk: bool = False
    ssd_evict_threshold_high: float = 95.0
    ssd_evict_threshold_low: float = 85.0
    rewarm_dram_watermark: float = 95.0
    io_threads: int = 4
    demote_queue_blocks: int = 256
    promote_timeout_s: float = 5.0
    # CPU workers: copy a step's saves at the start of the next step (vLLM's
    # handle_preemptions, before it writes any KV) instead of at the end of
    # the step that computed them, so that the step's tokens go out first.
    defer_saves: bool = False
    # KV cache in host memory (and the arena, embedded): a byte of each page
    # read this often; 0: never; None: hostmem.warm_interval_s decides (5 s on a VM).
    kv_warm_interval_s: float | None = None
    # The node's meta service (backend pool): its URL and shared token. Empty:
    # from the config files named by MMC_LOCAL_CONFIG_PATH / MMC_META_CONFIG_PATH,
    # else tcp://127.0.0.1:5000; the token also from KVTIER_TOKEN.
    meta_service_url: str = ""
    token: str = ""

    def __post_init__(self) -> None:
        if self.backend.shared and not self.verify_checksums:
            # On a shared pool a slot can be rewritten under a reader whose
            # session ended (lease, reconnect): only the checksum catches it.
            raise ConfigError("verify_checksums", False, "must stay on with a shared pool (backend pool/memcache)")
        pairs = (("evict_threshold_low", "evict_threshold_high"),
                 ("ssd_evict_threshold_low", "ssd_evict_threshold_high"))
        for low, high in pairs:
            if getattr(self, low) >= getattr(self, high):
                raise ConfigError(low, getattr(self, low), f"must be below {high} ({getattr(self, high)})")
        if self.ssd_paths and self.rewarm_dram_watermark <= self.evict_threshold_high:
            raise ConfigError("rewarm_dram_watermark", self.rewarm_dram_watermark,
                              f"must be above evict_threshold_high ({self.evict_threshold_high}), "
                              "or DRAM eviction never demotes to SSD")


# Connector extra-config key -> (dataclass field, parser). One table, so an
# unknown key is refused with the list of known ones.
_CONNECTOR_KEYS: dict[str, tuple[str, Callable[[str, object, str], object]]] = {
    "backend": ("backend", parse_enum(Backend)),
    "dram_size": ("dram_size_bytes", parse_size),
    "evict_threshold_high": ("evict_threshold_high", parse_percent),
    "evict_threshold_low": ("evict_threshold_low", parse_percent),
    "verify_checksums": ("verify_checksums", parse_bool),
    "shm_dir": ("shm_dir", parse_path),
    "model_id": ("model_id", parse_path),
    "ssd_path": ("ssd_paths", parse_paths),
    "ssd_size": ("ssd_size_bytes", parse_size),
    "force_new_disk": ("force_new_disk", parse_bool),
    "ssd_evict_threshold_high": ("ssd_evict_threshold_high", parse_percent),
    "ssd_evict_threshold_low": ("ssd_evict_threshold_low", parse_percent),
    "rewarm_dram_watermark": ("rewarm_dram_watermark", parse_percent),
    "io_threads": ("io_threads", parse_int_range(1, 64)),
    "demote_queue_blocks": ("demote_queue_blocks", parse_int_range(1, 1 << 20)),
    "promote_timeout_s": ("promote_timeout_s", parse_seconds),
    "defer_saves": ("defer_saves", parse_bool),
    "kv_warm_interval_s": ("kv_warm_interval_s", parse_seconds),
    "meta_service_url": ("meta_service_url", parse_url_value),
    "token": ("token", parse_token),
}

# The names the seeds' config files use, accepted as written there.
_ALIASES = {"rewarm.dram_watermark": "rewarm_dram_watermark"}

# Connector keys that size or tune the store itself. On a shared pool the
# meta service owns the store and reads them from its own files: here,
# the key of those files that does the same, or None where the service
# keeps kvtier's default.
POOL_OWNED_KEYS: dict[str, str | None] = {
    "dram_size": "ock.mmc.local_service.dram.size (per device)",
    "evict_threshold_high": "ock.mmc.evict_threshold_high",
    "evict_threshold_low": "ock.mmc.evict_threshold_low",
    "shm_dir": "kvtier.shm_dir",
    "ssd_path": "ubsio.disk.path",
    "ssd_size": "kvtier.ssd_size",
    "force_new_disk": "ubsio.standalone.force_new_disk",
    "ssd_evict_threshold_high": None,
    "ssd_evict_threshold_low": None,
    "rewarm_dram_watermark": "ock.mmc.rewarm.dram_watermark",
    "io_threads": "kvtier.io_threads",
    "demote_queue_blocks": None,
}
# Keys only a shared pool's client reads.
POOL_CLIENT_KEYS = ("meta_service_url", "token")


def keys_not_used(extra: Mapping[str, object] | None, cfg: KvtierConfig) -> list[str]:
    """Lines naming each key of ``extra`` (already parsed into ``cfg``)
    that this backend does not read, and where it belongs instead."""
    lines = []
    for key in extra or {}:
        name = _ALIASES.get(key, key)
        if cfg.backend.shared and name in POOL_OWNED_KEYS:
            where = POOL_OWNED_KEYS[name]
            lines.append(f"{key!r} is not used with backend {cfg.backend.value}: the meta service sizes and "
                         f"runs the pool from its own config files"
                         + (f" (there: {where})" if where else " (it keeps kvtier's default there)"))
        elif not cfg.backend.shared and name in POOL_CLIENT_KEYS:
            lines.append(f"{key!r} is not used with backend {cfg.backend.value}: only a shared pool's client "
                         "(backend pool or memcache) reads it")
    return lines

_SOURCE = "kv_connector_extra_config"


def parse_connector_config(extra: Mapping[str, object] | None, *, check_memory: bool = True) -> KvtierConfig:
    """Validate vLLM's ``kv_connector_extra_config`` into a :class:`KvtierConfig`.

    ``check_memory`` refuses a ``dram_size`` larger than the free space of
    ``shm_dir``, the host's available memory or what the container's memory
    limit leaves, before anything is allocated.
    """
    values: dict[str, object] = {}
    given: dict[str, str] = {}  # field -> the key that set it
    for key, raw in (extra or {}).items():
        name = _ALIASES.get(key, key)
        if name not in _CONNECTOR_KEYS:
            known = ", ".join(sorted(_CONNECTOR_KEYS))
            raise ConfigError(key, raw, f"unknown key (known keys: {known})", _SOURCE)
        field, parse = _CONNECTOR_KEYS[name]
        if field in given:
            raise ConfigError(key, raw, f"set twice: also given as {given[field]!r}", _SOURCE)
        given[field] = key
        values[field] = parse(key, raw, _SOURCE)
    try:
        cfg = KvtierConfig(**values)  # type: ignore[arg-type]
    except ConfigError as err:
        raise ConfigError(err.key, err.value, err.reason, _SOURCE) from None
    if check_memory:
        check_dram_fits(cfg)
    return cfg


def check_dram_fits(cfg: KvtierConfig) -> None:
    if not os.path.isdir(cfg.shm_dir):
        raise ConfigError("shm_dir", cfg.shm_dir, "not a directory", _SOURCE)
    st = os.statvfs(cfg.shm_dir)
    page = hugetlbfs_page_size(cfg.shm_dir)
    if page is not None:  # a hugetlbfs mount: the arena takes reserved huge pages
        free = free_huge_pages(page) * page
        if st.f_blocks:  # the mount's own size limit
            free = min(free, st.f_bavail * page)
        need = cfg.dram_size_bytes - cfg.dram_size_bytes % page
        if need < page or need > free:
            raise ConfigError(
                "dram_size",
                cfg.dram_size_bytes,
                f"needs {max(1, need // page)} huge pages of {page >> 20} MiB in {cfg.shm_dir}, "
                f"{free // page} free (reserve more: /proc/sys/vm/nr_hugepages; kvtier size prints the count)",
                _SOURCE,
            )
        return
    free = min(st.f_bavail * st.f_frsize, available_memory_bytes())
    if cfg.dram_size_bytes > free:
        raise ConfigError(
            "dram_size",
            cfg.dram_size_bytes,
            f"larger than the free memory for shared memory ({free / (1 << 30):.1f} GiB free in {cfg.shm_dir})",
            _SOURCE,
        )
    # tmpfs pages are charged to the cgroup of the process that allocates
    # them: in a container the limit, not the host's free memory, decides
    # whether the arena fits, and past it the engine is OOM-killed instead
    # of refused. (Huge pages are not charged to it: checked above.)
    cg = cgroup_memory_limit()
    if cg is not None and cfg.dram_size_bytes > cg.available_bytes:
        raise ConfigError(
            "dram_size",
            cfg.dram_size_bytes,
            f"larger than the container's memory limit leaves free ({cg.available_bytes / (1 << 30):.1f} GiB "
            f"of the {cg.limit_bytes / (1 << 30):.1f} GiB limit in {cg.path}, with "
            f"{cg.used_bytes / (1 << 30):.1f} GiB in use); the arena counts against it",
            _SOURCE,
        )


def known_connector_keys() -> list[str]:
    return sorted(_CONNECTOR_KEYS)


assert {f for f, _ in _CONNECTOR_KEYS.values()} <= {f.name for f in fields(KvtierConfig)}


class PublishOn(enum.Enum):
    """When the node pool hands a block to the cluster tier."""

    SAVE = "save"  # write-through: as soon as a save is complete (the default: peers find it at once)
    EVICT = "evict"  # when the block leaves the node's DRAM (less traffic; peers find only what left)


@dataclass(frozen=True)
class ClusterConfig:
    """The cluster tier (Mooncake Store under the node pool): built by
    :meth:`kvtier.pool.config.PoolConfig.cluster_config` from the ``kvtier.cluster.*``
    keys; None there when the tier is off.

    ``master_host``/``master_port``: Mooncake's master (on the master node, the
    host of ``ock.mmc.meta_service_url``). ``local_hostname``: the address this
    node's transfer engine is reached at by peers. ``segment_bytes``: the memory
    this node lends the cluster (0: none, a pure client). ``metadata_server``:
    Mooncake's transfer metadata (``P2PHANDSHAKE``: none needed). ``etcd_endpoints``:
    a highly available master set (empty: the one master). ``lookup_blocks``: the
    most keys one lookup asks the cluster about. ``timeout_s``: how long the
    node pool waits for one cluster lookup before answering a miss
    (``CLUSTER_LOOKUP_WAIT_S``, half an instance's wait for the pool).
    """

    master_host: str = "127.0.0.1"
    master_port: int = 50051
    master_metrics_port: int = 50052
    local_hostname: str = "127.0.0.1"
    segment_bytes: int = 1 << 30
    protocol: str = "tcp"
    rdma_devices: str = ""
    metadata_server: str = "P2PHANDSHAKE"
    replicas: int = 1
    etcd_endpoints: str = ""
    eviction_high_watermark: float = 0.9
    publish_on: PublishOn = PublishOn.SAVE
    lookup_blocks: int = 256
    timeout_s: float = CLUSTER_LOOKUP_WAIT_S

    @property
    def master_address(self) -> str:
        host = f"[{self.master_host}]" if ":" in self.master_host else self.master_host
        return f"{host}:{self.master_port}"
