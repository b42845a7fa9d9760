"""Start and stop a vLLM OpenAI-compatible server (CPU build or CUDA) with or without kvtier.

Runs in tests, the demo and benchmarks. :class:`VllmServer` is a context
manager: it starts ``python -m vllm.entrypoints.openai.api_server`` as a
child process in its own process group on 127.0.0.1, waits for /health,
and on exit stops it (SIGINT to the API server, SIGKILL to what is left of
its session, then vLLM's leftover shared memory: :func:`stop_group`). The server's
output goes to a log file, readable with :meth:`VllmServer.log_text`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvtier.errors import KvtierError
from kvtier.hostmem import streaming_copy_env


def poll_until(cond: Callable[[], object], timeout_s: float, interval_s: float = 0.1) -> bool:
    """Check ``cond()`` every ``interval_s`` until it holds (True) or
    ``timeout_s`` has passed (False): a wait for another process."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvtier_transfer_config(**extra: object) -> str:
    return json.dumps({
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"backend": "embedded", **extra},
    })


@dataclass
class ServerOptions:
    model: str
    kvtier: dict | None = None  # kv_connector_extra_config; None runs vLLM alone
    block_size: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int = 16384
    num_gpu_blocks: int | None = None  # --num-gpu-blocks-override: a small device cache
    dtype: str = "bfloat16"
    memory_fraction: float = 0.3
    max_num_seqs: int = 16
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def model_len(self) -> int:
        """vLLM refuses a max length its device cache cannot hold once."""
        if self.num_gpu_blocks:
            return min(self.max_model_len, (self.num_gpu_blocks - 1) * self.block_size)  # one null block
        return self.max_model_len

    def argv(self, port: int) -> list[str]:
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--served-model-name", "model",
            "--host", "127.0.0.1", "--port", str(port),
            "--dtype", self.dtype, "--block-size", str(self.block_size),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--max-model-len", str(self.model_len()),
            "--max-num-seqs", str(self.max_num_seqs),
            "--gpu-memory-utilization", str(self.memory_fraction),
            "--enforce-eager", "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--seed", "0",
        ]
        if self.num_gpu_blocks:
            args += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        if self.kvtier is not None:
            args += ["--kv-transfer-config", kvtier_transfer_config(**self.kvtier)]
        return args + self.extra_args


class ServerError(KvtierError, RuntimeError):
    """A server (vLLM, the meta service) that did not start or stop as it
    should: one line for the operator, with its log's last lines."""


# vLLM's own segments in /dev/shm: its message queues (``psm_*``, Python's
# shared_memory) and, with tensor parallelism on CPU, the ranks'
# ``vllm_dist_*-cpushm_N``, which vLLM creates at start-up and never
# removes. (Its named semaphores, ``sem.mp-*``, are mapped by no process;
# vLLM removes them itself when its API server is stopped alone.)
VLLM_SHM_NAME = re.compile(r"(psm_[0-9a-f]+|vllm_dist_[\w.:\[\]-]+-cpushm_\d+)")


def session_pids(sid: int) -> list[int]:
    """The live processes of session ``sid`` (zombies left out)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields: state, ppid, pgrp, session
            out.append(int(entry))
    return out


def vllm_shm_files(pids: list[int]) -> set[str]:
    """vLLM's files in /dev/shm that processes ``pids`` map (names as :data:`VLLM_SHM_NAME`)."""
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)  # address perms offset dev inode [path]
                    path = parts[5].strip() if len(parts) == 6 else ""
                    if path.startswith("/dev/shm/") and VLLM_SHM_NAME.fullmatch(path[9:]):
                        found.add(path)
        except OSError:
            continue
    return found


