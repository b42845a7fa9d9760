"""kvtier bench's client against a real local server (a subprocess on 127.0.0.1) that misbehaves."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtier.cli import main as cli_main
from kvtier.errors import ConfigError
from kvtier.tools.loadgen import BenchOptions, Session, load_workload, run
from kvtier.tools.report import markdown, write_all
from kvtier.tools.server import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def flaky_url() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.integration.flaky_server", str(port)], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(url + "/v1/models", timeout=1)
            break
        except httpx.HTTPError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("flaky server did not start")
            time.sleep(0.1)
    yield url
    proc.kill()
    proc.wait()


def test_failures_are_counted_by_kind_and_kept_out_of_latencies(flaky_url: str) -> None:
    sessions = [Session([f"question {m}"]) for m in ("ok", "error", "stall", "cut", "empty", "midError", "ok")]
    report = run(sessions, BenchOptions(url=flaky_url, concurrency=4, timeout_s=1.5, max_tokens=8))
    s = report.summary
    assert s["requests"] == 7 and s["succeeded"] == 2 and s["failed"] == 5
    assert s["errors"] == {"http": 2, "timeout": 1, "cut": 1, "empty": 1}
    ok = [r for r in report.results if r.ok]
    assert all(r.completion_tokens == 5 and r.ttft_s > 0 and len(r.itl_s) == 4 for r in ok)
    # Failed requests never reach the latency figures: they are the ok ones' alone.
    assert s["e2el_s"]["mean"] == pytest.approx(sum(r.e2e_s for r in ok) / len(ok))
    assert s["ttft_s"]["mean"] == pytest.approx(sum(r.ttft_s for r in ok) / len(ok))
    assert s["completion_tokens"] == 10
    assert report.results[0].text == "t1.0 t1.1 t1.2 t1.3 t1.4 "


def test_multi_turn_sessions_carry_the_real_answers(flaky_url: str) -> None:
    sessions = [Session(["hello ok", "again ok", "third ok"], system="be brief")]
    report = run(sessions, BenchOptions(url=flaky_url, max_tokens=8))
    texts = [r.text for r in report.results]
    # The server numbers its answer by how many user turns it was sent.
    assert [t.split(".")[0] for t in texts] == ["t1", "t2", "t3"]
    assert [r.prompt_tokens for r in report.results] == [10, 20, 30]


def test_a_failed_turn_ends_its_session(flaky_url: str) -> None:
    report = run([Session(["a ok", "b error", "c ok"])], BenchOptions(url=flaky_url))
    assert [(r.turn, r.ok) for r in report.results] == [(0, True), (1, False)]


def test_hit_rates_come_from_metrics_deltas(flaky_url: str) -> None:
    report = run([Session([f"q{i} ok"]) for i in range(4)], BenchOptions(url=flaky_url, concurrency=2))
    assert report.hits is not None
    assert report.hits.h1 == pytest.approx(0.5)
    assert report.hits.h2 == pytest.approx(0.5)
    assert report.hits.h_all == pytest.approx(0.75)
    assert report.hits.by_source["host"] == 100


def test_request_rate_spaces_session_starts(flaky_url: str) -> None:
    report = run([Session([f"q{i} ok"]) for i in range(4)],
                 BenchOptions(url=flaky_url, concurrency=4, request_rate=20, arrival="fixed"))
    starts = sorted(r.start_s for r in report.results)
    # Fixed arrivals at 20/s: the 4th request starts no earlier than 150 ms in.
    assert starts[3] >= 0.15


def test_reports_are_written(flaky_url: str, tmp_path: Path) -> None:
    report = run([Session([f"q{i} ok"]) for i in range(3)] + [Session(["x error"])],
                 BenchOptions(url=flaky_url, label="cfg A"))
    paths = write_all([report], str(tmp_path))
    names = sorted(Path(p).name for p in paths)
    assert names == ["report.md", "requests-cfg-A.csv", "results.json", "ttft_cdf.png", "ttft_vs_hit_rate.png"]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data[0]["summary"]["failed"] == 1
    assert (tmp_path / "requests-cfg-A.csv").read_text().count("\n") == 5
    assert "| requests (ok / failed) | 3 / 1 |" in markdown([report])


def test_cli_bench_run(flaky_url: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ds = tmp_path / "qa.jsonl"
    ds.write_text("\n".join(json.dumps({"question": f"q{i} ok", "answer": ""}) for i in range(3)) + "\n")
    rc = cli_main(["bench", "run", "--url", flaky_url, "--dataset", str(ds), "--concurrency", "2",
                   "--output", str(tmp_path / "out"), "--no-plots"])
    assert rc == 0
    assert "| requests (ok / failed) | 3 / 0 |" in capsys.readouterr().out
    assert (tmp_path / "out" / "results.json").exists()


def test_workloads_load_and_bad_files_are_named(tmp_path: Path) -> None:
    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps([{"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"},
                                                 {"from": "human", "value": "c"}]}, {"conversations": []}]))
    assert [s.turns for s in load_workload(str(sg))] == [["a", "c"]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\nnot json\n')
    with pytest.raises(ConfigError, match="line 2"):
        load_workload(str(bad))
    with pytest.raises(ConfigError, match="no such file"):
        load_workload(str(tmp_path / "missing.jsonl"))


def test_stats_once_shows_hit_rates_and_tiers(flaky_url: str, capsys: pytest.CaptureFixture) -> None:
    run([Session(["q ok"])], BenchOptions(url=flaky_url))
    assert cli_main(["stats", "--url", flaky_url, "--once"]) == 0
    out = capsys.readouterr().out
    assert "h_all" in out and "75.0%" in out
    assert "cached tokens: host" in out
    assert cli_main(["stats", "--url", "http://127.0.0.1:9", "--once"]) == 2
