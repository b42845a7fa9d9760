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
"""

from __future__ import annotations

import ctypes
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


def master_command(cfg: ClusterConfig, program: str | None = None) -> list[str]:
    """The master's command line for ``cfg`` (loopback unless configured)."""
    cmd = [program or master_program(),
           f"-rpc_address={cfg.master_host}", f"-rpc_port={cfg.master_port}",
           f"-metrics_host={cfg.master_host}", f"-metrics_port={cfg.master_metrics_port}",
           "-enable_metric_reporting=false",
           f"-eviction_high_watermark_ratio={cfg.eviction_high_watermark}"]
    if cfg.etcd_endpoints:
        cmd += ["-enable_ha=true", f"-etcd_endpoints={cfg.etcd_endpoints}"]
    return cmd


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: PR_SET_PDEATHSIG = 1.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)


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
        self._thread: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        p = self._proc
        return p.pid if p is not None and p.poll() is None else None

    @property
    def running(self) -> bool:
        return self.pid is not None

    def start(self) -> None:
        """Start the master and wait until its port answers; ClusterError-like
        ConfigError when the port is taken or the master does not come up."""
        if port_open(self.cfg.master_host, self.cfg.master_port):
            raise ConfigError("kvtier.cluster.master_port", self.cfg.master_port,
                              f"something already listens on {self.cfg.master_address}")
        self._spawn()
        if not self._wait_up(self.startup_timeout_s):
            self.stop()
            raise ConfigError("kvtier.cluster.master_port", self.cfg.master_port,
                              f"mooncake_master did not listen on {self.cfg.master_address} within "
                              f"{self.startup_timeout_s:.0f} s (log: {self.log_path or 'stderr'})")
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
            if port_open(self.cfg.master_host, self.cfg.master_port):
                return True
            time.sleep(0.05)
        return False

    def _watch(self) -> None:
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
                except OSError as err:
                    log.error("kvtier cluster: cannot restart the Mooncake master: %s", err)
                    backoff = min(backoff * 2, RESTART_MAX_S)
                    continue
            if self._wait_up(self.startup_timeout_s):
                self.restarts += 1
                backoff = RESTART_FIRST_S
                log.info("kvtier cluster: Mooncake master restarted (pid %s); it starts empty", self.pid)
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
        if self._thread is not None:
            self._thread.join(timeout=5)
