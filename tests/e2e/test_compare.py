"""``kvtier bench compare`` end to end: it starts vLLM alone and vLLM with kvtier (DRAM + SSD) in turn,
runs the same long-document QA workload against each, stops them, and reports side by side."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from kvtier.cli import main as cli_main
from kvtier.tools.demo import serving_dtype

pytestmark = pytest.mark.e2e


def test_compare_runs_each_configuration_and_stops_its_servers(tiny_model: str, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    raw, qa, out = tmp_path / "raw.jsonl", tmp_path / "qa.jsonl", tmp_path / "out"
    assert cli_main(["dataset", "longdoc", "--output", str(raw), "--count", "4", "--min-words", "100",
                     "--tokenizer", tiny_model, "--max-tokens", "800"]) == 0
    assert cli_main(["dataset", "convert", "--input", str(raw), "--output", str(qa), "--min-length", "100",
                     "--max-length", "100000", "--repeat", "2", "--output-format", "qa"]) == 0  # D1..D4 then D4..D1
    # Device cache of 40 blocks (2,560 tokens) for 4 documents of 800 tokens;
    # the SSD configuration's DRAM tier holds 32 blocks, so D1's blocks go to SSD.
    rc = cli_main(["bench", "compare", "--model-dir", tiny_model, "--configs", "vllm,ssd", "--dataset", str(qa),
                   "--device-blocks", "40", "--max-batched-tokens", "512", "--ssd-dram-size", "4MB",
                   "--ssd-path", str(tmp_path / "ssd.img"), "--ssd-size", "64MB", "--max-tokens", "4",
                   "--output", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    vllm, ssd = json.loads((out / "results.json").read_text())
    assert (vllm["label"], ssd["label"]) == ("vLLM alone", "kvtier DRAM + SSD")
    for r in (vllm, ssd):
        assert r["summary"]["succeeded"] == 8 and r["summary"]["failed"] == 0
    # Same prompts, so the same prompt tokens; only kvtier adds external hits.
    assert vllm["summary"]["prompt_tokens"] == ssd["summary"]["prompt_tokens"]
    assert vllm["hit_rates"]["h2"] == 0 and vllm["hit_rates"]["by_source"].get("disk", 0) == 0
    assert ssd["hit_rates"]["h2"] > 0 and ssd["hit_rates"]["by_source"].get("disk", 0) > 0
    # The hits were loaded (vLLM counts them before the load runs): blocks of 64 tokens.
    assert ssd["hit_rates"]["load_errors"] == 0
    assert ssd["hit_rates"]["loaded_blocks"] * 64 == ssd["hit_rates"]["external_tokens"] > 0
    assert ssd["summary"]["cached_tokens"] > vllm["summary"]["cached_tokens"]
    assert "| measure | vLLM alone | kvtier DRAM + SSD |" in text
    assert (out / "report.md").exists() and (out / "ttft_cdf.png").exists()
    for name in ("vllm", "ssd"):
        log = (out / f"server-{name}.log").read_text()
        assert "Application startup complete" in log
        # The demo's dtype: float32 where bf16 would be emulated (x86 without bf16 instructions).
        assert f"'dtype': '{serving_dtype(real=False)}'" in log
    # Both servers were stopped: nothing listens on their ports any more.
    ports = [int(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("stopped vLLM")]
    assert len(ports) == 2
    for port in ports:
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0
