"""kvtier bench's client against a real local server (a subprocess on 127.0.0.1) that misbehaves."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtier.cli import main as cli_main
from kvtier.errors import ConfigError
from kvtier.tools.client import RequestResult, absorb_chunk, hit_rates, stream_chat
from kvtier.tools.loadgen import (
    Arrival,
    BenchOptions,
    BenchReport,
    Result,
    Session,
    arrival_schedule,
    load_workload,
    run,
    summarize,
)
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
    modes = ("ok", "error", "stall", "cut", "empty", "midError", "trickle", "ok")
    sessions = [Session([f"question {m}"]) for m in modes]
    report = run(sessions, BenchOptions(url=flaky_url, concurrency=4, timeout_s=5, max_tokens=8))
    s = report.summary
    assert s["requests"] == 8 and s["succeeded"] == 2 and s["failed"] == 6
    # A stream that keeps trickling tokens times out like one that never starts.
    assert s["errors"] == {"http": 2, "timeout": 2, "cut": 1, "empty": 1}
    ok = [r for r in report.results if r.ok]
    assert all(r.completion_tokens == 5 and r.ttft_s > 0 and len(r.itl_s) == 4 for r in ok)
    # Failed requests never reach the latency figures: they are the ok ones' alone.
    assert s["e2el_s"]["mean"] == pytest.approx(sum(r.e2e_s for r in ok) / len(ok))
    assert s["ttft_s"]["mean"] == pytest.approx(sum(r.ttft_s for r in ok) / len(ok))
    assert s["completion_tokens"] == 10
    assert report.results[0].text == "t1.0 t1.1 t1.2 t1.3 t1.4 "


def test_ttft_starts_at_the_first_chunk_that_carries_a_token(flaky_url: str) -> None:
    """vLLM streams a chunk per token: one whose token decodes to nothing yet
    has empty text, a reasoning model's first tokens are reasoning, and only
    the role-only first chat chunk carries none."""
    report = run([Session([f"q {m}"]) for m in ("silent", "reasoning", "ok")],
                 BenchOptions(url=flaky_url, concurrency=1, max_tokens=8))
    by_mode = {r.session: r for r in report.results}
    silent, reasoning, ok = by_mode[0], by_mode[1], by_mode[2]
    assert all(r.ok for r in (silent, reasoning, ok))
    # Five tokens each: the first sets TTFT, the other four are gaps.
    assert [(r.token_chunks, len(r.itl_s)) for r in (silent, reasoning, ok)] == [(5, 4)] * 3
    assert silent.text == "" and 0 < silent.ttft_s < silent.e2e_s
    assert reasoning.text == "t1.1 t1.2 t1.3 t1.4 "
    assert report.summary["ttft_s"]["p50"] > 0


def test_the_simple_client_fails_streams_that_break_off(flaky_url: str) -> None:
    """The client of the demo and benchmarks: an error inside the stream, or
    a stream closed before [DONE], is a failed request, not a short answer."""
    with httpx.Client() as client:
        def ask(mode: str) -> RequestResult:
            return stream_chat(client, flaky_url, [{"role": "user", "content": f"q {mode}"}], max_tokens=8)

        broken = {m: ask(m) for m in ("midError", "nodone", "cut", "empty")}
        assert not any(r.ok for r in broken.values())
        assert "engine died" in broken["midError"].error
        assert broken["nodone"].error == "stream ended before [DONE]"
        assert broken["empty"].error == "stream ended without output"
        good, silent = ask("ok"), ask("silent")
        assert good.ok and good.text == "t1.0 t1.1 t1.2 t1.3 t1.4 " and good.completion_tokens == 5
        assert silent.ok and silent.token_chunks == 5 and 0 < silent.ttft_s < silent.e2e_s


def test_hit_rates_across_a_server_restart() -> None:
    """Counters lower than at the start were reset (the server restarted):
    the interval counts what they counted since, never a negative delta."""
    before = {"vllm:prefix_cache_queries_total": 10000.0, "vllm:prefix_cache_hits_total": 9000.0,
              "vllm:external_prefix_cache_queries_total": 1000.0, "vllm:external_prefix_cache_hits_total": 10.0,
              "vllm:num_requests_running": 3.0}
    # The external hits grew past their old count since the restart; the
    # running gauge fell, as gauges do.
    after = {"vllm:prefix_cache_queries_total": 1000.0, "vllm:prefix_cache_hits_total": 0.0,
             "vllm:external_prefix_cache_queries_total": 1000.0, "vllm:external_prefix_cache_hits_total": 900.0,
             "vllm:num_requests_running": 0.0}
    h = hit_rates(before, after)
    assert h.queries == 1000 and h.h1 == 0.0 and h.h2 == pytest.approx(0.9)
    assert h.external_tokens == 900
    # Without a restart, a falling gauge is no reset, even one named like a counter.
    after["kvtier_dram_slots_total"], before["kvtier_dram_slots_total"] = 512.0, 1024.0
    assert hit_rates({**before, "vllm:prefix_cache_queries_total": 500.0, "vllm:prefix_cache_hits_total": 0.0,
                      "vllm:external_prefix_cache_queries_total": 0.0,
                      "vllm:external_prefix_cache_hits_total": 0.0}, after).queries == 500
    later = {**after, "vllm:prefix_cache_queries_total": 1500.0, "vllm:prefix_cache_hits_total": 100.0,
             "vllm:num_requests_running": 5.0}
    assert hit_rates(after, later).queries == 500 and hit_rates(after, later).h1 == pytest.approx(0.2)


def _bodies(url: str) -> list[dict]:
    return httpx.get(url + "/requests", timeout=5).json()


def test_multi_turn_sessions_carry_the_real_answers(flaky_url: str) -> None:
    sessions = [Session(["hello ok", "again ok", "third ok"], system="be brief")]
    seen = len(_bodies(flaky_url))
    report = run(sessions, BenchOptions(url=flaky_url, max_tokens=8))
    texts = [r.text for r in report.results]
    # The server numbers its answer by how many user turns it was sent.
    assert [t.split(".")[0] for t in texts] == ["t1", "t2", "t3"]
    assert [r.prompt_tokens for r in report.results] == [10, 20, 30]
    assert [r.cached_tokens for r in report.results] == [4, 8, 12]
    # What went over the wire: each turn carries the system prompt, the
    # earlier questions and the server's own answers to them, in order.
    sent = _bodies(flaky_url)[seen:]
    assert len(sent) == 3  # no warm-up request unless asked
    assert sent[2]["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello ok"}, {"role": "assistant", "content": texts[0]},
        {"role": "user", "content": "again ok"}, {"role": "assistant", "content": texts[1]},
        {"role": "user", "content": "third ok"}]


def test_sampling_options_go_into_every_request(flaky_url: str) -> None:
    seen = len(_bodies(flaky_url))
    run([Session(["a ok"]), Session(["b ok"])],
        BenchOptions(url=flaky_url, max_tokens=7, temperature=0.5, ignore_eos=True, warmup=1))
    sent = _bodies(flaky_url)[seen:]
    assert len(sent) == 3 and sent[0]["messages"][-1]["content"] == "warm-up 0"
    for body in sent:
        assert body["max_tokens"] == 7 and body["temperature"] == 0.5 and body["ignore_eos"] is True
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    seen += 3
    run([Session(["c ok"])], BenchOptions(url=flaky_url))
    (body,) = _bodies(flaky_url)[seen:]
    assert "ignore_eos" not in body and body["temperature"] == 0.0


def test_a_failed_turn_ends_its_session_and_the_rest_count_as_skipped(flaky_url: str) -> None:
    report = run([Session(["a ok", "b error", "c ok", "d ok"])], BenchOptions(url=flaky_url))
    assert [(r.turn, r.ok, r.error_kind) for r in report.results] == [
        (0, True, ""), (1, False, "http"), (2, False, "skipped"), (3, False, "skipped")]
    assert report.summary["requests"] == 4 and report.summary["errors"] == {"http": 1, "skipped": 2}


def test_an_unreachable_server_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="--url"):
        run([Session(["a ok"])], BenchOptions(url="http://127.0.0.1:9"))


def test_hit_rates_come_from_metrics_deltas(flaky_url: str) -> None:
    report = run([Session([f"q{i} ok"]) for i in range(4)], BenchOptions(url=flaky_url, concurrency=2))
    assert report.hits is not None
    assert report.hits.h1 == pytest.approx(0.5)
    assert report.hits.h2 == pytest.approx(0.5)
    assert report.hits.h_all == pytest.approx(0.75)
    assert report.hits.by_source["host"] == 100


def test_arrival_schedules() -> None:
    assert arrival_schedule(4, 20, Arrival.FIXED) == pytest.approx([0, 0.05, 0.10, 0.15])
    assert arrival_schedule(3, 0, Arrival.POISSON) == [0, 0, 0]
    poisson = arrival_schedule(4001, 10, Arrival.POISSON, seed=1)
    gaps = [b - a for a, b in itertools.pairwise(poisson)]
    # Exponential gaps: mean 1/rate, standard deviation 1/rate as well.
    mean = sum(gaps) / len(gaps)
    std = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
    assert mean == pytest.approx(0.1, rel=0.05) and std == pytest.approx(0.1, rel=0.08)
    assert arrival_schedule(50, 10, Arrival.POISSON, seed=1) == poisson[:50]
    assert arrival_schedule(50, 10, Arrival.POISSON, seed=2) != poisson[:50]


class _StoppedClock:
    """loadgen's clock, moved only by its own sleeps: the run's schedule is
    read from the clock, never from how long anything really took. A
    sleeper wakes at its deadline (the clock moves on to it, never back)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        wake = self.now + seconds
        await asyncio.sleep(0)  # the other sleepers, due no later, go first
        self.now = max(self.now, wake)

    def __getattr__(self, name: str):  # the rest of asyncio, as it is
        return getattr(asyncio, name)


