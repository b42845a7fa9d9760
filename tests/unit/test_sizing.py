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


def test_a_latent_attention_model_holds_one_latent_vector_a_token_and_layer_on_every_rank(tmp_path: Path) -> None:
    # DeepSeek-V2-Lite: 27 layers x (512 latent + 64 rotary) x 2 bytes, not 2 x layers x heads x head size.
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "hidden_size": 2048,
        "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
        "torch_dtype": "bfloat16"}))
    kv = sizing.from_model_dir(str(tmp_path))
    assert kv.bytes_per_token == 27 * 576 * 2
    tp2 = sizing.from_model_dir(str(tmp_path), tp=2)  # the same latent on both ranks
    assert tp2.bytes_per_token == 27 * 576 * 2 and tp2.instance_bytes_per_token == 2 * 27 * 576 * 2
    assert sizing.from_model_dir(str(tmp_path), dtype="fp8_e4m3").bytes_per_token == 27 * 576  # vLLM's spelling


def test_bad_model_configs_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no config.json"):
        sizing.from_model_dir(str(tmp_path))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        (tmp_path / "config.json").write_text("{}")
        sizing.from_model_dir(str(tmp_path))
    with pytest.raises(ConfigError, match="--dtype"):
        sizing.from_model_dir(model_dir(tmp_path), dtype="float7")
    for field in ("num_attention_heads", "num_hidden_layers"):
        with pytest.raises(ConfigError, match=field):
            sizing.from_model_dir(model_dir(tmp_path, **{field: 0}))
    with pytest.raises(ConfigError, match="not a number"):
        sizing.from_model_dir(model_dir(tmp_path, num_hidden_layers="many"))


def test_a_multimodal_configs_top_level_dtype_counts(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float32", "text_config": {
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 512}}))
    assert sizing.from_model_dir(str(tmp_path)).bytes_per_token == 2 * 2 * 2 * 128 * 4


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
    with pytest.raises(ConfigError, match="--devices"):
        sizing.from_log(log, devices=0)
    with pytest.raises(ConfigError, match="KV cache size"):
        sizing.from_log("Available KV cache memory: 1 GiB")


def test_both_log_formats_of_the_field_give_the_same_model_size() -> None:
    # Two deployments of one model: 4 devices logging "Available KV cache
    # memory" in GiB, and 2 devices in an older build logging bytes. Both
    # come to about 0.26 GB per 1k tokens for the instance.
    four = sizing.from_log("Available KV cache memory: 9.21 GiB\nGPU KV cache size: 150,800 tokens\n", devices=4)
    two = sizing.from_log("Available memory: 36408063180,\nGPU KV cache size: 277,760 tokens\n", devices=2)
    assert two.bytes_per_token == pytest.approx(36408063180 / 277760)
    assert four.gb_per_1k_tokens * 4 == pytest.approx(0.2623, abs=1e-3)
    assert two.gb_per_1k_tokens * 2 == pytest.approx(0.2622, abs=1e-3)
    # Log formats are not confused with vLLM CPU's node memory warning.
    with pytest.raises(ConfigError):
        sizing.from_log("Available memory on node 0 (12 GiB) is less than desired\nKV cache size: 10 tokens")


def test_a_log_of_several_starts_counts_the_last() -> None:
    log = ("Available KV cache memory: 1.00 GiB\nAvailable KV cache memory: 1.00 GiB\n"
           "GPU KV cache size: 1,000 tokens\n...restart...\n"
           "Available KV cache memory: 2.00 GiB\nGPU KV cache size: 4,000 tokens\n")
    kv = sizing.from_log(log)
    assert kv.devices == 1 and kv.bytes_per_token == pytest.approx(2 * (1 << 30) / 4000)


def test_several_engines_log_their_size_after_the_workers_memory() -> None:
    # Data parallel: both workers' memory lines, then each engine core's size line.
    log = ("(Worker_DP0) Available KV cache memory: 4.00 GiB\n(Worker_DP1) Available KV cache memory: 4.00 GiB\n"
           "(EngineCore_DP0) GPU KV cache size: 32,768 tokens\n(EngineCore_DP1) GPU KV cache size: 32,768 tokens\n")
    kv = sizing.from_log(log)
    assert kv.devices == 2 and kv.bytes_per_token == pytest.approx(4 * (1 << 30) / 32768)


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
    page = sizing.hugepage_size_bytes()
    assert f"huge pages: {-(-(4 << 30) // page)} of {page >> 10} kB" in out
    # The arena (2 x 1 GiB) on 4 KiB pages: 524,288 entries of 8 bytes; on 2 MiB pages, 1,024.
    assert "page tables: 4 MiB in each process that maps the arena" in out and "8 KiB on 2 MiB huge pages" in out
    assert cli_main(["size"]) == 2



