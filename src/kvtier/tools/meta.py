"""Start and stop a meta service process (``python -m kvtier.meta``).

Runs in ``kvtier serve``, the demo, tests and benchmarks. :class:`MetaProcess`
writes nothing but a log: the caller hands it the two config files, it
starts the service in a process group of its own, waits until it serves
(its ready file names the socket and metrics URLs), and stops it with
SIGTERM (then SIGKILL) on exit. :meth:`MetaProcess.kill` is ``kill -9``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from kvtier.tools.server import ServerError, exit_status, log_tail, stop_group, temp_log, wait_exit


class MetaProcess:
    def __init__(self, meta_config: str | Path, local_config: str | Path | None = None,
                 log_path: str | Path | None = None, startup_timeout_s: float = 60.0,
                 env: dict[str, str] | None = None, args: list[str] | None = None,
                 prefix: list[str] | None = None) -> None:
        self.meta_config = str(meta_config)
        self.local_config = str(local_config or meta_config)
        self.log_path = Path(log_path) if log_path else temp_log("kvtier-meta-")
        self.startup_timeout_s = startup_timeout_s
        self.env = env or {}
        self.args = list(args or [])  # more arguments of ``kvtier meta`` (``--role local``)
        self.prefix = list(prefix or [])  # what the command runs under (``ip netns exec NODE``)
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.metrics_url = ""

    def env_for_clients(self) -> dict[str, str]:
        """What a vLLM instance needs to find this service (as the seeds export it)."""
        return {"MMC_META_CONFIG_PATH": self.meta_config, "MMC_LOCAL_CONFIG_PATH": self.local_config}

    def start(self, stop: threading.Event | None = None) -> MetaProcess:
        """Start it and wait until it serves; ``stop`` (set by a signal
        handler, Ctrl-C) ends the wait: the process is stopped and
        ServerError says so."""
        ready = Path(tempfile.mkdtemp(prefix="kvtier-meta-")) / "ready"
        env = dict(os.environ)
        env.update(self.env_for_clients())
        env.update(self.env)
        try:
            self._log = open(self.log_path, "a")
            self.proc = subprocess.Popen([*self.prefix, sys.executable, "-m", "kvtier.meta", "--ready-file",
                                          str(ready), *self.args],
                                         stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            deadline = time.monotonic() + self.startup_timeout_s
            while time.monotonic() < deadline:
                if stop is not None and stop.is_set():
                    raise ServerError("interrupted while the meta service started")
                if (rc := exit_status(self.proc)) is not None:
                    raise ServerError(f"kvtier meta exited with {rc} during start-up; "
                                      f"log {self.log_path}:\n{self.log_tail()}")
                if ready.exists() and len(ready.read_text().splitlines()) == 2:
                    self.address, self.metrics_url = ready.read_text().splitlines()
                    return self
                time.sleep(0.1)
            raise ServerError(f"kvtier meta not ready after {self.startup_timeout_s}s; log {self.log_path}")
        except BaseException:
            self.stop()  # Ctrl-C without a ``stop`` event, or a failed start: nothing left running, it is reaped
            raise
        finally:  # the ready file's folder goes, whatever the start came to
            shutil.rmtree(ready.parent, ignore_errors=True)

    def health(self) -> dict:
        return httpx.get(self.metrics_url + "/health", timeout=5).json()

    def kill(self) -> None:
        """``kill -9``: no cleanup runs; the arena stays for the next start to remove."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        wait_exit(self.proc, 30.0)  # not reaped: stop() still finds its session by its id

    def stop(self) -> int | None:
        """Stop the service's session (again: its status, nothing signalled)."""
        if self.proc is None:
            if hasattr(self, "_log"):
                self._log.close()
            return None
        if self.proc.returncode is not None:
            return self.proc.returncode
        rc = stop_group(self.proc, signal.SIGTERM)
        self._log.close()
        return rc

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)

    def __enter__(self) -> MetaProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
