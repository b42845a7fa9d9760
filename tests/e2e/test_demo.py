"""The main job (``kvtier demo``), shrunk: it serves the model with kvtier, prints the tables, stops the server."""

from __future__ import annotations

import io
import re
import socket

import pytest
from rich.console import Console

from kvtier.tools.demo import DemoOptions, run_demo

pytestmark = pytest.mark.e2e


def test_demo_shows_kvtier_hits_and_stops_its_server(tiny_model: str, tmp_path) -> None:
    out = io.StringIO()
    # Three documents of 800 tokens against a device cache of 1,920 tokens.
    summary = run_demo(DemoOptions(geometry="tiny", docs=3, doc_tokens=800, device_blocks=30, dram_size="64MB",
                                   log_path=str(tmp_path / "demo.log")), Console(file=out, width=120))
    text = out.getvalue()
    assert "TTFT by where the prompt's KV came from" in text and "Prefix-cache hit rates" in text
    for kind in ("cold", "device hit", "kvtier hit", "other instance"):
        assert kind in summary["ttft_ms"]
    # Round 2: the device cache has moved on (it keeps at most the last
    # document and the shared chat prefix); kvtier holds the rest.
    assert summary["round 2"]["h1"] < 0.5
    assert summary["round 2"]["h2"] > 0.8 and summary["round 2"]["h_all"] > 0.9
    # Those hits were loaded, not recomputed after failed loads: every
    # external token came in a block kvtier copied (blocks of 64 tokens).
    r2 = summary["round 2"]
    assert r2["load_errors"] == 0 and r2["external_tokens"] > 0
    assert r2["loaded_blocks"] * 64 == r2["external_tokens"]
    whole = summary["rounds 1-2"]
    assert whole["h_all"] == pytest.approx(whole["h1"] + (1 - whole["h1"]) * whole["h2"])
    # Round 3: instance B computed none of the documents; their prefixes
    # come from the pool, loaded from the blocks A saved.
    r3 = summary["round 3 (B)"]
    assert r3["h1"] < 0.5 and r3["h2"] > 0.8
    assert r3["load_errors"] == 0 and r3["loaded_blocks"] * 64 == r3["external_tokens"] > 0
    assert r3["by_source"].get("host", 0) == r3["external_tokens"]
    # The TTFT table says where each kind's KV came from, as measured.
    kv_from = summary["kv_from"]
    assert kv_from["other instance"] == f"blocks A saved: {r3['by_source']['host'] / 3:.0f} tok/req from host"
    assert kv_from["kvtier hit"] == f"A's own blocks: {r2['by_source']['host'] / 3:.0f} tok/req from host"
    ports = [int(p) for p in re.findall(r"instance [AB] ready at http://127\.0\.0\.1:(\d+)", text)]
    meta_port = int(re.search(r"meta service \(the node's pool\) at tcp://127\.0\.0\.1:(\d+)", text).group(1))
    assert len(ports) == 2
    for port in ports + [meta_port]:
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0  # stopped
    assert "instances and meta service stopped" in text
