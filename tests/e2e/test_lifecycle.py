"""Every clean stop removes the arena; cleanup never removes a live one (issue 7, item 11).

``docker stop`` sends SIGTERM to the container's first process, the API
server, and to nothing else: that is the stop tested here. And at start-up
the stale-arena cleanup must keep an arena whose owner lives in another
container (its pid invisible here) but holds the arena's lock, while it
removes one that nobody holds.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvtier.tools.server import VllmServer
from tests.e2e.conftest import BLOCK, complete, server_options, tokens

pytestmark = pytest.mark.e2e

_HOLDER = textwrap.dedent("""
    import fcntl, os, sys
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("locked", flush=True)
    sys.stdin.read()
""")


def _unused_pid() -> int:
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read()) + 1


def _arena_of(srv: VllmServer) -> str:
    m = re.search(r"kvtier: DRAM tier (\S+?),", srv.log_text())
    assert m is not None, srv.log_tail()
    return m.group(1)


def _wait_gone(srv: VllmServer, timeout_s: float) -> list[int]:
    """Wait until no process of the server's session is left; return those still there."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = srv.pids()
        if not left:
            return []
        time.sleep(0.5)
    return srv.pids()


def test_sigterm_to_the_api_server_removes_the_arena_and_cleanup_spares_live_ones(tiny_model, tmp_path):
    # A shm_dir of this test's own: a server that other tests start at the
    # same time must not be the one that cleans up the dead arena here.
    shm = tmp_path / "shm"
    shm.mkdir()
    pid = _unused_pid()
    live = os.path.join(shm, f"kvtier-dram-{pid}-other-container")
    dead = os.path.join(shm, f"kvtier-dram-{pid}-killed-engine")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, live], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    srv = VllmServer(server_options(tiny_model, {"dram_size": "64MB", "shm_dir": str(shm)}),
                     log_path=tmp_path / "vllm.log")
    try:
        assert holder.stdout.readline().strip() == "locked"
        open(dead, "wb").close()
        srv.start()
        # Start-up cleanup: the unheld arena went, the held one of an invisible pid stayed.
        assert not os.path.exists(dead)
        assert os.path.exists(live)
        assert "kvtier: removed 1 arenas left by dead processes" in srv.log_text()

        arena = _arena_of(srv)
        assert os.path.exists(arena)
        complete(srv, tokens(1, 4 * BLOCK), max_tokens=2)  # a served request: workers attached the arena

        os.kill(srv.proc.pid, signal.SIGTERM)  # the API server only, as docker stop does
        assert srv.wait_exit(120) is not None, srv.log_tail()
        assert _wait_gone(srv, 60) == [], srv.log_tail()
        assert not os.path.exists(arena), srv.log_tail()
    finally:
        srv.stop()
        holder.stdin.close()
        holder.wait(30)
        for path in (live, dead):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def test_with_prefix_caching_off_kvtier_stays_inert(tiny_model, tmp_path):
    shm = tmp_path / "shm"  # its own, so that other servers' arenas do not count
    shm.mkdir()
    opts = server_options(tiny_model, {"dram_size": "64MB", "shm_dir": str(shm)},
                          extra_args=["--no-enable-prefix-caching"])
    with VllmServer(opts, log_path=tmp_path / "vllm.log") as srv:
        prompt = tokens(2, 6 * BLOCK)
        first = complete(srv, prompt, max_tokens=4)
        again = complete(srv, prompt, max_tokens=4)
        text = srv.log_text()
        metrics = srv.metrics()
        made = set(os.listdir(shm))
    assert again["text"] == first["text"]
    assert text.count("kvtier: off for this run: vLLM runs with prefix caching off") == 1
    assert "kvtier: DRAM tier" not in text
    assert made == set()  # no arena
    assert metrics.get("vllm:external_prefix_cache_hits_total", 0.0) == 0.0
    assert metrics.get("kvtier_blocks_saved_total", 0.0) == 0.0