@pytest.mark.parametrize("arrival", ["fixed", "poisson"])
def test_each_session_starts_at_its_arrival(flaky_url: str, arrival: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvtier.tools.loadgen as loadgen

    clock = _StoppedClock()
    monkeypatch.setattr(loadgen, "time", clock)
    monkeypatch.setattr(loadgen, "asyncio", clock)
    opts = BenchOptions(url=flaky_url, concurrency=4, request_rate=20, arrival=arrival, seed=5)
    report = run([Session([f"q{i} ok"]) for i in range(4)], opts)
    due = arrival_schedule(4, 20, Arrival(arrival), seed=5)
    assert sorted(r.session for r in report.results) == [0, 1, 2, 3]
    assert [r.start_s for r in sorted(report.results, key=lambda r: r.session)] == pytest.approx(due)
    assert len(clock.sleeps) == 3  # the first session is due at once


def test_a_run_with_no_success_reports_no_latency(flaky_url: str) -> None:
    """No request succeeded: the latency figures are missing ("-"), never a
    0 that reads as a measurement."""
    report = run([Session(["q error"]), Session(["q empty"])], BenchOptions(url=flaky_url, concurrency=2))
    s = report.summary
    assert s["succeeded"] == 0 and s["ttft_s"] == {"mean": None, "p50": None, "p90": None, "p99": None}
    table = markdown([report])
    assert "| TTFT p50 (ms) | - |" in table and "| E2EL p99 (s) | - |" in table
    json.dumps(report.to_json(), allow_nan=False)  # strict JSON


def test_summary_figures() -> None:
    def ok(i: int, ttft: float, e2e: float, out: int) -> Result:
        return Result(i, 0, True, ttft_s=ttft, e2e_s=e2e, tpot_s=(e2e - ttft) / (out - 1) if out > 1 else 0.0,
                      itl_s=[0.01] * (out - 1), prompt_tokens=100, completion_tokens=out, cached_tokens=40)

    results = [ok(i, 0.1 * (i + 1), 0.1 * (i + 1) + 0.9, 10) for i in range(10)]
    results.append(ok(10, 5.0, 5.0, 1))  # one output token: no TPOT
    results.append(Result(11, 0, False, "http", ttft_s=99.0, e2e_s=99.0, completion_tokens=50))
    s = summarize(results, duration_s=2.0)
    assert (s["requests"], s["succeeded"], s["failed"]) == (12, 11, 1)
    ttfts = [0.1 * (i + 1) for i in range(10)] + [5.0]
    assert s["ttft_s"]["mean"] == pytest.approx(sum(ttfts) / 11)
    assert s["ttft_s"]["p50"] == pytest.approx(0.6)
    assert s["ttft_s"]["p90"] == pytest.approx(1.0)
    assert s["ttft_s"]["p99"] == pytest.approx(1.0 + 0.9 * 4.0)
    assert s["tpot_s"]["mean"] == pytest.approx(0.1) and s["tpot_s"]["p99"] == pytest.approx(0.1)
    assert s["itl_s"]["p50"] == pytest.approx(0.01)
    assert (s["prompt_tokens"], s["completion_tokens"], s["cached_tokens"]) == (1100, 101, 440)
    assert s["request_throughput"] == pytest.approx(5.5)
    assert s["output_throughput"] == pytest.approx(50.5)
    assert s["total_throughput"] == pytest.approx(600.5)


def test_cached_tokens_a_server_does_not_report_are_unknown_not_zero() -> None:
    """vLLM without --enable-prompt-tokens-details sends no prompt_tokens_details:
    the report says "-", not 0 cached tokens (which would read as all misses)."""
    res = RequestResult(ok=True)
    absorb_chunk(res, {"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 3}}, 0.0, 0.0)
    assert (res.prompt_tokens, res.cached_tokens) == (100, None)
    absorb_chunk(res, {"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 3,
                                                "prompt_tokens_details": {"cached_tokens": 0}}}, 0.0, 0.0)
    assert res.cached_tokens == 0  # said, and none
    s = summarize([Result(0, 0, True, ttft_s=0.1, e2e_s=0.2, prompt_tokens=100, completion_tokens=3)], duration_s=1)
    assert s["cached_tokens"] is None
    assert "| prompt / cached tokens | 100 / - |" in markdown([BenchReport("x", {}, [], 1.0, None, s)])


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
                   "--output", str(tmp_path / "out"), "--no-plots", "--label", "cfg"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| requests (ok / failed) | 3 / 0 |" in out
    assert (tmp_path / "out" / "results.json").exists()
    assert out.splitlines()[0].startswith("cfg ") and " 3/3 " in out.splitlines()[0]  # the progress bar, done
    # A failing request is counted on the bar and makes the exit status 1.
    ds.write_text(json.dumps({"question": "q error"}) + "\n" + json.dumps({"question": "q ok"}) + "\n")
    assert cli_main(["bench", "run", "--url", flaky_url, "--dataset", str(ds), "--no-plots"]) == 1
    bar = capsys.readouterr().out.splitlines()[0]
    assert " 2/2 " in bar and "failed 1" in bar


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


def test_stats_live_view_refreshes_and_reports_the_last_interval(flaky_url: str, capsys: pytest.CaptureFixture,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import kvtier.tools.stats as stats

    run([Session(["q ok"])], BenchOptions(url=flaky_url))  # the server has counted hits before the view
    waits = []

    def one_request_per_interval(seconds: float) -> None:
        waits.append(seconds)
        run([Session(["q ok"])], BenchOptions(url=flaky_url))

    # stats' own reference to the time module, not the module everyone shares.
    monkeypatch.setattr(stats, "time", types.SimpleNamespace(sleep=one_request_per_interval, strftime=time.strftime))
    assert cli_main(["stats", "--url", flaky_url, "--interval", "0.05", "--count", "2"]) == 0
    assert waits == [0.05, 0.05]
    out = capsys.readouterr().out
    assert "since server start" in out and "last interval" in out
    # The last table: one request's 25 host tokens in the interval, at
    # least three requests' since the server started.
    host = [line for line in out.splitlines() if "cached tokens: host" in line][-1]
    total, recent = [int(cell.strip().replace(",", "")) for cell in host.split("│")[2:4]]
    assert recent == 25 and total >= 75
    h_all = [line for line in out.splitlines() if "h_all" in line][-1]
    assert h_all.split("│")[3].strip() == "75.0%"


def test_stats_once_shows_hit_rates_and_tiers(flaky_url: str, capsys: pytest.CaptureFixture) -> None:
    run([Session(["q ok"])], BenchOptions(url=flaky_url))
    assert cli_main(["stats", "--url", flaky_url, "--once"]) == 0
    out = capsys.readouterr().out
    assert "h_all" in out and "75.0%" in out
    assert "cached tokens: host" in out
    assert cli_main(["stats", "--url", "http://127.0.0.1:9", "--once"]) == 2
