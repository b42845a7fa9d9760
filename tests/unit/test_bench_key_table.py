"""bench/key_table.py runs, and its batch lookups agree with a dict on every key it times."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_a_short_run_prints_a_row_per_table_and_kind_of_key(capsys):
    spec = importlib.util.spec_from_file_location("kvtier_bench_key_table", BENCH / "key_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--slots", "3000", "--keys", "512", "--reps", "3"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "index (" in line]
    assert [r.split(" | ")[1] for r in rows] == ["held", "held nowhere"] * 2
