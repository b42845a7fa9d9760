"""``kvtier serve`` and ``kvtier stop``: a node's pool and its vLLM instances in one command.

Runs as a supervisor process in the foreground. ``serve`` starts the meta
service (from the config files in ``--config-dir``, those named by
``MMC_META_CONFIG_PATH`` / ``MMC_LOCAL_CONFIG_PATH``, or loopback defaults
written into the log folder), then ``--instances`` vLLM OpenAI servers
wired to it (``"backend": "memcache"``), each in a process group of its
own, and prints their URLs and the metrics URL. It records every process
id, with the process's start time, in ``<log-dir>/serve.json``.

It stops everything (instances first, then the service) on Ctrl-C,
SIGTERM, or ``kvtier stop``, which signals the supervisor recorded in
that file. Processes are found only by those recorded ids, checked against
their recorded start times, never by name: a reused pid is left alone. A
child that dies is reported with the last lines of its log, and the rest
are stopped. Logs: ``<log-dir>/meta.log``, ``<log-dir>/vllm-<i>.log``.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvtier.hostmem import streaming_copy_env
from kvtier.tools.meta import MetaProcess
from kvtier.tools.server import (ServerError, exit_status, free_port, log_tail, poll_until, remove_files, session_pids,
                                 signal_pids, stop_group, vllm_shm_files)

STATE_FILE = "serve.json"
LOCK_FILE = "serve.lock"  # held by the supervisor while it runs (flock)
# vLLM flags serve sets itself; given again, vLLM would take the last one
# (logging only "Found duplicate keys").
OWN_VLLM_FLAGS = {"--port": "--port", "--host": "--host", "--model": "--model",
                  "--kv-transfer-config": "(kvtier serve wires the connector itself)"}


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat
    field 22), None if gone or exited (a zombie its parent has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


OWN_HEADER = "# written by kvtier serve\n"

NVIDIA_GPUS = "/proc/driver/nvidia/gpus"  # one folder per GPU the driver sees
# vLLM's flags whose values multiply into the devices one instance uses
# (long ones as vLLM also takes them, with "_" for "-").
_PARALLEL_FLAGS = {"-tp": "tp", "--tensor-parallel-size": "tp", "-pp": "pp", "--pipeline-parallel-size": "pp",
                   "-dp": "dp", "--data-parallel-size": "dp", "-dpl": "dpl", "--data-parallel-size-local": "dpl",
                   "-pcp": "pcp", "--prefill-context-parallel-size": "pcp"}


# vLLM's flags after which the devices (or cores) of one instance on this
# node are not the product of its sizes: a file that may set them, an
# instance spread over nodes, one data parallel rank of several.
_UNSPLIT_FLAGS = {"--config", "--nnodes", "-n", "--node-rank", "-r", "--data-parallel-rank", "-dpn",
                  "--data-parallel-start-rank", "-dpr", "--headless"}
UNSPLIT_WHY = ("vLLM's --config, or its flags for an instance over several nodes, may set its parallel sizes "
               "per node")


def devices_per_instance(vllm_args: list[str]) -> int | None:
    """The devices one vLLM instance takes on this node: its tensor x
    pipeline x prefill-context x data parallel sizes (the local data
    parallel size where given), as given among ``vllm_args`` (1 each when
    absent); None with ``--config`` or a multi-node flag
    (:data:`_UNSPLIT_FLAGS`: not split)."""
    sizes = {"tp": 1, "pp": 1, "dp": 1, "dpl": 0, "pcp": 1}
    for i, arg in enumerate(vllm_args):
        flag, eq, value = arg.partition("=")
        if flag.startswith("--"):
            flag = "--" + flag[2:].replace("_", "-")
        if flag in _UNSPLIT_FLAGS:
            return None
        if flag not in _PARALLEL_FLAGS:
            continue
        if not eq:
            value = vllm_args[i + 1] if i + 1 < len(vllm_args) else ""
        try:
            n = int(value)
        except ValueError:
            raise ServerError(f"{flag} {value!r}: expected a whole number") from None
        if n < 1:
            raise ServerError(f"{flag} {value!r}: at least 1")
        sizes[_PARALLEL_FLAGS[flag]] = n
    return sizes["tp"] * sizes["pp"] * sizes["pcp"] * (sizes["dpl"] or sizes["dp"])


def cuda_build() -> bool:
    """Whether this environment's torch is a CUDA build (vLLM's CPU build
    pins a ``+cpu`` torch): read from its installed version, without
    importing it."""
    from importlib import metadata

    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return False
    return "+cpu" not in version


def visible_devices(environ: dict[str, str], gpus_dir: str = NVIDIA_GPUS, cuda: bool | None = None
                    ) -> list[str] | None:
    """The CUDA devices the instances may take: ``CUDA_VISIBLE_DEVICES``'s
    list where set, else one index per GPU the NVIDIA driver lists; None
    where there is none: vLLM's CPU build (``cuda``: whether torch is a
    CUDA build, :func:`cuda_build` by default), or the variable set empty."""
    if not (cuda_build() if cuda is None else cuda):
        return None
    given = environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        # Empty (or "-1", CUDA's "none"): no device, as on the CPU build.
        return [d.strip() for d in given.split(",") if d.strip()] if given.strip() not in ("", "-1") else None
    try:
        count = len(os.listdir(gpus_dir))
    except OSError:
        return None
    return [str(i) for i in range(count)] or None


def split_devices(instances: int, per_instance: int | None, devices: list[str] | None) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` for each instance: consecutive, disjoint
    sets of ``per_instance`` devices, so that instances do not start on the
    same GPU. None where there are no devices to split (CPU), or their
    number per instance is not known (``--config``)."""
    if devices is None or per_instance is None:
        return None
    need = instances * per_instance
    if need > len(devices):
        raise ServerError(f"--instances {instances} with {per_instance} device(s) each (vLLM's tensor, pipeline "
                          f"and data parallel sizes) need {need} devices; {len(devices)} visible "
                          f"({','.join(devices) or 'none'}): fewer instances, or CUDA_VISIBLE_DEVICES")
    return [",".join(devices[i * per_instance : (i + 1) * per_instance]) for i in range(instances)]


