"""Mooncake's master as a supervised child of the master node's meta service.

Runs in ``kvtier meta`` on the master node (and in tests). Mooncake Store
keeps the cluster's index (which node's segment holds which key, leases,
eviction) in one master process, ``mooncake_master``, shipped as a program
by the ``kvtier[cluster]`` wheel. :class:`MasterSupervisor` starts it on the
host of ``ock.mmc.meta_service_url`` at ``kvtier.cluster.master_port``, and
starts it again when it exits (a crash, or a ``kill -9`` in the fault
tests), with a back-off of 0.5 s doubling to 10 s; :meth:`stop` ends it.

Order of calls::

    sup = MasterSupervisor(cfg, log_path)   # nothing started
    sup.start()                             # child running, or ClusterError
    sup.restarts, sup.pid                   # what /metrics and tests read
    sup.stop()

The child is asked to die with its parent (``PR_SET_PDEATHSIG``): a meta
service killed with -9 leaves no master behind holding the port. A master
restarted this way starts empty (Mooncake's index is in its memory): blocks
are found again once nodes publish them again; peers' clients re-mount
their segments on their own.

With ``kvtier.cluster.etcd_endpoints`` set the master runs highly available
(:mod:`kvtier.cluster.etcd`): :meth:`start` first refuses endpoints where no
etcd answers (ConfigError naming the key), then starts the master with
``-enable_ha``; it counts as up once its HTTP side answers, as leader or as
standby (a standby opens its RPC port only when elected). Two ``kvtier
meta`` with the same endpoints, each with its own ``master_port``, are a
leader and a standby; :meth:`role` says which this one is now.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from kvtier.cluster import etcd
from kvtier.config import ClusterConfig
from kvtier.errors import ConfigError

log = logging.getLogger(__name__)

RESTART_FIRST_S = 0.5
RESTART_MAX_S = 10.0


def master_program() -> str:
    """Path of ``mooncake_master``: beside this Python (a virtual
    environment's bin/), else on PATH; ConfigError when the extra is missing."""
    here = Path(sys.executable).parent / "mooncake_master"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("mooncake_master")
    if found:
        return found
    raise ConfigError("kvtier.cluster.enabled", "true",
                      "mooncake_master not found: install the cluster extra, pip install 'kvtier[cluster]'")


def preflight(cfg: ClusterConfig) -> None:
    """What ``kvtier meta`` checks before it starts anything, on every node:
    the extra is installed, and etcd answers when configured (ConfigError
    naming the key, one line)."""
    master_program()
    if cfg.etcd_endpoints:
        etcd.require(cfg.etcd_endpoints)


def master_command(cfg: ClusterConfig, program: str | None = None) -> list[str]:
    """The master's command line for ``cfg`` (loopback unless configured)."""
    cmd = [program or master_program(),
           f"-rpc_address={cfg.master_host}", f"-rpc_port={cfg.master_port}",
           f"-metrics_host={cfg.master_host}", f"-metrics_port={cfg.master_metrics_port}",
           "-enable_metric_reporting=false",
           f"-eviction_high_watermark_ratio={cfg.eviction_high_watermark}"]
    if cfg.etcd_endpoints:
        # -rpc_address above is the address the leader publishes in etcd:
        # the master node's, reachable by every node. The cluster id names
        # the leader's key; Mooncake's clients read MC_STORE_CLUSTER_ID,
        # the master only its flag.
        cmd += ["-enable_ha=true", "-ha_backend_type=etcd",
                f"-etcd_endpoints={';'.join(etcd.endpoints(cfg.etcd_endpoints))}",
                f"-cluster_id={etcd.cluster_id()}"]
    return cmd


def master_role(cfg: ClusterConfig, timeout_s: float = 0.5) -> str | None:
    """What the master at ``cfg``'s metrics port says it is (``leader``,
    ``standby``, ...), from its ``/health``; None when it does not answer."""
    import urllib.request

    host = f"[{cfg.master_host}]" if ":" in cfg.master_host else cfg.master_host
    try:
        url = f"http://{host}:{cfg.master_metrics_port}/health"
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            body = json.loads(r.read(1 << 16))
    except (OSError, ValueError):
        return None
    return str(body.get("role") or "") if isinstance(body, dict) else None


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: PR_SET_PDEATHSIG = 1.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)


