"""bench/blockcopy.py runs the worker's CPU copy paths on a real arena and
leaves nothing behind; its figures are what docs/benchmarks.md quotes."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def blockcopy(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # it imports bench/ttft.py for memcpy
    spec = importlib.util.spec_from_file_location("kvtier_bench_blockcopy", BENCH / "blockcopy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("ttft", None)


def shm_dirs() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("kvtier-bench-copy-")}


def test_times_each_path_and_removes_its_arena(blockcopy, capsys) -> None:
    before = shm_dirs()
    res = blockcopy.run(argparse.Namespace(geometry="tiny", dtype="bfloat16", prompt_tokens=257, block=16,
                                           reps=2, kv_size="64MB"))
    assert shm_dirs() == before
    assert res["blocks"] == 16  # (257 - 1) // 16: the blocks of a full hit
    assert res["bytes"] == 16 * res["block_bytes"]
    for path in ("copies_only", "load", "save_sealed", "save_then_seal"):
        assert len(res[path]) == 2 and all(t > 0 for t in res[path]), path
    # The paths timed move the right bytes: a prompt's blocks saved and
    # loaded into other blocks come back equal (the bench raises if not).
    assert res["round_trip_blocks"] == 16
    blockcopy.report(res)
    out = capsys.readouterr().out
    assert "16 blocks of" in out and "save_sealed" in out and "x memcpy" in out


def test_a_kv_cache_smaller_than_one_prompt_is_refused_by_name(blockcopy) -> None:
    with pytest.raises(SystemExit, match="--kv-size 1MB holds 2 blocks, fewer than the 254"):
        blockcopy.main(["--geometry", "bench", "--kv-size", "1MB", "--reps", "1"])
    with pytest.raises(SystemExit):
        blockcopy.main(["--reps", "0"])


@pytest.mark.parametrize("glibc_default", [False, True])
def test_the_script_runs_again_with_the_copies_it_measures(glibc_default: bool) -> None:
    """glibc reads its tunables once, at start: the script re-executes itself
    with the instances' setting (or, with --glibc-default, without it),
    keeping the user's other tunables."""
    from kvtier.hostmem import GLIBC_TUNABLES, NT_TUNABLE, streaming_copy_env

    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); import blockcopy; "
            f"blockcopy.copies_as_instances({glibc_default}); "
            "print(os.environ.get('GLIBC_TUNABLES'), blockcopy.copies_label(), sep='|')")
    mine = "glibc.malloc.arena_max=2"
    start = streaming_copy_env({GLIBC_TUNABLES: mine}) if glibc_default else {GLIBC_TUNABLES: mine}
    env = {**os.environ, **start}
    out = subprocess.run([sys.executable, "-c", code, str(BENCH)], env=env, capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()
    assert len(out) == 1  # printed once, by the process it became
    tunables, label = out[0].split("|")
    if glibc_default:
        assert (tunables, label) == (mine, "glibc's default copies")
    else:
        assert (tunables, label) == (f"{mine}:{NT_TUNABLE}=0x8000", "copies over 0x8000 bytes streamed")


def test_the_round_trip_catches_a_load_that_copies_nothing(blockcopy, monkeypatch) -> None:
    """The figures are of copies that happen: a load path that reports
    every block good and copies nothing is timed without complaint, and
    the run then fails at its round trip."""
    real = blockcopy.scatter_checked
    monkeypatch.setattr(blockcopy, "scatter_checked", lambda *args: [])
    args = argparse.Namespace(geometry="tiny", dtype="bfloat16", prompt_tokens=257, block=16, reps=1, kv_size="64MB")
    with pytest.raises(AssertionError, match="the blocks loaded back differ from the blocks saved"):
        blockcopy.run(args)
    monkeypatch.setattr(blockcopy, "scatter_checked", real)
    assert blockcopy.run(args)["round_trip_blocks"] == 16
