"""``kvtier serve`` / ``kvtier stop``: recorded process ids, never names; failures reported with their logs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.tools.serve import (
    STATE_FILE,
    Cpu,
    Serve,
    cuda_build,
    devices_per_instance,
    find_configs,
    host_cpus,
    id_ranges,
    parse_ids,
    physical_cores,
    process_start_time,
    reserved_cores,
    split_cores,
    split_devices,
    stop,
    visible_devices,
)
from kvtier.tools.server import ServerError, free_port

_WAITER = ("import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
           "print('ready', flush=True)\ntime.sleep(300)\n")


def waiter() -> subprocess.Popen:
    """A process that exits 7 on SIGTERM, once its handler is in place."""
    p = subprocess.Popen([sys.executable, "-c", _WAITER], start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def refused(s: Serve, match: str) -> None:
    """``s.start()`` raises ServerError matching ``match``; ``s`` is then stopped, as serve() does."""
    try:
        with pytest.raises(ServerError, match=match):
            s.start()
    finally:
        s.stop()


def record(folder: Path, procs: list[tuple[str, int, int | None]]) -> None:
    (folder / STATE_FILE).write_text(json.dumps(
        {"processes": [{"role": r, "pid": pid, "start": start} for r, pid, start in procs]}))


def test_stop_signals_the_recorded_supervisor(tmp_path: Path) -> None:
    sup = waiter()
    record(tmp_path, [("supervisor", sup.pid, process_start_time(sup.pid))])
    assert stop(str(tmp_path), timeout_s=20) == 0
    assert sup.wait(10) == 7  # it got SIGTERM, the clean stop


def test_a_supervisor_that_does_not_stop_is_killed_after_its_children_are_stopped(tmp_path: Path) -> None:
    hung = subprocess.Popen([sys.executable, "-c", _WAITER.replace("sys.exit(7)", "None")], start_new_session=True,
                            stdout=subprocess.PIPE, text=True)  # takes SIGTERM and goes on
    assert hung.stdout is not None and hung.stdout.readline().strip() == "ready"
    child = waiter()
    record(tmp_path, [("supervisor", hung.pid, process_start_time(hung.pid)),
                      ("meta", child.pid, process_start_time(child.pid))])
    assert stop(str(tmp_path), timeout_s=1) == 0
    assert child.wait(10) == 7  # stopped in order
    assert hung.wait(10) == -9
    assert not (tmp_path / STATE_FILE).exists()


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
    port, metrics = free_port(), free_port()  # picked here: the service binds them in a moment
    for name in ("mmc-meta.conf", "mmc-local.conf"):
        (conf / name).write_text(f"ock.mmc.meta_service_url = tcp://127.0.0.1:{port}\n"
                                 f"ock.mmc.meta_service.metrics_url = http://127.0.0.1:{metrics}\n"
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


def test_worker_node_of_the_cluster_runs_the_local_role(tmp_path: Path) -> None:
    from kvtier.tools.serve import meta_role_args

    local = tmp_path / "mmc-local.conf"
    local.write_text("ock.mmc.meta_service_url = tcp://10.0.0.1:5000\n")
    assert meta_role_args(local) == []
    local.write_text("ock.mmc.meta_service_url = tcp://10.0.0.1:5000\nkvtier.node_service_url = tcp://127.0.0.1:5010\n"
                     "kvtier.cluster.enabled = true\n")
    assert meta_role_args(local) == ["--role", "local"]


@pytest.mark.parametrize("arg", ["--port", "--port=9000", "--host", "--model", "--kv-transfer-config",
                                 "--kv-transfer-config.kv_connector", "--kv_transfer_config", "--kv-transfer",
                                 "--kv-tr", "--mod"])
def test_vllm_arguments_that_replace_serves_own_are_refused(arg: str) -> None:
    """vLLM takes the last of a flag given twice (it only logs it): the
    instance would listen where serve does not look, or lose the connector."""
    from kvtier.tools.serve import check_vllm_args

    with pytest.raises(ServerError, match=f"vLLM argument '{arg}': "):
        check_vllm_args(["--max-model-len", "64", arg, "x"])
    check_vllm_args(["--max-model-len", "64", "--portable", "--hostname-x"])  # other flags pass


@pytest.mark.parametrize("argv", [
    ["--model", "M", "--instances", "2", "--max-model-len", "512", "--enforce-eager"],
    ["--model", "M", "--max-model-len", "512", "--instances", "2", "--enforce-eager"],
    ["--max-model-len", "512", "--model", "M", "--instances", "2", "--", "--enforce-eager"],
    ["--model", "M", "--instances", "2", "--", "--max-model-len", "512", "--enforce-eager"],
], ids=["after", "between", "before-and-after-dashes", "after-dashes"])
def test_serve_passes_what_it_does_not_know_to_vllm_in_order(argv: list[str]) -> None:
    # The form: kvtier serve --model M --instances 2 [vLLM args...],
    # with or without the "--".
    from kvtier.cli import parse

    args = parse(["serve", *argv])
    assert (args.model, args.instances) == ("M", 2)
    assert args.vllm_args == ["--max-model-len", "512", "--enforce-eager"]


@pytest.mark.parametrize(("argv", "says"), [
    (["--model", "M", "--instance", "2"], "'--instance': did you mean --instances?"),
    (["--model", "M", "--log_dir", "logs"], "'--log_dir': did you mean --log-dir?"),
])
def test_a_near_miss_of_serves_own_flags_is_a_typo_not_a_vllm_argument(argv: list[str], says: str, capsys) -> None:
    from kvtier.cli import parse

    with pytest.raises(SystemExit):
        parse(["serve", *argv])
    assert says in capsys.readouterr().err
    # After "--" it is vLLM's, whatever it looks like; before "serve", kvtier's.
    assert parse(["serve", "--model", "M", "--", *argv[2:]]).vllm_args == argv[2:]
    with pytest.raises(SystemExit):
        parse(["--bogus", "serve", "--model", "M"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_serve_keeps_vllms_config_flag_apart_from_its_own_and_checks_its_port(capsys) -> None:
    from kvtier.cli import parse

    args = parse(["serve", "--model", "M", "--config", "vllm.yaml"])  # not an abbreviation of --config-dir
    assert args.config_dir is None and args.vllm_args == ["--config", "vllm.yaml"]
    for port in ("-5", "65536", "８０"):
        with pytest.raises(SystemExit):
            parse(["serve", "--model", "M", "--port", port])
        assert f"argument --port: '{port}' is not a port" in capsys.readouterr().err
    assert parse(["serve", "--model", "M", "--port", "8100"]).port == 8100
    with pytest.raises(SystemExit):
        parse(["size", "--max-model-len", "5"])  # other commands refuse what they do not know
    assert "unrecognized arguments: --max-model-len 5" in capsys.readouterr().err


def test_a_second_serve_on_a_folder_in_use_is_refused(tmp_path: Path) -> None:
    """It would take over the first one's record, logs and config files;
    kvtier stop would then stop only the second."""
    sup = waiter()
    try:
        record(tmp_path, [("supervisor", sup.pid, process_start_time(sup.pid))])
        second = Serve("m", 1, tmp_path, out=lambda *_: None)
        with pytest.raises(ServerError, match=f"kvtier serve already runs there: supervisor \\(pid {sup.pid}\\)"):
            second.start()
        second.stop()  # what serve() does after a refused start: the first one's record stays
        assert json.loads((tmp_path / STATE_FILE).read_text())["processes"][0]["pid"] == sup.pid
        assert sup.poll() is None
    finally:
        sup.kill()
        sup.wait()


def test_a_serve_starting_holds_its_folder_before_the_meta_service_starts(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """From its first step, not once the meta service serves: a second
    serve in that window is refused (it would take over the record), and
    the record names the supervisor, for kvtier stop to signal."""
    from kvtier.tools import serve as serve_mod

    seen: list[str] = []
    real_start = serve_mod.MetaProcess.start

    def start(meta, stop=None):
        procs = json.loads((tmp_path / STATE_FILE).read_text())["processes"]
        seen.append(",".join(f"{p['role']}:{p['pid']}" for p in procs))
        refused(Serve("m", 1, tmp_path, out=lambda *_: None), "another kvtier serve is starting or running there")
        assert (tmp_path / STATE_FILE).exists()  # the refused one leaves the first one's record
        first.request_stop()  # stops the start once the meta service is up: no vLLM
        return real_start(meta, stop)

    monkeypatch.setattr(serve_mod.MetaProcess, "start", start)
    first = Serve("m", 1, tmp_path, out=lambda *_: None)
    refused(first, "interrupted")
    assert seen == [f"supervisor:{os.getpid()}"]
    assert not (tmp_path / STATE_FILE).exists()
    later = Serve("m", 1, tmp_path, out=lambda *_: None)  # the folder is free again once it stopped
    later._take_folder()
    later.stop()


def test_a_stop_during_the_checks_starts_no_meta_service(tmp_path: Path) -> None:
    s = Serve("m", 1, tmp_path / "logs", out=lambda *_: None)
    s.request_stop()  # kvtier stop, before the meta service was started
    refused(s, "interrupted")
    assert s.meta is None


def test_a_port_whose_connections_linger_in_time_wait_is_free_to_serve(tmp_path: Path) -> None:
    import socket

    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as vLLM's server (asyncio) binds
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = srv.accept()
        conn.close()  # the server side closes first: its end lingers in TIME_WAIT
        client.recv(1)
        client.close()
    s = Serve("m", 1, tmp_path / "logs", first_port=port, out=lambda *_: None)
    s._check_ports()  # no "Address already in use"


def test_processes_a_killed_supervisor_left_keep_their_folder(tmp_path: Path) -> None:
    """Its children run in sessions of their own and outlive it: a new
    serve on the folder would overwrite the record that names them."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    orphan = waiter()
    second = Serve("m", 1, tmp_path, out=lambda *_: None)
    try:
        record(tmp_path, [("supervisor", gone.pid, 12345), ("meta", orphan.pid, process_start_time(orphan.pid))])
        with pytest.raises(ServerError, match=f"processes of a kvtier serve already run.*meta \\(pid {orphan.pid}\\)"):
            second.start()
        assert second.meta is None  # refused before anything started
        assert stop(str(tmp_path), timeout_s=10) == 0  # and kvtier stop still stops them
        assert orphan.wait(10) == 7
    finally:
        second.stop()  # a start not refused (a regression) leaves no meta service running
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()