@pytest.mark.parametrize("args", [["--devices", "-2"], ["--devices", "0"], ["--tp", "0"], ["--concurrency", "-1"]])
def test_cli_size_refuses_counts_below_their_floor(tmp_path: Path, args: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as info:
        cli_main(["size", "--model-dir", model_dir(tmp_path), "--dram-size", "20GB", *args])
    assert info.value.code == 2
    assert args[0] in capsys.readouterr().err


def test_cli_size_config_without_a_file_is_refused(capsys, monkeypatch) -> None:
    monkeypatch.delenv("MMC_LOCAL_CONFIG_PATH", raising=False)
    monkeypatch.delenv("MMC_META_CONFIG_PATH", raising=False)
    assert cli_main(["size", "--config"]) == 2
    assert "MMC_LOCAL_CONFIG_PATH" in capsys.readouterr().err


def test_cli_size_from_a_log(tmp_path: Path, capsys) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("INFO Available KV cache memory: 9.21 GiB\nINFO GPU KV cache size: 150,800 tokens\n")
    assert cli_main(["size", "--log", str(log), "--devices", "4"]) == 0
    out = capsys.readouterr().out
    assert "4 device(s)" in out
    assert "per 1k tokens: 0.0656 GB (0.0611 GiB) per device, 0.2623 GB (0.2443 GiB) for the instance" in out
    assert cli_main(["size", "--log", str(tmp_path / "missing.log")]) == 2
    assert "--log" in capsys.readouterr().err


def test_cli_size_config_says_when_kvtier_meta_would_refuse_the_pool(capsys, tmp_path: Path) -> None:
    big, small = tmp_path / "big.conf", tmp_path / "small.conf"
    big.write_text("ock.mmc.local_service.dram.size = 20GB\nock.mmc.local_service.world_size = 256\n")
    small.write_text("ock.mmc.local_service.dram.size = 64MB\n")
    assert cli_main(["size", "--config", str(big)]) == 0  # sizing asked: an answer, not an error
    out = capsys.readouterr().out
    assert "256 device(s) x (20.0 GiB DRAM tier" in out
    assert "on this host, kvtier meta would refuse it: ock.mmc.local_service.dram.size = 20 GiB x 256" in out
    assert cli_main(["size", "--config", str(small)]) == 0
    assert "would refuse" not in capsys.readouterr().out


@pytest.mark.parametrize(("cfg", "dtype", "tp", "block"), [
    ({}, None, 1, 16), ({}, "float32", 4, 64), ({"num_key_value_heads": 2}, None, 8, 128),
    ({"head_dim": 65, "num_key_value_heads": 1}, "float8_e4m3fn", 1, 16),  # 2,080-byte pages, padded to 2,112
])
def test_a_blocks_bytes_per_rank_are_what_the_connector_lays_out(tmp_path: Path, cfg: dict, dtype: str | None,
                                                                  tp: int, block: int) -> None:
    """What `kvtier size` prints for kvtier.slot_rank_bytes is the
    connector's own figure for the same model, from vLLM's KV spec."""
    import math

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvtier.connector.connector import rank_bytes_for

    kv = sizing.from_model_dir(model_dir(tmp_path, **cfg), dtype, tp)
    heads = max(1, math.ceil(cfg.get("num_key_value_heads", 8) / tp))
    spec = FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=cfg.get("head_dim", 128),
                             dtype=getattr(torch, dtype or "bfloat16"))
    assert sizing.block_rank_bytes(kv, block) == rank_bytes_for(spec, 32)


def test_the_size_command_prints_a_blocks_bytes_per_rank(tmp_path: Path, capsys) -> None:
    assert cli_main(["size", "--model-dir", model_dir(tmp_path), "--block-size", "64"]) == 0
    # 32 layers x 64 tokens x 8 KV heads x 128 x 2 (K and V) x 2 bytes
    assert "a block of 64 tokens: 8,388,608 bytes per rank" in capsys.readouterr().out
    log = tmp_path / "vllm.log"
    log.write_text("Available KV cache memory: 10.00 GiB\nGPU KV cache size: 81,920 tokens\n")
    with pytest.raises(ConfigError, match="needs --model-dir"):
        sizing.block_rank_bytes(sizing.from_log(log.read_text()), 16)
