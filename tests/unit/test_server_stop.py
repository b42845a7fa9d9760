"""Stopping a server's session: the leader first, SIGKILL for what lingers,
and vLLM's shared-memory files the session left behind removed, nothing else."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvtier.tools.serve import STATE_FILE, process_start_time, stop
from kvtier.tools.meta import MetaProcess
from kvtier.tools.server import (ServerError, VllmServer, exit_status, poll_until, session_pids, stop_group,
                                 vllm_shm_files, wait_exit)

# A stand-in for vLLM's process tree: the leader and a child in its session
# each create and map files in /dev/shm, as vLLM's queues and CPU ranks do,
# and never remove them. The child ignores SIGINT and SIGTERM (it lingers);
# the leader exits on either.
_TREE = r"""
import mmap, os, signal, subprocess, sys, time
def mapped(name):
    fd = os.open("/dev/shm/" + name, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    return mmap.mmap(fd, 4096)
if sys.argv[1] == "child":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    m = [mapped(n) for n in sys.argv[2:]]
    print("ready", flush=True)
    time.sleep(300)
leader_files, child_files = sys.argv[2].split(","), sys.argv[3].split(",")
m = [mapped(n) for n in leader_files]
child = subprocess.Popen([sys.executable, "-c", sys.argv[4], "child", *child_files],
                         stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
for s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(s, lambda *a: os._exit(3))
print("ready", flush=True)
time.sleep(300)
"""


def names() -> dict[str, str]:
    tag = secrets.token_hex(4)
    return {"queue": f"psm_{tag}", "rank0": f"vllm_dist_{tag}-tp:0-[0-1]-cpushm_0",
            "rank1": f"vllm_dist_{tag}-tp:0-[0-1]-cpushm_1", "other": f"kvtier-test-{tag}"}


def start_tree(n: dict[str, str]) -> subprocess.Popen:
    leader = ",".join([n["queue"], n["other"]])
    child = ",".join([n["rank0"], n["rank1"]])
    p = subprocess.Popen([sys.executable, "-c", _TREE, "leader", leader, child, _TREE],
                         start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


@pytest.fixture
def shm_names():
    n = names()
    yield n
    for name in n.values():
        Path("/dev/shm", name).unlink(missing_ok=True)


def test_stop_ends_the_session_and_removes_only_vllms_files_it_mapped(shm_names: dict[str, str]) -> None:
    unrelated = Path("/dev/shm", f"psm_{secrets.token_hex(4)}")  # vLLM's pattern, not this session's
    unrelated.write_bytes(b"x")
    try:
        p = start_tree(shm_names)
        assert len(session_pids(p.pid)) == 2
        assert vllm_shm_files(session_pids(p.pid)) == {
            f"/dev/shm/{shm_names[k]}" for k in ("queue", "rank0", "rank1")}
        assert stop_group(p, signal.SIGINT, timeout_s=20, grace_s=0.5) == 3  # the leader's own exit
        assert session_pids(p.pid) == []  # the lingering child got SIGKILL
        assert [k for k, name in shm_names.items() if Path("/dev/shm", name).exists()] == ["other"]
        assert unrelated.exists()
    finally:
        unrelated.unlink(missing_ok=True)


def test_files_recorded_before_a_kill_are_removed_at_stop(shm_names: dict[str, str]) -> None:
    p = start_tree(shm_names)
    recorded = vllm_shm_files(session_pids(p.pid))
    os.killpg(p.pid, signal.SIGKILL)  # as a test's kill -9 of the whole server
    p.wait()
    assert stop_group(p, signal.SIGINT, files=recorded) == -signal.SIGKILL
    assert [k for k, name in shm_names.items() if Path("/dev/shm", name).exists()] == ["other"]


def test_kvtier_stop_without_a_supervisor_cleans_up_the_same_way(tmp_path: Path, shm_names: dict[str, str]) -> None:
    p = start_tree(shm_names)
    (tmp_path / STATE_FILE).write_text(
        '{"processes": [{"role": "vllm-0", "pid": %d, "start": %d}]}' % (p.pid, process_start_time(p.pid)))
    # The child ignores SIGTERM: stop waits all of timeout_s, then kills the session.
    assert stop(str(tmp_path), timeout_s=3) == 0
    assert p.wait(10) == 3  # SIGTERM reached the leader
    assert session_pids(p.pid) == []
    assert [k for k, name in shm_names.items() if Path("/dev/shm", name).exists()] == ["other"]


def test_a_dead_leader_is_not_reaped_before_its_session_is_stopped() -> None:
    """While a watcher only looks (exit_status, wait_exit), the dead leader
    stays a zombie: its pid, its session's id, cannot go to another
    program's session leader before stop_group has looked that session up."""
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(4)"], start_new_session=True)
    assert wait_exit(p, 30) == 4
    assert exit_status(p) == 4 and p.returncode is None
    assert Path(f"/proc/{p.pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    assert stop_group(p, signal.SIGINT, timeout_s=5, grace_s=0.5) == 4
    assert p.returncode == 4  # reaped now, its session looked up first


class _StandIn:
    """Server options whose command is a stand-in for vLLM: ``code`` run by Python."""

    def __init__(self, code: str) -> None:
        self.code, self.env = code, {}

    def argv(self, port: int) -> list[str]:
        return [sys.executable, "-c", self.code]


def _interrupt_once_started(get_proc, caught: threading.Event) -> threading.Thread:
    """Ctrl-C to this process once ``get_proc()`` names a started child,
    again every 5 s until ``caught`` is set (the start has ended, however):
    a KeyboardInterrupt raised while the main thread runs a weakref
    callback (the garbage collector's) is printed as unraisable and lost,
    and the start would wait out its timeout (seen once in CI). 5 s: far
    longer than the start takes to stop its stand-in after the first."""
    def run() -> None:
        assert poll_until(lambda: get_proc() is not None, 60, 0.01)
        while not caught.is_set():
            os.kill(os.getpid(), signal.SIGINT)
            caught.wait(5.0)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("what", ["vllm", "meta"])
def test_ctrl_c_while_a_server_starts_stops_it(tmp_path: Path, what: str) -> None:
    """The server runs in a session of its own, so the terminal's Ctrl-C
    reaches only the caller, as KeyboardInterrupt inside the wait for it
    to serve: the server is stopped and reaped, not left running."""
    never_ready = "import time; print('up', flush=True); time.sleep(300)"
    if what == "vllm":
        srv = VllmServer(_StandIn(never_ready), log_path=tmp_path / "vllm.log", port=1, startup_timeout_s=120)
    else:
        srv = MetaProcess(tmp_path / "none.conf", log_path=tmp_path / "meta.log", startup_timeout_s=120,
                          prefix=[sys.executable, "-c", never_ready])
    caught = threading.Event()
    t = _interrupt_once_started(lambda: srv.proc, caught)
    interrupted = False
    try:
        srv.start()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        caught.set()  # no more Ctrl-C, whatever happened
    t.join()
    assert interrupted
    assert srv.proc is not None and srv.proc.returncode is not None  # stopped, and reaped
    assert session_pids(srv.proc.pid) == []


@pytest.mark.parametrize("what", ["vllm", "meta"])
def test_a_server_that_exits_during_start_up_is_reaped(tmp_path: Path, what: str) -> None:
    exits = "import sys; sys.exit(3)"
    if what == "vllm":
        srv = VllmServer(_StandIn(exits), log_path=tmp_path / "vllm.log", port=1)
    else:
        srv = MetaProcess(tmp_path / "none.conf", log_path=tmp_path / "meta.log", prefix=[sys.executable, "-c", exits])
    with pytest.raises(ServerError, match="exited with 3 during start-up"):
        srv.start()
    assert srv.proc is not None and srv.proc.returncode == 3