def exit_status(proc: subprocess.Popen) -> int | None:
    """``proc``'s exit status once it has exited (as Popen gives it), else
    None, without reaping it: until :func:`stop_group` reaps it, its pid,
    which is also its session's id, cannot be given to another process, so
    the session's members are found by that id and no stranger's are.
    ``Popen.poll()`` would reap it, and a pid reused after that (by a new
    session leader) would make another program's processes look like ours."""
    if proc.returncode is not None:
        return proc.returncode
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped by someone else (a wait() of the caller's)
        return proc.poll()
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def wait_exit(proc: subprocess.Popen, timeout_s: float) -> int | None:
    """:func:`exit_status` once ``proc`` exits within ``timeout_s``, else None; never reaps."""
    deadline = time.monotonic() + timeout_s
    while (rc := exit_status(proc)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return rc


def stop_group(proc: subprocess.Popen, first: signal.Signals = signal.SIGINT, timeout_s: float = 30.0,
               grace_s: float = 10.0, files: set[str] | None = None) -> int:
    """Stop the session ``proc`` leads; returns ``proc``'s exit status.

    ``first`` goes to ``proc`` alone: vLLM's API server then stops its
    engine and workers in order and they remove their shared memory (the
    same signal sent to every process at once left /dev/shm/psm_* and
    sem.mp-* behind). What is left of the session ``grace_s`` after
    ``proc`` exited (or ``timeout_s`` after the signal) gets SIGKILL. Then
    vLLM's segments in /dev/shm (:data:`VLLM_SHM_NAME`) that the session
    mapped, now or in ``files`` (recorded earlier, for a session killed
    since), and that are still there are removed: nothing else has them,
    and with tensor parallelism on CPU vLLM leaves its ranks' segments
    (2 x 4 MiB) behind on every stop.

    ``proc`` is reaped last, once its session is empty (:func:`exit_status`).
    One reaped before (by the caller) may have its pid in use by another
    program's session already: only ``files`` are removed then.
    """
    if proc.returncode is not None:
        remove_files(set(files or ()))
        return proc.returncode
    files = set(files or ()) | vllm_shm_files(session_pids(proc.pid))
    if exit_status(proc) is None:
        try:
            os.kill(proc.pid, first)
        except ProcessLookupError:
            pass
        wait_exit(proc, timeout_s)
    if exit_status(proc) is not None:
        poll_until(lambda: not session_pids(proc.pid), grace_s)
    signal_pids(session_pids(proc.pid), signal.SIGKILL)
    poll_until(lambda: not session_pids(proc.pid), 5.0)
    rc = proc.wait()
    remove_files(files)
    return rc


def signal_pids(pids: list[int], sig: signal.Signals) -> None:
    """``sig`` to each of ``pids``; one that is gone already is skipped."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def remove_files(paths: set[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def temp_log(prefix: str) -> Path:
    """A new empty log file in the temporary folder (its descriptor closed)."""
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".log")
    os.close(fd)
    return Path(path)


def log_tail(path: str | Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file ("(no log)" if it cannot be read)."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class VllmServer:
    def __init__(self, options: ServerOptions, log_path: str | Path | None = None, port: int | None = None,
                 startup_timeout_s: float = 300.0) -> None:
        self.options = options
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path) if log_path else temp_log("vllm-")
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.shm_files: set[str] = set()  # vLLM's segments its processes mapped (for stop)

    def environment(self) -> dict[str, str]:
        """The instance's environment: this process's, vLLM's settings for
        a small host where unset, then ``options.env``."""
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        env.setdefault("VLLM_SERVER_DEV_MODE", "1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        env.update(self.options.env)
        # Every instance, with kvtier or without (the peers it is measured
        # against), with block copies that stream past the caches
        # (hostmem.streaming_copy_env); a threshold already set is kept.
        env.update(streaming_copy_env(env))
        return env

    def start(self) -> VllmServer:
        env = self.environment()
        self._log = open(self.log_path, "w")
        try:
            self.proc = subprocess.Popen(self.options.argv(self.port), stdout=self._log, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
            self._wait_ready()
            self.shm_files = vllm_shm_files(session_pids(self.proc.pid))  # for a stop after a kill -9
        except BaseException:
            # Ctrl-C during the wait (vLLM's session does not get the
            # terminal's SIGINT), or a start that failed: nothing is left
            # running, and an exited server is reaped.
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if (rc := exit_status(self.proc)) is not None:
                raise ServerError(f"vLLM exited with {rc} during start-up; "
                                  f"log {self.log_path}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise ServerError(f"vLLM not ready after {self.startup_timeout_s}s; log {self.log_path}:\n{self.log_tail()}")

    def wait_exit(self, timeout_s: float) -> int | None:
        """The API server's exit status once it exits, not reaped (:meth:`stop` does)."""
        return wait_exit(self.proc, timeout_s)

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, signal.SIGINT, files=self.shm_files)
        if hasattr(self, "_log"):
            self._log.close()

    def kill(self) -> None:
        """SIGKILL to every process of the server at once (a crash), after
        noting vLLM's shared memory for :meth:`stop` to remove."""
        pids = self.pids()
        self.shm_files |= vllm_shm_files(pids)
        signal_pids(pids, signal.SIGKILL)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- helpers for clients ---------------------------------------------

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=10).text)

    def reset_prefix_cache(self, external: bool = False) -> None:
        """Empty vLLM's device prefix cache (and kvtier's pool with ``external``)."""
        params = {"reset_external": "true"} if external else {}
        httpx.post(self.url + "/reset_prefix_cache", params=params, timeout=30).raise_for_status()

    def pids(self) -> list[int]:
        """The server's processes (it runs in a session of its own)."""
        return session_pids(self.proc.pid)

    def pss_bytes(self) -> int:
        """Proportional set size of all the server's processes: shared pages counted once."""
        total = 0
        for pid in self.pids():
            try:
                with open(f"/proc/{pid}/smaps_rollup") as f:
                    for line in f:
                        if line.startswith("Pss:"):
                            total += int(line.split()[1]) * 1024
            except OSError:
                pass
        return total


_METRIC_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text to ``{"name{labels}": value}``; labels kept as printed, minus engine/model ones."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _METRIC_RE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        kept = [p for p in re.findall(r'(\w+="[^"]*")', labels)
                if not p.startswith(("engine=", "model_name="))]
        key = name + ("{" + ",".join(kept) + "}" if kept else "")
        out[key] = out.get(key, 0.0) + value
    return out
