"""The connector inside a real vLLM CPU engine: hits, identical outputs, recompute on corruption;
then ``kvtier bench`` and ``kvtier stats`` against the same server (one vLLM start serves both)."""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvtier.cli import main as cli_main
from kvtier.tools.dataset import SynthSpec, synth, write_synth
from kvtier.tools.loadgen import BenchOptions, Session, run
from kvtier.tools.server import ServerError, VllmServer
from tests.e2e.conftest import (BLOCK, assert_loads_succeeded, complete, delta, server_options, tokens,
                                wait_for_log)

pytestmark = pytest.mark.e2e

EXT_HITS = "vllm:external_prefix_cache_hits_total"
HOST = 'vllm:prompt_tokens_cached_by_source_total{source="host"}'
DEVICE = 'vllm:prompt_tokens_cached_by_source_total{source="device"}'


def push_out_of_device_cache(srv, seed: int) -> None:
    """Three 1,500-token prompts: together more than the device cache holds."""
    for i in range(3):
        complete(srv, tokens(seed + i, 1500), max_tokens=2)


def test_evicted_prefix_is_loaded_from_dram_and_output_matches_device_hit(kvtier_server):
    a = tokens(1, 24 * BLOCK)  # exactly 24 full blocks: the last one must still be computed
    complete(kvtier_server, a)  # cold: kvtier saves A's blocks
    device_hit = complete(kvtier_server, a)  # served from vLLM's own prefix cache
    assert device_hit["usage"]["prompt_tokens_details"]["cached_tokens"] == 23 * BLOCK

    push_out_of_device_cache(kvtier_server, seed=100)
    before = kvtier_server.metrics()
    again = complete(kvtier_server, a)
    after = kvtier_server.metrics()

    assert delta(after, before, DEVICE) == 0, "A was meant to be gone from the device cache"
    ext = delta(after, before, EXT_HITS)
    # All 24 blocks are in the pool, but the last token must be computed:
    # 23 blocks load, never the whole prompt.
    assert ext == 23 * BLOCK
    assert delta(after, before, HOST) == ext
    assert delta(after, before, "kvtier_blocks_loaded_total") == ext // BLOCK
    # Bytes: K and V x 2 layers x 4 heads x 64 x 64 tokens x float32 a block (the tiny model).
    assert delta(after, before, "kvtier_bytes_loaded_total") == ext // BLOCK * 2 * 2 * 4 * 64 * BLOCK * 4
    assert delta(after, before, "kvtier_load_seconds_total") > 0
    assert delta(after, before, "kvtier_load_errors_total") == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == ext
    assert again["text"] == device_hit["text"]

    # vLLM's own log shows the external hits and kvtier's transfer figures.
    rates = wait_for_log(kvtier_server, r"External prefix cache hit rate: [1-9][0-9.]*%")
    assert rates, "no non-zero external prefix cache hit rate in vLLM's log"
    transfers = wait_for_log(kvtier_server, r"KV Transfer metrics: .*blocks_loaded=[1-9]")
    assert transfers, "no kvtier transfer figures in vLLM's log"


def test_concurrent_shared_prefixes_match_vllm_alone(kvtier_server, plain_server):
    prefixes = [tokens(200, 10 * BLOCK), tokens(201, 10 * BLOCK)]
    prompts = [prefixes[i % 2] + tokens(300 + i, 100 + 7 * i) for i in range(8)]

    def run(srv) -> list[str]:
        # Warm: each prefix once, then push it out of the device cache, so
        # that with kvtier the concurrent requests load it from DRAM.
        for p in prefixes:
            complete(srv, p + tokens(400, 50), max_tokens=2)
        push_out_of_device_cache(srv, seed=500)
        with ThreadPoolExecutor(8) as pool:
            return [r["text"] for r in pool.map(lambda p: complete(srv, p, max_tokens=16), prompts)]

    before = kvtier_server.metrics()
    with_kvtier = run(kvtier_server)
    after = kvtier_server.metrics()
    alone = run(plain_server)

    ext = delta(after, before, EXT_HITS)
    assert ext > 0
    assert_loads_succeeded(before, after, ext)
    assert with_kvtier == alone