SYS_CPU = "/sys/devices/system/cpu"  # the kernel's view of each logical CPU's topology


@dataclass(frozen=True)
class Cpu:
    """A logical CPU, with the NUMA node, package and physical core it is
    on; ``core`` names the core by its lowest logical CPU (unique on the
    host, where core ids repeat across dies or clusters)."""
    id: int
    node: int = 0
    package: int = 0
    core: int = -1  # -1: its own core (no topology to read)


def _read_int(path: str, default: int) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return default


def parse_ids(text: str) -> list[int]:
    """``"0-2,5"`` as ``[0, 1, 2, 5]`` (the kernel's and vLLM's CPU lists)."""
    ids: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        ids.extend(range(int(lo), int(hi or lo) + 1))
    return ids


def _first_sibling(base: str) -> int:
    """The lowest logical CPU of the core that ``base`` (a cpuN folder) is on, -1 unknown."""
    for name in ("core_cpus_list", "thread_siblings_list"):
        try:
            with open(f"{base}/topology/{name}") as f:
                return min(parse_ids(f.read()))
        except (OSError, ValueError):
            continue
    return -1


def host_cpus(allowed: set[int] | None = None, sys_cpu: str = SYS_CPU) -> list[Cpu]:
    """The logical CPUs this process may run on (``sched_getaffinity``
    unless ``allowed`` is given), with their topology from ``sys_cpu``
    (a CPU whose files are missing counts as a core of its own, on node 0)."""
    out = []
    for cpu in sorted(os.sched_getaffinity(0) if allowed is None else allowed):
        base = f"{sys_cpu}/cpu{cpu}"
        try:
            node = min((int(e[4:]) for e in os.listdir(base) if e.startswith("node") and e[4:].isdigit()),
                       default=0)
        except OSError:
            node = 0
        out.append(Cpu(cpu, node, _read_int(f"{base}/topology/physical_package_id", 0), _first_sibling(base)))
    return out