def answers(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Whether the process behind ``host:port`` reads what it is sent: a
    master's RPC server closes a connection that sends it bytes that are no
    request at once, or answers them; a stopped (or wedged) one leaves them
    unread, though the kernel took the connection. A port that merely
    accepts is not enough before Mooncake's ``setup``, which holds the GIL
    while it waits on the master."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.sendall(b"\0" * 64)  # no request of Mooncake's RPC (its header's magic is not 0)
            s.settimeout(timeout_s)
            s.recv(64)  # data or end of stream: someone read it
            return True
    except OSError:  # refused, reset (also an answer, but not one to connect to), or no answer in time
        return False


def port_open(host: str, port: int, timeout_s: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class MasterSupervisor:
    """Runs ``mooncake_master`` as a child and restarts it when it exits."""

    def __init__(self, cfg: ClusterConfig, log_path: str | os.PathLike | None = None,
                 startup_timeout_s: float = 20.0) -> None:
        self.cfg = cfg
        self.log_path = str(log_path) if log_path else None
        self.startup_timeout_s = startup_timeout_s
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # Set by stop() once the master is gone: the watch thread lives until
        # then, since a master it respawned is asked to die with it (the
        # kernel's parent-death signal follows the thread that forked, not
        # the process), which would SIGKILL it before stop()'s SIGTERM.
        self._ended = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        p = self._proc
        return p.pid if p is not None and p.poll() is None else None

    @property
    def running(self) -> bool:
        return self.pid is not None

    @property
    def ha(self) -> bool:
        """Whether this master is one of a highly available set (etcd configured)."""
        return bool(self.cfg.etcd_endpoints)

    def role(self) -> str | None:
        """``leader``, ``standby`` (or another of Mooncake's states) while
        running; None when it does not answer."""
        return master_role(self.cfg) if self.running else None

    def start(self) -> None:
        """Start the master and wait until its port answers (in HA mode: its
        HTTP side, as leader or standby); ConfigError when etcd does not
        answer, the port is taken or the master does not come up."""
        if self.ha:
            etcd.require(self.cfg.etcd_endpoints)
        if port_open(self.cfg.master_host, self.cfg.master_port):
            raise ConfigError("kvtier.cluster.master_port", self.cfg.master_port,
                              f"something already listens on {self.cfg.master_address}")
        if self.ha and port_open(self.cfg.master_host, self.cfg.master_metrics_port):
            # In HA mode that port is how start() knows the master is up.
            raise ConfigError("kvtier.cluster.master_metrics_port", self.cfg.master_metrics_port,
                              f"something already listens on {self.cfg.master_host}:"
                              f"{self.cfg.master_metrics_port}")
        self._spawn()
        if not self._wait_up(self.startup_timeout_s):
            self.stop()
            if self.ha:  # its HTTP side is what answers first (a standby's RPC port stays closed)
                key, port = "kvtier.cluster.master_metrics_port", self.cfg.master_metrics_port
                where = f"{self.cfg.master_host}:{port}"
            else:
                key, port, where = "kvtier.cluster.master_port", self.cfg.master_port, self.cfg.master_address
            raise ConfigError(key, port,
                              f"mooncake_master did not listen on {where} within "
                              f"{self.startup_timeout_s:.0f} s (log: {self.log_path or 'stderr'})")
        if self.ha:
            log.info("kvtier cluster: Mooncake master (pid %d) at %s, highly available through etcd at %s "
                     "(%s; it serves while it holds the lease there)", self.pid, self.cfg.master_address,
                     self.cfg.etcd_endpoints, self.role() or "starting")
        else:
            log.info("kvtier cluster: Mooncake master (pid %d) at %s", self.pid, self.cfg.master_address)
        self._thread = threading.Thread(target=self._watch, name="kvtier-cluster-master", daemon=True)
        self._thread.start()

    def _spawn(self) -> None:
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self._proc = subprocess.Popen(master_command(self.cfg), stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()

    def _wait_up(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            p = self._proc
            if p is None or p.poll() is not None:
                return False
            if self.ha:
                if master_role(self.cfg, timeout_s=0.2):
                    return True
            elif port_open(self.cfg.master_host, self.cfg.master_port):
                return True
            time.sleep(0.05)
        return False

    def _watch(self) -> None:
        try:
            self._restart_when_gone()
        finally:
            self._ended.wait(60)

    def _restart_when_gone(self) -> None:
        backoff = RESTART_FIRST_S
        while not self._stop.is_set():
            p = self._proc
            if p is not None:
                while p.poll() is None:
                    if self._stop.wait(0.2):
                        return
            if self._stop.is_set():
                return
            log.warning("kvtier cluster: Mooncake master exited (%s); restarting in %.1f s",
                        p.returncode if p else "?", backoff)
            if self._stop.wait(backoff):
                return
            with self._lock:
                if self._stop.is_set():
                    return
                try:
                    self._spawn()
                except Exception as err:  # noqa: BLE001 - e.g. the program gone (ConfigError), a failed fork
                    # Logged and tried again: the thread ending would leave the node without a master.
                    log.error("kvtier cluster: cannot restart the Mooncake master: %s", err)
                    backoff = min(backoff * 2, RESTART_MAX_S)
                    continue
            if self._wait_up(self.startup_timeout_s):
                self.restarts += 1
                backoff = RESTART_FIRST_S
                log.info("kvtier cluster: Mooncake master restarted (pid %s); %s", self.pid,
                         "it stands by until elected" if self.ha else "it starts empty")
            else:
                backoff = min(backoff * 2, RESTART_MAX_S)

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the master (SIGTERM, then SIGKILL) and stop restarting it."""
        self._stop.set()
        with self._lock:
            p = self._proc
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._ended.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