def test_corrupt_dram_block_is_recomputed_not_served(kvtier_server):
    a = tokens(7, 20 * BLOCK)
    first = complete(kvtier_server, a)
    push_out_of_device_cache(kvtier_server, seed=700)
    # Flip one byte in the data of every slot in use: the connector must
    # notice (checksum) and let vLLM recompute.
    arenas = [f for f in os.listdir("/dev/shm") if f.startswith("kvtier-dram-")]
    path = next(os.path.join("/dev/shm", f) for f in arenas if _arena_of(kvtier_server, f))
    _flip_slot_bytes(path)
    before = kvtier_server.metrics()
    again = complete(kvtier_server, a)
    after = kvtier_server.metrics()
    # All 19 blocks A loads (20 full blocks, the last one computed) fail
    # their checksum, are dropped from the pool and are recomputed.
    assert delta(after, before, EXT_HITS) == 19 * BLOCK
    assert delta(after, before, "kvtier_load_errors_total") == 19
    assert delta(after, before, "kvtier_corrupt_blocks_total") == 19
    assert delta(after, before, "kvtier_blocks_loaded_total") == 0
    assert again["text"] == first["text"]
    # The corrupt blocks were dropped; the recompute saved good ones, which now hit.
    push_out_of_device_cache(kvtier_server, seed=800)
    before = kvtier_server.metrics()
    third = complete(kvtier_server, a)
    after = kvtier_server.metrics()
    assert delta(after, before, EXT_HITS) == 19 * BLOCK
    assert_loads_succeeded(before, after, 19 * BLOCK)
    assert third["text"] == first["text"]


def _arena_of(srv, name: str) -> bool:
    m = re.search(r"kvtier: DRAM tier (\S+?),", srv.log_text())
    return m is not None and m.group(1).endswith(name)


def _flip_slot_bytes(path: str) -> None:
    """Flip the sign-and-exponent byte of a few float32 values of every slot in
    use: KV that, served, would change the answer (a flipped lowest mantissa
    byte would not, so the text check alone could not tell)."""
    from kvtier.tier.dram import DramTier

    tier = DramTier.attach(path)
    try:
        for slot in range(tier.num_slots):
            if tier.header(slot).ready_mask:
                view = tier.rank_view(slot, 0)
                for value in (25, 4000, 40000):
                    view[4 * value + 3] ^= 0x7F
    finally:
        tier.close()


def test_bad_config_stops_startup_with_one_clear_line(tiny_model, tmp_path):
    # Parsing errors (sizes, unknown keys, ranges) are unit-tested against
    # the parser (test_config.py); this shows that an error raised while the
    # engine builds the connector (here the SSD tier refusing a directory)
    # reaches vLLM's log as one line and vLLM does not start.
    opts = server_options(tiny_model, {"dram_size": "64MB", "ssd_path": str(tmp_path)})
    srv = VllmServer(opts, log_path=tmp_path / "bad3.log", startup_timeout_s=240)
    with pytest.raises(ServerError):
        srv.start()
    srv.stop()
    assert f"kvtier config error: ssd_path = '{tmp_path}': not a regular file or block device" in srv.log_text()


# --- kvtier bench and kvtier stats against the same server ---------------------


def test_synthetic_shared_prefix_run_reports_hits(kvtier_server: VllmServer, tiny_model: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    # Prefixes of 1,120 tokens: the device cache (40 blocks) holds at most
    # two of the three, so the mirrored reuse finds the third in kvtier.
    spec = SynthSpec(tokens=1400, fraction=80, num_diff_prefix=3, group_size=2, num_groups=6, seed=3)
    data, _ = write_synth(synth(tok, spec), spec, str(tmp_path / "ds"))
    out = tmp_path / "out"
    before = kvtier_server.metrics()
    rc = cli_main(["bench", "run", "--url", kvtier_server.url, "--dataset", data, "--concurrency", "2",
                   "--max-tokens", "4", "--ignore-eos", "--endpoint", "completions", "--output", str(out)])
    assert rc == 0
    after = kvtier_server.metrics()
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
    assert h["load_errors"] == 0
    # (Two prompts at a time may not both fit in the device cache: a request
    # vLLM preempts loads its prefix again, which assert_loads_succeeded allows.)
    assert_loads_succeeded(before, after, h["external_tokens"])
    assert "| h_all |" in capsys.readouterr().out

    # kvtier stats reads the same server: hit rates and kvtier's own series.
    assert cli_main(["stats", "--url", kvtier_server.url, "--once"]) == 0
    view = capsys.readouterr().out
    for row in ("h_all", "blocks saved", "blocks loaded", "DRAM tier in use", "workers in kvtier's hooks (s)"):
        assert row in view, view
    # The engine's time inside the hooks is counted on both halves.
    m = kvtier_server.metrics()
    assert m["kvtier_scheduler_hook_seconds_total"] > 0 and m["kvtier_worker_hook_seconds_total"] > 0


def test_multi_turn_sessions_grow_their_prompts(kvtier_server: VllmServer) -> None:
    sessions = [Session(["Tell me about rivers.", "And mountains?", "And the sea?"]),
                Session(["Describe a city.", "Its music?"])]
    report = run(sessions, BenchOptions(url=kvtier_server.url, concurrency=2, max_tokens=8))
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
