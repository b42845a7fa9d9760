"""Start and stop a vLLM OpenAI-compatible server (CPU build or CUDA) with or without kvtier.

Runs in tests, the demo and benchmarks. :class:`VllmServer` is a context
manager: it starts ``python -m vllm.entrypoints.openai.api_server`` as a
child process in its own process group on 127.0.0.1, waits for /health,
and on exit stops the whole group (SIGINT, then SIGKILL). The server's
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


class ServerError(RuntimeError):
    pass


def stop_group(proc: subprocess.Popen, first: signal.Signals = signal.SIGINT, timeout_s: float = 30.0) -> int:
    """Stop the process group ``proc`` leads: ``first``, then SIGKILL after
    ``timeout_s``; returns its exit status."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, first)
            proc.wait(timeout_s)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return proc.wait()


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
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None

    def start(self) -> VllmServer:
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
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.options.argv(self.port), stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"vLLM exited with {self.proc.returncode} during start-up; "
                                  f"log {self.log_path}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerError(f"vLLM not ready after {self.startup_timeout_s}s; log {self.log_path}:\n{self.log_tail()}")

    def wait_exit(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        if self.proc is None:
            return
        stop_group(self.proc, signal.SIGINT)
        self._log.close()

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
        sid = self.proc.pid
        out = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.getsid(int(entry)) == sid:
                        out.append(int(entry))
                except OSError:
                    pass
        return out

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
