"""Bad input to the command line: one line naming the flag and the value, exit status 2, no traceback."""

from __future__ import annotations

from pathlib import Path

from kvtier.cli import main as cli_main
from kvtier.tools.server import ServerError


def test_a_dataset_of_items_that_are_no_conversations_is_one_line(tmp_path: Path, capsys) -> None:
    data = tmp_path / "x.json"
    data.write_text("[1, 2]")
    assert cli_main(["bench", "run", "--dataset", str(data), "--url", "http://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "--dataset" in err and "item 0 is not a conversation" in err and len(err.strip().splitlines()) == 1


def test_a_folder_given_as_a_log_is_one_line(tmp_path: Path, capsys) -> None:
    assert cli_main(["size", "--log", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--log = '{tmp_path}': Is a directory" in err and len(err.strip().splitlines()) == 1


def test_a_server_that_fails_to_start_is_one_line_not_a_traceback(monkeypatch, capsys) -> None:
    # What kvtier bench compare and the demo raise when vLLM or the meta
    # service cannot start; here from the handler of a real subcommand.
    from kvtier import cli

    def fails(args) -> int:
        raise ServerError("vLLM exited with 1 during start-up; log /tmp/vllm.log:\nOSError: no room")

    monkeypatch.setattr(cli, "_disk_release", fails)
    assert cli_main(["disk", "release", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: vLLM exited with 1 during start-up") and "Traceback" not in err
