"""kvtier.tools.sizing and ``kvtier size``: KV bytes per token, workload memory, huge pages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli import main as cli_main
from kvtier.errors import ConfigError
from kvtier.tools import sizing


def model_dir(tmp_path: Path, **cfg) -> str:
    base = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
            "torch_dtype": "bfloat16"}
    base.update(cfg)
    (tmp_path / "config.json").write_text(json.dumps(base))
    return str(tmp_path)


def test_bytes_per_token_from_a_model_config(tmp_path: Path) -> None:
    # Llama-3-8B-like: 2 x 32 layers x 8 KV heads x 128 x 2 bytes = 128 KiB per token.
    kv = sizing.from_model_dir(model_dir(tmp_path))
    assert kv.bytes_per_token == 131072
    assert kv.gib_per_1k_tokens == pytest.approx(131072 * 1000 / (1 << 30))
    assert sizing.from_model_dir(model_dir(tmp_path), dtype="float32").bytes_per_token == 262144
    tp4 = sizing.from_model_dir(model_dir(tmp_path), tp=4)
    assert tp4.bytes_per_token == 32768 and tp4.instance_bytes_per_token == 131072
    # Fewer KV heads than ranks: each rank keeps a whole head.
    assert sizing.from_model_dir(model_dir(tmp_path), tp=16).bytes_per_token == 16384


def test_head_dim_and_nested_text_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 512,
        "head_dim": 64, "torch_dtype": "float16"}}))
    assert sizing.from_model_dir(str(tmp_path)).bytes_per_token == 2 * 2 * 2 * 64 * 2


def test_bad_model_configs_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no config.json"):
        sizing.from_model_dir(str(tmp_path))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        (tmp_path / "config.json").write_text("{}")
        sizing.from_model_dir(str(tmp_path))
    with pytest.raises(ConfigError, match="--dtype"):
        sizing.from_model_dir(model_dir(tmp_path), dtype="float7")


def test_bytes_per_token_from_vllm_log_lines() -> None:
    log = ("(Worker_TP0) INFO ... Available KV cache memory: 13.88 GiB\n"
           "(Worker_TP1) INFO ... Available KV cache memory: 13.88 GiB\n"
           "(EngineCore) INFO ... GPU KV cache size: 1,217,457 tokens\n")
    kv = sizing.from_log(log)
    assert kv.devices == 2
    assert kv.bytes_per_token == pytest.approx(13.88 * (1 << 30) / 1217457)
    assert kv.gib_per_1k_tokens == pytest.approx(0.0114, abs=1e-4)
    with pytest.raises(ConfigError, match="Available KV cache memory"):
        sizing.from_log("GPU KV cache size: 10 tokens")
    with pytest.raises(ConfigError, match="KV cache size"):
        sizing.from_log("Available KV cache memory: 1 GiB")


def test_workload_host_memory_and_huge_pages(tmp_path: Path) -> None:
    kv = sizing.KvShape(1000.0, "test")
    assert sizing.workload_bytes_per_device(kv, concurrency=10, mean_tokens=2000) == 10 * 2000 * 1.5 * 1000
    assert sizing.host_memory_bytes(8, 20 << 30, 10 << 30) == 240 << 30
    assert sizing.hugepages_for(256 << 30, 2 << 20, 4 << 30) == 133120
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 1 kB\nHugepagesize:    2048 kB\n")
    assert sizing.hugepage_size_bytes(str(meminfo)) == 2 << 20


def test_cli_size(tmp_path: Path, capsys) -> None:
    rc = cli_main(["size", "--model-dir", model_dir(tmp_path), "--concurrency", "4", "--mean-tokens", "1000",
                   "--dram-size", "1GB", "--staging-size", "1GB", "--devices", "2", "--hugepage-buffer", "0"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "131,072 bytes per device" in out
    assert "= 0.73 GiB per device" in out  # 4 x 1000 x 1.5 x 128 KiB
    assert "2 device(s) x (1.0 GiB DRAM tier + 1.0 GiB SSD staging) = 4.0 GiB" in out
    assert cli_main(["size"]) == 2