def id_ranges(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2,5"`` (taskset's and vLLM's form)."""
    parts: list[str] = []
    ids = sorted(ids)
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


@dataclass(frozen=True)
class CoreShare:
    """One instance's share of the host's cores: ``cpus``, the logical
    CPUs its processes may run on (every sibling of its cores), and
    ``omp_bind``, ``VLLM_CPU_OMP_THREADS_BIND`` for its ranks (one logical
    CPU per physical core, as vLLM's own binding takes them; ranks
    separated by ``|``)."""
    cpus: frozenset[int]
    omp_bind: str


def physical_cores(cpus: list[Cpu]) -> dict[tuple[int, int, int], list[int]]:
    """The logical CPUs of each physical core, by (node, package, core)."""
    cores: dict[tuple[int, int, int], list[int]] = {}
    for c in cpus:
        cores.setdefault((c.node, c.package, c.core if c.core >= 0 else (1 << 30) + c.id), []).append(c.id)
    return cores


def split_cores(instances: int, ranks: int, cpus: list[Cpu], reserve: int = 0) -> list[CoreShare] | None:
    """Disjoint shares of the physical cores in ``cpus``, one per instance,
    each cut into ``ranks`` equal runs for its vLLM ranks, cores in order
    of NUMA node, package and core (a share spans two nodes only where the
    split falls across one). None where there are fewer physical cores
    than ``instances * ranks``. Cores left over by an uneven split go to
    no instance.

    ``reserve``: cores of each share kept out of its OpenMP teams for the
    instance's other processes (its API server, engine core, kvtier's
    threads), as vLLM's own binding keeps them: taken from the ends of the
    last ranks' runs, never a run's last core, and none where the share has
    no more cores than that. They stay in the share's ``cpus``."""
    cores = physical_cores(cpus)
    order = sorted(cores)
    per_rank = len(order) // (instances * ranks)
    if per_rank < 1:
        return None
    shares = []
    for i in range(instances):
        runs = [order[(i * ranks + r) * per_rank: (i * ranks + r + 1) * per_rank] for r in range(ranks)]
        share = frozenset(cpu for run in runs for key in run for cpu in cores[key])
        omp = [[min(cores[key]) for key in run] for run in runs]
        if per_rank * ranks > reserve:
            for r in range(ranks):  # vLLM's split of the reserve: the remainder to the last ranks
                take = reserve // ranks + (1 if r >= ranks - reserve % ranks else 0)
                omp[r] = omp[r][: max(1, len(omp[r]) - take)]
        shares.append(CoreShare(share, "|".join(id_ranges(run) for run in omp)))
    return shares


class _PinTo:
    """What the child runs before vLLM starts: every thread and process it
    makes inherits the mask (vLLM binds its OpenMP threads inside it)."""

    def __init__(self, cpus: frozenset[int]) -> None:
        self.cpus = cpus

    def __call__(self) -> None:
        os.sched_setaffinity(0, self.cpus)


def reserved_cores(environ: dict[str, str], ranks: int) -> int:
    """Cores of an instance's share that vLLM keeps out of its OpenMP teams:
    ``VLLM_CPU_NUM_OF_RESERVED_CPU`` where set, else vLLM's own default on
    x86 with a KV connector (one per rank for its engine core, one more for
    the connector)."""
    value = environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU")
    if value is None:
        return 2 * ranks
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise ServerError(f"VLLM_CPU_NUM_OF_RESERVED_CPU={value!r}: expected a whole number of cores, 0 or more")
    return n


def write_own(path: Path, text: str) -> None:
    """Write ``path`` unless it is a file kvtier serve did not write (one
    without :data:`OWN_HEADER`: refused, naming it). Through a new file
    renamed over it: a symbolic link there is replaced, not followed."""
    if path.is_symlink() or (path.exists() and not _starts_with(path, OWN_HEADER)):
        raise ServerError(f"{path}: not a file kvtier serve wrote; it is left as it is (move it, or choose "
                          f"another --log-dir, or give --config-dir)")
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)  # a link or a leftover: removed, never written through
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(path)


