"""``kvtier serve`` with two real vLLM instances on one meta service, then
``kvtier stop``: a prefix from instance 0 is a pool hit on instance 1, and
the stop leaves no process, no arena and no vLLM segment behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from kvtier.hostmem import NT_THRESHOLD, streaming_threshold
from kvtier.tools.serve import STATE_FILE, host_cpus, id_ranges, parse_ids, physical_cores, process_start_time
from kvtier.tools.server import parse_metrics, poll_until, session_pids, vllm_shm_files
from tests.e2e.conftest import BLOCK, CHUNK, DEVICE_BLOCKS, assert_loads_succeeded, complete, delta, tokens

pytestmark = pytest.mark.e2e

EXT_HITS = "vllm:external_prefix_cache_hits_total"


def read_until(proc: subprocess.Popen, marker: str, lines: list[str], timeout_s: float) -> threading.Thread:
    """Collect ``proc``'s output lines into ``lines`` (until its end, on a
    thread, returned); wait until one starts with ``marker``."""
    done = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith(marker):
                done.set()
        done.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    if not done.wait(timeout_s) or not any(x.startswith(marker) for x in lines):
        raise AssertionError(f"kvtier serve did not print {marker!r}:\n" + "\n".join(lines[-40:]))
    return reader


def test_serve_two_instances_one_pool_then_stop_leaves_nothing(tiny_model: str, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    kvtier = str(Path(sys.executable).parent / "kvtier")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMC_")}  # loopback defaults
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_LOG_STATS_INTERVAL="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    vllm_args = ["--served-model-name", "model", "--dtype", "float32", "--block-size", str(BLOCK),
                 "--num-gpu-blocks-override", str(DEVICE_BLOCKS), "--max-model-len", str((DEVICE_BLOCKS - 1) * BLOCK),
                 "--max-num-batched-tokens", str(CHUNK), "--enforce-eager", "--seed", "0"]
    proc = subprocess.Popen([kvtier, "serve", "--model", tiny_model, "--instances", "2", "--log-dir", str(logs),
                             "--", *vllm_args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    out: list[str] = []
    try:
        reader = read_until(proc, "serving;", out, timeout_s=600)
        urls = [m.group(1) for x in out if (m := re.match(r"instance \d+\s+(http://\S+)/v1", x))]
        metrics_url = re.search(r"metrics (http://\S+)/metrics", out[0]).group(1)
        assert len(urls) == 2
        a, b = (SimpleNamespace(url=u) for u in urls)
        recorded = json.loads((logs / STATE_FILE).read_text())["processes"]
        instances = [p["pid"] for p in recorded if p["role"].startswith("vllm-")]
        segments = vllm_shm_files([pid for leader in instances for pid in session_pids(leader)])
        for pid in instances:  # each instance's block copies stream past the caches (hostmem)
            environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0")
                           if "=" in item)
            assert streaming_threshold(environ) == NT_THRESHOLD
        assert "kvtier: copies of " in (logs / "vllm-0.log").read_text()  # the worker's line on them
        # On the CPU build, each instance on cores of its own: every process
        # of its session inside its mask (a worker's main thread narrower:
        # OpenMP binds it), its OpenMP team bound inside it by kvtier's list.
        cores = [os.sched_getaffinity(pid) for pid in instances]
        if len(physical_cores(host_cpus())) >= 2:
            assert not cores[0] & cores[1], cores
            for i, pid in enumerate(instances):
                assert all(os.sched_getaffinity(p) <= cores[i] for p in session_pids(pid))
                assert f"cores {id_ranges(list(cores[i]))}" in next(x for x in out if x.startswith(f"instance {i}"))
                environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0")
                               if "=" in item)
                omp = environ["VLLM_CPU_OMP_THREADS_BIND"]
                assert set(parse_ids(omp.replace("|", ","))) <= cores[i]
                log = (logs / f"vllm-{i}.log").read_text()
                assert f"VLLM_CPU_OMP_THREADS_BIND={omp!r}, auto_setup=False" in log  # vLLM took it
        assert segments  # each instance's message queues
        arena = re.search(r"DRAM pool (\S+),", (logs / "meta.log").read_text()).group(1)
        assert os.path.exists(arena)

        prompt = tokens(5, 18 * BLOCK + 3)
        first = complete(a, prompt)
        # A's word that its saves are written goes without waiting for an
        # answer, on A's connection: B asks once the service has settled them.
        assert poll_until(lambda: httpx.get(metrics_url + "/health", timeout=10).json()["slots"]
                          ["unsettled_entries"] == 0, 60)
        before = parse_metrics(httpx.get(b.url + "/metrics", timeout=10).text)
        on_b = complete(b, prompt)
        after = parse_metrics(httpx.get(b.url + "/metrics", timeout=10).text)
        assert delta(after, before, EXT_HITS) == 18 * BLOCK
        assert_loads_succeeded(before, after, 18 * BLOCK)
        assert on_b["text"] == first["text"]
        assert "kvtier_pool_clients" in httpx.get(metrics_url + "/metrics", timeout=10).text

        stopped = subprocess.run([kvtier, "stop", "--log-dir", str(logs)], capture_output=True, text=True,
                                 timeout=300)
        assert stopped.returncode == 0, stopped.stderr
        assert proc.wait(120) == 0
        reader.join(10)
    finally:
        if proc.poll() is None:  # a failure above: leave nothing running
            subprocess.run([kvtier, "stop", "--log-dir", str(logs)], capture_output=True, timeout=300)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert out[-1] == "stopped"
    for p in recorded:
        assert process_start_time(p["pid"]) != p["start"], p  # every recorded process is gone
    assert not (logs / STATE_FILE).exists()
    assert not os.path.exists(arena)  # the meta service removed its arena
    assert sorted(p for p in segments if os.path.exists(p)) == []  # and vLLM's queues are gone
