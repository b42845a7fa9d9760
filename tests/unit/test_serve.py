"""``kvtier serve`` / ``kvtier stop``: recorded process ids, never names; failures reported with their logs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.tools.serve import STATE_FILE, Serve, find_configs, process_start_time, stop
from kvtier.tools.server import ServerError, free_port

_WAITER = ("import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
           "print('ready', flush=True)\ntime.sleep(300)\n")


def waiter() -> subprocess.Popen:
    """A process that exits 7 on SIGTERM, once its handler is in place."""
    p = subprocess.Popen([sys.executable, "-c", _WAITER], start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def record(folder: Path, procs: list[tuple[str, int, int | None]]) -> None:
    (folder / STATE_FILE).write_text(json.dumps(
        {"processes": [{"role": r, "pid": pid, "start": start} for r, pid, start in procs]}))


def test_stop_signals_the_recorded_supervisor(tmp_path: Path) -> None:
    sup = waiter()
    record(tmp_path, [("supervisor", sup.pid, process_start_time(sup.pid))])
    assert stop(str(tmp_path), timeout_s=20) == 0
    assert sup.wait(10) == 7  # it got SIGTERM, the clean stop


def test_an_exited_process_not_yet_reaped_counts_as_gone() -> None:
    # kvtier stop waits for the supervisor to be gone; one whose parent has
    # not reaped it yet (a zombie) has stopped.
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    start = process_start_time(p.pid)
    p.stdin.close()  # type: ignore[union-attr]  # now it exits
    try:
        while open(f"/proc/{p.pid}/stat").read().rpartition(")")[2].split()[0] != "Z":
            time.sleep(0.01)
        assert start is not None and process_start_time(p.pid) is None
    finally:
        p.wait()


def test_stop_leaves_a_reused_pid_alone(tmp_path: Path) -> None:
    other = waiter()
    try:
        # The pid was recorded for a process that started at another time:
        # whatever runs under that pid now is not ours.
        record(tmp_path, [("supervisor", other.pid, process_start_time(other.pid) - 1),
                          ("meta", other.pid, process_start_time(other.pid) - 1)])
        assert stop(str(tmp_path), timeout_s=2) == 0
        time.sleep(0.3)
        assert other.poll() is None
        assert not (tmp_path / STATE_FILE).exists()
    finally:
        other.kill()
        other.wait()


def test_stop_without_a_record_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert stop(str(tmp_path)) == 1
    assert str(tmp_path / STATE_FILE) in capsys.readouterr().err


def test_a_config_dir_without_its_files_is_named(tmp_path: Path) -> None:
    (tmp_path / "mmc-meta.conf").write_text("")
    with pytest.raises(ServerError, match="mmc-local.conf: no such file"):
        find_configs(str(tmp_path), tmp_path)


def test_an_instance_that_dies_is_reported_with_its_log_and_everything_stops(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    conf.mkdir()
    for name in ("mmc-meta.conf", "mmc-local.conf"):
        (conf / name).write_text(f"ock.mmc.meta_service_url = tcp://127.0.0.1:{PORT}\n"
                                 f"ock.mmc.meta_service.metrics_url = http://127.0.0.1:{METRICS}\n"
                                 "ock.mmc.local_service.dram.size = 4MB\nock.mmc.local_service.world_size = 1\n")
    lines: list[str] = []
    s = Serve(str(tmp_path / "no-such-model"), 1, tmp_path / "logs", str(conf), ["--max-model-len", "64"],
              out=lines.append)
    try:
        with pytest.raises(ServerError) as err:
            s.start()
        assert "vLLM instance 0 exited with" in str(err.value) and "vllm-0.log" in str(err.value)
        assert "no-such-model" in str(err.value)  # the log's last lines say why
        recorded = json.loads((tmp_path / "logs" / STATE_FILE).read_text())
        assert [p["role"] for p in recorded["processes"]] == ["supervisor", "meta", "vllm-0"]
        assert lines[0].startswith("meta service  tcp://127.0.0.1:")
        meta_pid = s.meta.proc.pid  # type: ignore[union-attr]
    finally:
        s.stop()
    assert process_start_time(meta_pid) is None
    assert not (tmp_path / "logs" / STATE_FILE).exists()
    assert (tmp_path / "logs" / "meta.log").exists() and (tmp_path / "logs" / "vllm-0.log").exists()


PORT, METRICS = free_port(), free_port()


def test_worker_node_of_the_cluster_runs_the_local_role(tmp_path: Path) -> None:
    from kvtier.tools.serve import meta_role_args

    local = tmp_path / "mmc-local.conf"
    local.write_text("ock.mmc.meta_service_url = tcp://10.0.0.1:5000\n")
    assert meta_role_args(local) == []
    local.write_text("ock.mmc.meta_service_url = tcp://10.0.0.1:5000\nkvtier.node_service_url = tcp://127.0.0.1:5010\n"
                     "kvtier.cluster.enabled = true\n")
    assert meta_role_args(local) == ["--role", "local"]