def _starts_with(path: Path, head: str) -> bool:
    try:
        with open(path, errors="replace") as f:
            return f.read(len(head)) == head
    except OSError:
        return False


def open_log(path: Path) -> int:
    """A log file opened for writing from its start, never through a symbolic link."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)


def default_configs(folder: Path) -> tuple[Path, Path]:
    """Loopback config files for a node with nothing configured."""
    port, metrics = free_port(), free_port()
    meta, local = folder / "mmc-meta.conf", folder / "mmc-local.conf"
    write_own(meta, f"{OWN_HEADER}ock.mmc.meta_service_url = tcp://127.0.0.1:{port}\n"
                    f"ock.mmc.meta_service.metrics_url = http://127.0.0.1:{metrics}\n")
    write_own(local, f"{OWN_HEADER}ock.mmc.meta_service_url = tcp://127.0.0.1:{port}\n"
                     "ock.mmc.local_service.protocol = host_shm\nock.mmc.local_service.dram.size = 1GB\n"
                     "ock.mmc.local_service.world_size = 1\n")
    return meta, local


def find_configs(config_dir: str | None, log_dir: Path) -> tuple[Path, Path]:
    if config_dir:
        meta, local = Path(config_dir) / "mmc-meta.conf", Path(config_dir) / "mmc-local.conf"
        for p in (meta, local):
            if not p.is_file():
                raise ServerError(f"{p}: no such file (--config-dir needs mmc-meta.conf and mmc-local.conf)")
        return meta, local
    env_meta, env_local = os.environ.get("MMC_META_CONFIG_PATH"), os.environ.get("MMC_LOCAL_CONFIG_PATH")
    for var, value in (("MMC_META_CONFIG_PATH", env_meta), ("MMC_LOCAL_CONFIG_PATH", env_local)):
        if value and not Path(value).is_file():
            raise ServerError(f"{var}={value}: no such file")
    if env_meta or env_local:
        return Path(env_meta or env_local), Path(env_local or env_meta)  # type: ignore[arg-type]
    return default_configs(log_dir)


def check_vllm_args(args: list[str]) -> None:
    """Refuse vLLM arguments that would replace what serve sets: one line
    naming serve's own flag."""
    for arg in args:
        # vLLM reads --kv_transfer_config as --kv-transfer-config, and its
        # parser takes a flag's abbreviation (--kv-transfer) for the flag.
        name = arg.split("=", 1)[0].replace("_", "-")
        for flag, instead in OWN_VLLM_FLAGS.items():
            if name == flag or name.startswith(flag + ".") or (len(name) > 3 and flag.startswith(name)):
                use = f"use kvtier serve's {instead}" if instead.startswith("--") else instead
                raise ServerError(f"vLLM argument {arg!r}: {use}")


def client_host(host: str) -> str:
    """Where to reach an instance bound to ``host`` from this machine."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def recorded(log_dir: Path) -> list[dict]:
    """The processes ``log_dir``'s record names that still run as recorded:
    a pid above 1 whose start time is the one recorded and whose owner is
    this user. A record this user does not own is refused (ServerError):
    anyone who can write the folder could name any process in it."""
    path = log_dir / STATE_FILE
    try:
        st = path.lstat()
    except FileNotFoundError:
        return []
    except OSError as err:
        raise ServerError(f"{path}: {err.strerror}") from None
    import stat as stat_mod

    # Writable by others, or by a group that is not this user's private one
    # (records of earlier versions took the umask: 0664 under a user-private group).
    shared = st.st_mode & 0o002 or (st.st_mode & 0o020 and not _private_group(st.st_gid))
    if not stat_mod.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or shared:
        raise ServerError(f"{path}: not a record of this user's kvtier serve (owner uid {st.st_uid}, mode "
                          f"{stat_mod.S_IMODE(st.st_mode):o}); nothing signalled")
    try:
        procs = json.loads(path.read_text())["processes"]
        if not isinstance(procs, list):
            raise TypeError("processes is not a list")
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise ServerError(f"{path}: not a record kvtier serve wrote ({err}); nothing signalled") from None
    return [p for p in procs if isinstance(p, dict) and _running_as_recorded(p)]


def _private_group(gid: int) -> bool:
    """Whether group ``gid`` is this user's alone: named after the user,
    no other members listed, and no other user's primary group."""
    import grp
    import pwd

    try:
        group, me = grp.getgrgid(gid), pwd.getpwuid(os.geteuid())
    except KeyError:
        return False
    if group.gr_name != me.pw_name or any(m != me.pw_name for m in group.gr_mem):
        return False
    return all(u.pw_gid != gid or u.pw_uid == me.pw_uid for u in pwd.getpwall())


