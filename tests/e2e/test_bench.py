"""kvtier bench against a real vLLM CPU server with kvtier: a small synthetic run and a multi-turn run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli import main as cli_main
from kvtier.tools.dataset import SynthSpec, synth, write_synth
from kvtier.tools.loadgen import BenchOptions, Session, run
from kvtier.tools.server import VllmServer
from tests.e2e.conftest import server_options

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def bench_server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("logs") / "vllm-bench.log"
    # A device cache of 19 usable blocks (1,216 tokens) holds at most two of
    # the three 560-token shared prefixes: the third comes back from kvtier.
    with VllmServer(server_options(tiny_model, {"dram_size": "128MB"}, num_gpu_blocks=20), log_path=log) as srv:
        yield srv


def test_synthetic_shared_prefix_run_reports_hits(bench_server: VllmServer, tiny_model: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    spec = SynthSpec(tokens=700, fraction=80, num_diff_prefix=3, group_size=2, num_groups=6, seed=3)
    data, _ = write_synth(synth(tok, spec), spec, str(tmp_path / "ds"))
    out = tmp_path / "out"
    rc = cli_main(["bench", "run", "--url", bench_server.url, "--dataset", data, "--concurrency", "2",
                   "--max-tokens", "4", "--ignore-eos", "--endpoint", "completions", "--output", str(out)])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())[0]
    s = results["summary"]
    assert s["succeeded"] == 12 and s["failed"] == 0
    assert s["ttft_s"]["p50"] > 0 and s["tpot_s"]["mean"] > 0 and s["itl_s"]["p50"] > 0
    # --ignore-eos: every answer runs to --max-tokens, whatever the random model says.
    assert all(r["completion_tokens"] == 4 for r in results["results"])
    # Every group after the first of each prefix reuses at least 80 % of its prompt.
    assert s["cached_tokens"] > 0.3 * s["prompt_tokens"]
    h = results["hit_rates"]
    assert h["h_all"] == pytest.approx(h["h1"] + (1 - h["h1"]) * h["h2"])
    assert h["h_all"] > 0.3
    # Part of the reuse is kvtier's, and those blocks were loaded, not recomputed.
    assert h["h2"] > 0 and h["external_tokens"] > 0
    assert h["load_errors"] == 0 and h["loaded_blocks"] * 64 == h["external_tokens"]
    assert "| h_all |" in capsys.readouterr().out

    # kvtier stats reads the same server: hit rates and kvtier's own series.
    assert cli_main(["stats", "--url", bench_server.url, "--once"]) == 0
    view = capsys.readouterr().out
    for row in ("h_all", "blocks saved", "blocks loaded", "DRAM tier in use"):
        assert row in view, view


def test_multi_turn_sessions_grow_their_prompts(bench_server: VllmServer) -> None:
    sessions = [Session(["Tell me about rivers.", "And mountains?", "And the sea?"]),
                Session(["Describe a city.", "Its music?"])]
    report = run(sessions, BenchOptions(url=bench_server.url, concurrency=2, max_tokens=8))
    assert report.summary["failed"] == 0 and report.summary["succeeded"] == 5
    by_session: dict[int, list] = {}
    for r in report.results:
        by_session.setdefault(r.session, []).append(r)
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        lengths = [r.prompt_tokens for r in turns]
        assert lengths == sorted(lengths) and len(set(lengths)) == len(lengths)
        # Each turn carries the previous answer, so its prompt is longer than
        # the last prompt plus the last answer.
        for a, b in zip(turns, turns[1:]):
            assert b.prompt_tokens >= a.prompt_tokens + a.completion_tokens
