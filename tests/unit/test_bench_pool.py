"""bench/pool.py's 0 % hits bookkeeping: the order configurations take
turns in, and how samples of several sets of instances are pooled; and a
short lookup run with the SSD tier on, so that the option keeps working."""

from __future__ import annotations

import argparse
import errno
import glob
import importlib.util
import os
import tempfile
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def pool():
    spec = importlib.util.spec_from_file_location("kvtier_bench_pool", BENCH / "pool.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_configuration_comes_first_once_per_round(pool):
    names = ["plain", "pool", "control"]
    orders = [pool.rotation(names, k) for k in range(6)]
    assert [o[0] for o in orders] == ["plain", "pool", "control"] * 2
    assert all(sorted(o) == sorted(names) for o in orders)
    assert pool.rotation(["a", "b"], 1) == ["b", "a"] and pool.rotation(["a", "b"], -1) == ["b", "a"]


def test_sets_pool_in_order_so_pairs_stay_aligned(pool):
    sets = [
        {"plain": {"ttfts": [1.0, 2.0], "rates": [10.0], "cpu_s": {"w": 1.0}, "tokens": 1000},
         "pool": {"ttfts": [1.1, 2.2], "rates": [11.0], "cpu_s": {"w": 2.0, "meta": 0.5}, "tokens": 1000,
                  "hook_s": 0.25}},
        {"plain": {"ttfts": [3.0, 4.0], "rates": [30.0], "cpu_s": {"w": 3.0}, "tokens": 3000},
         "pool": {"ttfts": [3.3, 4.4], "rates": [27.0], "cpu_s": {"w": 4.0}, "tokens": 3000, "hook_s": 0.5}},
    ]
    out = pool.merge_sets(sets)
    assert out["pool"]["ttfts"] == [1.1, 2.2, 3.3, 4.4]
    assert [p / q for p, q in zip(out["pool"]["rates"], out["plain"]["rates"])] == [1.1, 0.9]
    assert out["plain"]["tokens_per_s"] == 20.0 and out["plain"]["ttft_s"] == 2.5
    assert out["pool"]["cpu_s"] == {"w": 6.0, "meta": 0.5}
    assert out["pool"]["cpu_ms_per_1k_tokens"] == pytest.approx(1e6 * 6.5 / 4000)
    assert out["pool"]["set_rates"] == [[11.0], [27.0]]
    assert out["plain"]["set_ttfts"] == [[1.0, 2.0], [3.0, 4.0]]
    # The hooks' time over every set's TTFT prompts, per prompt; none for vLLM alone.
    assert out["pool"]["hook_s_per_prompt"] == 0.75 / 4 and out["plain"]["hook_s_per_prompt"] == 0.0


def test_lookup_with_the_ssd_tier_runs_both_stores_with_one(pool):
    # A short run: 64 keys of 16-token blocks and 16 of 64, 10 probes each,
    # through a meta service on each transport and in this process.
    args = argparse.Namespace(tokens=1024, reps=10, ssd=True, gap_ms=0.5)
    out = pool.run_lookup(args)
    assert out["gap_ms"] == 0.5
    assert out["embedded_ssd_slots"] > 0
    assert set(out["ssd_bytes"]) == {"unix", "tcp"} and min(out["ssd_bytes"].values()) > 0
    calls = [r for r in out["rows"] if r["keys"]]
    assert sorted((r["transport"], r.get("call", "probe"), r["keys"]) for r in calls) == [
        ("tcp", "pin", 64), ("tcp", "probe", 16), ("tcp", "probe", 64), ("unix", "pin", 64), ("unix", "probe", 16),
        ("unix", "probe", 64)]
    assert all(len(r["service_s"]) == len(r["embedded_s"]) == 10 for r in calls)
    probes = [r for r in calls if r.get("call", "probe") == "probe"]
    assert all(len(r["embedded_known_s"]) == 10 == len(r["by_call_s"]) for r in probes)
    assert all(r["mapped"] == 1.0 for r in probes)  # every lookup of a request held whole: no call
    # The last key not held: asked whole, by call, the head not counted in the index first.
    assert all(r["heads"] == 0.0 and len(r["last_new_s"]) == 10 == len(r["last_new_by_call_s"]) for r in probes)
    pool.print_lookup(out)  # both peers of a probe in its row, the keys-known one alone in a pin's


def test_a_new_request_has_equal_keys_in_new_objects(pool):
    keys = pool.request_keys(3, 256, 16)
    fresh = pool.fresh_keys(keys)
    assert fresh == keys
    assert not any(a is b for a, b in zip(fresh, keys))


def test_timed_calls_pause_between_calls_outside_the_timing(pool, monkeypatch):
    events = []
    monkeypatch.setattr(pool.time, "sleep", lambda s: events.append(("sleep", s)))
    assert len(pool.time_calls(lambda: events.append("call"), 3, 0.002)) == 3
    assert events == ["call", ("sleep", 0.002)] * 3
    events.clear()
    pool.time_calls(lambda: events.append("call"), 2)
    assert events == ["call", "call"]
    # An argument made for each call, before its timing starts.
    events.clear()
    made = iter(range(3))
    monkeypatch.setattr(pool.time, "perf_counter", lambda: events.append("clock") or 0.0)
    pool.time_calls(lambda x: events.append(("call", x)), 2, make_arg=lambda: events.append("made") or next(made))
    assert events == ["made", "clock", ("call", 0), "clock", "made", "clock", ("call", 1), "clock"]


def test_a_store_that_fails_to_open_leaves_no_folder(pool, monkeypatch):
    def no_room(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(pool, "open_store", no_room)
    roots = [pool.shm_root(), tempfile.gettempdir()]
    before = {p for r in roots for p in glob.glob(os.path.join(r, "kvtier-bench-pool-*"))}
    with pytest.raises(OSError, match="space"):
        with pool.embedded_store(1 << 20, ssd=True):
            pass
    assert {p for r in roots for p in glob.glob(os.path.join(r, "kvtier-bench-pool-*"))} == before


def test_lookup_against_another_tree_runs_its_service_from_that_tree(pool, tmp_path):
    # The other service imports kvtier from the folder given (here a copy of
    # this tree's, which leaves a mark when imported); the probes alternate
    # in blocks, the same number to each.
    import shutil

    src = Path(pool.__file__).resolve().parents[1] / "src"
    other = tmp_path / "src"
    shutil.copytree(src / "kvtier", other / "kvtier", ignore=shutil.ignore_patterns("__pycache__"))
    with open(other / "kvtier" / "__init__.py", "a") as f:
        f.write("\nimport pathlib as _p\n_p.Path(__file__).with_name('imported-here').touch()\n")
    args = argparse.Namespace(tokens=1024, reps=2 * pool.AGAINST_BLOCK, against=str(other), transport="unix")
    out = pool.run_lookup_against(args)
    assert (other / "kvtier" / "imported-here").exists()
    assert sorted(r["keys"] for r in out["rows"]) == [16, 64]
    for row in out["rows"]:
        assert {k: len(v) for k, v in row["times_s"].items()} == {"this tree": 100, "against": 100}
        assert min(row["in_store_s"].values()) > 0
    pool.print_lookup_against(out)
    with pytest.raises(SystemExit):
        pool.main(["lookup", "--against", str(tmp_path / "nothing")])