def _running_as_recorded(p: dict) -> bool:
    pid, start = p.get("pid"), p.get("start")
    if type(pid) is not int or type(start) is not int or pid <= 1 or not isinstance(p.get("role"), str):
        return False
    return process_start_time(pid) == start and _owner(pid) == os.geteuid()


def _owner(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def live_supervisor(log_dir: Path) -> int | None:
    """The pid of a ``kvtier serve`` still running on ``log_dir`` (its record names it), else None."""
    try:
        procs = recorded(log_dir)
    except ServerError:
        return None
    return next((p["pid"] for p in procs if p["role"] == "supervisor"), None)


@dataclass
class Instance:
    index: int
    port: int
    proc: subprocess.Popen
    log_path: Path
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{client_host(self.host)}:{self.port}"


def _transfer_config() -> str:
    return json.dumps({"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.connector",
                       "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": {"backend": "memcache"}})


def meta_role_args(local_conf: str | Path) -> list[str]:
    """``kvtier meta``'s role on this node: a worker node of the cluster tier
    (its local file sets ``kvtier.node_service_url``) runs ``--role local``,
    the master node (and a node without the cluster tier) the meta service."""
    from kvtier.pool.config import load_pool_config

    return ["--role", "local"] if load_pool_config(None, str(local_conf), env={}).node_service_url else []


class Serve:
    def __init__(self, model: str, instances: int, log_dir: Path, config_dir: str | None = None,
                 vllm_args: list[str] | None = None, host: str = "127.0.0.1", first_port: int = 0,
                 startup_timeout_s: float = 600.0, out=print, share_cores: bool = False) -> None:
        self.model = model
        self.share_cores = share_cores
        self.n = instances
        self.log_dir = log_dir
        self.config_dir = config_dir
        self.vllm_args = list(vllm_args or [])
        self.host = host
        self.first_port = first_port
        self.startup_timeout_s = startup_timeout_s
        self.out = out
        self.meta: MetaProcess | None = None
        self.instances: list[Instance] = []
        self._stop = threading.Event()
        self._wrote = False  # the record in the log folder is this supervisor's
        self._lock_fd: int | None = None  # LOCK_FILE, locked

    def _write_state(self) -> None:
        procs = [("supervisor", os.getpid())]
        if self.meta and self.meta.proc:
            procs.append(("meta", self.meta.proc.pid))
        procs += [(f"vllm-{i.index}", i.proc.pid) for i in self.instances]
        state = {"processes": [{"role": role, "pid": pid, "start": process_start_time(pid)} for role, pid in procs],
                 "urls": [i.url for i in self.instances],
                 "metrics": self.meta.metrics_url if self.meta else ""}
        tmp = self.log_dir / (STATE_FILE + ".tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(state, indent=1))
        tmp.replace(self.log_dir / STATE_FILE)
        self._wrote = True

    def _start_instance(self, i: int, env: dict[str, str], devices: str | None = None,
                        cores: CoreShare | None = None) -> Instance:
        port = self.first_port + i if self.first_port else free_port()
        log_path = self.log_dir / f"vllm-{i}.log"
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--host", self.host, "--port", str(port), "--enable-prefix-caching", "--enable-prompt-tokens-details",
                "--kv-transfer-config", _transfer_config(), *self.vllm_args]
        if devices is not None:
            env = {**env, "CUDA_VISIBLE_DEVICES": devices}
        if cores is not None:
            env = {**env, "VLLM_CPU_OMP_THREADS_BIND": cores.omp_bind}
        fd = open_log(log_path)
        try:
            proc = subprocess.Popen(argv, stdout=fd, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                    preexec_fn=_PinTo(cores.cpus) if cores is not None else None)
        except subprocess.SubprocessError as err:  # the pin refused (the cores gone from this cgroup's set)
            raise ServerError(f"vLLM instance {i} could not start on cores {id_ranges(list(cores.cpus))}: "
                              f"{err}") from None
        finally:
            os.close(fd)
        return Instance(i, port, proc, log_path, self.host)

    def _wait_ready(self, inst: Instance) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            if (rc := exit_status(inst.proc)) is not None:
                raise ServerError(f"vLLM instance {inst.index} exited with {rc} during start-up; "
                                  f"last lines of {inst.log_path}:\n{log_tail(inst.log_path, 20)}")
            try:
                if httpx.get(inst.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        if self._stop.is_set():
            raise ServerError(f"interrupted while vLLM instance {inst.index} started")
        raise ServerError(f"vLLM instance {inst.index} not ready after {self.startup_timeout_s:.0f} s; "
                          f"log {inst.log_path}")

    def _check_ports(self) -> None:
        """Each instance's port, when given, must be free now: found before
        vLLM spends its start-up (and the instances before it theirs)."""
        if not self.first_port:
            return
        import socket

        for i in range(self.n):
            port = self.first_port + i
            if port > 65535:
                raise ServerError(f"--port {self.first_port} with --instances {self.n}: port {port} is past 65535")
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            with socket.socket(family) as s:
                # As servers bind: a port whose last connections linger in
                # TIME_WAIT (an instance stopped a moment ago) is free to them.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((self.host if self.host not in ("",) else "0.0.0.0", port))
                except OSError as err:
                    raise ServerError(f"--port {self.first_port}: port {port} (instance {i}) on {self.host}: "
                                      f"{err.strerror}") from None

    def start(self) -> None:
        check_vllm_args(self.vllm_args)
        if self.n < 1:
            raise ServerError(f"--instances {self.n}: at least 1")
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ServerError(f"--log-dir {self.log_dir}: {err.strerror}") from None
        self._take_folder()
        running = recorded(self.log_dir)
        if running:
            # A supervisor, or processes a killed one left (they run in
            # sessions of their own): a new record would hide them from kvtier stop.
            who = ", ".join(f"{p['role']} (pid {p['pid']})" for p in running)
            what = "kvtier serve" if any(p["role"] == "supervisor" for p in running) else "processes of a kvtier serve"
            raise ServerError(f"--log-dir {self.log_dir}: {what} already runs there: {who}; "
                              f"stop it (kvtier stop --log-dir {self.log_dir}) or choose another folder")
        self._write_state()  # the supervisor, before anything starts: kvtier stop finds it from now on
        self._check_ports()
        # Found before anything starts: N instances on one GPU would each
        # take vLLM's share of its memory, and all but the first fail.
        per_instance = devices_per_instance(self.vllm_args)
        devices = split_devices(self.n, per_instance, visible_devices(dict(os.environ)))
        if per_instance is None and self.n > 1 and visible_devices(dict(os.environ)):
            self.out(f"{UNSPLIT_WHY}: the instances' devices are not split; "
                     "set CUDA_VISIBLE_DEVICES yourself, or give the sizes as flags")
        shares = self._core_shares(per_instance, devices)
        meta_conf, local_conf = find_configs(self.config_dir, self.log_dir)
        if self._stop.is_set():  # kvtier stop (or Ctrl-C) during the checks: nothing is started
            raise ServerError("interrupted during start-up")
        self.meta = MetaProcess(meta_conf, local_conf, log_path=self.log_dir / "meta.log",
                                args=meta_role_args(local_conf))
        self.meta.start(stop=self._stop)
        self.out(f"meta service  {self.meta.address}   metrics {self.meta.metrics_url}/metrics")
        env = dict(os.environ)
        env.update(self.meta.env_for_clients())
        env.update(streaming_copy_env(env))  # block copies past the caches (hostmem), unless set already
        # Started one after another: on a small host parallel start-ups only
        # compete for the same cores; each must be up before the next.
        for i in range(self.n):
            if self._stop.is_set():
                raise ServerError("interrupted during start-up")
            inst = self._start_instance(i, env, devices[i] if devices else None, shares[i] if shares else None)
            self.instances.append(inst)
            self._write_state()
            self._wait_ready(inst)
            on = f", CUDA devices {devices[i]}" if devices else ""
            on += f", cores {id_ranges(list(shares[i].cpus))}" if shares else ""
            self.out(f"instance {i}    {inst.url}/v1   (log {inst.log_path}{on})")
        self._write_state()

    def _core_shares(self, per_instance: int | None, devices: list[str] | None) -> list[CoreShare] | None:
        """On vLLM's CPU build, each of several instances on cores of its
        own: vLLM binds one OpenMP thread to each core it is given, so
        instances that share cores run their teams over each other. Not where the
        instances run on GPUs, with ``--share-cores``, or where
        ``VLLM_CPU_OMP_THREADS_BIND`` is set (it goes to every instance as
        it is); a line says why where it matters."""
        if self.n < 2 or self.share_cores or devices is not None or cuda_build():
            return None
        # The user's binding, any value ("0" is CPU 0); vLLM's simulated
        # NUMA nodes, on unless "0" (vLLM asserts beside a bind list).
        for var, is_set in (("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_OMP_THREADS_BIND" in os.environ),
                            ("VLLM_CPU_SIM_MULTI_NUMA", os.environ.get("VLLM_CPU_SIM_MULTI_NUMA", "0") != "0")):
            if is_set:
                self.out(f"{var} is set: every instance gets it as it is, and the host's cores are not split "
                         f"between them")
                return None
        if per_instance is None:
            self.out(f"{UNSPLIT_WHY}: the host's cores are not split between the instances; set "
                     "VLLM_CPU_OMP_THREADS_BIND yourself, or give the sizes as flags")
            return None
        cpus = host_cpus()
        shares = split_cores(self.n, per_instance, cpus, reserved_cores(dict(os.environ), per_instance))
        if shares is None:
            cores = len(physical_cores(cpus))
            self.out(f"{self.n} instances of {per_instance} rank(s) need {self.n * per_instance} cores to run on "
                     f"cores of their own; {cores} here: they share them")
        return shares

    def watch(self) -> int:
        """Until a stop signal (0) or a child's death (1)."""
        while not self._stop.wait(1.0):
            # Not reaped here (exit_status): stop() finds what is left of a
            # dead child's session by its id, which no other process can take meanwhile.
            for inst in self.instances:
                if (rc := exit_status(inst.proc)) is not None:
                    self.out(f"vLLM instance {inst.index} exited with {rc}; last lines of "
                             f"{inst.log_path}:\n{log_tail(inst.log_path, 20)}")
                    return 1
            if self.meta and self.meta.proc and (rc := exit_status(self.meta.proc)) is not None:
                self.out(f"the meta service exited with {rc}; last lines of "
                         f"{self.meta.log_path}:\n{self.meta.log_tail(20)}")
                return 1
        return 0

    def request_stop(self, *_: object) -> None:
        self._stop.set()

    def stop(self) -> None:
        for inst in self.instances:
            stop_group(inst.proc, signal.SIGTERM)
        if self.meta is not None:
            self.meta.stop()
        if self._wrote:  # another serve's record (a refused start) stays
            try:
                (self.log_dir / STATE_FILE).unlink()
            except OSError:
                pass
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _take_folder(self) -> None:
        """Lock the log folder for this supervisor's life: a second serve
        starting on it at the same time would take over its record."""
        import fcntl

        path = self.log_dir / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as err:
            raise ServerError(f"{path}: {err.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ServerError(f"--log-dir {self.log_dir}: another kvtier serve is starting or running there; stop "
                              f"it (kvtier stop --log-dir {self.log_dir}) or choose another folder") from None
        self._lock_fd = fd


def serve(model: str, instances: int, log_dir: str, config_dir: str | None, vllm_args: list[str],
          first_port: int = 0, host: str = "127.0.0.1", share_cores: bool = False) -> int:
    s = Serve(model, instances, Path(log_dir), config_dir, vllm_args, host=host, first_port=first_port,
              share_cores=share_cores)
    # SIGHUP: the terminal closed; the children run in sessions of their own
    # and would be left behind.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, s.request_stop)
    try:
        s.start()
        where = shlex.quote(os.path.abspath(log_dir))
        print(f"serving; stop with Ctrl-C or: kvtier stop --log-dir {where}", flush=True)
        rc = s.watch()
    except ServerError as err:
        print(f"kvtier serve: {err}", file=sys.stderr)
        rc = 1
    finally:
        s.stop()
    print("stopped", flush=True)
    return rc


# How long the supervisor may take per process it stops (stop_group: 30 s
# for the signal, 10 s of grace, 5 s after SIGKILL), plus a margin.
STOP_S_PER_PROCESS = 45.0


def stop(log_dir: str, timeout_s: float | None = None) -> int:
    """Stop what ``kvtier serve`` recorded in ``log_dir``: its supervisor
    (which stops the rest), or each recorded process if it is gone. Only
    processes that still run as recorded (pid, start time, this user) are
    signalled (:func:`recorded`). ``timeout_s``: how long the supervisor
    gets, by default as long as it may need for every process it stops."""
    path = Path(log_dir) / STATE_FILE
    if not path.exists() and not path.is_symlink():
        print(f"kvtier stop: {path}: nothing recorded there (not serving?)", file=sys.stderr)
        return 1
    try:
        procs = recorded(Path(log_dir))
    except ServerError as err:
        print(f"kvtier stop: {err}", file=sys.stderr)
        return 1
    if not procs:
        path.unlink(missing_ok=True)
        print(f"nothing recorded in {path} was running; removed the stale record")
        return 0
    if timeout_s is None:
        timeout_s = STOP_S_PER_PROCESS * len(procs) + 30.0
    sup = [p for p in procs if p["role"] == "supervisor"]
    if sup:
        signal_pids([sup[0]["pid"]], signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and process_start_time(sup[0]["pid"]) == sup[0]["start"]:
            time.sleep(0.2)
        if process_start_time(sup[0]["pid"]) != sup[0]["start"]:
            print("stopped")
            return 0
    # No supervisor (killed): the recorded processes, each checked again,
    # stopped as stop_group does for a child.
    leaders = [p["pid"] for p in procs if p["role"] != "supervisor" and process_start_time(p["pid"]) == p["start"]]
    files = vllm_shm_files([pid for leader in leaders for pid in session_pids(leader)])
    signal_pids(leaders, signal.SIGTERM)
    poll_until(lambda: not any(session_pids(pid) for pid in leaders), timeout_s)
    signal_pids([p for leader in leaders for p in session_pids(leader)], signal.SIGKILL)
    poll_until(lambda: not any(session_pids(pid) for pid in leaders), 5.0)
    remove_files(files)
    if sup and process_start_time(sup[0]["pid"]) == sup[0]["start"]:
        # It outlived its children's stop: hung. Nothing of its is left to stop in order.
        signal_pids([sup[0]["pid"]], signal.SIGKILL)
        print(f"kvtier stop: the supervisor (pid {sup[0]['pid']}) did not stop within {timeout_s:g} s; killed",
              file=sys.stderr)
    path.unlink(missing_ok=True)
    print("stopped")
    return 0