def _unused_pid() -> int:
    pid = int(Path("/proc/sys/kernel/pid_max").read_text()) - 1
    while Path(f"/proc/{pid}").exists():
        pid -= 1
    return pid


def test_stop_signals_only_well_formed_entries(tmp_path: Path) -> None:
    other = waiter()
    try:
        # A pid as text (it was taken as a number), and a null start time for
        # a pid that does not exist (it matched, and os.kill of it raised).
        entries = [{"role": "supervisor", "pid": str(other.pid), "start": process_start_time(other.pid)},
                   {"role": "meta", "pid": _unused_pid(), "start": None}]
        (tmp_path / STATE_FILE).write_text(json.dumps({"processes": entries}))
        assert stop(str(tmp_path), timeout_s=2) == 0
        assert other.poll() is None
        assert not (tmp_path / STATE_FILE).exists()
    finally:
        other.kill()
        other.wait()


def test_stop_refuses_a_record_others_may_have_written(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    other = waiter()
    try:
        record(tmp_path, [("supervisor", other.pid, process_start_time(other.pid))])
        (tmp_path / STATE_FILE).chmod(0o666)  # anyone could have named any process in it
        assert stop(str(tmp_path), timeout_s=2) == 1
        assert "not a record of this user's kvtier serve" in capsys.readouterr().err
        assert other.poll() is None and (tmp_path / STATE_FILE).exists()
        # Writable by the user's group (an earlier version's record under umask
        # 002): taken if that group is the user's private one, else refused.
        from kvtier.tools.serve import _private_group

        os.chown(tmp_path / STATE_FILE, -1, os.getegid())
        (tmp_path / STATE_FILE).chmod(0o664)
        if _private_group(os.getegid()):
            assert stop(str(tmp_path), timeout_s=20) == 0
            assert other.wait(10) == 7
        else:
            assert stop(str(tmp_path), timeout_s=2) == 1 and other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_default_configs_never_replace_a_file_kvtier_did_not_write(tmp_path: Path) -> None:
    from kvtier.tools.serve import default_configs

    mine = tmp_path / "mmc-meta.conf"
    mine.write_text("ock.mmc.meta_service_url = tcp://10.1.2.3:5000\n")  # the user's own
    with pytest.raises(ServerError, match="mmc-meta.conf: not a file kvtier serve wrote"):
        default_configs(tmp_path)
    assert mine.read_text() == "ock.mmc.meta_service_url = tcp://10.1.2.3:5000\n"
    mine.unlink()
    target = tmp_path / "elsewhere.txt"
    target.write_text("keep")
    mine.symlink_to(target)  # a link planted in a shared folder
    with pytest.raises(ServerError, match="not a file kvtier serve wrote"):
        default_configs(tmp_path)
    assert target.read_text() == "keep"
    mine.unlink()
    meta, local = default_configs(tmp_path)
    again = default_configs(tmp_path)  # its own files: rewritten
    assert (meta, local) == again and meta.read_text().startswith("# written by kvtier serve")


def test_a_busy_port_is_named_before_anything_starts(tmp_path: Path) -> None:
    import socket

    def free(port: int) -> bool:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                return False
            return True

    with socket.socket() as busy:
        # Instance 0's port must be free: another test's server may hold the
        # one just below a port the kernel hands out.
        for _ in range(50):
            busy.bind(("127.0.0.1", 0))
            port = busy.getsockname()[1]
            if free(port - 1):
                break
            busy.close()
            busy = socket.socket()
        s = Serve("m", 2, tmp_path / "logs", first_port=port - 1, out=lambda *_: None)
        with pytest.raises(ServerError, match=f"port {port} \\(instance 1\\)"):
            s.start()
        assert s.meta is None  # refused before the meta service or any vLLM


def test_ctrl_c_while_the_meta_service_starts_stops_it_and_starts_nothing(tmp_path: Path) -> None:
    import threading

    lines: list[str] = []
    s = Serve("m", 1, tmp_path / "logs", out=lines.append)
    threading.Timer(0.3, s.request_stop).start()  # Ctrl-C soon after start
    try:
        with pytest.raises(ServerError, match="interrupted"):
            s.start()
        assert s.instances == [] and lines == []
        assert s.meta is not None and s.meta.proc is not None and s.meta.proc.poll() is not None
    finally:
        s.stop()


def test_a_missing_config_file_named_by_the_environment_names_the_variable(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MMC_META_CONFIG_PATH", str(tmp_path / "nowhere.conf"))
    monkeypatch.delenv("MMC_LOCAL_CONFIG_PATH", raising=False)
    with pytest.raises(ServerError, match="MMC_META_CONFIG_PATH=.*nowhere.conf: no such file"):
        find_configs(None, tmp_path)


def test_stop_with_a_stale_or_garbled_record(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    record(tmp_path, [("supervisor", gone.pid, 12345)])
    assert stop(str(tmp_path)) == 0
    assert "removed the stale record" in capsys.readouterr().out and not (tmp_path / STATE_FILE).exists()
    (tmp_path / STATE_FILE).write_text("{not json")
    assert stop(str(tmp_path)) == 1
    assert "not a record kvtier serve wrote" in capsys.readouterr().err


def test_an_instance_url_reaches_the_address_it_binds() -> None:
    from kvtier.tools.serve import client_host

    assert [client_host(h) for h in ("127.0.0.1", "0.0.0.0", "10.0.0.5", "::", "fd00::5")] == \
        ["127.0.0.1", "127.0.0.1", "10.0.0.5", "[::1]", "[fd00::5]"]


def test_a_meta_service_that_fails_to_start_leaves_no_folder_behind(tmp_path: Path, monkeypatch) -> None:
    # The bad file makes kvtier meta exit 2 at once; its ready file's
    # temporary folder goes all the same.
    import tempfile

    from kvtier.tools.meta import MetaProcess

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    conf = tmp_path / "mmc-local.conf"
    conf.write_text("ock.mmc.local_service.world_size = 0\n")
    meta = MetaProcess(conf, conf, log_path=tmp_path / "meta.log")
    with pytest.raises(ServerError, match="exited with 2") as err:
        meta.start()
    assert "ock.mmc.local_service.world_size" in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.log", "mmc-local.conf"]


@pytest.mark.parametrize(("args", "n"), [
    ([], 1), (["-tp", "2"], 2), (["--tensor-parallel-size=4", "--max-model-len", "64"], 4),
    (["-tp", "2", "--pipeline-parallel-size", "2"], 4), (["-dp", "2", "-tp", "2"], 4),
    (["--tensor_parallel_size", "2", "-pcp", "2"], 4),  # vLLM takes "_" for "-" too
    (["-dp", "4", "--data-parallel-size-local=2", "-tp", "2"], 4),  # the replicas on this node
    (["-tp", "2", "--config", "vllm.yaml"], None),  # the file may set the sizes: not split
    (["-tp", "4", "--nnodes", "2"], None), (["-tp", "2", "-n=2"], None),  # an instance over nodes
    (["-dp", "4", "--data-parallel-start-rank", "2", "-dpl", "2"], None), (["--headless"], None),
])
def test_the_devices_an_instance_takes_follow_vllms_parallel_sizes(args: list[str], n: int | None) -> None:
    assert devices_per_instance(args) == n


@pytest.mark.parametrize("args", [["-tp", "two"], ["-tp"], ["--pipeline-parallel-size=0"]])
def test_a_parallel_size_that_is_not_a_count_is_named(args: list[str]) -> None:
    with pytest.raises(ServerError, match=args[0].split("=")[0]):
        devices_per_instance(args)


def test_instances_get_disjoint_devices_and_too_few_devices_are_refused(tmp_path: Path) -> None:
    gpus = tmp_path / "gpus"
    gpus.mkdir()
    for bus in ("0000:17:00.0", "0000:31:00.0", "0000:b1:00.0", "0000:ca:00.0"):
        (gpus / bus).mkdir()
    assert visible_devices({}, str(gpus), cuda=True) == ["0", "1", "2", "3"]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "3, 5,6"}, str(gpus), cuda=True) == ["3", "5", "6"]
    assert visible_devices({}, str(tmp_path / "no-driver"), cuda=True) is None  # no GPU: nothing to split
    assert visible_devices({"CUDA_VISIBLE_DEVICES": ""}, str(gpus), cuda=True) is None  # no device
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "-1"}, str(gpus), cuda=True) is None
    # vLLM's CPU build on a host with GPUs: its instances take no device.
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "0,1"}, str(gpus), cuda=False) is None
    assert split_devices(2, None, ["0", "1"]) is None  # sizes unknown (--config): not split
    assert split_devices(2, 2, ["0", "1", "2", "3"]) == ["0,1", "2,3"]
    assert split_devices(3, 1, ["3", "5", "6"]) == ["3", "5", "6"]
    assert split_devices(4, 8, None) is None
    with pytest.raises(ServerError, match=r"--instances 2 with 2 device\(s\) each .* need 4 devices; 3 visible"):
        split_devices(2, 2, ["3", "5", "6"])


def test_too_few_gpus_for_the_instances_are_named_before_anything_starts(tmp_path: Path, monkeypatch) -> None:
    import kvtier.tools.serve as serve_mod

    monkeypatch.setattr(serve_mod, "cuda_build", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    s = Serve("m", 2, tmp_path / "logs", vllm_args=["-tp", "2"], out=lambda *_: None)
    refused(s, "need 4 devices; 2 visible")
    assert s.meta is None and s.instances == []


def test_each_instance_is_started_on_its_own_devices(tmp_path: Path, monkeypatch) -> None:
    """What each vLLM process is given (the spawn itself recorded, not run)."""
    import kvtier.tools.serve as serve_mod

    started: list[dict[str, str]] = []

    class Spawned:
        pid = 0

    def popen(argv, *, env, **kw):  # noqa: ANN001, ANN003, ANN202
        started.append(env)
        return Spawned()
    monkeypatch.setattr(serve_mod.subprocess, "Popen", popen)
    s = Serve("m", 2, tmp_path, out=lambda *_: None)
    base = {"PATH": "/usr/bin"}
    for i, devices in enumerate(["0,1", "2,3"]):
        s._start_instance(i, base, devices)
    s._start_instance(2, base, None)
    assert [e.get("CUDA_VISIBLE_DEVICES") for e in started] == ["0,1", "2,3", None]
    assert base == {"PATH": "/usr/bin"}  # the shared environment is left as it was


def test_this_environment_s_torch_build_is_read_without_importing_it() -> None:
    import importlib.metadata

    assert cuda_build() == ("+cpu" not in importlib.metadata.version("torch"))


def fake_sys_cpu(root: Path, topology: dict[int, tuple[int, int, str]], siblings_file: str = "core_cpus_list"
                 ) -> str:
    """A ``/sys/devices/system/cpu`` with ``cpu -> (node, package, its core's CPUs)``."""
    for cpu, (node, package, siblings) in topology.items():
        base = root / f"cpu{cpu}"
        (base / "topology").mkdir(parents=True)
        (base / f"node{node}").mkdir()
        (base / "topology" / "physical_package_id").write_text(f"{package}\n")
        (base / "topology" / "core_id").write_text("0\n")  # repeats across cores on some parts: not used
        (base / "topology" / siblings_file).write_text(f"{siblings}\n")
    return str(root)


@pytest.mark.parametrize("siblings_file", ["core_cpus_list", "thread_siblings_list"])  # new kernels, old ones
def test_the_host_s_cpus_are_read_with_their_node_package_and_core(tmp_path: Path, siblings_file: str) -> None:
    # Two sockets of two cores, two threads a core (cpu c and c + 4 are one core).
    topo = {cpu: (cpu % 4 // 2, cpu % 4 // 2, f"{cpu % 4},{cpu % 4 + 4}") for cpu in range(8)}
    root = fake_sys_cpu(tmp_path / "cpu", topo, siblings_file)
    assert host_cpus({0, 2, 5, 7}, root) == [Cpu(0, 0, 0, 0), Cpu(2, 1, 1, 2), Cpu(5, 0, 0, 1), Cpu(7, 1, 1, 3)]
    assert len(physical_cores(host_cpus(set(range(8)), root))) == 4
    # A CPU without its topology files: a core of its own on node 0.
    assert host_cpus({9}, root) == [Cpu(9, 0, 0, -1)]


def test_cpu_lists_are_written_as_ranges() -> None:
    assert id_ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert id_ranges([3]) == "3"
    assert parse_ids("0-2,5,7-8\n") == [0, 1, 2, 5, 7, 8]


def test_instances_get_disjoint_cores_their_siblings_and_one_thread_per_core() -> None:
    # 2 nodes x 4 cores, hyperthreads: cpu c and c + 8 are one core.
    cpus = [Cpu(c, node=(c % 8) // 4, core=c % 8) for c in range(16)]
    shares = split_cores(2, 1, cpus)
    assert [sorted(s.cpus) for s in shares] == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    assert [s.omp_bind for s in shares] == ["0-3", "4-7"]  # each instance on one node, a thread per core
    # Two ranks each (-tp 2): a run of cores per rank, as vLLM's list of lists.
    assert [s.omp_bind for s in split_cores(2, 2, cpus)] == ["0-1|2-3", "4-5|6-7"]
    # Three instances on eight cores: two cores each; the last two go to none.
    three = split_cores(3, 1, cpus)
    assert [s.omp_bind for s in three] == ["0-1", "2-3", "4-5"]
    assert set().union(*(s.cpus for s in three)) == set(range(16)) - {6, 7, 14, 15}
    assert split_cores(3, 3, cpus) is None  # 9 ranks, 8 cores: not split
    # No topology known: each logical CPU a core, in id order.
    assert [s.omp_bind for s in split_cores(2, 1, [Cpu(0), Cpu(1)])] == ["0", "1"]


def test_cores_are_kept_out_of_each_instance_s_openmp_teams_as_vllm_keeps_them() -> None:
    cpus = [Cpu(c, node=(c % 8) // 4, core=c % 8) for c in range(16)]
    # vLLM's default with a connector, one rank: two of each share's four cores.
    shares = split_cores(2, 1, cpus, reserve=2)
    assert [s.omp_bind for s in shares] == ["0-1", "4-5"]
    assert [sorted(s.cpus) for s in shares] == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    assert [s.omp_bind for s in split_cores(2, 2, cpus, reserve=2)] == ["0|2", "4|6"]  # one from each rank
    assert [s.omp_bind for s in split_cores(2, 2, cpus, reserve=1)] == ["0-1|2", "4-5|6"]  # the last rank's
    assert [s.omp_bind for s in split_cores(2, 2, cpus, reserve=3)] == ["0|2", "4|6"]  # a run keeps a core
    # A share with no more cores than the reserve keeps them all (vLLM's rule too).
    assert [s.omp_bind for s in split_cores(2, 1, [Cpu(0), Cpu(1)], reserve=2)] == ["0", "1"]


def test_the_reserve_follows_vllm_s_variable() -> None:
    assert reserved_cores({}, 1) == 2 and reserved_cores({}, 2) == 4  # vLLM's default, with a connector
    assert reserved_cores({"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}, 2) == 0
    with pytest.raises(ServerError, match=r"VLLM_CPU_NUM_OF_RESERVED_CPU='two'"):
        reserved_cores({"VLLM_CPU_NUM_OF_RESERVED_CPU": "two"}, 1)


def test_a_pinned_instance_and_everything_it_starts_run_on_its_cores_only() -> None:
    """The real spawn: the child's mask, and its child's, are the share's."""
    import kvtier.tools.serve as serve_mod

    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("one CPU: no mask narrower than this process's")
    want = frozenset(mine[-1:])
    code = ("import os, subprocess, sys\nprint(sorted(os.sched_getaffinity(0)))\n"
            "print(subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'],"
            " capture_output=True, text=True).stdout.strip())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         preexec_fn=serve_mod._PinTo(want)).stdout.split("\n")
    assert out[:2] == [str(sorted(want))] * 2
    assert sorted(os.sched_getaffinity(0)) == mine  # the supervisor's own mask is left as it was


def test_each_instance_is_started_on_cores_of_its_own(tmp_path: Path, monkeypatch) -> None:
    import kvtier.tools.serve as serve_mod

    started: list[tuple[dict[str, str], object]] = []

    class Spawned:
        pid = 0

    def popen(argv, *, env, preexec_fn=None, **kw):  # noqa: ANN001, ANN003, ANN202
        started.append((env, preexec_fn))
        return Spawned()
    monkeypatch.setattr(serve_mod.subprocess, "Popen", popen)
    s = Serve("m", 2, tmp_path, out=lambda *_: None)
    shares = split_cores(2, 1, [Cpu(0), Cpu(1)])
    for i in range(2):
        s._start_instance(i, {"PATH": "/usr/bin"}, None, shares[i])
    s._start_instance(2, {"PATH": "/usr/bin"})
    assert [e.get("VLLM_CPU_OMP_THREADS_BIND") for e, _ in started] == ["0", "1", None]
    assert [p.cpus for _, p in started[:2]] == [s.cpus for s in shares] and started[2][1] is None


def test_when_the_cores_are_split_and_when_a_line_says_why_not(tmp_path: Path, monkeypatch) -> None:
    import kvtier.tools.serve as serve_mod

    monkeypatch.setattr(serve_mod, "cuda_build", lambda: False)
    monkeypatch.setattr(serve_mod, "host_cpus", lambda: [Cpu(c, core=c) for c in range(4)])
    for var in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_SIM_MULTI_NUMA", "VLLM_CPU_NUM_OF_RESERVED_CPU"):
        monkeypatch.delenv(var, raising=False)
    said: list[str] = []

    def shares(n: int, per_instance: int | None, devices=None, **kw) -> list[str] | None:  # noqa: ANN001, ANN003
        said.clear()
        got = Serve("m", n, tmp_path, out=said.append, **kw)._core_shares(per_instance, devices)
        return [x.omp_bind for x in got] if got is not None else None

    assert shares(2, 1) == ["0-1", "2-3"] and said == []
    assert shares(2, 2) == ["0|1", "2|3"]
    assert shares(1, 1) is None and said == []  # one instance: vLLM's own binding, all cores
    assert shares(2, 1, share_cores=True) is None and said == []
    assert shares(2, 1, devices=["0", "1"]) is None  # on GPUs
    assert shares(3, 2) is None and said == ["3 instances of 2 rank(s) need 6 cores to run on cores of their "
                                             "own; 4 here: they share them"]
    assert shares(2, None) is None and "--config" in said[0]
    for value in ("0-1|2-3", "0"):  # "0": CPU 0, the user's too
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", value)
        assert shares(2, 1) is None and "VLLM_CPU_OMP_THREADS_BIND is set" in said[0]
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    # vLLM's simulated NUMA nodes take its own binding only (it asserts otherwise).
    monkeypatch.setenv("VLLM_CPU_SIM_MULTI_NUMA", "1")
    assert shares(2, 1) is None and "VLLM_CPU_SIM_MULTI_NUMA is set" in said[0]
    monkeypatch.setenv("VLLM_CPU_SIM_MULTI_NUMA", "0")
    assert shares(2, 1) == ["0-1", "2-3"]
    monkeypatch.setattr(serve_mod, "host_cpus", lambda: [Cpu(c, core=c) for c in range(8)])
    assert shares(2, 1) == ["0-1", "4-5"]  # vLLM's default reserve: two of four cores each
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    assert shares(2, 1) == ["0-3", "4-7"]
    monkeypatch.setattr(serve_mod, "cuda_build", lambda: True)
    assert shares(2, 1) is None and said == []  # a CUDA build: its instances' CPU threads are few
